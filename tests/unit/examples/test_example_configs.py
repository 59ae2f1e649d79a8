"""Every config shipped in examples/configs reads as a valid config, with the ZeRO stage and
precision its name promises (the demo itself runs under a sample of them in
tests/dist/examples/test_train_gpt_demo.py)."""

import re
from pathlib import Path

import pytest

from shardwise.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "examples" / "configs").glob("*.json"))


def test_the_configs_are_found():
    assert len(CONFIGS) >= 10


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    config = load_config(str(path), world_size=2)
    stage = re.match(r"zero(\d)", path.stem)
    if stage:
        assert config.zero.stage == int(stage[1])
    for precision in ("bf16", "fp16"):
        if precision in path.stem:
            assert getattr(config, precision).enabled
