"""The fast path (``replace_with_kernel_inject=True``): a lean decoder over the model's
own weights, with a static KV cache, fused projections and ``scaled_dot_product_attention``.

[Note: the fast decoder]
Hugging Face's forward is general: per step it builds masks, updates a growing cache
object and runs a module tree with hooks. The decoder here runs the same arithmetic with
less around it:

- the key / value cache of a generation is allocated once at its final length
  (``[batch, kv_heads, prompt + new tokens, head_dim]`` per layer) and written in place;
- query, key and value (and the MLP's gate and up) are one matmul: their weights are
  concatenated once and the original layers' weights (and biases) become views of the fused tensors,
  so no memory is added and the Hugging Face module still runs (``engine(...)``);
- attention is ``scaled_dot_product_attention`` over the filled part of the cache, with
  no mask at all when the batch has no padding;
- only the last position goes through the final norm and the LM head;
- weights are stored input-major ([Note: input-major weights]).

Norms, rotary embeddings and activations are the model's own modules and functions, so
the numbers are the model's; the greedy tokens are identical to ``generate``'s (tests).
Under tensor parallelism each rank runs its heads and MLP slice and all-reduces the
block outputs, as the row-parallel layers do.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.inference._quant import int8_parts
from shardwise.tensor_parallel.layers import RowParallelLinear

# [Note: input-major weights]
# A linear layer's weight is ``[out, in]``; ``F.linear`` reads it transposed either way,
# but on the CPU (MKL) a decode step's few input rows multiply much faster by a weight
# stored ``[in, out]``: 141 against 268 us for 8 rows times a 512 x 2816 weight, 2.4
# against 3.8 ms for a 32000-word LM head (equal for one row). The decoder re-stores each
# weight input-major once and the layer's ``weight`` becomes the transposed view, so the
# model's own forward reads the same memory (and gets faster too); GPT-2's Conv1D stores
# its weights that way already.


class _Proj:
    """One linear projection ``y = x W^T + b`` (int8 ``W`` times per-row scales), summed
    over the tensor group first when it is row-parallel."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, *, scale: torch.Tensor | None = None, comm=None
    ) -> None:
        self.weight, self.bias, self.scale, self.comm = weight, bias, scale, comm

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is None and self.comm is None:
            return F.linear(x, self.weight, self.bias)
        return self.finish(self.local(x))

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of the output: no bias, not summed over the tensor group."""
        w = self.weight if self.scale is None else self.weight.to(x.dtype)
        y = F.linear(x, w)
        return y if self.scale is None else y * self.scale.to(x.dtype)

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """``y``, local parts (of this projection, or summed with another's), summed over
        the tensor group, plus the bias."""
        if self.comm is not None:
            y = y.contiguous()
            self.comm.all_reduce(y, tag="inference row-parallel output").wait()
        return y if self.bias is None else y + self.bias


def _parts(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(weight [out, in], bias, int8 scale or None)`` of a linear-like layer."""
    quant = int8_parts(module)
    conv1d = _is_conv1d(module)
    if quant is not None:
        weight, scale = quant
    else:
        weight, scale = module.weight, None
    return (weight.t() if conv1d else weight), module.bias, scale


def _is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's transposed linear (also once parametrized, which subclasses it)."""
    return any(cls.__name__ == "Conv1D" for cls in type(module).__mro__)


def proj(module: nn.Module) -> _Proj:
    """The projection of one layer (row-parallel layers all-reduce), its weight stored
    input-major (see [Note: input-major weights])."""
    weight, bias, scale = _parts(module)
    weight = _store_input_major(module, weight, scale)
    comm = module.comm if isinstance(module, RowParallelLinear) and module.tp_degree > 1 else None
    return _Proj(weight, bias, scale=scale, comm=comm)


def input_major(module: nn.Module, *, embedding: nn.Module) -> nn.Module:
    """``module`` (the LM head) with its weight stored input-major. A head tied to the input
    embedding is re-stored too when both are plain ``nn.Linear`` / ``nn.Embedding`` (no
    second copy: see [Note: tied head, input-major])."""
    weight, _, scale = _parts(module)
    if weight.data_ptr() != embedding.weight.data_ptr():
        _store_input_major(module, weight, scale)
    elif type(module) is nn.Linear and type(embedding) is nn.Embedding and module.weight is embedding.weight:
        _store_input_major(module, weight, scale)
        embedding.weight = module.weight  # tied again: one parameter, both modules
    return module


# [Note: tied head, input-major]
# GPT-2 and OPT (and any model with ``tie_word_embeddings``) multiply by the input
# embedding's ``[vocab, hidden]`` table to get the logits. Stored input-major
# ([Note: input-major weights]) the head runs 1.4-2x faster on the CPU at batch 1 and 8
# (hidden 256 / 768, vocab 8000; 2026-11-28), and the head is a large part of a small
# model's step. The table is re-stored once as ``[hidden, vocab]`` and both modules hold
# its transposed view: the embedding's lookup then gathers each row with a stride (a few
# rows per step, microseconds), and no memory is added.


def _store_input_major(module: nn.Module, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``weight`` re-stored input-major (a transposed view; the layer's weight becomes it),
    or as it is when it is already."""
    if weight.stride(-1) != 1:
        return weight
    weight = weight.detach().t().contiguous().t()
    _rebind(module, weight, scale)
    return weight


def fused_proj(modules: list[nn.Module]) -> tuple[_Proj, list[int]]:
    """One projection computing ``modules``' outputs side by side (they read the same
    input), and each one's output width. The layers' weights become views of the fused
    weight (see [Note: the fast decoder])."""
    parts = [_parts(m) for m in modules]
    if any(_is_conv1d(m) for m in modules) or any(isinstance(m, RowParallelLinear) for m in modules):
        raise TypeError("only [out, in] column layers fuse")
    widths = [w.shape[0] for w, _, _ in parts]
    weight = torch.cat([w.detach().t() for w, _, _ in parts], dim=1).t()  # input-major
    scale = None if parts[0][2] is None else torch.cat([s for _, _, s in parts])
    has_bias = [b is not None for _, b, _ in parts]
    if any(has_bias) and not all(has_bias):
        bias = torch.cat([b.detach() if b is not None else weight.new_zeros(w) for (_, b, _), w in zip(parts, widths)])
    else:
        bias = torch.cat([b.detach() for _, b, _ in parts]) if all(has_bias) else None
    offset = 0
    for module, width, with_bias in zip(modules, widths, has_bias):
        _rebind(module, weight[offset : offset + width], None if scale is None else scale[offset : offset + width])
        if with_bias:  # a view too, so that writing the layer's bias writes the decoder's
            _rebind_bias(module, bias[offset : offset + width])
        offset += width
    return _Proj(weight, bias, scale=scale), widths


def _rebind(module: nn.Module, weight_view: torch.Tensor, scale_view: torch.Tensor | None) -> None:
    """Make ``module``'s ``[out, in]`` weight (and int8 scale) a view of the decoder's
    tensors (not for a Conv1D, whose weight is never re-stored)."""
    from shardwise.tensor_parallel._partition import copy_marks

    if scale_view is not None:
        old = module.parametrizations.weight.original
        new = nn.Parameter(weight_view, requires_grad=False)
        copy_marks(old, new)
        module.parametrizations.weight.original = new
        next(p for p in module.parametrizations.weight if hasattr(p, "scale")).scale = scale_view
        return
    old = module.weight
    new = nn.Parameter(weight_view, requires_grad=old.requires_grad)
    copy_marks(old, new)
    module.weight = new


def _rebind_bias(module: nn.Module, bias_view: torch.Tensor) -> None:
    """Make ``module``'s bias a view of the decoder's fused bias."""
    from shardwise.tensor_parallel._partition import copy_marks

    old = module.bias
    new = nn.Parameter(bias_view, requires_grad=old.requires_grad)
    copy_marks(old, new)
    module.bias = new


class StaticCache:
    """Keys and values of every layer, allocated once at the generation's final length."""

    def __init__(
        self, *, num_layers: int, batch: int, kv_heads: int, length: int, head_dim: int, dtype, device
    ) -> None:
        shape = (num_layers, batch, kv_heads, length, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.split_layers()

    def split_layers(self) -> None:
        """Keep each layer's view of ``keys`` and ``values`` (a decode step then writes
        and reads them with ``narrow``, not with Python indexing, see [Note: the fast
        decoder]); call again after replacing ``keys`` or ``values``."""
        self.layer_keys, self.layer_values = self.keys.unbind(0), self.values.unbind(0)

    def update(
        self, layer: int, start: int | torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``, ``v`` (``[batch, kv_heads, n, head_dim]``) at ``start`` and return
        the filled part of the layer's cache; a tensor ``start`` (one position, on the
        device) writes one token there and returns the whole cache ([Note: decode graphs])."""
        if isinstance(start, torch.Tensor):
            self.keys[layer].index_copy_(2, start, k)
            self.values[layer].index_copy_(2, start, v)
            return self.keys[layer], self.values[layer]
        keys, values, n = self.layer_keys[layer], self.layer_values[layer], k.shape[2]
        keys.narrow(2, start, n).copy_(k)
        values.narrow(2, start, n).copy_(v)
        return keys.narrow(2, 0, start + n), values.narrow(2, 0, start + n)


class FastDecoder:
    """A family's decoder; subclasses read the weights of one Hugging Face layout."""

    num_layers: int
    kv_heads: int
    head_dim: int
    sliding_window: int | None = None

    rotary: nn.Module | None = None
    """The model's rotary embedding module, for families with rotary positions."""

    def new_cache(self, batch: int, length: int) -> StaticCache:
        cache = StaticCache(
            num_layers=self.num_layers,
            batch=batch,
            kv_heads=self.kv_heads,
            length=length,
            head_dim=self.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        if self.rotary is not None:  # the table of every position the generation can reach, computed once
            probe = torch.empty(1, length, self.head_dim, dtype=self.dtype, device=self.device)
            cache.rotary = self.rotary(probe, torch.arange(length, device=self.device)[None])
        return cache

    def _attend(self, q, k, v, mask, *, causal: bool, scale: float) -> torch.Tensor:
        gqa = q.shape[1] != k.shape[1]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale, enable_gqa=gqa
        )
        b, h, s, d = out.shape
        return out.transpose(1, 2).reshape(b, s, h * d)

    def logits(self, hidden_last: torch.Tensor) -> torch.Tensor:
        return self.head(self.final_norm(hidden_last)).float()


class GatedMLP:
    """A gated MLP ``down(act(gate(x)) * up(x))`` with gate and up as one projection."""

    def __init__(self, mlp: nn.Module) -> None:
        self.gate_up, (self.g_width, _) = fused_proj([mlp.gate_proj, mlp.up_proj])
        self.down, self.act = proj(mlp.down_proj), mlp.act_fn

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_up(x).split(self.g_width, dim=-1)
        return self.down(self.act(g) * u)


class LlamaDecoder(FastDecoder):
    """Llama, Mistral, Qwen2: pre-norm RMSNorm blocks, rotary positions, gated MLP (and
    the query / key norms of the families that have them, see ``_fast_moe.py``)."""

    def __init__(self, model: nn.Module) -> None:
        base = model.model
        self.embed, self.final_norm, self.rotary = base.embed_tokens, _rms_norm(base.norm), base.rotary_emb
        self.head = input_major(model.lm_head, embedding=base.embed_tokens)
        self.apply_rotary = sys.modules[type(base.layers[0].self_attn).__module__].apply_rotary_pos_emb
        self.dtype, self.device = base.embed_tokens.weight.dtype, base.embed_tokens.weight.device
        self.layers = []
        for layer in base.layers:
            attn = layer.self_attn
            qkv, (q_width, k_width, v_width) = fused_proj([attn.q_proj, attn.k_proj, attn.v_proj])
            qk_norms = None
            if getattr(attn, "q_norm", None) is not None:  # Qwen3: RMSNorm of each head's query and key
                qk_norms = (_rms_norm(attn.q_norm), _rms_norm(attn.k_norm))
            self.layers.append(
                (
                    _rms_norm(layer.input_layernorm),
                    qkv,
                    proj(attn.o_proj),
                    _rms_norm(layer.post_attention_layernorm),
                    self._mlp(layer.mlp),
                    qk_norms,
                )
            )
        attn = base.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scale = attn.scaling
        self.widths = (q_width, k_width, v_width)
        self.heads, self.kv_heads = q_width // self.head_dim, k_width // self.head_dim
        self.num_layers = len(self.layers)
        self.sliding_window = (
            getattr(model.config, "sliding_window", None) if getattr(model.config, "use_sliding_window", True) else None
        )

    def _mlp(self, mlp: nn.Module):
        """The callable running one layer's MLP block on ``[batch, tokens, hidden]``."""
        return GatedMLP(mlp)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask, cache: StaticCache, start: int):
        x = self.embed(ids)
        cos, sin = (table[0, positions] for table in cache.rotary)
        b, s, _ = x.shape
        hd = self.head_dim
        for i, (ln1, qkv, o_proj, ln2, mlp, qk_norms) in enumerate(self.layers):
            q, k, v = qkv(ln1(x)).split(self.widths, dim=-1)
            q, k, v = q.view(b, s, -1, hd), k.view(b, s, -1, hd), v.view(b, s, -1, hd)
            if qk_norms is not None:
                q, k = qk_norms[0](q), qk_norms[1](k)
            q, k = self.apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            k, v = cache.update(i, start, k, v.transpose(1, 2))
            x = x + o_proj(self._attend(q, k, v, mask, causal=s > 1, scale=self.scale))
            x = x + mlp(ln2(x))
        return self.logits(x[:, -1])


class GPT2Decoder(FastDecoder):
    """GPT-2: learned positions, pre-norm LayerNorm blocks, stacked query/key/value."""

    def __init__(self, model: nn.Module) -> None:
        base = model.transformer
        attn = base.h[0].attn
        if getattr(attn, "scale_attn_by_inverse_layer_idx", False) or getattr(attn, "reorder_and_upcast_attn", False):
            raise _NoFastPath("GPT-2 with scale_attn_by_inverse_layer_idx or reorder_and_upcast_attn")
        self.embed, self.positions, self.final_norm = base.wte, base.wpe, _layer_norm(base.ln_f)
        self.head = input_major(model.lm_head, embedding=base.wte)
        self.layers = [
            (
                _layer_norm(block.ln_1),
                proj(block.attn.c_attn),
                proj(block.attn.c_proj),
                _layer_norm(block.ln_2),
                proj(block.mlp.c_fc),
                proj(block.mlp.c_proj),
                block.mlp.act,
            )
            for block in base.h
        ]
        self.head_dim = attn.head_dim
        self.scale = 1.0 / math.sqrt(self.head_dim) if attn.scale_attn_weights else 1.0
        self.heads = self.layers[0][1].weight.shape[0] // (3 * self.head_dim)
        self.kv_heads = self.heads
        self.num_layers = len(self.layers)
        self.dtype, self.device = base.wte.weight.dtype, base.wte.weight.device

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask, cache: StaticCache, start: int):
        x = self.embed(ids) + self.positions(positions)
        b, s, _ = x.shape
        hd = self.head_dim
        for i, (ln1, c_attn, c_proj, ln2, c_fc, mlp_proj, act) in enumerate(self.layers):
            q, k, v = c_attn(ln1(x)).view(b, s, 3, -1, hd).permute(2, 0, 3, 1, 4)
            k, v = cache.update(i, start, k, v)
            x = x + c_proj(self._attend(q, k, v, mask, causal=s > 1, scale=self.scale))
            x = x + mlp_proj(act(c_fc(ln2(x))))
        return self.logits(x[:, -1])


class GPTNeoXDecoder(FastDecoder):
    """GPT-NeoX (Pythia): head-major stacked query/key/value, partial rotary positions, and
    usually the parallel residual (attention and MLP read the same input)."""

    def __init__(self, model: nn.Module) -> None:
        base = model.gpt_neox
        attn = base.layers[0].attention
        self.embed, self.final_norm, self.rotary = base.embed_in, _layer_norm(base.final_layer_norm), base.rotary_emb
        self.head = input_major(model.get_output_embeddings(), embedding=base.embed_in)
        self.apply_rotary = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self.parallel_residual = model.config.use_parallel_residual
        self.layers = [
            (
                _layer_norm(layer.input_layernorm),
                proj(layer.attention.query_key_value),
                proj(layer.attention.dense),
                _layer_norm(layer.post_attention_layernorm),
                proj(layer.mlp.dense_h_to_4h),
                proj(layer.mlp.dense_4h_to_h),
                layer.mlp.act,
            )
            for layer in base.layers
        ]
        self.head_dim = attn.head_size
        self.scale = attn.scaling
        self.heads = self.kv_heads = self.layers[0][1].weight.shape[0] // (3 * self.head_dim)
        self.num_layers = len(self.layers)
        self.dtype, self.device = base.embed_in.weight.dtype, base.embed_in.weight.device

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask, cache: StaticCache, start: int):
        x = self.embed(ids)
        cos, sin = (table[0, positions] for table in cache.rotary)
        b, s, _ = x.shape
        for i, (ln1, qkv, dense, ln2, h_to_4h, four_h_to_h, act) in enumerate(self.layers):
            q, k, v = qkv(ln1(x)).view(b, s, -1, 3 * self.head_dim).transpose(1, 2).chunk(3, dim=-1)
            q, k = self.apply_rotary(q, k, cos, sin)
            k, v = cache.update(i, start, k, v)
            attention = self._attend(q, k, v, mask, causal=s > 1, scale=self.scale)
            if self.parallel_residual and dense.comm is not None:
                # one all-reduce for both blocks: their outputs are summed anyway
                both = dense.finish(dense.local(attention) + four_h_to_h.local(act(h_to_4h(ln2(x)))))
                x = (both if four_h_to_h.bias is None else both + four_h_to_h.bias) + x
            elif self.parallel_residual:
                x = four_h_to_h(act(h_to_4h(ln2(x)))) + dense(attention) + x
            else:
                x = x + dense(attention)
                x = x + four_h_to_h(act(h_to_4h(ln2(x))))
        return self.logits(x[:, -1])


class OPTDecoder(FastDecoder):
    """OPT: learned positions (offset 2), LayerNorm before (most sizes) or after (350m)
    each block, the query scaled before attention, optional projections around the
    decoder when the embedding is narrower than the hidden size."""

    def __init__(self, model: nn.Module) -> None:
        base = model.model.decoder
        attn = base.layers[0].self_attn
        self.embed, self.positions = base.embed_tokens, base.embed_positions
        self.project_in, self.project_out = base.project_in, base.project_out
        self.final_norm = _layer_norm(base.final_layer_norm) if base.final_layer_norm is not None else nn.Identity()
        self.head = input_major(model.get_output_embeddings(), embedding=base.embed_tokens)
        self.norm_first = model.config.do_layer_norm_before
        self.layers = []
        for layer in base.layers:
            a = layer.self_attn
            qkv, widths = fused_proj([a.q_proj, a.k_proj, a.v_proj])
            self.layers.append(
                (
                    _layer_norm(layer.self_attn_layer_norm),
                    qkv,
                    proj(a.out_proj),
                    _layer_norm(layer.final_layer_norm),
                    proj(layer.fc1),
                    proj(layer.fc2),
                    layer.activation_fn,
                )
            )
        self.widths = widths
        self.head_dim = attn.head_dim
        self.query_scale = attn.scaling
        self.heads = self.kv_heads = widths[0] // self.head_dim
        self.num_layers = len(self.layers)
        self.dtype, self.device = base.embed_tokens.weight.dtype, base.embed_tokens.weight.device

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask, cache: StaticCache, start: int):
        x = self.embed(ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.positions(None, position_ids=positions)
        b, s, _ = x.shape
        hd = self.head_dim
        for i, (attn_norm, qkv, out_proj, mlp_norm, fc1, fc2, act) in enumerate(self.layers):
            h = attn_norm(x) if self.norm_first else x
            q, k, v = qkv(h).split(self.widths, dim=-1)
            q = (q * self.query_scale).view(b, s, -1, hd).transpose(1, 2)
            k = k.view(b, s, -1, hd).transpose(1, 2)
            v = v.view(b, s, -1, hd).transpose(1, 2)
            k, v = cache.update(i, start, k, v)
            x = x + out_proj(self._attend(q, k, v, mask, causal=s > 1, scale=1.0))
            if not self.norm_first:
                x = attn_norm(x)
            x = x + fc2(act(fc1(mlp_norm(x) if self.norm_first else x)))
            if not self.norm_first:
                x = mlp_norm(x)
        return self.logits(x[:, -1])

    def logits(self, hidden_last: torch.Tensor) -> torch.Tensor:
        hidden = self.final_norm(hidden_last)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return self.head(hidden).float()


def _rms_norm(norm: nn.Module):
    """Hugging Face's RMSNorm (``weight * x / sqrt(mean(x^2) + eps)``) as one fused call in
    float32; other dtypes (whose Hugging Face version rounds in between) keep the module."""
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None or norm.weight.dtype != torch.float32 or not type(norm).__name__.endswith("RMSNorm"):
        return norm
    shape = tuple(norm.weight.shape)
    return lambda x: F.rms_norm(x, shape, norm.weight, eps)


def _layer_norm(norm: nn.Module):
    """``nn.LayerNorm``'s forward as one call to the function it makes (the same numbers,
    without the module call around it; the weights are read at each call, as
    ``_rms_norm`` does, so a replaced parameter is seen); other norms keep the module."""
    if type(norm) is not nn.LayerNorm:
        return norm
    shape, eps = tuple(norm.normalized_shape), norm.eps
    return lambda x: F.layer_norm(x, shape, norm.weight, norm.bias, eps)


class _NoFastPath(Exception):
    """The model's variant has no fast decoder; the engine runs its own forward."""


_FAMILIES = {
    "llama": LlamaDecoder,
    "mistral": LlamaDecoder,
    "qwen2": LlamaDecoder,
    "gpt2": GPT2Decoder,
    "gpt_neox": GPTNeoXDecoder,
    "opt": OPTDecoder,
}


def build_decoder(model: nn.Module) -> tuple[FastDecoder | None, str]:
    """The fast decoder for ``model``, or None and why not."""
    from shardwise.inference._fast_moe import MODEL_TYPES, MoEDecoder

    families = {**_FAMILIES, **dict.fromkeys(MODEL_TYPES, MoEDecoder)}
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family = families.get(model_type)
    if family is None:
        return None, f"no fast decoder for model_type {model_type!r} (fast decoders: {sorted(families)})"
    try:
        return family(model), ""
    except _NoFastPath as exc:
        return None, f"no fast decoder for {exc}"
