"""Sequence parallelism as one more split of the grid's data axis.

[Note: sequence groups]
With ``sequence_parallel_size`` (sp), consecutive ranks of a data-parallel group share one
sequence: the *sequence-parallel* group, ``[0..sp-1], [sp..2sp-1], ...`` of the data
indices, as DeepSpeed lays them out. Each of its ranks holds a piece of the sequence and
the attention swaps pieces for heads among them (``shardwise/sequence``). The whole data
axis stays the group that shards ZeRO state and reduces gradients (DeepSpeed's
*sequence-data-parallel* group); the number of data-parallel replicas, which the batch
size counts, is ``data / sp``.

Gradients are averaged over the whole data axis. The loss of a piece of a sequence is
therefore made the *whole* sequence's loss on every rank of the sequence group, by sums
over that group whose backward sums too (``shardwise.sequence.loss``, and DeepSpeed's
recipe of all-gathering the pieces' losses weighted by their token counts): each rank's
gradient is then ``sp`` times its piece's share, and the average over ``data`` ranks is
the mean over the ``data / sp`` replicas of each sequence's exact gradient. (DeepSpeed
divides by ``data / sp`` instead, so its own recipe gives ``sp`` times the gradient.)
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.comm import Communicator


@dataclass(frozen=True)
class SequenceGroups:
    """The sequence-parallel group of this rank (see [Note: sequence groups])."""

    size: int
    comm: Communicator
    ranks: tuple[int, ...]
    data_size: int
    """The data axis these groups split (``size`` x replicas)."""

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def replicas(self) -> int:
        """Data-parallel replicas: the data axis over ``size``."""
        return self.data_size // self.size


def sequence_rank_lists(data_ranks: list[int], size: int) -> list[list[int]]:
    """Consecutive runs of ``size`` ranks of one data group (global ranks in data order)."""
    return [data_ranks[i : i + size] for i in range(0, len(data_ranks), size)]


def check_sequence_parallel_size(size, data_size: int) -> None:
    """``size`` must be a positive integer dividing the data-parallel size."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"sequence_parallel_size must be a positive integer, got {size!r}")
    if data_size % size:
        raise ValueError(
            f"sequence_parallel_size={size} does not divide the {data_size} data-parallel rank(s): a "
            f"sequence is split over sequence_parallel_size ranks of one data-parallel group; use a size "
            f"that divides {data_size} (or change the number of processes)"
        )
