"""RandomLTDScheduler gives DeepSpeed 0.19.8's kept lengths and consumed layer tokens.

The reference values come from ``make_random_ltd_reference.py`` (run once with DeepSpeed's
own scheduler); this test needs no DeepSpeed.
"""

import json
import pathlib

import pytest

from shardwise.runtime.data_pipeline.data_routing import RandomLTDScheduler

REFERENCE = json.loads(pathlib.Path(__file__).with_name("random_ltd_reference.json").read_text())


def _section(config):
    """The reference's DeepSpeed dict plus the keys a user section carries."""
    layers = config["total_layer_num"]
    ids = list(range(1, config["random_ltd_layer_num"] + 1))
    assert ids[-1] < layers
    return {
        **config,
        "random_ltd_layer_id": ids,
        "model_type": "decoder",
        "hidden_state_order": "batch_seq_dim",
    }


@pytest.mark.parametrize("case", sorted(REFERENCE))
def test_values_equal_deepspeed(case):
    ref = REFERENCE[case]
    scheduler = RandomLTDScheduler(_section(ref["config"]))
    seqs, tokens = [], []
    for step in range(ref["steps"]):
        scheduler.update_seq(step)
        if step == 3:
            scheduler.update_seq(step)
        seqs.append(scheduler.get_current_seq())
        tokens.append(scheduler.consumed_layer_tokens)
    assert seqs == ref["current_seq"]
    assert tokens == ref["consumed_layer_tokens"]
    assert scheduler.state_dict() == ref["state_dict"]
    fresh = RandomLTDScheduler(_section(ref["config"]))
    assert fresh.get_total_layer_tokens(ref["steps"]) == ref["total_layer_tokens"]


def test_state_dict_resumes_mid_ramp():
    ref = REFERENCE["gpt_like"]
    section = _section(ref["config"])
    first = RandomLTDScheduler(section)
    for step in range(40):
        first.update_seq(step)
    resumed = RandomLTDScheduler(section)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    for step in range(40, ref["steps"]):
        resumed.update_seq(step)
        assert resumed.get_current_seq() == ref["current_seq"][step]
        assert resumed.consumed_layer_tokens == ref["consumed_layer_tokens"][step]


def test_global_batch_size_is_required():
    section = _section(REFERENCE["gpt_like"]["config"])
    del section["global_batch_size"]
    with pytest.raises(ValueError, match="global_batch_size"):
        RandomLTDScheduler(section)
    assert RandomLTDScheduler(section, global_batch_size=8).global_batch_size == 8
