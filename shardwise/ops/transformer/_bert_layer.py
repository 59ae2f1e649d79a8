"""DeepSpeed's fused BERT layer (``DeepSpeedTransformerLayer``) in plain PyTorch.

[Note: the fused BERT layer's math]
DeepSpeed's CUDA kernel (``ds_transformer_cuda.cpp``) computes, with ``x`` the input,
``LN(t; w, b)`` a layer norm, ``attn(t)`` multi-head self-attention whose query, key and
value come from one ``[3 * hidden, hidden]`` projection (``attn_qkvw``: query rows, then
key rows, then value rows; heads are consecutive blocks of each) and ``gelu`` the tanh
approximation the kernel uses::

    pre-LN:   a = x + drop(attn(LN(x; norm_w, norm_b)) @ attn_ow.T + attn_ob)
              y = a + drop(ffn(LN(a; attn_nw, attn_nb)))
    post-LN:  a = LN(x + drop(attn(x) @ attn_ow.T + attn_ob); attn_nw, attn_nb)
              y = LN(a + drop(ffn(a)); norm_w, norm_b)

    ffn(t) = gelu(t @ inter_w.T + inter_b) @ output_w.T + output_b

So ``attn_nw`` / ``attn_nb`` is the norm after attention in both layouts (Hugging Face
BERT's ``attention.output.LayerNorm``) and ``norm_w`` / ``norm_b`` is the input norm of a
pre-LN layer or the final norm of a post-LN one (BERT's ``output.LayerNorm``). The
attention mask is added to the scores (BERT's extended mask: 0 to attend, a large
negative number to mask; shape ``[batch, 1, 1, seq]`` or anything broadcasting to
``[batch, heads, seq, seq]``); a boolean mask means True = attend, as in PyTorch's SDPA.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("shardwise")


@dataclasses.dataclass
class DeepSpeedTransformerConfig:
    """DeepSpeed's configuration of the fused BERT layer: the same arguments, in the same
    order, with the same defaults (-1: not set). Mutable, as DeepSpeed's is: the layer
    records its ``layer_id`` on it.

    ``normalize_invertible``, ``gelu_checkpoint``, ``attn_dropout_checkpoint`` and
    ``stochastic_mode`` choose how DeepSpeed's CUDA kernel saves memory or time; they do
    not change the result and have no effect here. ``batch_size``, ``local_rank``, ``seed``,
    ``fp16`` and ``training`` are read by the kernel's set-up only; the layer computes in
    its parameters' dtype on their device, draws dropout from torch's generator and
    follows ``module.train()`` / ``eval()``.
    """

    batch_size: int = -1
    hidden_size: int = -1
    intermediate_size: int = -1
    """Width of the feed-forward layer (not set: 4 x hidden_size)."""
    heads: int = -1
    attn_dropout_ratio: float = -1
    """Dropout on the attention probabilities (not set: none)."""
    hidden_dropout_ratio: float = -1
    """Dropout on the attention output and the feed-forward output (not set: none)."""
    num_hidden_layers: int = -1
    """Layers in the model; with ``adjust_init_range`` the output projections are
    initialised with ``initializer_range / sqrt(2 * num_hidden_layers)``."""
    initializer_range: float = -1
    """Standard deviation of the initial weights."""
    layer_norm_eps: float = 1e-12
    local_rank: int = -1
    seed: int = -1
    fp16: bool = False
    pre_layer_norm: bool = True
    """Pre-LN (norm before attention and feed-forward) or post-LN (BERT's original)."""
    normalize_invertible: bool = False
    gelu_checkpoint: bool = False
    adjust_init_range: bool = True
    attn_dropout_checkpoint: bool = False
    stochastic_mode: bool = False
    return_tuple: bool = False
    """Return ``(output,)`` instead of ``output``."""
    training: bool = True
    layer_id: int = -1
    """Set by the layer built from this config (DeepSpeed's running layer counter)."""

    def __post_init__(self) -> None:
        if self.intermediate_size <= 0 and self.hidden_size > 0:
            self.intermediate_size = 4 * self.hidden_size

    @classmethod
    def from_dict(cls, json_object: dict) -> DeepSpeedTransformerConfig:
        """A config from a dict of the constructor's arguments.

        Raises:
            ValueError: a key is not one of the arguments (the message lists them).
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(json_object) - known)
        if unknown:
            raise ValueError(f"DeepSpeedTransformerConfig has no field(s) {unknown}; known: {sorted(known)}")
        return cls(**json_object)

    @classmethod
    def from_json_file(cls, json_file) -> DeepSpeedTransformerConfig:
        """A config from a JSON file (UTF-16 with a byte-order mark, as DeepSpeed writes
        it, or UTF-8)."""
        data = Path(json_file).read_bytes()
        encoding = "utf-16" if data[:2] in (b"\xff\xfe", b"\xfe\xff") else "utf-8"
        return cls.from_dict(json.loads(data.decode(encoding)))


def _check(config: DeepSpeedTransformerConfig) -> None:
    if config.hidden_size <= 0 or config.heads <= 0 or config.hidden_size % config.heads:
        raise ValueError(
            f"DeepSpeedTransformerConfig: hidden_size ({config.hidden_size}) must be a positive "
            f"multiple of heads ({config.heads})"
        )
    if config.initializer_range <= 0:
        raise ValueError(
            "DeepSpeedTransformerConfig.initializer_range must be > 0 (the std of the initial "
            f"weights, BERT uses 0.02), got {config.initializer_range}"
        )
    if config.adjust_init_range and config.num_hidden_layers <= 0:
        raise ValueError(
            "DeepSpeedTransformerConfig.num_hidden_layers must be > 0 with adjust_init_range=True, "
            f"got {config.num_hidden_layers}"
        )
    for name in ("attn_dropout_ratio", "hidden_dropout_ratio"):
        if getattr(config, name) >= 1:
            raise ValueError(f"DeepSpeedTransformerConfig.{name} must be < 1, got {getattr(config, name)}")


class DeepSpeedTransformerLayer(nn.Module):
    """One BERT encoder layer with DeepSpeed's parameter names, on PyTorch's
    ``scaled_dot_product_attention`` (see [Note: the fused BERT layer's math]).

    State dicts use DeepSpeed's names (``attn_qkvw``, ``attn_qkvb``, ``attn_ow``,
    ``attn_ob``, ``attn_nw``, ``attn_nb``, ``inter_w``, ``inter_b``, ``output_w``,
    ``output_b``, ``norm_w``, ``norm_b``) and shapes, so checkpoints of models built on
    DeepSpeed's kernel load unchanged.

    Args:
        config: a :class:`DeepSpeedTransformerConfig`; its ``layer_id`` is set to this
            layer's number (layers are numbered from 0 in construction order).
        initial_weights: DeepSpeed's testing hook: eight tensors (query, key, value,
            attention output, attention norm, intermediate, output, norm weights) copied
            into the parameters instead of the random initialisation.
        initial_biases: likewise for the biases (the query, key and value entries are not
            read: the projection bias starts at zero, as in DeepSpeed).
    """

    layer_id = 0
    """The next layer's number (DeepSpeed's class-level counter)."""

    def __init__(self, config: DeepSpeedTransformerConfig, initial_weights=None, initial_biases=None):
        super().__init__()
        _check(config)
        self.config = config
        config.layer_id = DeepSpeedTransformerLayer.layer_id
        DeepSpeedTransformerLayer.layer_id += 1
        hidden, inner = config.hidden_size, config.intermediate_size
        shapes = {
            "attn_qkvw": (3 * hidden, hidden),
            "attn_qkvb": (3 * hidden,),
            "attn_ow": (hidden, hidden),
            "attn_ob": (hidden,),
            "attn_nw": (hidden,),
            "attn_nb": (hidden,),
            "inter_w": (inner, hidden),
            "inter_b": (inner,),
            "output_w": (hidden, inner),
            "output_b": (hidden,),
            "norm_w": (hidden,),
            "norm_b": (hidden,),
        }
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape)))
        self.init_transformer_weights(config.adjust_init_range)
        if initial_weights is not None or initial_biases is not None:
            self._copy_initial(initial_weights, initial_biases)
        logger.debug("DeepSpeedTransformerLayer %d: %s", config.layer_id, config)

    def init_transformer_weights(self, adjust_init_range: bool = False) -> None:
        """Normal(0, initializer_range) weights (the output projections' std divided by
        ``sqrt(2 * num_hidden_layers)`` with ``adjust_init_range``), zero biases, unit norms."""
        std = self.config.initializer_range
        output_std = std / math.sqrt(2.0 * self.config.num_hidden_layers) if adjust_init_range else std
        with torch.no_grad():
            for name in ("attn_qkvw", "inter_w"):
                getattr(self, name).normal_(mean=0.0, std=std)
            for name in ("attn_ow", "output_w"):
                getattr(self, name).normal_(mean=0.0, std=output_std)
            for name in ("attn_qkvb", "attn_ob", "attn_nb", "inter_b", "output_b", "norm_b"):
                getattr(self, name).zero_()
            self.attn_nw.fill_(1.0)
            self.norm_w.fill_(1.0)

    def _copy_initial(self, weights, biases) -> None:
        with torch.no_grad():
            if weights is not None:
                self.attn_qkvw.copy_(torch.cat([w.detach() for w in weights[:3]]))
                for name, value in zip(("attn_ow", "attn_nw", "inter_w", "output_w", "norm_w"), weights[3:8]):
                    getattr(self, name).copy_(value.detach())
            if biases is not None:
                for name, value in zip(("attn_ob", "attn_nb", "inter_b", "output_b", "norm_b"), biases[3:8]):
                    getattr(self, name).copy_(value.detach())

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        head_mask=None,
        layer_head_mask=None,
        encoder_hidden_states=None,
        encoder_attention_mask=None,
        past_key_value=None,
        output_attentions=False,
        grads=None,
    ):
        """The layer's output for ``hidden_states`` ``[batch, seq, hidden]`` (a 1-tuple with
        ``config.return_tuple``). ``attention_mask``: see [Note: the fused BERT layer's math].
        The other arguments are DeepSpeed's signature; giving any of them is an error
        (DeepSpeed's kernel ignores them silently)."""
        given = {
            "head_mask": head_mask,
            "layer_head_mask": layer_head_mask,
            "encoder_hidden_states": encoder_hidden_states,
            "encoder_attention_mask": encoder_attention_mask,
            "past_key_value": past_key_value,
            "grads": grads,
        }
        unsupported = [name for name, value in given.items() if value is not None] + (
            ["output_attentions"] if output_attentions else []
        )
        if unsupported:
            raise NotImplementedError(
                f"DeepSpeedTransformerLayer.forward: {unsupported} are not supported (nor "
                "used by DeepSpeed's kernel); pass hidden_states and attention_mask only"
            )
        cfg = self.config
        p_hidden = max(cfg.hidden_dropout_ratio, 0.0) if self.training else 0.0
        x = hidden_states
        if cfg.pre_layer_norm:
            a = x + F.dropout(self._attention(self._norm(x, "norm_"), attention_mask), p_hidden)
            y = a + F.dropout(self._feed_forward(self._norm(a, "attn_n")), p_hidden)
        else:
            a = self._norm(x + F.dropout(self._attention(x, attention_mask), p_hidden), "attn_n")
            y = self._norm(a + F.dropout(self._feed_forward(a), p_hidden), "norm_")
        return (y,) if cfg.return_tuple else y

    def _norm(self, x, prefix: str):
        return F.layer_norm(
            x, (x.shape[-1],), getattr(self, prefix + "w"), getattr(self, prefix + "b"), eps=self.config.layer_norm_eps
        )

    def _attention(self, x, mask):
        batch, seq, hidden = x.shape
        heads = self.config.heads
        qkv = F.linear(x, self.attn_qkvw, self.attn_qkvb).view(batch, seq, 3, heads, hidden // heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [batch, heads, seq, head_dim]
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(q.dtype)
        p_attn = max(self.config.attn_dropout_ratio, 0.0) if self.training else 0.0
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p_attn)
        return F.linear(context.transpose(1, 2).reshape(batch, seq, hidden), self.attn_ow, self.attn_ob)

    def _feed_forward(self, x):
        inner = F.gelu(F.linear(x, self.inter_w, self.inter_b), approximate="tanh")  # the kernel's GELU
        return F.linear(inner, self.output_w, self.output_b)
