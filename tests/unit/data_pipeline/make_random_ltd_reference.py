"""Write ``random_ltd_reference.json``: DeepSpeed 0.19.8's random-LTD scheduler values.

Run with the separate DeepSpeed environment (never a shardwise dependency)::

    /work/ds-env/bin/python tests/unit/data_pipeline/make_random_ltd_reference.py

For each case below the file records, per global step, the kept length
(``get_current_seq``) and the consumed layer tokens after ``update_seq(step)``, the
``state_dict`` at the end, and ``get_total_layer_tokens`` over the whole run.
``test_random_ltd_scheduler.py`` compares shardwise's scheduler with it, without DeepSpeed.
"""

import json
import pathlib

from deepspeed.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler

# (name, min_value, max_value, require_steps, seq_per_step, total layers, ltd layers,
#  global batch, steps); one repeated step per case checks it counts tokens once.
CASES = [
    ("gpt_like", 128, 2048, 200, 16, 24, 22, 8, 260),
    ("min_not_multiple", 100, 512, 37, 8, 6, 4, 3, 50),
    ("one_step_ramp", 64, 256, 1, 64, 4, 2, 2, 5),
    ("coarse_steps", 150, 1000, 90, 100, 12, 10, 16, 120),
]


def _config(case):
    _, low, high, require, per_step, layers, ltd_layers, batch, _ = case
    return {
        "total_layer_num": layers,
        "random_ltd_layer_num": ltd_layers,
        "global_batch_size": batch,
        "layer_token_lr_schedule": {"enabled": False},
        "random_ltd_schedule": {
            "min_value": low,
            "max_value": high,
            "schedule_type": "fixed_linear",
            "schedule_config": {"require_steps": require, "seq_per_step": per_step},
        },
    }


def _run(case):
    config = _config(case)
    steps = case[-1]
    scheduler = RandomLTDScheduler(config)
    seqs, tokens = [], []
    for step in range(steps):
        scheduler.update_seq(step)
        if step == 3:
            scheduler.update_seq(step)  # gradient accumulation: same step again
        seqs.append(scheduler.get_current_seq())
        tokens.append(scheduler.state["consumed_layer_tokens"])
    total = RandomLTDScheduler(config).get_total_layer_tokens(steps)
    return {
        "config": config,
        "steps": steps,
        "current_seq": seqs,
        "consumed_layer_tokens": tokens,
        "state_dict": scheduler.state_dict(),
        "total_layer_tokens": total,
    }


def main():
    out = {case[0]: _run(case) for case in CASES}
    path = pathlib.Path(__file__).with_name("random_ltd_reference.json")
    path.write_text(json.dumps(out, sort_keys=True) + "\n")
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
