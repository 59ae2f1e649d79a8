"""The engine passes attributes it lacks through to the wrapped module, as DeepSpeed's
does (DeepSpeed-Chat reads ``engine.model``), without hiding its own attributes."""

import copy
import pickle

import pytest
import torch

import shardwise
from shardwise.runtime.engine import Engine
from shardwise.testing.models import TinyMLP


class _Wrapped(TinyMLP):
    """A model with a submodule named ``model`` and attributes the engine also has."""

    def __init__(self):
        super().__init__(seed=0)
        self.model = torch.nn.Identity()
        self.vocab_note = "from the module"
        self.step = "the module's step"  # the engine's step() must win


@pytest.fixture
def engine(one_rank_group):
    """A one-rank engine (the process group is destroyed after the test)."""
    built, *_ = shardwise.initialize(
        model=_Wrapped(),
        dist_init_required=False,
        config={
            "train_micro_batch_size_per_gpu": 1,
            "steps_per_print": 1000,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        },
    )
    return built


def test_unknown_attributes_come_from_the_module(engine):
    assert engine.model is engine.module.model
    assert engine.vocab_note == "from the module"
    assert engine.fc1 is engine.module.fc1


def test_engine_attributes_are_not_hidden(engine):
    assert callable(engine.step) and engine.step.__self__ is engine
    assert isinstance(engine.config, dict) and engine.config["train_micro_batch_size_per_gpu"] == 1
    assert engine.module.step == "the module's step"


def test_missing_everywhere_names_the_engine_and_the_module(engine):
    with pytest.raises(
        AttributeError,
        match=r"neither the Engine nor its wrapped module \(_Wrapped\) has an "
        r"attribute 'no_such_thing'",
    ):
        engine.no_such_thing
    assert not hasattr(engine, "no_such_thing")


def test_dunder_names_are_not_passed_through(engine):
    engine.module.__custom_dunder__ = "module"
    assert not hasattr(engine, "__custom_dunder__")


def test_no_recursion_before_the_module_is_set():
    bare = Engine.__new__(Engine)  # as pickle and copy create it: no __init__, no module
    with pytest.raises(AttributeError):
        bare.model
    torch.nn.Module.__init__(bare)  # construction has begun, ``module`` not assigned yet
    with pytest.raises(AttributeError, match="module"):
        bare.module


def test_copy_and_pickle_of_a_module_holding_engine_state_do_not_recurse():
    holder = Engine.__new__(Engine)
    torch.nn.Module.__init__(holder)
    holder.module = torch.nn.Linear(2, 2)
    holder.marker = 3
    clone = copy.deepcopy(holder)
    assert clone.marker == 3 and clone.weight.shape == (2, 2)
    restored = pickle.loads(pickle.dumps(holder))
    assert restored.marker == 3 and torch.equal(restored.weight, holder.module.weight)
