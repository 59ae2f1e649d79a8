"""Tensor-parallel loading on 2 gloo ranks (one spawn, llama and gpt2): each rank builds
the model on the meta device and ``init_inference(tensor_parallel={"tp_size": 2},
checkpoint=dir)`` fills its shard from a sharded safetensors directory. The logits equal
the full model's (fp32, 1e-4), greedy tokens are identical, every split layer holds the
tensor ``init_inference`` cuts from the full model (GPT-2's stacked q|k|v block by block,
its Conv1D transposed, its tied head by vocabulary), and each rank read from the files
(counted at ``safe_open``) exactly the replicated tensors plus half of the split ones."""

import copy
import functools

import torch

from shardwise.testing import run_distributed
from shardwise.testing.causal_lm import prompts, tiny_lm

NEW = 16


class _CountingFile:
    """A ``safe_open`` handle that adds the elements of every tensor it returns to ``read``."""

    def __init__(self, handle, read: list[int]):
        self._handle, self._read = handle, read

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def get_tensor(self, key):
        return self._count(self._handle.get_tensor(key))

    def get_slice(self, key):
        return _CountingSlice(self._handle.get_slice(key), self)

    def _count(self, tensor):
        self._read[0] += tensor.numel()
        return tensor


class _CountingSlice:
    def __init__(self, sliced, owner: _CountingFile):
        self._sliced, self._owner = sliced, owner

    def get_shape(self):
        return self._sliced.get_shape()

    def __getitem__(self, index):
        return self._owner._count(self._sliced[index])


def _counting_open(plain_open, read: list[int], *args, **kwargs) -> _CountingFile:
    return _CountingFile(plain_open(*args, **kwargs), read)


def _expected_elements(reference, engine, tp: int) -> tuple[int, int]:
    """(elements a rank must read, elements of the full model): a split tensor's share is
    1/tp, a replicated one's all of it; a tied head counts as its own tensor."""
    held = dict(engine.module.named_parameters())
    must = full = 0
    for name, param in reference.named_parameters(remove_duplicate=False):
        if name not in held:
            continue
        split = getattr(held[name], "tensor_parallel_shard", None) is not None
        must += param.numel() // tp if split else param.numel()
        full += param.numel()
    return must, full


def _check_slices(engine, sharded) -> None:
    """Every parameter equals the one ``init_inference`` cut from the full model (the
    shard rule, with GPT-2's block interleave and transposition), with the same marks."""
    from shardwise.tensor_parallel._partition import shard_info

    want = dict(sharded.module.named_parameters())
    got = dict(engine.module.named_parameters())
    assert got.keys() == want.keys()
    for name, param in got.items():
        assert torch.equal(param, want[name]), name
        assert shard_info(param) == shard_info(want[name]), name
        for mark in ("partition_stride", "tensor_parallel_transposed"):
            assert getattr(param, mark, None) == getattr(want[name], mark, None), (name, mark)
        assert not param.requires_grad, name


def _body(rank, world_size, root):
    import transformers

    import shardwise
    from shardwise.inference import _loading

    single, (batch, mask) = prompts()
    report = {}
    for family in ("llama", "gpt2"):
        reference = tiny_lm(family)
        path = f"{root}/{family}"
        if rank == 0:
            reference.save_pretrained(path, safe_serialization=True, max_shard_size="20KB")
        torch.distributed.barrier()
        with torch.device("meta"):
            meta = transformers.AutoModelForCausalLM.from_config(reference.config)
        read = [0]
        plain_open = _loading.safe_open
        _loading.safe_open = functools.partial(_counting_open, plain_open, read)
        try:
            engine = shardwise.init_inference(
                meta, dtype=torch.float32, tensor_parallel={"tp_size": world_size}, checkpoint=path
            )
        finally:
            _loading.safe_open = plain_open
        sharded = shardwise.init_inference(
            copy.deepcopy(reference), dtype=torch.float32, tensor_parallel={"tp_size": world_size}
        )
        _check_slices(engine, sharded)
        must, full = _expected_elements(reference, engine, world_size)
        assert read[0] == must < 0.75 * full, (family, read[0], must, full)
        with torch.no_grad():
            want = reference(batch, attention_mask=mask).logits
        got = engine(batch, attention_mask=mask).logits
        err = (got - want)[mask.bool()].abs().max().item()
        assert err < 1e-4, (family, err)
        for ids, kwargs in ((single, {}), (batch, {"attention_mask": mask})):
            want = reference.generate(ids, max_new_tokens=NEW, do_sample=False, **kwargs)
            got = engine.generate(ids, max_new_tokens=NEW, do_sample=False, **kwargs)
            assert torch.equal(got, want), (family, ids.shape)
        report[family] = (read[0], full, err)
    return report


def test_each_rank_loads_only_its_slices(tmp_path):
    reports = run_distributed(_body, world_size=2, tmp_path=tmp_path, timeout_s=300, root=str(tmp_path))
    for family in ("llama", "gpt2"):
        read, full, _ = reports[0][family]
        assert reports[1][family][0] == read < full, family
