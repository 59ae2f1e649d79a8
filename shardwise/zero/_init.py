"""``zero.Init``: build a model already partitioned, so it never exists whole on a rank.

[Note: partition at construction]
Inside the context every ``nn.Module`` subclass's ``__init__`` is wrapped. When the
outermost ``__init__`` of a module object returns (a subclass calling ``super().__init__``
is still constructing), the parameters that module registered itself and that are not
yet partitioned are broadcast from rank 0 (so every rank starts from the same values),
cut by the partition rule of ``_partition.py`` applied to each parameter on its own, and
replaced by an empty tensor; the rank keeps only its slice. At most one module's full
parameters are therefore alive at a time. Parameters created on the meta device are
allocated and initialised module by module instead (``reset_parameters()``), see
:func:`materialize`.

Code that writes parameters after their module's ``__init__`` (a model-level
``apply(init_weights)``) must do so under ``GatheredParameters(..., modifier_rank=0)``,
as with DeepSpeed: a partitioned parameter is an empty tensor and writing it changes
nothing.

The stage 3 engine adopts such parameters when it lays out its units: one unit at a
time, the per-parameter slices are all-gathered into the unit's flat buffer and cut again
by the unit rule, then the buffer is freed (``Stage3Strategy._add_bucket``).
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from shardwise.accelerator import get_accelerator
from shardwise.comm import Communicator
from shardwise.zero._partition import partition

logger = logging.getLogger("shardwise")


@dataclass(eq=False)
class InitShard:
    """What a parameter partitioned by ``zero.Init`` keeps: its slice and its full shape."""

    local: torch.Tensor
    shape: torch.Size
    comm: Communicator

    @property
    def numel(self) -> int:
        return self.shape.numel()


def init_shard(param: torch.Tensor) -> InitShard | None:
    """The ``zero.Init`` slice of ``param``, or None if it was not built partitioned."""
    return getattr(param, "_shardwise_init", None)


def full_shape(param: torch.Tensor) -> torch.Size:
    """``param``'s shape as the model sees it, also while it is partitioned."""
    shard = init_shard(param)
    if shard is not None:
        return shard.shape
    return getattr(param, "ds_shape", param.shape)


def _partition_param(
    param: nn.Parameter,
    comm: Communicator,
    dtype: torch.dtype | None,
    device: torch.device,
    where: str,
    shard_device: torch.device | None = None,
) -> None:
    with torch.no_grad():
        full = param.detach().to(device)
        if dtype is not None and full.is_floating_point():
            full = full.to(dtype)
        full = full.contiguous()
        comm.broadcast(full, src=0, tag=f"zero.Init {where}").wait()
        padded, shard = partition(full.numel(), comm.world_size)
        flat = torch.zeros(padded, dtype=full.dtype, device=full.device)
        flat[: full.numel()].copy_(full.reshape(-1))
        local = flat[comm.rank * shard : (comm.rank + 1) * shard].clone().to(shard_device or full.device)
    _mark_partitioned(param, InitShard(local, param.shape, comm))
    param.data = torch.empty(0, dtype=full.dtype, device=full.device)


_DS_IDS = itertools.count()
"""DeepSpeed's ``param.ds_id``: one number per partitioned parameter of the process."""


def give_ds_id(param: nn.Parameter) -> None:
    """Number ``param`` as DeepSpeed numbers partitioned parameters (``ds_id``; scripts test
    ``hasattr(p, "ds_id")`` to tell a stage-3 parameter), unless it has its number."""
    if "ds_id" not in param.__dict__:
        param.ds_id = next(_DS_IDS)


def _mark_partitioned(param: nn.Parameter, shard: InitShard) -> None:
    param._shardwise_init = shard
    give_ds_id(param)
    param.ds_shape, param.ds_numel, param.ds_tensor = shard.shape, shard.numel, shard.local  # DeepSpeed's names
    # copy.deepcopy looks __deepcopy__ up on the instance; torch's Parameter copy would drop
    # the slice (nn.TransformerEncoder deep-copies its layer under zero.Init)
    param.__deepcopy__ = functools.partial(_deepcopy_partitioned, param)


def _deepcopy_partitioned(param: nn.Parameter, memo: dict) -> nn.Parameter:
    """A copy of a partitioned parameter: empty, with a copy of this rank's slice."""
    shard = init_shard(param)
    copy = nn.Parameter(torch.empty(0, dtype=param.dtype, device=param.device), requires_grad=param.requires_grad)
    memo[id(param)] = copy
    _mark_partitioned(copy, InitShard(shard.local.clone(), shard.shape, shard.comm))
    return copy


def gather_init_params(params) -> None:
    """Make ``zero.Init`` parameters whole (collective, in the given order)."""
    for p in params:
        shard = init_shard(p)
        device = p.device  # the compute device (the slice may be in CPU memory: remote_device)
        full = torch.empty(shard.local.numel() * shard.comm.world_size, dtype=shard.local.dtype, device=device)
        shard.comm.all_gather_into_tensor(full, shard.local.to(device), tag="zero.Init gather").wait()
        p.data = full[: shard.numel].view(shard.shape)


def release_init_params(params, *, modifier_rank: int | None) -> None:
    """Keep ``modifier_rank``'s values (if set) in the slices and empty the parameters again."""
    with torch.no_grad():
        for p in params:
            shard = init_shard(p)
            if modifier_rank is not None:
                full = p.data.contiguous()
                shard.comm.broadcast(full, src=modifier_rank, tag="GatheredParameters (zero.Init)").wait()
                padded, size = partition(shard.numel, shard.comm.world_size)
                start = shard.comm.rank * size
                valid = max(0, min(size, shard.numel - start))
                shard.local.zero_()
                shard.local[:valid].copy_(full.reshape(-1)[start : start + valid])
            p.data = torch.empty(0, dtype=shard.local.dtype, device=p.device)


def _read_config(config, group=None):
    if config is None:
        return None
    from shardwise.config import load_config

    return load_config(config, world_size=dist.get_world_size(group))


def _config_dtype(config) -> torch.dtype | None:
    if config is None:
        return None
    if config.bf16.enabled:
        return torch.bfloat16
    if config.fp16.enabled:
        return torch.float16
    return torch.float32


def _all_subclasses(cls: type) -> list[type]:
    found, stack = [], [cls]
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub not in found:
                found.append(sub)
                stack.append(sub)
    return found


_lock = threading.RLock()  # nested contexts (from_pretrained inside a user's Init) re-enter


class Init:
    """Partition every module built inside the context (DeepSpeed's ``zero.Init``).

    See [Note: partition at construction]. Usable as ``with Init(): model = Model()`` or
    as ``Init(module=model)`` to partition (and materialise, if on the meta device) a
    model built already. Needs torch.distributed; it is initialised if it is not.

    Args:
        module: an already-built model to partition now.
        data_parallel_group: the process group to partition over (None: all ranks).
        config_dict_or_path / config: a shardwise/DeepSpeed config; its fp16/bf16 setting
            picks the parameter dtype when ``dtype`` is not given.
        enabled: False makes the context do nothing.
        dtype: parameter dtype. Without it and without a config, parameters keep the dtype
            they were created with (DeepSpeed would use fp16 here; shardwise does not
            change precision behind your back).
        remote_device: "cpu" or "nvme" keep each rank's slices in CPU memory while the model
            is built (``initialize()`` then places them as ``offload_param`` says: with
            nvme, in swap files); None/"none": on the compute device.
        mpu: a Megatron-style model-parallel unit or shardwise grid: the parameters are
            partitioned over its data-parallel group (as ``initialize(mpu=...)`` will
            train them) unless ``data_parallel_group`` is given.
        pin_memory, mem_efficient_linear: accepted for DeepSpeed compatibility.
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group=None,
        mem_efficient_linear: bool = True,
        remote_device=None,
        pin_memory: bool = False,
        config_dict_or_path=None,
        config=None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu=None,
        **unused,
    ):
        del mem_efficient_linear, pin_memory
        unknown = sorted(
            set(unused)
            - {
                "zero_param_parallel_group",
                "zero_quantized_weights",
                "zero_quantized_nontrainable_weights",
                "sequence_data_parallel_group",
                "param_swapper",
            }
        )
        if unknown:
            raise TypeError(f"zero.Init got unexpected arguments {unknown}")
        if remote_device not in (None, "none", "cpu", "nvme"):
            raise ValueError(f'zero.Init(remote_device={remote_device!r}): use None, "cpu" or "nvme"')
        self.shard_device = torch.device("cpu") if remote_device in ("cpu", "nvme") else None
        self.enabled = enabled
        self._wrapped: list[tuple[type, object]] = []
        self._built: list[weakref.ref] = []
        if not enabled:
            return
        from shardwise.comm import init_distributed

        init_distributed(verbose=False)
        if data_parallel_group is None and mpu is not None:
            data_parallel_group = mpu.get_data_parallel_group()
        config = _read_config(config if config is not None else config_dict_or_path, data_parallel_group)
        self.dtype = dtype if dtype is not None else _config_dtype(config)
        timeout_s = config.comm.timeout_s if config is not None else 1800.0
        self.comm = Communicator(data_parallel_group, timeout_s=timeout_s, name="zero.Init")
        self.device = get_accelerator().device()
        if module is not None:
            self.partition_module(module)

    # -- partitioning ------------------------------------------------------------------------

    def partition_module(self, module: nn.Module) -> nn.Module:
        """Partition (materialising from meta first) every parameter of ``module``'s tree,
        one module at a time, children before parents."""
        untouched, memo = [], {}
        for name, sub in reversed(list(module.named_modules())):
            if not self._partition_own(sub, name or type(sub).__name__, memo=memo):
                untouched.append(name or type(sub).__name__)
        if untouched:
            logger.warning(
                "zero.Init: modules without reset_parameters() were materialised from the meta "
                "device uninitialised: %s; load their weights (shardwise.zero.load_state_dict)",
                ", ".join(untouched[:8]) + (" ..." if len(untouched) > 8 else ""),
            )
        return module

    def _partition_own(
        self, module: nn.Module, where: str, *, materialize_meta: bool = True, memo: dict | None = None
    ) -> bool:
        """Partition ``module``'s own unpartitioned parameters; False if meta ones had no
        initialiser. While a model is being built, meta parameters are left alone: the
        builder (e.g. ``from_pretrained``) fills them."""
        initialised = materialize(module, self.device, _memo=memo) if materialize_meta else True
        for name, p in module.named_parameters(recurse=False):
            if init_shard(p) is None and not hasattr(p, "_shardwise_unit") and not p.is_meta:
                _partition_param(p, self.comm, self.dtype, self.device, f"{where}.{name}", self.shard_device)
        return initialised

    # -- the context --------------------------------------------------------------------------

    def __enter__(self):
        if not self.enabled:
            return self
        _lock.acquire()
        owner = self

        def wrap(cls: type) -> None:
            original = cls.__dict__["__init__"]

            @functools.wraps(original)
            def __init__(module, *args, **kwargs):  # noqa: N807 - replaces the class's __init__
                depth = module.__dict__.get("_shardwise_init_depth", 0)
                module.__dict__["_shardwise_init_depth"] = depth + 1
                try:
                    original(module, *args, **kwargs)
                finally:
                    module.__dict__["_shardwise_init_depth"] = depth
                if depth == 0:
                    del module.__dict__["_shardwise_init_depth"]
                    owner._partition_own(module, type(module).__name__, materialize_meta=False)
                    owner._built.append(weakref.ref(module))

            cls.__init__ = __init__
            self._wrapped.append((cls, original))

        for cls in [nn.Module] + _all_subclasses(nn.Module):
            if "__init__" in cls.__dict__:
                wrap(cls)
        original_init_subclass = nn.Module.__dict__.get("__init_subclass__")

        def __init_subclass__(cls, **kwargs):  # noqa: N807 - classes defined inside the context
            super(nn.Module, cls).__init_subclass__(**kwargs)
            if "__init__" in cls.__dict__:
                wrap(cls)

        nn.Module.__init_subclass__ = classmethod(__init_subclass__)
        self._original_init_subclass = original_init_subclass
        return self

    def __exit__(self, exc_type, *exc):
        if not self.enabled:
            return False
        try:
            if exc_type is None:
                # parameters filled in after construction (from_pretrained loads into meta
                # parameters) are partitioned now
                for ref in self._built:
                    module = ref()
                    if module is not None:
                        self._partition_own(module, type(module).__name__, materialize_meta=False)
            self._built.clear()
            for cls, original in reversed(self._wrapped):
                cls.__init__ = original
            self._wrapped.clear()
            if self._original_init_subclass is None:
                del nn.Module.__init_subclass__
            else:
                nn.Module.__init_subclass__ = self._original_init_subclass
        finally:
            _lock.release()
        return False


def _has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)))


def materialize(module: nn.Module, device: torch.device | str = "cpu", *, _memo: dict | None = None) -> bool:
    """Allocate ``module``'s own meta parameters and buffers on ``device`` and initialise
    them with its ``reset_parameters()``; False if it has meta tensors but no initialiser.

    A meta parameter shared with another module is replaced by one new parameter in both
    (pass the same ``_memo`` dict for the whole model)."""
    if not _has_meta(module):
        return True
    memo = {} if _memo is None else _memo
    fresh = False
    for name, p in list(module._parameters.items()):
        if p is None or not p.is_meta:
            continue
        if p not in memo:
            memo[p] = nn.Parameter(torch.zeros(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
            fresh = True
        module._parameters[name] = memo[p]
    for name, b in list(module._buffers.items()):
        if b is not None and b.is_meta:
            module._buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device=device)
            fresh = True
    reset = getattr(module, "reset_parameters", None)
    if reset is None:
        return not fresh
    with torch.no_grad():
        reset()
    return True


def load_state_dict(module: nn.Module, state_dict: dict | None, *, strict: bool = True, src: int = 0):
    """Load full weights into a partitioned model, one module at a time (collective).

    The ``from_pretrained`` path for a model built under ``zero.Init`` or trained at stage
    3: only rank ``src`` needs ``state_dict`` (others may pass None); each module's
    parameters are gathered, filled on ``src`` and broadcast, then partitioned again, so
    only one module's full parameters are alive at a time. Works unpartitioned too.

    Returns ``(missing_keys, unexpected_keys)`` as seen on ``src``; with ``strict`` a
    mismatch raises on every rank.
    """
    from shardwise.zero._gathered import GatheredParameters

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    comm = Communicator(name="zero.load_state_dict") if world > 1 else None
    if rank == src and state_dict is None:
        raise ValueError(f"load_state_dict: rank {src} (the source) must be given the state dict")
    expected: set[str] = set()
    problems: list[str] = []
    for prefix, sub in module.named_modules():
        prefix = f"{prefix}." if prefix else ""
        own = list(sub.parameters(recurse=False))
        names = [prefix + n for n, _ in sub.named_parameters(recurse=False)]
        buffers = [
            (prefix + n, b) for n, b in sub.named_buffers(recurse=False) if n not in sub._non_persistent_buffers_set
        ]
        expected.update(names)
        expected.update(n for n, _ in buffers)
        with GatheredParameters(own, modifier_rank=src):
            if rank == src:
                with torch.no_grad():
                    for name, p in zip(names, own):
                        if name in state_dict:
                            _copy_checked(p, state_dict[name], name, problems)
        for name, b in buffers:
            if rank == src and name in state_dict:
                with torch.no_grad():
                    _copy_checked(b, state_dict[name], name, problems)
            if comm is not None:
                comm.broadcast(b.data, src=src, tag=f"buffer {name}").wait()
    missing = sorted(expected - set(state_dict)) if rank == src else []
    unexpected = sorted(set(state_dict) - expected) if rank == src else []
    if comm is not None:  # every rank raises the same error (a raise on one rank would hang the rest)
        missing, unexpected, problems = comm.all_gather_object(
            (missing, unexpected, problems), tag="load_state_dict result"
        )[src]
    if problems:
        raise ValueError("load_state_dict: " + "; ".join(problems[:10]))
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"load_state_dict: missing keys {missing[:10]}, unexpected keys {unexpected[:10]}; "
            "pass strict=False to load the matching part"
        )
    return missing, unexpected


def _copy_checked(target: torch.Tensor, value: torch.Tensor, name: str, problems: list[str]) -> None:
    if tuple(target.shape) != tuple(value.shape):
        problems.append(
            f"{name} has shape {tuple(value.shape)} in the state dict and {tuple(target.shape)} in the model"
        )
        return
    target.copy_(value)
