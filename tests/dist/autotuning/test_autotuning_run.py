"""``shardwise run --autotuning run`` on 2 CPU ranks, in one tuning run of three short jobs:
configurations the estimator rejects never run, each experiment's FLOPs are counted, the
choice is the one with the highest ``flops`` (and, the model being the same, the fastest),
the result files have DeepSpeed's layout, and ``run`` then trains with the choice. (Crashes,
hangs and the search rules are tested without launching training jobs:
tests/unit/autotuning.)

The tuner itself (``shardwise run --autotuning run`` as its command line) runs in this
process: it only starts the experiments and the final run as processes of their own, so a
process of its own would add a Python start and the imports of torch to the launched jobs'."""

import json
from pathlib import Path

import pytest

from shardwise.cli import main as shardwise_main

SCRIPT = Path(__file__).with_name("tune_script.py")
_MIB = 2**20
_SAMPLE_FLOPS = 3 * 3 * 2 * 8 * 16 * 32
"""TinyMLP's FLOPs per sample: fc1, fc2 and the head are each a (8 x 16) by (16 x 32) matrix
product or its transpose; the backward twice the forward (every input needs its gradient)."""


def _cells(line):
    return [cell.strip() for cell in line.split("|")[1:-1]]


def test_tune_then_run(tmp_path, monkeypatch, capfd):
    # 1M declared parameters in fp32: stage 0 needs 16 MiB of model states per rank, stage 1
    # on 2 ranks 12 MiB; 14 MiB per rank prunes stage 0
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": [0, 1]},
        "autotuning": {
            "enabled": True,
            "metric": "flops",
            "start_profile_step": 2,  # the first step is the counted one
            "end_profile_step": 2,
            "results_dir": str(tmp_path / "results"),
            "exps_dir": str(tmp_path / "exps"),
            "model_info": {"num_params": 2**20},
            "memory_per_rank": 14 * _MIB,
            "max_train_micro_batch_size_per_gpu": 2,
        },
    }
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("SHARDWISE_ACCELERATOR", "cpu")
    monkeypatch.chdir(tmp_path)
    command = ["run", "--autotuning", "run", "--nproc", "2", str(SCRIPT)]
    command += ["--deepspeed_config", str(tmp_path / "ds_config.json")]
    command += ["--done_file", str(tmp_path / "done.json")]
    code = shardwise_main(command)
    assert code == 0, capfd.readouterr().err[-3000:]

    results, exps = tmp_path / "results", tmp_path / "exps"
    ran = ["z1_gas1_tmbspg1", "z1_gas1_tmbspg2"]
    assert sorted(p.name for p in exps.iterdir()) == [f"{name}.json" for name in ran]
    assert not any(p.name.startswith("z0") for p in results.iterdir())  # pruned: never run
    measured = {p.parent.name: json.loads(p.read_text()) for p in results.glob("*/metrics.json")}
    assert set(measured) == set(ran)
    for name, metrics in measured.items():  # each rank's mean count of one iteration
        assert metrics["flops_per_step"] == _SAMPLE_FLOPS * int(name.rpartition("tmbspg")[2])
    best = max(measured, key=lambda name: measured[name]["flops"])
    assert best == max(measured, key=lambda name: measured[name]["throughput"])
    micro = int(best.rpartition("tmbspg")[2])

    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert "autotuning" not in optimal
    assert (optimal["zero_optimization"]["stage"], optimal["train_micro_batch_size_per_gpu"]) == (1, micro)
    assert (results / "cmd_optimal.txt").read_text().split() == [
        "shardwise", "run", "--nproc", "2", str(SCRIPT), "--deepspeed_config",
        str(results / "ds_config_optimal.json"), "--done_file", str(tmp_path / "done.json"),
    ]  # fmt: skip
    for name in ran:
        assert {p.name for p in (results / name).iterdir()} >= {"ds_config.json", "exp.json", "cmd.txt", "stderr.log"}

    lines = (results / "summary.txt").read_text().splitlines()
    assert _cells(lines[0]) == ["tuning_space", "num_experiments", "best_metric_val", "best_exp_name"]
    global_row = _cells(next(line for line in lines if line.startswith("| global")))
    assert global_row[1] == "2" and global_row[3] == best
    assert float(global_row[2]) == pytest.approx(measured[best]["flops"], rel=1e-5)
    assert "Total number of experiments: 2." in "\n".join(lines)
    statuses = {_cells(line)[0]: _cells(line)[1] for line in lines if line.startswith("| z")}
    assert statuses["z1_gas1_tmbspg1"] == "measured" and statuses["z0_gas1_tmbspg2"] == "pruned"

    # run: the chosen config trained to the end (no autotuning section, so no early exit)
    assert json.loads((tmp_path / "done.json").read_text()) == {"stage": 1, "micro": micro, "gas": 1, "steps": 6}
