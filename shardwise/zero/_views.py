"""The state and checkpoint views of the ZeRO strategies (``ZeroViews`` in ``_strategy.py``):
what a checkpoint, the engine's state accessors and ``safe_get_full_*`` read and write,
apart from the step lifecycle the strategies implement. A strategy holds its views as
``strategy.views``.

:class:`ShardedViews` reads the layout stages 1 to 3 share (``ShardedBucket``: a flat
buffer per bucket or unit, each rank's shard the ``shard`` elements from ``rank * shard``)
and the strategy's gatherer; :class:`Stage3Views` differs only where stage 3's
parameters are not whole (the module's state is gathered a unit at a time, and is
loaded into the shards). :class:`Stage0Views` reads stage 0's replicated
layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from shardwise.zero._bucket import ShardedBucket, master_is_copy, same_storage
from shardwise.zero._named_state import check_groups, load_per_param_state_by_name, per_param_state_by_name
from shardwise.zero._strategy import GRAD_KEY, MASTER_KEY, PARAM_KEY, ModelStateBytes, ShardBlock
from shardwise.zero._unit import UnitState


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    if optimizer is None:
        return 0
    return sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )


def optimizer_state_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The optimizer's per-element state tensors (not its scalar ``step`` counters)."""
    if optimizer is None:
        return []
    return [
        v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor) and v.numel() > 1
    ]


class ShardedViews:
    """The views of a stage 1, 2 or 3 strategy (see the module docstring)."""

    def __init__(self, strategy):
        self.strategy = strategy

    def _holder_rank(self, bucket: ShardedBucket) -> int | None:
        """``ShardBlock.holder_rank`` of ``bucket``."""
        return None if bucket.comm is self.strategy.comm else bucket.comm.rank

    def sync_params_from_master(self) -> None:
        """Bring the parameters in line with the masters (see the gatherer's)."""
        self.strategy.gatherer.sync_params_from_master()

    def module_state_dict(self) -> dict:
        """The module's full state dict (parameters are whole on every rank here)."""
        return self.strategy.module.state_dict()

    def load_module_state_dict(self, state: dict, *, strict: bool):
        """Load full weights into the module and refresh the master copies."""
        result = self.strategy.module.load_state_dict(state, strict=strict)
        self.reset_master_from_params()
        return result

    def reset_master_from_params(self) -> None:
        """Bring the masters in line with the parameters (see the gatherer's)."""
        self.strategy.gatherer.reset_master_from_params()

    def model_state_bytes(self) -> ModelStateBytes:
        def size(t):
            return 0 if t is None else t.numel() * t.element_size()

        untouched = [p for p in self.strategy.module.parameters() if p not in self.strategy._bucket_of]
        params = sum(size(b.flat_param) for b in self.strategy.buckets) + sum(size(p) for p in untouched)
        grads = sum(size(b.grad_full) for b in self.strategy.buckets)
        grads += sum(
            size(b.grad_shard)
            for b in self.strategy.buckets
            if b.grad_full is None or not same_storage(b.grad_shard, b.grad_full)
        )
        master = sum(size(b.master) for b in self.strategy.buckets if master_is_copy(b))
        return ModelStateBytes(params, grads, master, optimizer_state_bytes(self.strategy.optimizer))

    # -- checkpoints ---------------------------------------------------------------------------

    def _gather(self, bucket: ShardedBucket, shard: torch.Tensor) -> torch.Tensor:
        device = bucket.flat_param.device  # where collectives run (shards may be offloaded)
        full = torch.empty(bucket.padded, dtype=shard.dtype, device=device)
        bucket.comm.all_gather_into_tensor(full, shard.to(device).contiguous(), tag="checkpoint gather").wait()
        return full

    def optimizer_state_by_name(self) -> dict:
        """Gather the sharded optimizer state into full tensors per parameter name (collective;
        every rank gets all of it: checkpoints use the blocks below instead)."""
        state: dict[str, dict] = {}
        master: dict[str, torch.Tensor] = {}
        for bucket in self.strategy.buckets:
            with self.strategy._resident([bucket]):
                per_key = {}
                held = self.strategy.optimizer.state.get(bucket.master, {})
                for key, value in sorted(held.items()):  # one collective per key: same order on every rank
                    per_key[key] = self._gather(bucket, value) if self._is_shard_state(bucket, key, value) else value
                full_master = (
                    self._gather(bucket, bucket.master.detach())
                    if self.strategy.policy.needs_master_copy and not bucket.frozen
                    else None
                )
            for p, off, shape in zip(bucket.params, bucket.offsets, bucket.shapes):
                name = self.strategy.names[p]
                state[name] = {
                    k: (
                        v[off : off + shape.numel()].view(shape).clone()
                        if isinstance(v, torch.Tensor) and v.numel() == bucket.padded
                        else v
                    )
                    for k, v in per_key.items()
                }
                if full_master is not None:
                    master[name] = full_master[off : off + shape.numel()].view(shape).clone()
        replicated = self.optimizer_state_replicated()
        return {
            "state": {n: s for n, s in state.items() if s},
            "param_groups": replicated["param_groups"],
            "master": master,
        }

    @staticmethod
    def _is_shard_state(bucket: ShardedBucket, key: str, value) -> bool:
        """Whether an optimizer state value is this rank's shard of a per-element tensor."""
        return key != "step" and isinstance(value, torch.Tensor) and value.numel() == bucket.shard

    def optimizer_state_replicated(self) -> dict:
        """The part of the named optimizer state that every rank holds alike: the parameter
        groups and the per-bucket scalars (``step``). The shards are in
        ``optimizer_state_blocks``."""
        state: dict[str, dict] = {}
        for bucket in self.strategy.buckets:
            held = self.strategy.optimizer.state.get(bucket.master, {})
            small = {k: v for k, v in held.items() if not self._is_shard_state(bucket, k, v)}
            if small:
                state.update({self.strategy.names[p]: dict(small) for p in bucket.params})
        groups = [
            {
                **options,
                "params": [self.strategy.names[p] for b in self.strategy.buckets if b.group == g for p in b.params],
            }
            for g, options in enumerate(self._optimizer_group_options())
        ]
        return {"state": state, "param_groups": groups, "master": {}}

    def optimizer_state_blocks(self) -> list[ShardBlock]:
        """Every sharded optimizer tensor, bucket by bucket, keys sorted (the same list on
        every rank; swapped-out state is described from its swap records, not read)."""
        blocks = []
        for bucket in self.strategy.buckets:
            held = self.strategy.optimizer.state.get(bucket.master, {})
            dtypes = {k: v.dtype for k, v in held.items() if self._is_shard_state(bucket, k, v)}
            if self.strategy.swapper is not None:
                dtypes.update(self.strategy.swapper.swapped_state_dtypes(bucket.index))
            if self.strategy.policy.needs_master_copy and not bucket.frozen:  # a frozen unit's is its weights
                dtypes[MASTER_KEY] = torch.float32
            names = tuple(self.strategy.names[p] for p in bucket.params)
            blocks += [
                ShardBlock(
                    bucket.index,
                    key,
                    dtype,
                    names,
                    tuple(bucket.shapes),
                    bucket.padded,
                    bucket.shard,
                    self._holder_rank(bucket),
                )
                for key, dtype in sorted(dtypes.items())
            ]
        return blocks

    @contextlib.contextmanager
    def optimizer_shards(self, bucket: int) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's shards of bucket ``bucket``'s optimizer state (and fp32 master, under
        ``MASTER_KEY``), in memory for the block."""
        b = self.strategy.buckets[bucket]
        with self.strategy._resident([b]):
            held = self.strategy.optimizer.state.get(b.master, {})
            shards = {k: v for k, v in held.items() if self._is_shard_state(b, k, v)}
            if self.strategy.policy.needs_master_copy and not b.frozen:
                shards[MASTER_KEY] = b.master.detach()
            yield shards

    def _optimizer_group_options(self) -> list[dict]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.strategy.optimizer.param_groups]

    def module_state_replicated(self) -> dict:
        """State-dict entries no bucket covers (buffers, parameters outside the buckets):
        every rank holds them alike. The bucketed parameters are in ``module_state_blocks``."""
        bucketed = {id(p) for p in self.strategy._bucket_of}
        return {
            k: v.detach() for k, v in self.strategy.module.state_dict(keep_vars=True).items() if id(v) not in bucketed
        }

    def module_state_pieces(self) -> Iterator[dict[str, torch.Tensor]]:
        """The state dict in pieces whose tensors are valid until the next piece (collective
        at stage 3, which gathers a unit per piece); here one piece, parameters being whole."""
        yield self.strategy.module.state_dict()

    def module_state_blocks(self) -> list[ShardBlock]:
        """Each bucket's parameters in their training dtype, named by ``named_parameters``."""
        return [
            ShardBlock(
                b.index,
                PARAM_KEY,
                b.flat_param.dtype,
                tuple(self.strategy.names[p] for p in b.params),
                tuple(b.shapes),
                b.padded,
                b.shard,
                self._holder_rank(b),
            )
            for b in self.strategy.buckets
        ]

    @contextlib.contextmanager
    def module_shards(self, bucket: int) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's shard of bucket ``bucket``'s parameters in their training dtype (where
        it lives is the gatherer's answer: a slice of the whole parameters at stages 1-2, the
        fp32 master at stage 3)."""
        yield {PARAM_KEY: self.strategy.gatherer.param_shard(self.strategy.buckets[bucket])}

    def load_optimizer_state_by_name(self, saved: dict) -> None:
        """Cut this rank's shards out of a named optimizer state (from any stage or world
        size). With nvme offload each bucket's state goes to its swap files before the next
        bucket's is cut, so the rank's whole state is never in memory at once."""
        check_groups(saved, self.strategy.optimizer, set(self.strategy.names.values()))
        index = {id(b.master): i for i, b in enumerate(self.strategy.buckets)}
        masters = saved.get("master", {})
        groups = [
            {**saved_group, "params": [index[id(p)] for p in group["params"]]}
            for saved_group, group in zip(saved["param_groups"], self.strategy.optimizer.param_groups)
        ]
        state: dict[int, dict] = {}
        for bucket in self.strategy.buckets:
            if self.strategy.policy.needs_master_copy and all(self.strategy.names[p] in masters for p in bucket.params):
                with torch.no_grad(), self.strategy._resident([bucket]):
                    bucket.master.copy_(
                        self._local_slice(
                            bucket, [masters[self.strategy.names[p]] for p in bucket.params], torch.float32
                        )
                    )
            entry = self._saved_entry(bucket, saved["state"])
            if self.strategy.swapper is None:
                if entry:
                    state[index[id(bucket.master)]] = entry
                continue
            # what stays in memory (``step``) through the optimizer's own loading; the rest
            # straight to the swap files
            swapped = {
                k: v.to(torch.float32) for k, v in entry.items() if self._is_shard_state(bucket, k, v) and v.numel() > 1
            }
            kept = {k: v for k, v in entry.items() if k not in swapped}
            if kept:
                state[index[id(bucket.master)]] = kept
            self.strategy.swapper.replace_state(bucket.index, swapped)
        self.strategy.optimizer.load_state_dict({"state": state, "param_groups": groups})
        self.sync_params_from_master()

    def _saved_entry(self, bucket: ShardedBucket, saved_state: dict) -> dict:
        """This rank's shard of the saved optimizer state of ``bucket``'s parameters."""
        named = [saved_state.get(self.strategy.names[p], {}) for p in bucket.params]
        entry = {}
        for key in set().union(*named):
            values = [s.get(key) for s in named]
            first = next(v for v in values if v is not None)
            if key == "step" or not isinstance(first, torch.Tensor):
                entry[key] = first
            else:
                entry[key] = self._local_slice(bucket, values, first.dtype)
        return entry

    def _local_slice(self, bucket: ShardedBucket, values, dtype) -> torch.Tensor:
        """This rank's shard of ``bucket`` cut from full per-parameter ``values`` (None: zeros),
        copying only the overlapping ranges (a mapped checkpoint file is read only there)."""
        out = torch.zeros(bucket.shard, dtype=dtype, device=bucket.master.device)
        low, high = bucket.comm.rank * bucket.shard, (bucket.comm.rank + 1) * bucket.shard
        for shape, off, value in zip(bucket.shapes, bucket.offsets, values):
            start, end = max(off, low), min(off + shape.numel(), high)
            if value is not None and start < end:
                out[start - low : end - low].copy_(value.reshape(-1)[start - off : end - off])
        return out

    # -- one parameter's state (see ZeroViews) -----------------------------------------------

    def _state_shard(self, bucket: ShardedBucket, key: str) -> torch.Tensor | None:
        """This rank's shard of ``key`` for ``bucket`` (call inside ``_resident``)."""
        if key == MASTER_KEY:
            return bucket.master.detach()
        if key == GRAD_KEY:
            self.strategy._zero_new_grads()
            return bucket.grad_shard
        value = (
            self.strategy.optimizer.state.get(bucket.master, {}).get(key)
            if self.strategy.optimizer is not None
            else None
        )
        return value if self._is_shard_state(bucket, key, value) else None

    def _overlap(self, bucket: ShardedBucket, param: nn.Parameter) -> tuple[int, int, int, torch.Size]:
        """``(param offset, start, end)`` of the part of ``param`` in this rank's shard, and its shape."""
        index = next(i for i, p in enumerate(bucket.params) if p is param)
        off, shape = bucket.offsets[index], bucket.shapes[index]
        low, high = bucket.comm.rank * bucket.shard, (bucket.comm.rank + 1) * bucket.shard
        start, end = max(off, low), min(off + shape.numel(), high)
        return off, start, max(start, end), shape

    def full_param_state(self, param: nn.Parameter, key: str) -> torch.Tensor | None:
        """The whole tensor of ``key`` for ``param`` (see ZeroViews); collective."""
        self.strategy._ensure_layout()
        bucket = self.strategy._bucket_of.get(param)
        if bucket is None:
            return None
        with self.strategy._resident([bucket]):
            shard = self._state_shard(bucket, key)
            full = None if shard is None else self._gather(bucket, shard)
        if full is None:
            return None
        off, _, _, shape = self._overlap(bucket, param)
        return full[off : off + shape.numel()].view(shape).clone()

    def local_param_state(self, param: nn.Parameter, key: str) -> torch.Tensor | None:
        """The part of ``param``'s ``key`` in this rank's shard, flattened (maybe empty)."""
        self.strategy._ensure_layout()
        bucket = self.strategy._bucket_of.get(param)
        if bucket is None:
            return None
        _, start, end, _ = self._overlap(bucket, param)
        low = bucket.comm.rank * bucket.shard
        with self.strategy._resident([bucket]):
            shard = self._state_shard(bucket, key)
            return None if shard is None else shard[start - low : end - low].clone()

    def set_param_state(self, param: nn.Parameter, key: str, value: torch.Tensor, *, local: bool) -> None:
        """Write ``value`` (whole, or this rank's part when ``local``) into ``param``'s
        ``key``; a new master also updates the parameters (collective then)."""
        self.strategy._ensure_layout()
        bucket = self.strategy._bucket_of.get(param)
        if bucket is None:
            raise ValueError(f"parameter {self.strategy.names.get(param, '?')} is not trained by this ZeRO strategy")
        off, start, end, _ = self._overlap(bucket, param)
        low = bucket.comm.rank * bucket.shard
        part = value.reshape(-1) if local else value.reshape(-1)[start - off : end - off]
        with torch.no_grad(), self.strategy._resident([bucket]):
            shard = self._state_shard(bucket, key)
            if shard is None:
                raise KeyError(f"the optimizer holds no state {key!r} for this parameter")
            shard[start - low : end - low].copy_(part)
            if key == MASTER_KEY:
                self.strategy.gatherer.copy_masters_to_params([bucket])
        if key == MASTER_KEY:
            self.strategy.gatherer.gather_params()

    def state_tensors(self, kind: str) -> list[torch.Tensor]:
        """The tensors holding ``kind`` of state (see ZeroViews)."""
        self.strategy._ensure_layout()
        tensors = {
            "optim_states": optimizer_state_tensors(self.strategy.optimizer),
            "hp_params": [b.master for b in self.strategy.buckets if master_is_copy(b) and not b.frozen],
            "lp_params": [b.flat_param for b in self.strategy.buckets],
            "lp_grads": [t for b in self.strategy.buckets for t in (b.grad_full, b.grad_shard) if t is not None],
            "contiguous_grad_buffer": [b.staging for b in self.strategy.buckets if b.staging is not None],
        }
        return tensors[kind]


class Stage3Views(ShardedViews):
    """Stage 3's views: its parameters are whole only while their unit is gathered."""

    def module_state_dict(self) -> dict:
        """The full module state (collective: every unit is gathered, copied, released)."""
        self.strategy._ensure_layout()
        for unit in self.strategy.buckets:
            self.strategy.gatherer.unshard(unit)
        state = {k: v.detach().clone() for k, v in self.strategy.module.state_dict().items()}
        for unit in self.strategy.buckets:
            self.strategy.gatherer.reshard(unit, force=True)
        return state

    def module_state_pieces(self):
        """The state dict a unit at a time: first what no unit holds, then each unit's
        parameters under every key that names them (tied ones twice), gathered for the
        piece and released after it. Collective: every rank must take every piece."""
        self.strategy._ensure_layout()
        current = self.strategy.module.state_dict(keep_vars=True)
        keys_of: dict[int, list[str]] = {}
        for key, tensor in current.items():
            keys_of.setdefault(id(tensor), []).append(key)
        yield {k: v.detach() for k, v in current.items() if v not in self.strategy._bucket_of}
        for unit in self.strategy.buckets:
            was_gathered = unit.state is UnitState.GATHERED
            self.strategy.gatherer.unshard(unit)
            yield {key: p.detach() for p in unit.params for key in keys_of.get(id(p), [])}
            if not was_gathered:
                self.strategy.gatherer.reshard(unit, force=True)

    def load_module_state_dict(self, state: dict, *, strict: bool):
        """Load full weights into the shards a unit at a time: each rank copies out of the
        (possibly mapped) full tensors only its shard, so nothing is gathered. Keys are
        checked as ``nn.Module.load_state_dict`` checks them."""
        self.strategy._ensure_layout()
        current = self.strategy.module.state_dict(keep_vars=True)
        key_of: dict[int, str] = {}  # a unit parameter -> a key that holds it (tied: the first given)
        for key, tensor in current.items():
            if tensor in self.strategy._bucket_of and key in state and id(tensor) not in key_of:
                key_of[id(tensor)] = key
        mismatched = [
            f"size mismatch for {key}: copying a param with shape {tuple(state[key].shape)} from "
            f"checkpoint, the shape in current model is {tuple(tensor.ds_shape)}"
            for key, tensor in current.items()
            if tensor in self.strategy._bucket_of and key in state and state[key].shape != tensor.ds_shape
        ]
        if mismatched:
            raise RuntimeError("Error(s) in loading state_dict: " + "; ".join(mismatched))
        rest = {k: v for k, v in state.items() if not (k in current and current[k] in self.strategy._bucket_of)}
        result = self.strategy.module.load_state_dict(rest, strict=False)
        missing = [k for k in result.missing_keys if k not in state]
        unexpected = list(result.unexpected_keys)
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"Error(s) in loading state_dict: missing keys {missing}, unexpected keys "
                f"{unexpected}; load with load_module_strict=False to skip them"
            )
        with torch.no_grad():
            for unit in self.strategy.buckets:
                present = [key_of.get(id(p)) for p in unit.params]
                if not any(present):
                    continue
                if unit.state is UnitState.GATHERED and not unit.persistent:
                    self.strategy.gatherer.reshard(unit, force=True)
                with self.strategy._resident([unit]):
                    if all(present):
                        unit.master.copy_(self._local_slice(unit, [state[k] for k in present], torch.float32))
                    else:  # some of the unit's parameters keep their values: gather, fill, cut
                        self.strategy.gatherer.unshard(unit)
                        for p, key in zip(unit.params, present):
                            if key is not None:
                                p.copy_(state[key])
                        unit.master.copy_(unit.local(unit.flat_param, unit.comm.rank))
                        self.strategy.gatherer.reshard(unit, force=True)
        self.sync_params_from_master()  # persistent units are whole: refresh them
        return result._replace(missing_keys=missing, unexpected_keys=unexpected)

    def model_state_bytes(self) -> ModelStateBytes:
        live = sum(u.flat_param.untyped_storage().nbytes() for u in self.strategy.buckets)
        masters = sum(u.master.numel() * 4 for u in self.strategy.buckets if not u.frozen)
        frozen = sum(u.master.numel() * u.master.element_size() for u in self.strategy.buckets if u.frozen)
        mixed = self.strategy.policy.needs_master_copy
        grads = sum(u.grad_shard.numel() * 4 for u in self.strategy.buckets if not u.frozen)
        return ModelStateBytes(
            live + frozen + (0 if mixed else masters),
            grads,
            masters if mixed else 0,
            optimizer_state_bytes(self.strategy.optimizer),
        )


class Stage0Views:
    """The views of a stage 0 strategy: every rank holds all of the state."""

    def __init__(self, strategy):
        self.strategy = strategy

    def named_optimizer_params(self) -> dict[torch.Tensor, str]:
        """The tensor the optimizer updates for each parameter, keyed to its module name."""
        return {
            self.strategy._master.get(p, p): name
            for name, p in self.strategy.module.named_parameters()
            if p.requires_grad
        }

    def optimizer_state_by_name(self) -> dict:
        """The optimizer state keyed by parameter name (see ``_named_state``)."""
        return per_param_state_by_name(
            self.strategy.optimizer, self.named_optimizer_params(), masters=bool(self.strategy._master)
        )

    def optimizer_state_replicated(self) -> dict:
        """All of the named optimizer state: every rank holds all of it at stage 0."""
        return self.optimizer_state_by_name()

    def optimizer_state_blocks(self) -> list:
        """None: nothing is sharded at stage 0."""
        return []

    def optimizer_shards(self, bucket: int):
        raise RuntimeError("stage 0 has no optimizer shards")

    def module_state_replicated(self) -> dict:
        """The whole state dict: every rank holds all of it at stage 0."""
        return self.module_state_dict()

    def module_state_blocks(self) -> list:
        return []

    def module_state_pieces(self):
        """The state dict in one piece (parameters are whole here)."""
        yield self.strategy.module.state_dict()

    def module_shards(self, bucket: int):
        raise RuntimeError("stage 0 has no parameter shards")

    def load_optimizer_state_by_name(self, saved: dict) -> None:
        load_per_param_state_by_name(self.strategy.optimizer, self.named_optimizer_params(), saved)
        self.sync_params_from_master()

    def sync_params_from_master(self) -> None:
        """Copy the fp32 master weights into the low-precision module parameters."""
        if self.strategy._master:
            with torch.no_grad():
                torch._foreach_copy_(
                    [p.data for p in self.strategy.trainable],
                    [self.strategy._master[p] for p in self.strategy.trainable],
                )

    def model_state_bytes(self) -> ModelStateBytes:
        params = sum(p.numel() * p.element_size() for p in self.strategy.module.parameters())
        grads = sum(b.buffer.numel() * b.buffer.element_size() for b in self.strategy.buckets)
        master = sum(2 * m.numel() * m.element_size() for m in self.strategy._master.values())
        return ModelStateBytes(params, grads, master, optimizer_state_bytes(self.strategy.optimizer))

    def module_state_dict(self) -> dict:
        """The module's full state dict (parameters are whole on every rank here)."""
        return self.strategy.module.state_dict()

    def load_module_state_dict(self, state: dict, *, strict: bool):
        """Load full weights into the module and refresh the master copies."""
        result = self.strategy.module.load_state_dict(state, strict=strict)
        self.reset_master_from_params()
        return result

    def reset_master_from_params(self) -> None:
        """Refresh the fp32 master copies from the module (after loading module weights)."""
        with torch.no_grad():
            for p, master in self.strategy._master.items():
                master.copy_(p)

    def _param_state(self, param: nn.Parameter, key: str) -> torch.Tensor | None:
        if param not in self.strategy._bucket_of:
            return None
        master = self.strategy._master.get(param, param)
        if key == MASTER_KEY:
            return master.detach()
        if key == GRAD_KEY:
            return param.grad
        return self.strategy.optimizer.state.get(master, {}).get(key) if self.strategy.optimizer is not None else None

    def full_param_state(self, param: nn.Parameter, key: str) -> torch.Tensor | None:
        """``param``'s ``key``, whole (a copy; fp32 for the master)."""
        value = self._param_state(param, key)
        return None if value is None else value.detach().clone()

    def local_param_state(self, param: nn.Parameter, key: str) -> torch.Tensor | None:
        """This rank holds all of ``param``: its ``key`` flattened."""
        value = self.full_param_state(param, key)
        return None if value is None else value.reshape(-1)

    def set_param_state(self, param: nn.Parameter, key: str, value: torch.Tensor, *, local: bool) -> None:
        """Write ``value`` into ``param``'s ``key`` (a new master also updates ``param``)."""
        del local  # the local part is the whole parameter
        target = self._param_state(param, key)
        if target is None:
            raise KeyError(f"no {key!r} is held for this parameter (not trained, or no optimizer state yet)")
        with torch.no_grad():
            target.copy_(value.reshape(target.shape))
            if key == MASTER_KEY and param in self.strategy._master:
                param.copy_(target)

    def state_tensors(self, kind: str) -> list[torch.Tensor]:
        """The tensors holding ``kind`` of state (see ZeroViews)."""
        tensors = {
            "optim_states": optimizer_state_tensors(self.strategy.optimizer),
            "hp_params": [t for m in self.strategy._master.values() for t in (m, m.grad) if t is not None],
            "lp_params": list(self.strategy.module.parameters()),
            "lp_grads": [b.buffer for b in self.strategy.buckets],
            "contiguous_grad_buffer": [],
        }
        return tensors[kind]
