"""``exclude_frozen_parameters`` as DeepSpeed's engine takes it: ``save_16bit_model`` and
``module_state_dict`` leave the frozen parameters out; ``save_checkpoint`` refuses it (a
checkpoint holds every parameter) instead of ignoring it."""

import pytest
import safetensors.torch
import torch

import shardwise
from shardwise.testing.models import TinyMLP

FROZEN = {"fc1.weight", "fc1.bias"}


@pytest.fixture(scope="module")
def engine():
    engine, *_ = shardwise.initialize(
        model=TinyMLP(freeze_first=True),
        config={"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
    )
    return engine


@pytest.mark.parametrize("name", ["model.safetensors", "pytorch_model.bin"])
def test_the_16bit_file_leaves_frozen_parameters_out_when_asked(engine, tmp_path, name):
    engine.save_16bit_model(tmp_path / "all", name)
    engine.save_16bit_model(tmp_path / "trained", name, exclude_frozen_parameters=True)

    def load(path):
        return safetensors.torch.load_file(path) if name.endswith(".safetensors") else torch.load(path)

    everything, trained = load(tmp_path / "all" / name), load(tmp_path / "trained" / name)
    assert set(everything) >= FROZEN and set(trained) == set(everything) - FROZEN
    assert all(torch.equal(trained[k], everything[k]) for k in trained)


def test_module_state_dict_and_the_checkpoint(engine, tmp_path):
    assert set(engine.module_state_dict()) - set(engine.module_state_dict(exclude_frozen_parameters=True)) == FROZEN
    with pytest.raises(NotImplementedError, match=r"save_checkpoint\(exclude_frozen_parameters=True\)"):
        engine.save_checkpoint(tmp_path, exclude_frozen_parameters=True)
    assert not any(tmp_path.iterdir())  # refused before writing anything
