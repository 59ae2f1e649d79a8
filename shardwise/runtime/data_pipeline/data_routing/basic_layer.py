"""``RandomLayerTokenDrop``: run one layer on a random sorted subset of each sample's tokens.

DeepSpeed's wrapper gathers and scatters with a CUDA op; here both are ``torch.gather`` /
``torch.scatter``, so the wrapper runs on CPU and GPU and autograd derives the backward
(tokens a layer skipped get the gradient of the identity, the kept ones the layer's).
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

BATCH_SEQ = "batch_seq_dim"
SEQ_BATCH = "seq_batch_dim"


def sample_kept_indices(batch: int, seq: int, kept: int, *, device: torch.device) -> Tensor:
    """``[batch, kept]`` int64 token positions: per sample a uniform random subset of
    ``range(seq)`` of size ``kept``, ascending (so a causal layer keeps the tokens' order).
    Drawn from torch's default generator for ``device``: ``torch.manual_seed`` fixes it."""
    scores = torch.rand(batch, seq, device=device)
    chosen = scores.topk(kept, dim=1, sorted=False).indices
    return chosen.sort(dim=1).values


def gather_tokens(hidden: Tensor, indices: Tensor, *, batch_first: bool) -> Tensor:
    """The kept tokens of ``hidden`` ([batch, seq, ...] or [seq, batch, ...] by
    ``batch_first``), in the same layout with ``seq`` replaced by ``indices.size(1)``."""
    return hidden.gather(1 if batch_first else 0, _expand(indices, hidden, batch_first))


def scatter_tokens(hidden: Tensor, part: Tensor, indices: Tensor, *, batch_first: bool) -> Tensor:
    """A new tensor equal to ``hidden`` with the kept positions replaced by ``part``."""
    dim = 1 if batch_first else 0
    return hidden.scatter(dim, _expand(indices, part, batch_first), part)


def _expand(indices: Tensor, like: Tensor, batch_first: bool) -> Tensor:
    """``indices`` ([batch, kept]) shaped as a gather/scatter index for ``like``'s layout."""
    index = indices if batch_first else indices.t()
    trailing = like.shape[2:]
    index = index.reshape(*index.shape, *([1] * len(trailing)))
    return index.expand(*index.shape[:2], *trailing)


def gather_mask(mask: Tensor, indices: Tensor, *, name: str) -> Tensor:
    """The rows and columns of an attention mask that belong to the kept tokens.

    Shapes: [batch, seq] (a key padding mask: columns only), [batch, seq, seq] and
    [batch or 1, heads or 1, seq, seq]. For a purely causal mask this equals DeepSpeed's
    decoder shortcut (the top-left kept x kept block); it also stays right with padding.
    """
    batch, kept = indices.shape
    if mask.dim() == 2:
        return mask.expand(batch, -1).gather(1, indices)
    if mask.dim() not in (3, 4):
        raise ValueError(f"random-LTD cannot gather the attention mask '{name}' of shape {tuple(mask.shape)}")
    mask = mask.expand(batch, *mask.shape[1:])
    middle = mask.shape[1:-2]
    lead = [1] * len(middle)
    rows = indices.reshape(batch, *lead, kept, 1).expand(batch, *middle, kept, mask.size(-1))
    mask = mask.gather(-2, rows)
    cols = indices.reshape(batch, *lead, 1, kept).expand(batch, *middle, kept, kept)
    return mask.gather(-1, cols)


def gather_per_token(value, indices: Tensor):
    """``value`` at the kept positions: a [batch or 1, seq, ...] tensor gathered along its
    second dimension (a batch of 1 broadcast first), a tuple or list of them item by item,
    anything else unchanged (rotary ``position_embeddings``, ``position_ids``)."""
    if isinstance(value, (tuple, list)):
        return type(value)(gather_per_token(item, indices) for item in value)
    if not isinstance(value, Tensor) or value.dim() < 2:
        return value
    value = value.expand(indices.size(0), *value.shape[1:])
    return value.gather(1, _expand(indices, value, True))


def _positional_index(layer: nn.Module, name: str) -> int | None:
    """Where ``layer.forward`` takes ``name`` among the positional arguments after the
    hidden states (Hugging Face's GPT-2 model passes its blocks the mask by position)."""
    try:
        parameters = inspect.signature(layer.forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read: only the keyword is known
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in parameters if p.kind in kinds][1:]
    return names.index(name) if name in names else None


class RandomLayerTokenDrop(nn.Module):
    """Wraps ``layer``; in training with ``kept_length`` below the sequence length, each
    sample's layer input is a random sorted subset of ``kept_length`` of its tokens; the
    layer's output goes back to those positions, and the dropped tokens pass through
    unchanged. Gathered with the tokens: the rows and columns of the mask argument
    ``mask_name`` (by keyword or by its position in the layer's signature), and the keyword
    arguments named in ``token_kwargs``, [batch or 1, seq, ...] tensors or tuples of them
    (a Llama layer's rotary ``position_embeddings`` and ``position_ids``; DeepSpeed has no
    such option).

    In eval, with ``kept_length`` None, or with ``kept_length >= seq`` the layer sees every
    token. ``kept_length`` is set by ``RandomLTD`` (the engine's component) from the
    scheduler; ``last_kept_indices`` holds the [batch, kept] positions of the last dropping
    forward, for inspection. The layer is ``self.random_ltd_layer``, DeepSpeed's attribute
    name, so state dict keys read ``<path>.random_ltd_layer.<param>`` as in DeepSpeed.
    """

    def __init__(
        self,
        layer: nn.Module,
        *,
        mask_name: str | None = None,
        hidden_state_order: str = BATCH_SEQ,
        token_kwargs: tuple[str, ...] = (),
    ):
        super().__init__()
        if hidden_state_order not in (BATCH_SEQ, SEQ_BATCH):
            raise ValueError(f"hidden_state_order must be {BATCH_SEQ} or {SEQ_BATCH}, got {hidden_state_order!r}")
        self.random_ltd_layer = layer
        self.mask_name = mask_name
        self.batch_first = hidden_state_order == BATCH_SEQ
        self.token_kwargs = tuple(token_kwargs)
        self.kept_length: int | None = None
        self.last_kept_indices: Tensor | None = None

    def forward(self, hidden_states: Tensor, *args, **kwargs):
        seq_dim, batch_dim = (1, 0) if self.batch_first else (0, 1)
        kept = self.kept_length
        if not self.training or kept is None or kept >= hidden_states.size(seq_dim):
            return self.random_ltd_layer(hidden_states, *args, **kwargs)
        indices = sample_kept_indices(
            hidden_states.size(batch_dim), hidden_states.size(seq_dim), kept, device=hidden_states.device
        )
        self.last_kept_indices = indices
        if self.mask_name is not None:
            args, kwargs = self._gather_mask_argument(args, kwargs, indices)
        for name in self.token_kwargs:
            if name in kwargs:
                kwargs[name] = gather_per_token(kwargs[name], indices)
        part = gather_tokens(hidden_states, indices, batch_first=self.batch_first)
        outputs = self.random_ltd_layer(part, *args, **kwargs)
        if isinstance(outputs, Tensor):
            return scatter_tokens(hidden_states, outputs, indices, batch_first=self.batch_first)
        if isinstance(outputs, tuple) and outputs and isinstance(outputs[0], Tensor):
            merged = scatter_tokens(hidden_states, outputs[0], indices, batch_first=self.batch_first)
            return (merged, *outputs[1:])
        raise TypeError(
            f"random-LTD needs the wrapped {type(self.random_ltd_layer).__name__} to return a tensor or a tuple "
            f"whose first element is the hidden states, got {type(outputs).__name__}"
        )

    def _gather_mask_argument(self, args: tuple, kwargs: dict, indices: Tensor) -> tuple[tuple, dict]:
        """``args`` and ``kwargs`` with the mask called ``mask_name`` (by keyword, as
        DeepSpeed reads it, or by its position in the layer's signature) gathered."""
        name = self.mask_name
        if name in kwargs:
            if kwargs[name] is not None:
                kwargs = {**kwargs, name: gather_mask(kwargs[name], indices, name=name)}
            return args, kwargs
        index = _positional_index(self.random_ltd_layer, name)
        if index is not None and index < len(args) and args[index] is not None:
            args = (*args[:index], gather_mask(args[index], indices, name=name), *args[index + 1 :])
        return args, kwargs
