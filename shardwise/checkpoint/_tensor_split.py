"""Where one tensor-parallel slice sits in the full tensor a checkpoint stores.

[Note: tensor-parallel slices of stored tensors]
A checkpoint stores every parameter whole, in the layout of the model without tensor
parallelism (for a Hugging Face model: its own state dict, Conv1D weights ``[in, out]``,
a stacked q|k|v output in q, k, v order). Tensor rank ``index`` of ``parts`` trains a
slice of it, described by a :class:`TensorSplit`:

- ``full_shape`` is the full tensor in *training orientation* (``[out, in]`` for a
  linear), cut along ``dim``; ``transposed`` says the stored tensor is its transpose
  (GPT-2's Conv1D);
- with ``stride`` k > 1 the cut dim holds k stacked blocks, each cut into ``parts``
  pieces, and the slice is block 0's piece ``index``, then block 1's, ... (Megatron's
  ``partition_stride``; AutoTP's stacked q/k/v). With k = 1 it is the contiguous chunk
  ``index``.

``slice_of`` cuts the slice out of a stored tensor (loading into a tensor-parallel
layout), ``full_from`` joins every rank's slice into the stored tensor (gathering a full
state dict), and ``positions`` maps elements of the slice to their flat positions in the
stored tensor, which is how a rank writes its part of a stored tensor in place
(``write_slice_into``) without anyone gathering it. A ZeRO shard of a slice is a flat
range of it, so ``positions`` takes a range. The three are one rule; a unit test holds
them to each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorSplit:
    """Tensor rank ``index`` of ``parts`` holds this slice of a stored tensor (see
    [Note: tensor-parallel slices of stored tensors])."""

    full_shape: tuple[int, ...]
    """The full tensor in training orientation (before ``transposed``)."""
    dim: int
    """The dim of ``full_shape`` that is cut."""
    index: int
    """Which slice: the tensor rank."""
    parts: int
    """How many slices: the tensor-parallel degree."""
    stride: int = 1
    """Blocks stacked along ``dim``, each cut into ``parts`` pieces."""
    transposed: bool = False
    """Whether the stored tensor is the transpose of ``full_shape`` (2-D only)."""

    def __post_init__(self):
        shape = tuple(int(d) for d in self.full_shape)
        object.__setattr__(self, "full_shape", shape)
        if not 0 <= self.dim < len(shape):
            raise ValueError(f"TensorSplit: dim {self.dim} is not a dim of shape {list(shape)}")
        if self.parts < 1 or not 0 <= self.index < self.parts or self.stride < 1:
            raise ValueError(f"TensorSplit: index {self.index} of {self.parts} parts, stride {self.stride}")
        if shape[self.dim] % (self.stride * self.parts):
            raise ValueError(
                f"TensorSplit: size {shape[self.dim]} of dim {self.dim} of {list(shape)} does not "
                f"split into {self.stride} block(s) of {self.parts} equal pieces"
            )
        if self.transposed and len(shape) != 2:
            raise ValueError(f"TensorSplit: only a 2-D tensor can be stored transposed, got {list(shape)}")

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape of the tensor in the checkpoint."""
        return self.full_shape[::-1] if self.transposed else self.full_shape

    @property
    def held_shape(self) -> tuple[int, ...]:
        """The shape of the slice a tensor rank holds."""
        shape = list(self.full_shape)
        shape[self.dim] //= self.parts
        return tuple(shape)

    def describe(self) -> str:
        """For messages: ``"[32, 64] of [64, 64] (dim 0, tensor rank 1 of 2)"``."""
        extra = (f", {self.stride} stacked blocks" if self.stride > 1 else "") + (
            ", stored transposed" if self.transposed else ""
        )
        return (
            f"{list(self.held_shape)} of {list(self.stored_shape)} (dim {self.dim} of the "
            f"{'transposed ' if self.transposed else ''}tensor, tensor rank {self.index} of {self.parts}{extra})"
        )

    def _piece(self) -> int:
        return self.full_shape[self.dim] // (self.stride * self.parts)

    def slice_of(self, stored: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the stored tensor ``stored`` (a view when ``stride`` is 1)."""
        if tuple(stored.shape) != self.stored_shape:
            raise ValueError(
                f"TensorSplit: the stored tensor has shape {list(stored.shape)}, expected {list(self.stored_shape)}"
            )
        full = stored.t() if self.transposed else stored
        piece = self._piece()
        blocks = [full.narrow(self.dim, (b * self.parts + self.index) * piece, piece) for b in range(self.stride)]
        return blocks[0] if self.stride == 1 else torch.cat(blocks, dim=self.dim)

    def full_from(self, slices: list[torch.Tensor]) -> torch.Tensor:
        """The stored tensor from every rank's slice, in rank order (the inverse of
        ``slice_of``; ``index`` plays no part)."""
        if len(slices) != self.parts:
            raise ValueError(f"TensorSplit: {len(slices)} slices given for {self.parts} parts")
        blocks = [s.reshape(self.held_shape).chunk(self.stride, dim=self.dim) for s in slices]
        full = torch.cat([blocks[t][b] for b in range(self.stride) for t in range(self.parts)], dim=self.dim)
        return full.t() if self.transposed else full

    def positions(self, start: int, end: int) -> torch.Tensor:
        """The flat positions in the stored tensor of elements ``[start, end)`` of this
        rank's slice (its row-major order), as int64."""
        flat = torch.arange(start, end, dtype=torch.int64)
        coords = list(torch.unravel_index(flat, self.held_shape))
        piece = self._piece()
        j = coords[self.dim]
        coords[self.dim] = (j // piece * self.parts + self.index) * piece + j % piece
        shape = self.full_shape
        if self.transposed:
            coords, shape = coords[::-1], shape[::-1]
        out = torch.zeros_like(flat)
        for coord, size in zip(coords, shape):
            out = out * size + coord
        return out
