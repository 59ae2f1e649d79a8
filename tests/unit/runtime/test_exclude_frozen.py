"""``exclude_frozen_parameters`` as DeepSpeed's engine takes it: ``save_16bit_model``,
``module_state_dict`` and ``save_checkpoint`` leave the frozen parameters out. A checkpoint
without them records it: a strict load into a model that trains one of them is an error
naming it (a non-strict one warns), and ``zero_to_fp32`` gives the trainable parameters
(training on 2 ranks at ZeRO 2 and 3: ``tests/dist/runtime/test_exclude_frozen_checkpoint.py``)."""

import logging

import pytest
import safetensors.torch
import torch

import shardwise
from shardwise.checkpoint import CheckpointError
from shardwise.testing.models import TinyMLP

FROZEN = {"fc1.weight", "fc1.bias"}


@pytest.fixture(scope="module")
def engine():
    """One engine for the module; the world of one it initialises is destroyed after the
    module (a module fixture is set up before the per-test clean-up looks)."""
    had_group = torch.distributed.is_initialized()
    engine, *_ = shardwise.initialize(
        model=TinyMLP(freeze_first=True),
        config={"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
    )
    yield engine
    if torch.distributed.is_initialized() and not had_group:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("name", ["model.safetensors", "pytorch_model.bin"])
def test_the_16bit_file_leaves_frozen_parameters_out_when_asked(engine, tmp_path, name):
    engine.save_16bit_model(tmp_path / "all", name)
    engine.save_16bit_model(tmp_path / "trained", name, exclude_frozen_parameters=True)

    def load(path):
        return safetensors.torch.load_file(path) if name.endswith(".safetensors") else torch.load(path)

    everything, trained = load(tmp_path / "all" / name), load(tmp_path / "trained" / name)
    assert set(everything) >= FROZEN and set(trained) == set(everything) - FROZEN
    assert all(torch.equal(trained[k], everything[k]) for k in trained)


def test_module_state_dict_leaves_frozen_parameters_out(engine):
    assert set(engine.module_state_dict()) - set(engine.module_state_dict(exclude_frozen_parameters=True)) == FROZEN


def _engine(*, freeze: bool):
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    return shardwise.initialize(model=TinyMLP(seed=1, freeze_first=freeze), config=config)[0]


def test_a_checkpoint_without_frozen_parameters_loads_only_where_they_are_frozen(engine, tmp_path, caplog):
    from shardwise.inference._loading import load_checkpoint as load_for_inference
    from shardwise.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as fp32_state

    engine.save_checkpoint(tmp_path, tag="adapters", exclude_frozen_parameters=True)
    engine.save_checkpoint(tmp_path, tag="everything")
    trained = engine.module_state_dict()
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        assert set(fp32_state(tmp_path, "adapters")) == set(trained) - FROZEN
    assert "fc1.bias, fc1.weight) are not in it" in caplog.text
    assert set(fp32_state(tmp_path, "everything", exclude_frozen_parameters=True)) == set(trained) - FROZEN

    with pytest.raises(ValueError, match="saved with exclude_frozen_parameters=True: .* cannot fill a model alone"):
        load_for_inference(TinyMLP(), tmp_path / "adapters")

    frozen = _engine(freeze=True)  # the same frozen base (seed 0 vs 1: only the trainable ones differ)
    frozen.module.fc1.load_state_dict(engine.module.fc1.state_dict())
    frozen.load_checkpoint(tmp_path, tag="adapters")  # strict: only the recorded frozen keys may be missing
    assert all(torch.equal(v, trained[k]) for k, v in frozen.module_state_dict().items())

    training = _engine(freeze=False)
    before = training.module.fc1.weight.detach().clone()
    with pytest.raises(CheckpointError, match=r"no tensor for fc1\.bias, fc1\.weight, which this model trains.*"):
        training.load_checkpoint(tmp_path, tag="adapters")
    assert torch.equal(training.module.fc1.weight, before)  # nothing loaded
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        # the saved optimizer names other parameters than this one's: take the weights
        training.load_checkpoint(tmp_path, tag="adapters", load_module_strict=False, load_optimizer_states=False)
    assert "fc1.bias, fc1.weight (saved with exclude_frozen_parameters=True), which this model trains" in caplog.text
    assert torch.equal(training.module.fc1.weight, before)
    assert torch.equal(training.module.fc2.weight, trained["fc2.weight"])
