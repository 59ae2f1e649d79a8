"""Megatron-style tensor-parallel layers: each rank holds its shard of the parameters.

A column-parallel linear splits the output features, a row-parallel linear the input
features, so the pair ``ColumnParallelLinear(gather_output=False)`` -> elementwise op ->
``RowParallelLinear(input_is_parallel=True)`` needs one all-reduce forward and one
backward. Shards follow [Note: tensor-parallel shard rule] in ``_partition.py``.

[Note: tensor-parallel initialisation]
A layer draws the full parameter on CPU from torch's default generator (or
``init_method(full_weight)``) and keeps this rank's slice, so every rank that seeded
torch alike (``torch.manual_seed``) builds a slice of the same model, and a model on ``N``
tensor ranks equals the one-rank model with the same seed. Without ``init_method`` the
rule is ``nn.Linear``'s (``nn.Embedding``'s for the embedding), so the layer's full
weight equals the PyTorch layer built after the same seed; with ``init_method`` the bias
starts at zero, as in Megatron. The full tensor exists on every rank during construction
(one layer at a time); ``device="meta"`` skips it.

[Note: return values]
Megatron's linear layers always return ``(output, bias)``, the bias being None unless
``skip_bias_add``. Here ``forward`` returns the output tensor alone, like ``nn.Linear``,
so the layers drop into PyTorch models; with ``skip_bias_add=True`` the bias is not added
and ``forward`` returns ``(output, bias)`` (Megatron's "return the bias" mode, for a
caller that fuses the bias into a later op).

[Note: gradients of replicated parameters under sequence parallelism]
Under sequence parallelism a rank sees only its chunk of the sequence, so parameters
every tensor rank holds whole (LayerNorm weight and bias, the row-parallel bias) get a
partial gradient on each rank. These layers pass such parameters through
:func:`copy_to_tensor_region` in forward, so backward sums their gradients over the
tensor group and every rank ends with the full, identical gradient. They are not marked
``sequence_parallel`` (Megatron's request to sum them after backward), so nothing sums
them a second time.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.tensor_parallel._comm import as_tensor_comm
from shardwise.tensor_parallel._partition import copy_marks, mark_sharded, shard_size, take_shard
from shardwise.tensor_parallel.mappings import (
    copy_to_tensor_region,
    gather_from_sequence_region,
    gather_from_tensor_region,
    reduce_from_tensor_region,
    reduce_scatter_to_sequence_region,
    scatter_to_tensor_region,
)

InitMethod = Callable[[torch.Tensor], object]
"""Initialises a full weight in place, as ``torch.nn.init.xavier_normal_`` does."""


class _HoldsComm:
    """A deep copy shares the Communicator (one per group) and keeps the shard marks,
    which ``copy.deepcopy`` of an ``nn.Parameter`` drops."""

    def __deepcopy__(self, memo):
        memo.setdefault(id(self.comm), self.comm)
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__dict__, memo))
        for name, param in self._parameters.items():
            if param is not None:
                copy_marks(param, new._parameters[name])
        return new


def _is_meta(device) -> bool:
    return device is not None and torch.device(device).type == "meta"


def _full_linear_params(
    out_features: int, in_features: int, *, bias: bool, init_method: InitMethod | None, dtype, device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The full weight and bias. See [Note: tensor-parallel initialisation]."""
    place = "meta" if _is_meta(device) else "cpu"
    weight = torch.empty(out_features, in_features, dtype=dtype, device=place)
    full_bias = torch.empty(out_features, dtype=dtype, device=place) if bias else None
    if place == "meta":
        return weight, full_bias
    with torch.no_grad():
        if init_method is None:  # nn.Linear.reset_parameters, draw for draw
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
            if full_bias is not None:
                bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
                nn.init.uniform_(full_bias, -bound, bound)
        else:
            init_method(weight)
            if full_bias is not None:
                full_bias.zero_()
    return weight, full_bias


class _ParallelLinear(_HoldsComm, nn.Module):
    """What column- and row-parallel linears share: the shard rule and construction."""

    weight_dim: int
    """The dim of the ``[out, in]`` weight that is sharded."""
    bias_sharded: bool
    """Whether the bias is sharded (along dim 0) or replicated."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool,
        group,
        init_method,
        skip_bias_add: bool,
        sequence_parallel: bool,
        dtype,
        device,
    ) -> None:
        super().__init__()
        self.comm = as_tensor_comm(group)
        self.input_size, self.output_size = input_size, output_size
        self.tp_degree = self.comm.world_size
        name = type(self).__name__
        sharded = ("output_size", output_size) if self.weight_dim == 0 else ("input_size", input_size)
        shard_size(sharded[1], self.tp_degree, what=f"{name}: {sharded[0]}")
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel
        weight, full_bias = _full_linear_params(
            output_size,
            input_size,
            bias=bias,
            init_method=init_method,
            dtype=dtype or torch.get_default_dtype(),
            device=device,
        )
        self._hold_shards(weight, full_bias, device=device)

    def _hold_shards(self, weight: torch.Tensor, bias: torch.Tensor | None, *, device=None) -> None:
        """Keep this rank's shards of the full ``weight`` and ``bias`` as parameters
        (copies, on ``device`` or where the full tensors are)."""
        index, parts = self.comm.rank, self.tp_degree

        def own(full: torch.Tensor, dim: int | None) -> nn.Parameter:
            with torch.no_grad():
                data = (
                    full.detach().clone()
                    if dim is None
                    else take_shard(full.detach(), dim=dim, index=index, parts=parts)
                )
            param = nn.Parameter(data if device is None else data.to(device))
            if dim is not None:
                mark_sharded(param, full_shape=full.shape, dim=dim, index=index, parts=parts)
            return param

        self.weight = own(weight, self.weight_dim)
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = own(bias, 0 if self.bias_sharded else None)

    @classmethod
    def _from_full(cls, weight: torch.Tensor, bias: torch.Tensor | None, *, group, **options):
        out_features, in_features = weight.shape
        layer = cls(
            in_features, out_features, bias=bias is not None, group=group, dtype=weight.dtype, device="meta", **options
        )
        layer._hold_shards(weight, bias)
        for param, source in ((layer.weight, weight), (layer.bias, bias)):
            if param is not None:
                param.requires_grad_(source.requires_grad)
        return layer

    def extra_repr(self) -> str:
        return (
            f"input_size={self.input_size}, output_size={self.output_size}, bias={self.bias is not None}, "
            f"tp_degree={self.tp_degree}, skip_bias_add={self.skip_bias_add}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class ColumnParallelLinear(_ParallelLinear):
    """``Y = X A^T + b`` with ``A`` split by output features: rank ``r`` holds rows
    ``r`` of ``A`` and of ``b`` (``[output_size / tp_degree, input_size]``) and computes
    its chunk of ``Y``'s last dim.

    Forward takes the full input ``[..., input_size]`` (the same on every tensor rank),
    or under sequence parallelism this rank's sequence chunk ``[s / tp_degree, b, h]``,
    which it all-gathers. Backward sums the input gradient over the tensor group
    (reduce-scatters it under sequence parallelism). Returns the output shard
    ``[..., output_size / tp_degree]``, or with ``gather_output`` the full output; see
    [Note: return values] for ``skip_bias_add``.

    Args:
        input_size: input features.
        output_size: output features of the full layer; must divide by the group size.
        bias: whether the layer has a bias (sharded like the output).
        gather_output: all-gather the output so every rank has all of it (an extra
            all-gather forward); False when a row-parallel layer consumes the shard.
        group: the tensor-parallel group: a process group, a Communicator, a grid or an
            mpu (see :func:`as_tensor_comm`).
        init_method: initialises the full weight in place; None: ``nn.Linear``'s rule.
            See [Note: tensor-parallel initialisation].
        skip_bias_add: return ``(output, bias)`` instead of adding the bias (with
            ``gather_output``, the bias is gathered too).
        sequence_parallel: the input is this rank's sequence chunk (dim 0); it is
            all-gathered forward and its gradient reduce-scattered backward. Excludes
            ``gather_output``.
        dtype: parameter dtype (default: torch's default dtype).
        device: parameter device (default: CPU); ``"meta"`` allocates nothing.

    Raises:
        ValueError: ``output_size`` does not divide by the tensor-parallel degree, or
            ``sequence_parallel`` with ``gather_output``.
    """

    weight_dim = 0
    bias_sharded = True

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = True,
        *,
        group,
        init_method: InitMethod | None = None,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
        device=None,
    ) -> None:
        if sequence_parallel and gather_output:
            raise ValueError(
                "ColumnParallelLinear: sequence_parallel=True needs gather_output=False (the output "
                "stays sharded for a row-parallel layer)"
            )
        self.gather_output = gather_output
        self.input_in_region = False
        """True when the caller put the input into the tensor region already (one
        ``copy_to_tensor_region`` shared by several column-parallel layers reading the
        same input, so their input gradients are summed before one all-reduce; see [Note:
        one input region for sibling layers] in ``autotp.py``)."""
        super().__init__(
            input_size,
            output_size,
            bias=bias,
            group=group,
            init_method=init_method,
            skip_bias_add=skip_bias_add,
            sequence_parallel=sequence_parallel,
            dtype=dtype,
            device=device,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        if self.sequence_parallel:
            x = gather_from_sequence_region(x, self.comm)
        elif not self.input_in_region:
            x = copy_to_tensor_region(x, self.comm)
        out = F.linear(x, self.weight, None if self.skip_bias_add else self.bias)
        if self.gather_output:
            out = gather_from_tensor_region(out, self.comm)
        if not self.skip_bias_add:
            return out
        bias = self.bias
        if bias is not None and self.gather_output:
            bias = gather_from_tensor_region(bias, self.comm)
        return out, bias

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        group,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
    ) -> ColumnParallelLinear:
        """This rank's column-parallel shard of a full ``nn.Linear`` (copied, on its
        device and dtype; ``linear`` is left as it is).

        Raises:
            ValueError: ``linear.out_features`` does not divide by the tensor-parallel degree.
        """
        return cls._from_full(
            linear.weight,
            linear.bias,
            group=group,
            gather_output=gather_output,
            skip_bias_add=skip_bias_add,
            sequence_parallel=sequence_parallel,
        )

    @classmethod
    def from_conv1d(
        cls, conv, *, group, gather_output: bool = False, skip_bias_add: bool = False, sequence_parallel: bool = False
    ) -> ColumnParallelLinear:
        """As :meth:`from_linear`, from Hugging Face's GPT-2 ``Conv1D`` (weight stored
        transposed, ``[in, out]``)."""
        return cls._from_full(
            conv.weight.t(),
            conv.bias,
            group=group,
            gather_output=gather_output,
            skip_bias_add=skip_bias_add,
            sequence_parallel=sequence_parallel,
        )


class RowParallelLinear(_ParallelLinear):
    """``Y = X A^T + b`` with ``A`` split by input features: rank ``r`` holds columns
    ``r`` of ``A`` (``[output_size, input_size / tp_degree]``) and all of ``b``.

    Forward takes the input's shard ``[..., input_size / tp_degree]`` (with
    ``input_is_parallel``; otherwise the full input, which it splits), sums the partial
    products over the tensor group, or under sequence parallelism reduce-scatters them
    to this rank's sequence chunk, then adds the bias. Returns the full output (the
    sequence chunk under sequence parallelism); see [Note: return values] for
    ``skip_bias_add``.

    Args:
        input_size: input features of the full layer; must divide by the group size.
        output_size: output features.
        bias: whether the layer has a bias (replicated, not marked tensor-parallel).
        input_is_parallel: the input is already this rank's shard (the output of a
            column-parallel layer with ``gather_output=False``).
        group: the tensor-parallel group (see :func:`as_tensor_comm`).
        init_method: initialises the full weight in place; None: ``nn.Linear``'s rule.
        skip_bias_add: return ``(output, bias)`` instead of adding the bias.
        sequence_parallel: reduce-scatter the output along dim 0 instead of
            all-reducing it; the bias gradient is then summed over the group (see
            [Note: gradients of replicated parameters under sequence parallelism]).
            Needs ``input_is_parallel``.
        dtype: parameter dtype (default: torch's default dtype).
        device: parameter device (default: CPU); ``"meta"`` allocates nothing.

    Raises:
        ValueError: ``input_size`` does not divide by the tensor-parallel degree, or
            ``sequence_parallel`` without ``input_is_parallel``.
    """

    weight_dim = 1
    bias_sharded = False

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = False,
        *,
        group,
        init_method: InitMethod | None = None,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
        device=None,
    ) -> None:
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True")
        self.input_is_parallel = input_is_parallel
        super().__init__(
            input_size,
            output_size,
            bias=bias,
            group=group,
            init_method=init_method,
            skip_bias_add=skip_bias_add,
            sequence_parallel=sequence_parallel,
            dtype=dtype,
            device=device,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        if not self.input_is_parallel:
            x = scatter_to_tensor_region(x, self.comm)
        out = F.linear(x, self.weight)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_region(out, self.comm)
        else:
            out = reduce_from_tensor_region(out, self.comm)
        bias = self.bias
        if bias is not None and self.sequence_parallel:
            bias = copy_to_tensor_region(bias, self.comm)
        if self.skip_bias_add:
            return out, bias
        return out if bias is None else out + bias

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        group,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
    ) -> RowParallelLinear:
        """This rank's row-parallel shard of a full ``nn.Linear`` (copied, on its device
        and dtype; ``linear`` is left as it is).

        Raises:
            ValueError: ``linear.in_features`` does not divide by the tensor-parallel degree.
        """
        return cls._from_full(
            linear.weight,
            linear.bias,
            group=group,
            input_is_parallel=input_is_parallel,
            skip_bias_add=skip_bias_add,
            sequence_parallel=sequence_parallel,
        )

    @classmethod
    def from_conv1d(
        cls,
        conv,
        *,
        group,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
    ) -> RowParallelLinear:
        """As :meth:`from_linear`, from Hugging Face's GPT-2 ``Conv1D`` (weight stored
        transposed, ``[in, out]``)."""
        return cls._from_full(
            conv.weight.t(),
            conv.bias,
            group=group,
            input_is_parallel=input_is_parallel,
            skip_bias_add=skip_bias_add,
            sequence_parallel=sequence_parallel,
        )


class VocabParallelEmbedding(_HoldsComm, nn.Module):
    """An embedding table split by vocabulary rows: rank ``r`` holds rows
    ``[r * V / tp_degree, (r + 1) * V / tp_degree)``.

    Forward takes the token ids (the same on every tensor rank), looks up the ids in this
    rank's range (zeros for the others) and sums over the tensor group, so every rank
    returns the full embeddings; under sequence parallelism the sum is reduce-scattered
    along dim 0 instead (ids ``[s, b]``, output ``[s / tp_degree, b, h]``).

    Args:
        num_embeddings: vocabulary size of the full table; must divide by the group size.
        embedding_dim: embedding features.
        group: the tensor-parallel group (see :func:`as_tensor_comm`).
        padding_idx: as ``nn.Embedding``'s: that row starts at zero and gets no gradient.
        init_method: initialises the full table in place; None: ``nn.Embedding``'s
            ``N(0, 1)``. See [Note: tensor-parallel initialisation].
        sequence_parallel: reduce-scatter the output along dim 0.
        dtype: parameter dtype (default: torch's default dtype).
        device: parameter device (default: CPU); ``"meta"`` allocates nothing.

    Raises:
        ValueError: ``num_embeddings`` does not divide by the tensor-parallel degree, or
            ``padding_idx`` is outside the vocabulary.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        group,
        padding_idx: int | None = None,
        init_method: InitMethod | None = None,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
        device=None,
    ) -> None:
        super().__init__()
        self.comm = as_tensor_comm(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_degree = self.comm.world_size
        rows = shard_size(num_embeddings, self.tp_degree, what="VocabParallelEmbedding: num_embeddings")
        self.vocab_start, self.vocab_end = self.comm.rank * rows, (self.comm.rank + 1) * rows
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(
                    f"VocabParallelEmbedding: padding_idx={padding_idx} is outside the vocabulary of {num_embeddings}"
                )
            padding_idx %= num_embeddings
        self.padding_idx = padding_idx
        self.sequence_parallel = sequence_parallel
        place = "meta" if _is_meta(device) else "cpu"
        full = torch.empty(num_embeddings, embedding_dim, dtype=dtype or torch.get_default_dtype(), device=place)
        if place != "meta":
            with torch.no_grad():
                (init_method or nn.init.normal_)(full)
                if padding_idx is not None:
                    full[padding_idx].zero_()
        self._hold_shard(full, device=device)

    def _hold_shard(self, full: torch.Tensor, *, device=None) -> None:
        with torch.no_grad():
            data = take_shard(full.detach(), dim=0, index=self.comm.rank, parts=self.tp_degree)
        self.weight = nn.Parameter(data if device is None else data.to(device))
        mark_sharded(self.weight, full_shape=full.shape, dim=0, index=self.comm.rank, parts=self.tp_degree)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        padding = self.padding_idx
        local_padding = (
            padding - self.vocab_start if padding is not None and self.vocab_start <= padding < self.vocab_end else None
        )
        if self.tp_degree == 1:
            out = F.embedding(ids, self.weight, local_padding)
        else:
            outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
            local = (ids - self.vocab_start).masked_fill(outside, 0)
            out = F.embedding(local, self.weight, local_padding).masked_fill(outside.unsqueeze(-1), 0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(out, self.comm)
        return reduce_from_tensor_region(out, self.comm)

    @classmethod
    def from_embedding(
        cls, embedding: nn.Embedding, *, group, sequence_parallel: bool = False
    ) -> VocabParallelEmbedding:
        """This rank's vocabulary shard of a full ``nn.Embedding`` (copied, on its device
        and dtype; its ``padding_idx`` kept).

        Raises:
            ValueError: ``embedding.num_embeddings`` does not divide by the tensor-parallel degree.
        """
        layer = cls(
            embedding.num_embeddings,
            embedding.embedding_dim,
            group=group,
            padding_idx=embedding.padding_idx,
            sequence_parallel=sequence_parallel,
            dtype=embedding.weight.dtype,
            device="meta",
        )
        layer._hold_shard(embedding.weight)
        layer.weight.requires_grad_(embedding.weight.requires_grad)
        return layer

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
            f"vocab=[{self.vocab_start}, {self.vocab_end}), padding_idx={self.padding_idx}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class SequenceParallelLayerNorm(_HoldsComm, nn.LayerNorm):
    """``nn.LayerNorm`` on this rank's sequence chunk, its weight and bias gradients
    summed over the tensor group in backward.

    The parameters are replicated (every tensor rank holds them whole and they stay
    equal); see [Note: gradients of replicated parameters under sequence parallelism].
    The state dict is ``nn.LayerNorm``'s.

    Args:
        normalized_shape, eps, elementwise_affine, bias: as ``nn.LayerNorm``'s.
        group: the tensor-parallel group (see :func:`as_tensor_comm`).
        dtype: parameter dtype (default: torch's default dtype).
        device: parameter device (default: CPU).
    """

    def __init__(
        self,
        normalized_shape,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        *,
        group,
        dtype: torch.dtype | None = None,
        device=None,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device=device, dtype=dtype)
        self.comm = as_tensor_comm(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else copy_to_tensor_region(self.weight, self.comm)
        bias = None if self.bias is None else copy_to_tensor_region(self.bias, self.comm)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)

    @classmethod
    def from_layer_norm(cls, norm: nn.LayerNorm, *, group) -> SequenceParallelLayerNorm:
        """A sequence-parallel LayerNorm that holds ``norm``'s own parameters (the same
        ``nn.Parameter`` objects, so an optimizer built over them keeps working)."""
        layer = cls(
            norm.normalized_shape, norm.eps, norm.elementwise_affine, norm.bias is not None, group=group, device="meta"
        )
        layer.weight, layer.bias = norm.weight, norm.bias
        return layer
