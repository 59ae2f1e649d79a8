"""Expert parallelism as one more split of the grid's data axis.

[Note: expert groups]
A mixture-of-experts layer with ``ep_size`` splits its experts over ``ep_size`` ranks of
the same data-parallel group: the *expert-parallel* group (tokens travel between its
ranks by all-to-all). Ranks holding the same experts form the *expert-data-parallel*
group, over which expert gradients are reduced and expert optimizer state is sharded.
Within one data-parallel group (fixed pipeline stage and tensor rank) with data indices
``0..dp-1``, as DeepSpeed lays them out:

- default: expert-parallel groups are consecutive, ``[0..ep-1], [ep..2ep-1], ...``, and
  expert-data-parallel groups strided, ``[0, ep, 2ep, ...], [1, ep+1, ...], ...``;
- ``use_data_before_expert_parallel_``: the other way round.

So the data group is exactly expert-parallel x expert-data-parallel; an expert's
gradient summed over its expert-data-parallel group and divided by the data-parallel size
is the gradient of the global mean loss (each rank's experts already received the
gradients of every expert-parallel peer's tokens through the all-to-all).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.comm import Communicator


@dataclass(frozen=True)
class ExpertGroups:
    """The expert-parallel and expert-data-parallel groups of one ``ep_size`` (see
    [Note: expert groups]); built by :meth:`ParallelGrid.expert_groups`."""

    name: str
    """DeepSpeed's group name, ``ep_size_<n>``."""
    ep_size: int
    ep_comm: Communicator
    """All-to-all of tokens between the ranks that split the experts."""
    edp_comm: Communicator
    """Reduction of expert gradients between the ranks holding the same experts."""
    ep_ranks: tuple[int, ...]
    edp_ranks: tuple[int, ...]
    data_size: int
    """The data-parallel size these groups split (ep_size x expert-data-parallel size)."""

    @property
    def ep_rank(self) -> int:
        return self.ep_comm.rank

    @property
    def edp_size(self) -> int:
        return self.data_size // self.ep_size


def expert_rank_lists(data_ranks: list[int], ep_size: int, *, data_before_expert: bool) -> tuple[list, list]:
    """The (expert-parallel, expert-data-parallel) rank lists splitting one data group
    (its global ranks in data-index order); see [Note: expert groups]."""
    dp = len(data_ranks)
    edp = dp // ep_size
    if data_before_expert:
        edp_lists = [data_ranks[i * edp : (i + 1) * edp] for i in range(ep_size)]
        ep_lists = [data_ranks[j::edp] for j in range(edp)]
    else:
        ep_lists = [data_ranks[i * ep_size : (i + 1) * ep_size] for i in range(edp)]
        edp_lists = [data_ranks[j::ep_size] for j in range(ep_size)]
    return ep_lists, edp_lists


def check_ep_size(ep_size, data_size: int) -> None:
    """``ep_size`` must be a positive integer dividing the data-parallel size."""
    if not isinstance(ep_size, int) or isinstance(ep_size, bool) or ep_size < 1:
        raise ValueError(f"ep_size must be a positive integer, got {ep_size!r}")
    if data_size % ep_size:
        raise ValueError(
            f"ep_size={ep_size} does not divide the data-parallel size {data_size}: the experts of a "
            f"layer are split over ep_size ranks of one data-parallel group; use an ep_size that "
            f"divides {data_size} (or change the number of processes)"
        )
