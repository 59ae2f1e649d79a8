"""Loading GPT-2's ``Conv1D`` weights into tensor-parallel slices, by value and in one
process: each of four ranks (a stand-in group that issues no collective) builds its split
model on the meta device, reads its slices from a safetensors directory, and must hold
exactly the tensors ``init_inference`` cuts from the full model.

At four ranks the MLP's slices are square (``c_fc``: 64 of 256 outputs x 64 inputs;
``mlp.c_proj``: 64 outputs x 64 of 256 inputs), so a slice read in the checkpoint's
``[in, out]`` layout and not transposed has the right shape and only its values tell.
"""

import copy

import pytest
import torch

from shardwise.comm import Communicator
from shardwise.inference._loading import load_checkpoint
from shardwise.inference._sharding import inference_policy, shard_model
from shardwise.testing.causal_lm import tiny_lm

transformers = pytest.importorskip("transformers")
TP = 4


class _StandIn(Communicator):
    """Rank ``rank`` of a tensor group of ``world_size``, only for splitting (no collective)."""

    def __init__(self, world_size: int, rank: int):
        self.world_size, self.rank, self.name = world_size, rank, "tensor-parallel"

    def all_reduce(self, tensor, *, op=None, tag=""):
        raise AssertionError(f"unexpected all-reduce {tag}")


def _split(model, rank):
    shard_model(model, _StandIn(TP, rank), inference_policy(model, None))
    return dict(model.named_parameters())


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    reference = tiny_lm("gpt2")
    path = tmp_path_factory.mktemp("gpt2")
    reference.save_pretrained(path, safe_serialization=True)
    return reference, path


@pytest.mark.parametrize("rank", range(TP))
def test_each_rank_reads_the_conv1d_slices_the_full_model_is_cut_into(gpt2_dir, rank):
    reference, path = gpt2_dir
    want = _split(copy.deepcopy(reference), rank)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(reference.config)
    _split(meta, rank)
    load_checkpoint(meta, path)
    got = dict(meta.named_parameters())
    assert got.keys() == want.keys()
    square = [
        name for name, p in got.items() if getattr(p, "tensor_parallel_transposed", False) and p.shape[0] == p.shape[1]
    ]
    assert len(square) == 4, square  # c_fc and mlp.c_proj of both blocks
    for name in [*square, *got]:  # the square slices first: only their values can be wrong
        assert torch.equal(got[name], want[name]), name
