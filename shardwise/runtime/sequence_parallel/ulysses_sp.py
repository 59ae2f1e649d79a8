"""DeepSpeed's ALST entry points for Hugging Face models: ``UlyssesSPAttentionHF`` and
``UlyssesSPDataLoaderAdapter``, at DeepSpeed's import path.

[Note: Ulysses inside Hugging Face attention]
``register_with_transformers`` replaces the model's attention function (say ``"sdpa"``) in
transformers' ``ALL_ATTENTION_FUNCTIONS`` by a wrapper, so every code path of the model that
checks its attention implementation still runs, and only the attention call changes: the
wrapper receives this rank's positions ``[b, heads, s_local, d]``, swaps them for every
position of this rank's heads ([Note: Ulysses head split]), runs the original function on
the whole sequence without a mask (the model built one for its local length; causal
attention needs none) and with the whole sequence's ``position_ids``, and swaps the output
back. The model's rotary embeddings are computed before attention from ``position_ids``,
which must be each piece's global positions: the data loader adapter keeps them.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from shardwise.runtime.sequence_parallel._tiled import (  # noqa: F401 - DeepSpeed's names at its path
    SequenceTiledCompute,
    TiledFusedLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
)
from shardwise.sequence import _kept_attention
from shardwise.sequence._batch_gather import gather_batches
from shardwise.sequence._exchange import HeadSplit, ToHeads, ToSequence, communicator, even_split, piece_lengths

_ORIGINALS: dict[str, Any] = {}
"""The attention functions ``register_with_transformers`` replaced, by name."""


class UlyssesSPAttentionHF(nn.Module):
    """A Hugging Face attention function run with its sequence split over ``process_group``
    (see [Note: Ulysses inside Hugging Face attention]).

    Args:
        attn: the original function from ``transformers``' ``ALL_ATTENTION_FUNCTIONS``.
        batch_size: the micro-batch size (checked against each call).
        attn_head_count, attn_head_size, kv_head_count, num_hidden_layers: the model's.
        process_group: the sequence-parallel group (or a Communicator).
        seq_length_is_variable: whether pieces may change length between calls; when False,
            ``local_seq_length`` is checked on every call.
        local_seq_length, global_seq_length: the fixed lengths (None when variable).
        disable_in_eval: run ``attn`` unsplit while the module is in eval mode.
        keep_attention_outputs: keep each layer's attention output from its forward for
            activation checkpointing's recompute instead of computing it again (a shardwise
            addition, off by default: faster, but a checkpointed layer stores about twice as
            much; see [Note: kept attention outputs]). None takes the class attribute, which a
            script can set before accelerate or the Trainer registers the attention.
    """

    keep_attention_outputs: bool = False

    def __init__(
        self,
        attn,
        batch_size: int,
        attn_head_count: int,
        attn_head_size: int,
        kv_head_count: int,
        num_hidden_layers: int,
        process_group,
        seq_length_is_variable: bool = False,
        local_seq_length: int | None = None,
        global_seq_length: int | None = None,
        disable_in_eval: bool = False,
        keep_attention_outputs: bool | None = None,
    ) -> None:
        super().__init__()
        self.attn = attn
        self.comm = communicator(process_group)
        self.process_group = self.comm.group
        self.world_size, self.sp_rank = self.comm.world_size, self.comm.rank
        self.batch_size = batch_size
        self.attn_head_count, self.attn_head_size, self.kv_head_count = attn_head_count, attn_head_size, kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.disable_in_eval = disable_in_eval
        self.split = HeadSplit.build(attn_head_count, kv_head_count, self.world_size)
        self.core_attn_implementation = None
        self._cache = None  # see _pieces
        if keep_attention_outputs is not None:
            self.keep_attention_outputs = keep_attention_outputs
        self._kept = _kept_attention.KeptAttention()

    def forward(self, module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask, *args, **kwargs):
        if (not module.training and self.disable_in_eval) or self.world_size == 1:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        b, heads, s_local, d = query.shape
        if (b, heads, d) != (self.batch_size, self.attn_head_count, self.attn_head_size) or key.shape[1] != (
            self.kv_head_count
        ):
            raise ValueError(
                f"Ulysses attention was registered for micro-batch {self.batch_size}, {self.attn_head_count} heads "
                f"of {self.attn_head_size} and {self.kv_head_count} key/value heads; this call has query "
                f"{tuple(query.shape)} and key {tuple(key.shape)} ([batch, heads, positions, head size])"
            )
        if not self.seq_length_is_variable and s_local != self.local_seq_length:
            raise ValueError(
                f"seq_length_is_variable=False with {self.local_seq_length} positions per rank, but this call has "
                f"{s_local}; register with seq_length_is_variable=True for batches of varying length"
            )
        if "position_ids" not in kwargs or kwargs["position_ids"] is None:
            raise ValueError(
                "Ulysses sequence parallelism needs position_ids in every forward: each piece's global positions "
                "(torch.arange(seq_len) per sample, split like input_ids; UlyssesSPDataLoaderAdapter keeps them)"
            )
        lengths, kwargs["position_ids"] = self._pieces(kwargs["position_ids"], s_local, query.device)
        q, k, v = (
            ToHeads.apply(t.transpose(1, 2), self.comm, lengths, heads_of, f"ulysses {name}").transpose(1, 2)
            for t, heads_of, name in (
                (query, self.split.q, "query"),
                (key, self.split.kv, "key"),
                (value, self.split.kv, "value"),
            )
        )
        groups = getattr(module, "num_key_value_groups", None)
        if groups is not None:  # this rank's query heads per key/value head (differs when replicated)
            module.num_key_value_groups = q.shape[1] // k.shape[1]
        try:
            if self.keep_attention_outputs and not args and _kept_attention.applies(self.attn, module, q, k, v, kwargs):
                out, weights = _kept_attention.attention(self._kept, module, q, k, v, kwargs), None
            else:
                out, weights = self.attn(module, q, k, v, None, *args, **kwargs)  # out: [b, s, heads_local, d]
        finally:
            if groups is not None:
                module.num_key_value_groups = groups
        out = ToSequence.apply(out.contiguous(), self.comm, lengths, self.split.q, heads, "ulysses output")
        return out, weights

    def _pieces(self, position_ids: Tensor, s_local: int, device) -> tuple[list[int], Tensor]:
        """Every rank's piece length and the whole sequence's position ids, exchanged once per
        forward: every layer (and a checkpointed layer's recompute) passes the same
        ``position_ids`` tensor, so its answer is kept while that tensor lives unchanged."""
        cached = self._cache
        if cached is not None and cached[0]() is position_ids and cached[1] == position_ids._version:
            return cached[2], cached[3]
        lengths = piece_lengths(self.comm, s_local, device)
        gathered = self._gather_positions(position_ids, lengths)
        self._cache = (weakref.ref(position_ids), position_ids._version, lengths, gathered)
        return lengths, gathered

    def _gather_positions(self, position_ids: Tensor, lengths: list[int]) -> Tensor:
        """Every piece's ``position_ids`` ``[b, s_local]``, concatenated in rank order."""
        position_ids = position_ids.expand(self.batch_size, -1).contiguous()
        flat = position_ids.new_empty(self.batch_size * sum(lengths))
        sizes = [self.batch_size * n for n in lengths]
        self.comm.all_to_all_single(
            flat,
            position_ids.reshape(-1).repeat(self.world_size),
            output_split_sizes=sizes,
            input_split_sizes=[position_ids.numel()] * self.world_size,
            tag="ulysses position ids",
        ).wait()
        pieces = [p.view(self.batch_size, n) for p, n in zip(flat.split(sizes), lengths)]
        return torch.cat(pieces, dim=1)

    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path,
        core_attn_implementation,
        sequence_parallel_size,
        micro_batch_size,
        seq_length=None,
        seq_length_is_variable=True,
        disable_in_eval=False,
        max_length=None,
        keep_attention_outputs=None,
    ):
        """Build the sequence-parallel groups and make transformers' ``core_attn_implementation``
        attention run sequence-parallel (see [Note: Ulysses inside Hugging Face attention]);
        returns the ``mpu`` to pass to ``shardwise.initialize(mpu=...)`` (None when
        ``sequence_parallel_size`` is 1). ``model_name_or_path`` is a model, its config's
        name on the Hub or a local path. ``keep_attention_outputs`` (shardwise's addition) is
        the attention's (see the class)."""
        if sequence_parallel_size == 1:
            return None
        if seq_length is None:
            seq_length = max_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError("seq_length_is_variable=False needs seq_length (the fixed length of every batch)")
        from transformers import AutoConfig
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from shardwise.runtime.sequence_parallel import parallel_state_sp as mpu

        if core_attn_implementation in ("eager", "paged|eager"):
            raise ValueError(
                f"core_attn_implementation={core_attn_implementation!r} builds a full [seq, seq] mask, which a "
                "sequence split cannot use; use 'sdpa' or a flash attention"
            )
        if core_attn_implementation == "flex_attention":
            raise ValueError(
                "core_attn_implementation='flex_attention' is not available with sequence parallelism in this "
                "version of shardwise (its block mask is built for the local piece); use 'sdpa'"
            )
        config = getattr(model_name_or_path, "config", None) or AutoConfig.from_pretrained(model_name_or_path)
        loaded = getattr(config, "_attn_implementation", None)
        if hasattr(model_name_or_path, "config") and loaded not in (None, core_attn_implementation):
            raise ValueError(
                f"core_attn_implementation={core_attn_implementation!r} but the model runs {loaded!r}; load the "
                "model with the same attn_implementation"
            )
        name = core_attn_implementation
        if name not in _ORIGINALS and name not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(f"{name!r} is not an attention implementation of transformers")
        original = _ORIGINALS.setdefault(name, ALL_ATTENTION_FUNCTIONS[name])
        mpu.initialize_sequence_parallel(sequence_parallel_size)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        attention = cls(
            attn=original,
            batch_size=micro_batch_size,
            attn_head_count=text.num_attention_heads,
            attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
            kv_head_count=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
            num_hidden_layers=text.num_hidden_layers,
            process_group=mpu.get_sequence_parallel_group(),
            seq_length_is_variable=seq_length_is_variable,
            local_seq_length=None if seq_length_is_variable else seq_length // sequence_parallel_size,
            global_seq_length=None if seq_length_is_variable else seq_length,
            disable_in_eval=disable_in_eval,
            keep_attention_outputs=keep_attention_outputs,
        )
        attention.core_attn_implementation = name

        def ulysses_attention(module, query, key, value, attention_mask, *args, **kwargs):
            return attention(module, query, key, value, attention_mask, *args, **kwargs)

        ALL_ATTENTION_FUNCTIONS[name] = ulysses_attention
        return mpu

    @staticmethod
    def unregister_from_transformers() -> None:
        """Give transformers back the attention functions ``register_with_transformers``
        replaced (a shardwise addition, for a process that trains more than one model)."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        for name, function in _ORIGINALS.items():
            ALL_ATTENTION_FUNCTIONS[name] = function
        _ORIGINALS.clear()


class UlyssesSPDataLoaderAdapter:
    """Wraps each rank's ``DataLoader`` for sequence parallelism, as DeepSpeed's does: it
    takes one batch from every rank of the sequence-parallel group, and yields, one after
    the other, this rank's piece of each (so the group trains on each rank's batch in turn;
    ``len`` is ``len(dl) * sp_world_size``). Batches are dicts of ``[batch, seq, ...]``
    tensors with ``input_ids``, ``position_ids`` and ``labels``; ``labels`` are shifted
    *before* the split into ``shift_labels`` (-100 where a position has no target), so each
    piece keeps the targets of its last position. A length not divisible by the group is
    split into pieces that differ by one position."""

    def __init__(self, dl: DataLoader, sp_rank: int, sp_group, sp_world_size: int, device):
        self.dl = dl
        self.sp_rank, self.sp_group, self.sp_world_size = sp_rank, sp_group, sp_world_size
        self.device = device
        self.comm = communicator(sp_group)
        self.iter = iter(dl)
        self.micro_batches: deque = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self):
        return self

    def __next__(self):
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)
            raise
        if "position_ids" not in batch:
            raise ValueError(
                "Ulysses sequence parallelism needs position_ids in every batch (torch.arange(seq_len) per sample, "
                "resetting at document boundaries for packed sequences): add them in the collator"
            )
        for whole in gather_batches(batch, self.comm):  # see [Note: gathering batches as tensors]
            self.micro_batches.append(self._piece(whole))

    def _piece(self, batch: dict) -> dict:
        length = batch["input_ids"].shape[1]
        for key, value in batch.items():
            if torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] != length:
                raise ValueError(f"{key} has shape {tuple(value.shape)}; every tensor must be [batch, {length}, ...]")
        batch = dict(batch)
        if "labels" in batch:
            labels = batch.pop("labels")
            batch["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
        sizes = even_split(length, self.sp_world_size)
        start = sum(sizes[: self.sp_rank])
        mine = slice(start, start + sizes[self.sp_rank])
        return {k: v[:, mine].to(self.device) if torch.is_tensor(v) and v.dim() >= 2 else v for k, v in batch.items()}
