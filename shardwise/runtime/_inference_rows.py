"""The rows an inference tensor group generates together: every rank's prompts in, each
rank's own rows out (see [Note: inference tensor parallelism] below)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

# [Note: inference tensor parallelism]
# With inference_tp_size > 1 the ranks of each inference tensor group (consecutive
# blocks of the world) generate together, as DeepSpeed's hybrid engine does: the
# inference copy is split over the group as init_inference splits a model (each rank
# fills its slices from the gathered full weights), every rank's batch is gathered
# (same shape on every rank of the group), the group generates the whole batch, each
# rank computing its heads and MLP slice, and each rank returns its own rows. The
# tokens of all ranks are equal because the all-reduced logits are, and, when sampling,
# because the group draws from one random stream: its first rank's. The other ranks take
# a copy of that rank's random state for the generation and get their own back after, so
# the first rank draws exactly as one process generating the group's rows would, and no
# rank's own stream (dropout in training) is changed by the group's.


def gather_rows(comm, module: nn.Module, args: tuple, kwargs: dict) -> tuple[int, tuple, dict]:
    """The input ids (and attention mask) of every rank of the tensor group, stacked in
    rank order, and this rank's row count."""
    kwargs = dict(kwargs)
    ids = args[0] if args else kwargs.pop("input_ids", kwargs.pop("inputs", None))
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError("hybrid_engine.inference_tp_size > 1 needs input ids as a [batch, length] tensor")
    shapes = ids.new_empty((comm.world_size, 2), dtype=torch.long)
    comm.all_gather_into_tensor(shapes, torch.tensor([list(ids.shape)], device=ids.device), tag="prompt shapes").wait()
    if bool((shapes != shapes[0]).any()):
        raise ValueError(
            f"hybrid_engine.inference_tp_size > 1: the ranks of a tensor group generate together and must pass "
            f"prompts of one shape; got {shapes.tolist()} (pad them to one length)"
        )
    gathered = {}
    for name, tensor in (("input_ids", ids), ("attention_mask", kwargs.get("attention_mask"))):
        if tensor is not None:
            whole = tensor.new_empty((comm.world_size * tensor.shape[0], *tensor.shape[1:]))
            comm.all_gather_into_tensor(whole, tensor.contiguous(), tag=f"prompt {name}").wait()
            gathered[name] = whole
    kwargs.update(gathered)
    return ids.shape[0], args[1:], kwargs


def samples(module: nn.Module, kwargs: dict) -> bool:
    """Whether ``generate(**kwargs)`` samples (``do_sample``, or the generation config's)."""
    config = kwargs.get("generation_config") or getattr(module, "generation_config", None)
    return bool(kwargs.get("do_sample", getattr(config, "do_sample", False)))


@contextlib.contextmanager
def first_rank_random_stream(comm, device: torch.device):
    """Every rank of ``comm``'s group draws from the group's first rank's random stream
    inside the block (the CPU generator, and ``device``'s when it is a GPU); the others
    get their own state back after it (see [Note: inference tensor parallelism])."""
    gpu = device.type == "cuda"
    states = [torch.get_rng_state()] + ([torch.cuda.get_rng_state(device)] if gpu else [])
    wire = device if gpu else torch.device("cpu")  # NCCL moves device tensors only
    shared = []
    for state in states:
        state = state.to(wire)
        comm.broadcast(state, src=0, tag="sampling random state").wait()
        shared.append(state.cpu())
    if comm.rank == 0:
        yield
        return
    with torch.random.fork_rng(devices=[device] if gpu else []):
        torch.set_rng_state(shared[0])
        if gpu:
            torch.cuda.set_rng_state(shared[1], device)
        yield


def own_rows(out, rows: int, rank: int):
    """This rank's rows of a generate output (a tensor, or an output with ``sequences``
    and per-step ``scores`` / ``logits``)."""
    mine = slice(rank * rows, (rank + 1) * rows)
    if isinstance(out, torch.Tensor):
        return out[mine]
    for name in ("sequences", "scores", "logits"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor):
            setattr(out, name, value[mine])
        elif isinstance(value, tuple):
            setattr(out, name, tuple(v[mine] for v in value))
    return out
