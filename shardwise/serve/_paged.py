"""A Llama-family decoder over the paged KV cache: one forward for a batch of chunks of
different sequences, each at its own position.

[Note: the paged forward]
The chunks of a step are laid end to end as one flat batch of ``T`` tokens. Everything that
treats tokens independently (embeddings, norms, the q/k/v/o projections, rotary embeddings
from each token's own position, the MLP) runs once over all ``T`` rows, with the model's own
modules, which is where batching pays. Each token's key and value are written into its
cache slot ([Note: paged KV cache]); then each chunk's queries attend to the keys and values
of its slots ``0..end-1``, gathered from the pool, with the causal rule on absolute positions
(query at ``p`` sees keys at ``<= p``). The one-token chunks (every decode) do it in one call
per layer, their slots padded to the longest and masked; longer chunks (prompt pieces) one
call each. Where each reads is worked out once per step (``_Layout``), not per layer: the
per-sequence loop of tensor building was most of a decode step's time on a CPU. Only the last
row of a chunk that samples goes through the final norm and the LM head.

The pool holds one block more than the allocator hands out: the *scratch block*, which no
sequence ever owns. The padded rows of a captured decode step write there and read only
there ([Note: decode graphs across batches] in ``_decode_graphs.py``).

Families: Llama, Mistral and Qwen2 (Hugging Face layouts with ``q_proj``/``k_proj``/
``v_proj``/``o_proj``, ``input_layernorm``, ``post_attention_layernorm``, ``mlp`` and
``rotary_emb``); a sliding window shorter than the served length is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardwise.serve._decode_graphs import DecodeBuckets, DecodeGraphs
from shardwise.serve._scheduler import Chunk

FAMILIES = ("llama", "mistral", "qwen2")


def check_family(model, max_model_len: int) -> None:
    """Refuse a model this decoder does not run, naming what would."""
    config = model.config
    if config.model_type not in FAMILIES:
        raise ValueError(
            f"the batching engine runs {', '.join(FAMILIES)} models, not model_type {config.model_type!r}; "
            "serve it with --engine sequential"
        )
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and window < max_model_len:
        raise ValueError(
            f"sliding_window={window} is shorter than max_model_len={max_model_len}; the batching engine has no "
            "windowed attention: serve with --max-model-len <= the window, or --engine sequential"
        )


@dataclass(frozen=True)
class StepPlan:
    """What one forward computes, as plain data (see [Note: the paged forward]): the flat
    token ids of every chunk laid end to end, each chunk's ``start`` and ``end`` positions,
    whether it samples, and its block table (the blocks holding slots ``0..end-1``). Every
    rank of a tensor-parallel engine runs the same plan ([Note: tensor-parallel serving])."""

    ids: list[int]
    starts: list[int]
    ends: list[int]
    samples: list[bool]
    tables: list[list[int]]

    @classmethod
    def of(cls, chunks: list[Chunk], block_size: int) -> StepPlan:
        return cls(
            ids=[t for c in chunks for t in c.sequence.token_slice(c.start, c.end)],
            starts=[c.start for c in chunks],
            ends=[c.end for c in chunks],
            samples=[c.samples for c in chunks],
            tables=[c.sequence.blocks[: -(-c.end // block_size)] for c in chunks],
        )


class PagedDecoder:
    """The model's own modules run over a flat batch of chunks (see [Note: the paged forward]).
    A tensor-parallel shard of the model (``init_inference``'s split) runs its own heads: the
    head counts are read from the projections' shapes, so the cache holds the local heads only.
    With ``buckets``, decode-only steps run padded to buckets, as CUDA graphs when the model is
    on a GPU (see [Note: decode graphs across batches])."""

    def __init__(self, model, *, num_blocks: int, block_size: int, buckets: DecodeBuckets | None = None):
        self.model = model
        self.inner = model.model
        attention = self.inner.layers[0].self_attn
        self.head_dim = attention.head_dim
        self.heads = attention.q_proj.weight.shape[0] // self.head_dim
        self.kv_heads = attention.k_proj.weight.shape[0] // self.head_dim
        self.scaling = attention.scaling
        self.block_size = block_size
        parameter = next(model.parameters())
        self.scratch_block = num_blocks
        """A block beyond the allocator's ``0..num_blocks-1``: written only by padded rows."""
        slots = (num_blocks + 1) * block_size
        shape = (len(self.inner.layers), slots, self.kv_heads, self.head_dim)
        self.keys = torch.zeros(shape, dtype=parameter.dtype, device=parameter.device)
        self.values = torch.zeros_like(self.keys)
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self._rotary = apply_rotary_pos_emb
        self.graphs = None if buckets is None else DecodeGraphs(self, buckets)
        """Decode-only steps padded to buckets, replayed as CUDA graphs on a GPU (None: every
        step eager)."""

    failed: str | None = None
    """Why this decoder can no longer run (never, for a single process)."""

    def idle(self) -> None:
        """Called while the engine has nothing to compute."""

    def close(self) -> None:
        """Called once when the engine stops."""

    def slots(self, blocks: list[int], start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end)
        table = torch.tensor(blocks, dtype=torch.long)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def forward(self, chunks: list[Chunk]) -> torch.Tensor:
        """Logits ``[chunks that sample, vocab]`` (in order) after computing every chunk."""
        return self.run(StepPlan.of(chunks, self.block_size))

    @torch.no_grad()
    def run(self, plan: StepPlan) -> torch.Tensor:
        """Logits ``[chunks that sample, vocab]`` (in order) after computing ``plan``."""
        device = self.keys.device
        spans = list(zip(plan.starts, plan.ends))
        hidden = self.graphs.run(plan) if self.graphs is not None and self.graphs.fits(plan) else None
        if hidden is not None:  # see [Note: decode graphs across batches]
            x = hidden[None]
        else:
            ids = torch.tensor(plan.ids, device=device)
            positions = torch.cat([torch.arange(start, end) for start, end in spans]).to(device)
            written = torch.cat([self.slots(t, s, e) for t, (s, e) in zip(plan.tables, spans)]).to(device)
            x = self.layers(ids, positions, written, _Layout.of(self, plan, spans))
        rows = torch.tensor([row for row, samples in zip(_ends(spans), plan.samples) if samples], dtype=torch.long)
        last = x[0, rows.to(device)]
        return self.model.lm_head(self.inner.norm(last)).float()

    def layers(self, ids, positions, written, layout: _Layout) -> torch.Tensor:
        """The hidden states ``[1, T, hidden]`` after the decoder layers (before the final
        norm) of tokens ``ids`` at ``positions``, their keys and values written to slots
        ``written``; no host synchronisation, so a CUDA graph can capture it."""
        x = self.inner.embed_tokens(ids)[None]
        cos, sin = self.inner.rotary_emb(x, positions[None])
        for index, layer in enumerate(self.inner.layers):
            hidden = layer.input_layernorm(x)
            x = x + self._attention(layer.self_attn, hidden, cos, sin, index, written, layout)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x

    def decode_layers(self, ids, positions, written, slots, mask) -> torch.Tensor:
        """``layers`` for one-token chunks only, as ``[rows, hidden]``: row ``i`` attends to
        ``slots[i]`` where ``mask[i]`` (see [Note: decode graphs across batches])."""
        rows = torch.arange(ids.shape[0], device=ids.device)
        return self.layers(ids, positions, written, _Layout(rows, slots, mask[:, None, None], []))[0]

    def _attention(self, attention, hidden, cos, sin, index, written, layout: _Layout) -> torch.Tensor:
        tokens = hidden.shape[1]
        q = attention.q_proj(hidden).view(1, tokens, self.heads, self.head_dim).transpose(1, 2)
        k = attention.k_proj(hidden).view(1, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
        v = attention.v_proj(hidden).view(1, tokens, self.kv_heads, self.head_dim)
        q, k = self._rotary(q, k, cos, sin)
        self.keys[index, written] = k[0].transpose(0, 1).to(self.keys.dtype)
        self.values[index, written] = v[0].to(self.values.dtype)
        gqa = self.heads != self.kv_heads
        out = q.new_empty(1, self.heads, tokens, self.head_dim)
        if layout.decode_rows is not None:  # every one-token chunk in one call, keys padded
            keys = self.keys[index, layout.decode_slots].permute(0, 2, 1, 3)  # [D, kv_heads, longest, d]
            values = self.values[index, layout.decode_slots].permute(0, 2, 1, 3)
            query = q[0, :, layout.decode_rows].transpose(0, 1)[:, :, None]  # [D, heads, 1, d]
            attended = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=layout.decode_mask, scale=self.scaling, enable_gqa=gqa
            )
            out[0, :, layout.decode_rows] = attended[:, :, 0].transpose(0, 1)
        for row, length, slots, mask in layout.prompts:
            keys = self.keys[index, slots].transpose(0, 1)[None]  # [1, kv_heads, end, d]
            values = self.values[index, slots].transpose(0, 1)[None]
            out[:, :, row : row + length] = F.scaled_dot_product_attention(
                q[:, :, row : row + length], keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=gqa
            )
        return attention.o_proj(out.transpose(1, 2).reshape(1, tokens, self.heads * self.head_dim))


@dataclass
class _Layout:
    """Where each chunk's attention reads, built once per step for every layer: the one-token
    chunks (decodes) as one padded batch (their flat rows, their context slots padded to the
    longest with slot 0, and a mask of the real ones), the longer chunks (prompt pieces) one by
    one (flat row, length, context slots, causal mask on absolute positions)."""

    decode_rows: torch.Tensor | None
    decode_slots: torch.Tensor | None
    decode_mask: torch.Tensor | None
    prompts: list[tuple[int, int, torch.Tensor, torch.Tensor]]

    @classmethod
    def of(cls, decoder: PagedDecoder, plan: StepPlan, spans: list[tuple[int, int]]) -> _Layout:
        device = decoder.keys.device
        rows, tables, lengths, prompts, row = [], [], [], [], 0
        for table, (start, end) in zip(plan.tables, spans):
            if end - start == 1:
                rows.append(row)
                tables.append(decoder.slots(table, 0, end))
                lengths.append(end)
            else:
                positions = torch.arange(end, device=device)
                mask = positions[None, :] <= positions[start:end, None]
                prompts.append((row, end - start, decoder.slots(table, 0, end).to(device), mask))
            row += end - start
        if not rows:
            return cls(None, None, None, prompts)
        longest = max(lengths)
        slots = torch.zeros(len(rows), longest, dtype=torch.long)
        for i, context in enumerate(tables):
            slots[i, : len(context)] = context
        mask = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]
        return cls(torch.tensor(rows, device=device), slots.to(device), mask[:, None, None].to(device), prompts)


def _ends(spans: list[tuple[int, int]]) -> list[int]:
    """The flat row of each chunk's last token."""
    ends, row = [], 0
    for start, end in spans:
        row += end - start
        ends.append(row - 1)
    return ends
