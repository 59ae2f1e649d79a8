"""Process topologies: how global ranks map to coordinates on named axes.

Pure Python (no torch.distributed): a topology is the arithmetic of the grid, unit-tested
without processes. :class:`~shardwise.parallel.ParallelGrid` builds the process groups
from one.

The rank order is row-major over the axes as listed: the last axis is innermost, so
consecutive ranks differ in their last coordinate. With DeepSpeed's
``PipeModelDataParallelTopology`` (axes ``pipe, data, model``) ranks ``0..tp-1`` form the
first tensor-parallel group, as in DeepSpeed and Megatron. DeepSpeed names the
tensor-parallel axis ``model``; shardwise accepts ``model`` or ``tensor`` for it.
"""

from __future__ import annotations

import itertools
from collections import namedtuple
from collections.abc import Sequence

TENSOR_AXES = ("tensor", "model")
"""Names accepted for the tensor-parallel axis (``model`` is DeepSpeed's)."""


class ProcessTopology:
    """Global ranks laid out on named axes; DeepSpeed's ``ProcessTopology``.

    Args:
        axes: axis names, outermost first.
        dims: the size of each axis.

    Example: ``ProcessTopology(axes=["x", "y"], dims=[2, 3])`` puts ranks 0, 1, 2 at
    ``x=0`` and ranks 3, 4, 5 at ``x=1``.
    """

    def __init__(self, axes: Sequence[str], dims: Sequence[int]):
        axes, dims = list(axes), [int(d) for d in dims]
        if len(axes) != len(dims):
            raise ValueError(
                f"ProcessTopology: {len(axes)} axes {axes} but {len(dims)} dims {dims}; give one size per axis"
            )
        if len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology: axis names must be unique, got {axes}")
        bad = [(a, d) for a, d in zip(axes, dims) if d < 1]
        if bad:
            raise ValueError(f"ProcessTopology: every axis needs size >= 1, got {bad}")
        self.axes = axes
        self.dims = dims
        self.ProcessCoord = namedtuple("ProcessCoord", axes)
        coords = itertools.product(*(range(d) for d in dims))
        self.mapping = {self.ProcessCoord(*c): rank for rank, c in enumerate(coords)}
        self._coords = list(self.mapping)

    def get_rank(self, **coord_kwargs: int) -> int:
        """The global rank at the coordinate given for every axis."""
        if set(coord_kwargs) != set(self.axes):
            raise ValueError(f"get_rank() needs a coordinate for every axis {self.axes}, got {sorted(coord_kwargs)}")
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise ValueError(f"coordinate {coord_kwargs} is outside the topology {dict(zip(self.axes, self.dims))}")
        return self.mapping[key]

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def get_rank_repr(self, rank: int, omit_axes=("data", "pipe"), inner_sep: str = "_", outer_sep: str = "-") -> str:
        """A string naming ``rank``'s coordinates on the axes not omitted (for file names),
        e.g. ``"model_01"``."""
        coord = self.get_coord(rank)
        return outer_sep.join(
            f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in self.axes if axis not in omit_axes
        )

    def get_dim(self, axis: str) -> int:
        """The size of ``axis``; 0 when the topology has no such axis (DeepSpeed's rule)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int):
        """``rank``'s coordinates, a namedtuple with one field per axis."""
        if not 0 <= rank < len(self._coords):
            raise ValueError(f"rank {rank} is not in a topology of {self.world_size()} ranks")
        return self._coords[rank]

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The groups of ranks that differ only along ``axis`` (each sorted; [] when the
        topology has no such axis)."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for fixed in itertools.product(*(range(self.get_dim(a)) for a in others)):
            where = dict(zip(others, fixed))
            lists.append([self.get_rank(**where, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """The ranks whose coordinates match every given ``axis=index``."""
        unknown = set(filter_kwargs) - set(self.axes)
        if unknown:
            raise ValueError(f"filter_match(): unknown axes {sorted(unknown)}; the axes are {self.axes}")
        return [
            rank
            for coord, rank in self.mapping.items()
            if all(getattr(coord, a) == i for a, i in filter_kwargs.items())
        ]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks at index ``idx`` of ``axis`` (all other axes free)."""
        if axis not in self.axes:
            return []
        return self.filter_match(**{axis: idx})

    def world_size(self) -> int:
        return len(self.mapping)

    def __str__(self) -> str:
        return str(self.mapping)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{a}={d}' for a, d in zip(self.axes, self.dims))})"


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallelism (axes ``pipe, data``); DeepSpeed's class."""

    def __init__(self, num_pp: int, num_dp: int):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x tensor ("model") parallelism, tensor innermost; DeepSpeed's class."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def tensor_axis(topology: ProcessTopology) -> str | None:
    """The name of ``topology``'s tensor-parallel axis, or None when it has none."""
    found = [a for a in TENSOR_AXES if a in topology.axes]
    if len(found) > 1:
        raise ValueError(
            f"the topology has both {found[0]!r} and {found[1]!r} axes; name the "
            "tensor-parallel axis once ('model' is DeepSpeed's name for it)"
        )
    return found[0] if found else None
