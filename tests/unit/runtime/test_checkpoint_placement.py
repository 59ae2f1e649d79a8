"""Which names of a checkpoint a rank holds (``runtime/_placement.py``) and what a load
restores into the step counters, without processes: a stand-in grid gives the ranks."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from shardwise.runtime._checkpoint_state import Stateful
from shardwise.runtime._checkpointing import _load_counters
from shardwise.runtime._counters import StepCounters
from shardwise.runtime._placement import placement


def _grid(*, tensor=1, tensor_rank=0, pipe=1, stage=0, global_rank=0, data=1):
    def comm(size, rank):
        return SimpleNamespace(world_size=size, rank=rank)

    return SimpleNamespace(
        tensor=tensor,
        tensor_rank=tensor_rank,
        pipe=pipe,
        stage_id=stage,
        global_rank=global_rank,
        data_comm=comm(data, 0),
        tensor_comm=comm(tensor, tensor_rank),
        pipe_comm=comm(pipe, stage),
    )


class _Tied(nn.Module):
    """An embedding tied to the output layer, a buffer, and (for the pipeline case) the
    tied weight reported as held by global ranks 0 and 2."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(4))

    def tied_weights(self):
        return [("embed", self.embed.weight, (0, 2), "weight")]


def test_tied_keys_name_one_parameter_and_an_earlier_stage_writes_it():
    first = placement(_Tied(), _grid(pipe=2, global_rank=0), zero_stage=1)
    assert first.aliases == {"head.weight": "embed.weight"}
    assert first.name_of_key == {"embed.weight": "embed.weight", "head.weight": "embed.weight"}
    assert first.keys == {
        "embed.weight": (torch.float32, (8, 4)),
        "head.weight": (torch.float32, (8, 4)),
        "scale": (torch.float32, (4,)),
    }
    assert first.tied_elsewhere == frozenset()
    later = placement(_Tied(), _grid(pipe=2, stage=1, global_rank=2), zero_stage=1)
    assert later.tied_elsewhere == {"embed.weight"}
    assert placement(_Tied(), _grid(global_rank=2), zero_stage=1).tied_elsewhere == frozenset()  # one stage


def test_a_stage_keeps_only_its_own_names_of_a_whole_model():
    place = placement(_Tied(), _grid(pipe=2, global_rank=0), zero_stage=2)
    whole = {"embed.weight": 1, "head.weight": 2, "scale": 3, "5.fc.weight": 4}
    assert place.stage_module_state(whole) == {"embed.weight": 1, "head.weight": 2, "scale": 3}
    optimizer = {
        "state": {"embed.weight": {"step": 1}, "5.fc.weight": {"step": 1}},
        "master": {"5.fc.weight": 0},
        "param_groups": [{"lr": 0.1, "params": ["embed.weight", "5.fc.weight"]}],
    }
    assert place.stage_optimizer_state(optimizer) == {
        "state": {"embed.weight": {"step": 1}},
        "master": {},
        "param_groups": [{"lr": 0.1, "params": ["embed.weight"]}],
    }
    alone = placement(_Tied(), _grid(), zero_stage=2)
    assert alone.stage_module_state(whole) is whole and alone.stage_optimizer_state(optimizer) is optimizer


def test_a_tensor_parallel_slice_is_stored_whole_and_named_by_every_key():
    model = _Tied()
    model.embed.weight.tensor_model_parallel = True
    model.embed.weight.partition_dim = 0
    place = placement(model, _grid(tensor=2, tensor_rank=1, global_rank=1), zero_stage=0)
    split = place.splits["embed.weight"]
    assert (split.stored_shape, split.index, split.parts) == ((16, 4), 1, 2)
    assert place.split_by_key == {"embed.weight": split, "head.weight": split}
    assert place.keys["head.weight"] == (torch.float32, (16, 4))
    assert place.keys["scale"] == (torch.float32, (4,))
    assert place.layout(torch.bfloat16) == {
        "zero_stage": 0,
        "dp_world_size": 1,
        "tp_degree": 2,
        "pp_degree": 1,
        "param_dtype": "bfloat16",
    }
    assert place.describe() == "ZeRO stage 0, data 1 x tensor 2"
    model.embed.weight.partition_dim = None
    with pytest.raises(NotImplementedError, match="embed.weight is marked tensor-parallel but has no partition_dim"):
        placement(model, _grid(tensor=2, tensor_rank=1), zero_stage=0)


def test_a_load_restores_the_counters_and_restarts_the_accumulation_window():
    counters = StepCounters(global_steps=1, global_samples=2, micro_steps=3, skipped_steps=0)
    parts = Stateful(
        module=None, optimizer=None, lr_scheduler=None, loss_scaler=None, counters=counters, accumulation_steps=4
    )
    # saved at another accumulation count: 7 steps of 2 micro-batches, one left over
    _load_counters(
        parts, {"global_steps": 7, "global_samples": 112, "micro_steps": 15, "skipped_steps": 2, "layout": {}}
    )
    assert counters == StepCounters(global_steps=7, global_samples=112, micro_steps=28, skipped_steps=2)
    assert counters.state_dict() == {"global_steps": 7, "global_samples": 112, "micro_steps": 28, "skipped_steps": 2}
