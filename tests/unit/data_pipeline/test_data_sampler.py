"""DeepSpeedDataSampler on one rank draws the same micro-batches as DeepSpeed 0.19.8's for the
same seed and index (reference from make_deepspeed_reference.py), resumes identically from
its state_dict, and names what is wrong with its input."""

import json
import os

import pytest
from make_deepspeed_reference import NUM_SAMPLES, SAMPLER_GAS, SAMPLER_MICRO, sampler_configs

from shardwise.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler

REFERENCE = os.path.join(os.path.dirname(__file__), "deepspeed_reference")


def _sampler(config):
    return DeepSpeedDataSampler(config, NUM_SAMPLES, SAMPLER_MICRO, 0, 1, None, SAMPLER_GAS, 0)


def _rows(sampler, count):
    rows = iter(sampler)
    return [next(rows) for _ in range(count)]


@pytest.mark.parametrize("case", ["value", "percentile", "both"])
def test_batches_equal_deepspeed(tmp_path, case):
    with open(os.path.join(REFERENCE, "sampler_batches.json")) as f:
        want = json.load(f)[case]
    config = sampler_configs(os.path.join(REFERENCE, "analyzer"), str(tmp_path))[case]
    assert _rows(_sampler(config), len(want)) == want


def test_resume_continues_identically(tmp_path):
    config = sampler_configs(os.path.join(REFERENCE, "analyzer"), str(tmp_path / "a"))["both"]
    whole = _rows(_sampler(config), 40)
    config = sampler_configs(os.path.join(REFERENCE, "analyzer"), str(tmp_path / "b"))["both"]
    first = _sampler(config)
    head = _rows(first, 15)
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON/torch.save round trip
    second = _sampler(config)
    second.load_state_dict(state)
    assert head + _rows(second, 25) == whole


def test_curriculum_must_be_enabled(tmp_path):
    config = sampler_configs(os.path.join(REFERENCE, "analyzer"), str(tmp_path))["value"]
    config["data_sampling"]["curriculum_learning"]["enabled"] = False
    with pytest.raises(ValueError, match="curriculum_learning.enabled"):
        _sampler(config)


def test_missing_index_names_the_analyzer(tmp_path):
    config = sampler_configs(str(tmp_path / "nowhere"), str(tmp_path))["value"]
    with pytest.raises(FileNotFoundError, match=r"seqlen_index_to_sample\.idx does not exist.*DataAnalyzer"):
        _sampler(config)
