"""The process grid: data x pipeline x tensor parallelism, and the groups of each axis.

[Note: the grid is the spine]
Every mechanism takes its process groups from one :class:`ParallelGrid`, passed to it
explicitly: ZeRO partitions and reduces over ``grid.data_comm``; tensor-parallel layers
use ``grid.tensor_comm``; the pipeline engine uses the pipe axis; the global gradient
norm and the fp16 overflow decision are summed over the tensor and pipe axes after the
data axis. Nothing reads the WORLD group as "the data-parallel group". A grid is built
by :func:`shardwise.initialize` from the config (``tensor_parallel.autotp_size``), from a
Megatron-style ``mpu`` or from the topology a user passes, and is exposed as
``engine.grid`` (also ``engine.mpu``).

The layout is DeepSpeed's and Megatron's: axes ``pipe, data, tensor`` with the tensor
axis innermost, so ``rank = (pipe * dp + data) * tp + tensor`` and ranks ``0..tp-1`` form
the first tensor-parallel group. The groups of a grid it builds itself come from a
``torch.distributed.device_mesh.DeviceMesh`` of shape ``(pp, dp, tp)``; a grid read from
an ``mpu`` uses that object's own groups (so the user's layers and shardwise agree on
them) after checking that its ranks follow this layout.

The grid also answers the Megatron / DeepSpeed ``mpu`` interface
(``get_data_parallel_rank()`` ...). ``get_model_parallel_*`` means all the model
parallelism of one data-parallel replica (pipe x tensor), as in DeepSpeed's
``PipelineParallelGrid`` and current Megatron; ``get_tensor_model_parallel_*`` (DeepSpeed
also: ``get_slice_parallel_*``) is the tensor axis alone.
"""

from __future__ import annotations

import torch.distributed as dist

from shardwise.comm import Communicator
from shardwise.parallel._expert import ExpertGroups, check_ep_size, expert_rank_lists
from shardwise.parallel._sequence import SequenceGroups, check_sequence_parallel_size, sequence_rank_lists
from shardwise.parallel.topology import ProcessTopology, tensor_axis

_ORDER = ("pipe", "data", "tensor")


def _sizes_of(topology: ProcessTopology) -> dict[str, int]:
    """pipe/data/tensor sizes of ``topology``, checking its axes follow the grid's layout."""
    t_axis = tensor_axis(topology)
    canonical = ["tensor" if a == t_axis else a for a in topology.axes]
    unknown = [a for a in canonical if a not in _ORDER]
    if unknown:
        raise ValueError(
            f"topology axes {topology.axes}: shardwise's grid has the axes pipe, data and "
            f"tensor (DeepSpeed's 'model'); {unknown} are not among them"
        )
    if canonical != [a for a in _ORDER if a in canonical]:
        raise ValueError(
            f"topology axes {topology.axes} are not in the order pipe, data, tensor (outermost "
            "first, tensor innermost, as DeepSpeed's PipeModelDataParallelTopology); list "
            "them in that order"
        )
    return {a: max(topology.get_dim(t_axis if a == "tensor" and t_axis else a), 1) for a in _ORDER}


class ParallelGrid:
    """The data x pipeline x tensor process grid of a job (see [Note: the grid is the spine]).

    Build one with :meth:`build` (sizes), :meth:`from_topology` or :meth:`from_mpu`;
    :func:`shardwise.initialize` builds one when the caller does not. torch.distributed
    must be started; construction is collective (every rank builds the same grid).

    Attributes:
        pipe, data, tensor: the axis sizes.
        stage_id, data_parallel_id, tensor_rank: this rank's coordinates.
        topology: a DeepSpeed ``PipeModelDataParallelTopology`` of the same layout.
        mesh: the ``DeviceMesh`` (pipe, data, tensor), None for a grid read from an ``mpu``.
    """

    def __init__(
        self,
        *,
        pipe: int,
        data: int,
        tensor: int,
        groups: dict,
        mesh=None,
        mpu=None,
        timeout_s: float = 1800.0,
        check_hangs: bool = True,
    ):
        from shardwise.parallel.topology import PipeModelDataParallelTopology

        self.pipe, self.data, self.tensor = pipe, data, tensor
        self.topology_ = PipeModelDataParallelTopology(num_pp=pipe, num_mp=tensor, num_dp=data)
        self.mesh = mesh
        self.mpu = mpu
        """The ``mpu`` this grid was read from (None when shardwise built it)."""
        self._groups = groups
        self._comm_options = {"timeout_s": timeout_s, "check_hangs": check_hangs}
        self._comms: dict[str, Communicator] = {}
        self._experts: dict[int, tuple[bool, ExpertGroups]] = {}
        self._sequence: SequenceGroups | None = None
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        coord = self.topology_.get_coord(self.global_rank)
        self.stage_id, self.data_parallel_id, self.tensor_rank = coord.pipe, coord.data, coord.model
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == pipe - 1

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        *,
        tensor: int = 1,
        pipe: int = 1,
        data: int | None = None,
        device_type: str | None = None,
        timeout_s: float = 1800.0,
        check_hangs: bool = True,
    ) -> ParallelGrid:
        """A grid of the given sizes over the whole world (``data`` defaults to what is left)."""
        world = dist.get_world_size()
        for name, size in (("tensor", tensor), ("pipe", pipe)):
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{name}-parallel size must be a positive integer, got {size!r}")
        if world % (tensor * pipe):
            raise ValueError(
                f"{world} rank(s) cannot be split into tensor-parallel groups of {tensor} x "
                f"pipeline stages {pipe}: tensor x pipe ({tensor * pipe}) must divide the "
                "number of ranks; change the sizes or the number of processes"
            )
        if data is None:
            data = world // (tensor * pipe)
        if pipe * data * tensor != world:
            raise ValueError(
                f"grid pipe {pipe} x data {data} x tensor {tensor} = {pipe * data * tensor} "
                f"ranks, but the job has {world}"
            )
        return cls._from_mesh(pipe, data, tensor, device_type, timeout_s, check_hangs)

    @classmethod
    def from_topology(
        cls,
        topology: ProcessTopology,
        *,
        device_type: str | None = None,
        timeout_s: float = 1800.0,
        check_hangs: bool = True,
    ) -> ParallelGrid:
        """A grid laid out as DeepSpeed's ``topology`` (its world size must be the job's)."""
        sizes = _sizes_of(topology)
        if topology.world_size() != dist.get_world_size():
            raise ValueError(
                f"the topology has {topology.world_size()} ranks ({topology!r}) but the job has {dist.get_world_size()}"
            )
        return cls._from_mesh(sizes["pipe"], sizes["data"], sizes["tensor"], device_type, timeout_s, check_hangs)

    @classmethod
    def _from_mesh(cls, pipe, data, tensor, device_type, timeout_s, check_hangs) -> ParallelGrid:
        from torch.distributed.device_mesh import init_device_mesh

        from shardwise.accelerator import get_accelerator

        device_type = device_type or get_accelerator().device().type
        mesh = init_device_mesh(device_type, (pipe, data, tensor), mesh_dim_names=_ORDER)
        groups = {axis: mesh.get_group(axis) for axis in _ORDER}
        topo = ProcessTopology(["pipe", "data", "tensor"], [pipe, data, tensor])
        model_lists = [topo.filter_match(data=d) for d in range(data)]
        groups["model"] = _own_group(model_lists)
        return cls(
            pipe=pipe, data=data, tensor=tensor, groups=groups, mesh=mesh, timeout_s=timeout_s, check_hangs=check_hangs
        )

    @classmethod
    def from_mpu(cls, mpu, *, timeout_s: float = 1800.0, check_hangs: bool = True) -> ParallelGrid:
        """A grid over the groups of a Megatron-style ``mpu`` (or another grid)."""
        if isinstance(mpu, ParallelGrid):
            return mpu
        if callable(getattr(mpu, "shardwise_grid", None)):  # parallel_state_sp (UlyssesSPAttentionHF's mpu)
            return mpu.shardwise_grid()
        missing = [
            m
            for m in ("get_data_parallel_group", "get_data_parallel_world_size", "get_data_parallel_rank")
            if not hasattr(mpu, m)
        ]
        if missing:
            raise TypeError(
                f"mpu={type(mpu).__name__} lacks {missing}: initialize(mpu=...) needs a Megatron-style "
                "object with get_data_parallel_group/rank/world_size and "
                "get_tensor_model_parallel_* (or get_model_parallel_*)"
            )

        def read(kind: str, prefixes: tuple[str, ...]):
            for prefix in prefixes:
                if hasattr(mpu, f"get_{prefix}_world_size"):
                    size = int(getattr(mpu, f"get_{prefix}_world_size")())
                    rank = int(getattr(mpu, f"get_{prefix}_rank")()) if size > 1 else 0
                    group = getattr(mpu, f"get_{prefix}_group")() if size > 1 else None
                    return size, rank, group
            return 1, 0, None

        tensor, t_rank, t_group = read("tensor", ("tensor_model_parallel", "slice_parallel", "model_parallel"))
        pipe, p_rank, p_group = read("pipe", ("pipeline_model_parallel", "pipe_parallel"))
        if (
            pipe > 1
            and not hasattr(mpu, "get_tensor_model_parallel_world_size")
            and not hasattr(mpu, "get_slice_parallel_world_size")
        ):
            raise TypeError(
                "the mpu has pipeline groups but no get_tensor_model_parallel_*: its "
                "get_model_parallel_* may include the pipeline; add the tensor-parallel accessors"
            )
        data = int(mpu.get_data_parallel_world_size())
        d_rank = int(mpu.get_data_parallel_rank())
        world = dist.get_world_size()
        if pipe * data * tensor != world:
            raise ValueError(
                f"the mpu's sizes pipe {pipe} x data {data} x tensor {tensor} = {pipe * data * tensor} "
                f"do not cover the job's {world} ranks"
            )
        coords = [None] * world  # every rank checks every rank's place, so all raise together
        dist.all_gather_object(coords, (p_rank, d_rank, t_rank))
        for r, (p, d, t) in enumerate(coords):
            expected = (p * data + d) * tensor + t
            if expected != r:
                raise ValueError(
                    f"the mpu puts global rank {r} at pipe {p}, data {d}, tensor {t}, which is rank "
                    f"{expected} in shardwise's layout (tensor innermost, then data, then pipe, as "
                    "Megatron and DeepSpeed lay ranks out); build the mpu's groups in that order"
                )
        groups = {"pipe": p_group, "data": mpu.get_data_parallel_group(), "tensor": t_group}
        topo = ProcessTopology(["pipe", "data", "tensor"], [pipe, data, tensor])
        groups["model"] = _own_group([topo.filter_match(data=d) for d in range(data)]) if pipe > 1 else t_group
        if None in groups.values():  # axes of size 1: this rank alone
            alone = _own_group([[r] for r in range(world)])
            groups = {axis: alone if group is None else group for axis, group in groups.items()}
        return cls(
            pipe=pipe, data=data, tensor=tensor, groups=groups, mpu=mpu, timeout_s=timeout_s, check_hangs=check_hangs
        )

    # -- communicators ----------------------------------------------------------------------

    def configure_comms(self, *, timeout_s: float, check_hangs: bool) -> None:
        """Set the deadline and diagnosis of the communicators to be created (the config
        is read after a grid from an ``mpu`` is built) and of those created already."""
        from datetime import timedelta

        self._comm_options = {"timeout_s": timeout_s, "check_hangs": check_hangs}
        for comm in self._comms.values():
            comm.timeout, comm.check_hangs = timedelta(seconds=timeout_s), check_hangs

    def _comm(self, axis: str, label: str) -> Communicator:
        if axis not in self._comms:
            # the tensor group's all-reduces sit on the critical path of every layer, the data
            # group's parameter gathers on the step's: same-host shared memory where it can
            self._comms[axis] = Communicator(
                self._group(axis), name=label, shared_memory=axis in ("tensor", "data"), **self._comm_options
            )
        return self._comms[axis]

    def _group(self, axis: str):
        return self._groups[axis]

    @property
    def data_comm(self) -> Communicator:
        """Collectives over this rank's data-parallel group (ZeRO's partitions)."""
        return self._comm("data", "data-parallel")

    @property
    def tensor_comm(self) -> Communicator:
        """Collectives over this rank's tensor-parallel group."""
        return self._comm("tensor", "tensor-parallel")

    @property
    def pipe_comm(self) -> Communicator:
        """Collectives over this rank's pipeline group (one rank per stage)."""
        return self._comm("pipe", "pipeline")

    def expert_groups(self, ep_size: int, *, data_before_expert: bool = False) -> ExpertGroups:
        """The expert-parallel and expert-data-parallel groups splitting this rank's data
        group for MoE layers of ``ep_size`` (see [Note: expert groups] in ``_expert.py``).
        Collective the first time a size is asked for: every rank asks for the same sizes
        in the same order (``shardwise.initialize`` does, walking the model's layers)."""
        check_ep_size(ep_size, self.data)
        cached = self._experts.get(ep_size)
        if cached is not None:
            if cached[0] != data_before_expert:
                raise ValueError(
                    f"expert groups of ep_size {ep_size} already exist with use_data_before_expert_parallel_"
                    f"={cached[0]}; one job uses one layout"
                )
            return cached[1]
        mine: dict[str, list[int]] = {}
        for stage in range(self.pipe):
            for t in range(self.tensor):
                data_ranks = self.topology_.filter_match(pipe=stage, model=t)
                ep_lists, edp_lists = expert_rank_lists(data_ranks, ep_size, data_before_expert=data_before_expert)
                for kind, lists in (("ep", ep_lists), ("edp", edp_lists)):
                    for ranks in lists:
                        group = dist.new_group(ranks=ranks) if len(ranks) > 1 else None
                        if self.global_rank in ranks:
                            mine[kind], mine[kind + "_group"] = ranks, group
        alone = None
        if mine["ep_group"] is None or mine["edp_group"] is None:
            alone = _own_group([[r] for r in range(self.world_size)])
        name = f"ep_size_{ep_size}"
        groups = ExpertGroups(
            name=name,
            ep_size=ep_size,
            ep_comm=Communicator(mine["ep_group"] or alone, name=f"expert-parallel ({name})", **self._comm_options),
            edp_comm=Communicator(
                mine["edp_group"] or alone,
                name=f"expert-data-parallel ({name})",
                shared_memory=True,
                **self._comm_options,
            ),
            ep_ranks=tuple(mine["ep"]),
            edp_ranks=tuple(mine["edp"]),
            data_size=self.data,
        )
        self._experts[ep_size] = (data_before_expert, groups)
        return groups

    def sequence_groups(self, size: int) -> SequenceGroups:
        """Split the data axis into sequence-parallel groups of ``size`` consecutive ranks
        (see [Note: sequence groups] in ``_sequence.py``). Collective the first time; a job
        has one sequence-parallel size."""
        check_sequence_parallel_size(size, self.data)
        if self._sequence is not None:
            if self._sequence.size != size:
                raise ValueError(
                    f"this grid already splits sequences over {self._sequence.size} ranks; one job has one "
                    f"sequence_parallel_size (asked for {size})"
                )
            return self._sequence
        mine = None
        for stage in range(self.pipe):
            for t in range(self.tensor):
                for ranks in sequence_rank_lists(self.topology_.filter_match(pipe=stage, model=t), size):
                    group = dist.new_group(ranks=ranks) if size > 1 else None
                    if self.global_rank in ranks:
                        mine = (ranks, group)
        group = mine[1] if mine[1] is not None else _own_group([[r] for r in range(self.world_size)])
        comm = Communicator(group, name="sequence-parallel", **self._comm_options)
        self._sequence = SequenceGroups(size=size, comm=comm, ranks=tuple(mine[0]), data_size=self.data)
        return self._sequence

    @property
    def sequence(self) -> int:
        """The sequence-parallel size (1 when sequences are not split)."""
        return self._sequence.size if self._sequence is not None else 1

    @property
    def sequence_comm(self) -> Communicator:
        """Collectives over this rank's sequence-parallel group (built by :meth:`sequence_groups`)."""
        if self._sequence is None:
            raise RuntimeError("no sequence-parallel group: set sequence_parallel_size in the config")
        return self._sequence.comm

    @property
    def replicas(self) -> int:
        """Data-parallel replicas of the model: the data axis over the sequence-parallel size."""
        return self.data // self.sequence

    @property
    def expert_group_dict(self) -> dict[str, ExpertGroups]:
        """The expert groups built so far, by DeepSpeed's group name (``ep_size_<n>``)."""
        return {groups.name: groups for _, groups in self._experts.values()}

    @property
    def model_parallel_size(self) -> int:
        return self.pipe * self.tensor

    def topology(self) -> ProcessTopology:
        """DeepSpeed's ``grid.topology()``."""
        return self.topology_

    # -- the Megatron / DeepSpeed mpu interface ---------------------------------------------

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data

    def get_data_parallel_group(self):
        return self._group("data")

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.topology_.filter_match(pipe=self.stage_id, model=self.tensor_rank)

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def get_tensor_model_parallel_rank(self) -> int:
        return self.tensor_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tensor

    def get_tensor_model_parallel_group(self):
        return self._group("tensor")

    def get_tensor_model_parallel_src_rank(self) -> int:
        """The global rank of tensor rank 0 in this rank's tensor-parallel group."""
        return self.global_rank - self.tensor_rank

    get_slice_parallel_rank = get_tensor_model_parallel_rank
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size
    get_slice_parallel_group = get_tensor_model_parallel_group

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe

    def get_pipe_parallel_group(self):
        return self._group("pipe")

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_pipeline_model_parallel_group = get_pipe_parallel_group

    def get_stage_id(self) -> int:
        return self.stage_id

    def stage_to_global(self, stage_id: int, **kwargs) -> int:
        """The global rank of ``stage_id`` at this rank's other coordinates (or those given)."""
        where = {"data": self.data_parallel_id, "model": self.tensor_rank, **kwargs, "pipe": stage_id}
        return self.topology_.get_rank(**where)

    def get_sequence_parallel_group(self):
        return self.sequence_comm.group

    def get_sequence_parallel_world_size(self) -> int:
        return self.sequence

    def get_sequence_parallel_rank(self) -> int:
        return self._sequence.rank if self._sequence is not None else 0

    def get_sequence_data_parallel_group(self):
        """DeepSpeed's sequence-data-parallel group: the whole data axis."""
        return self._group("data")

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.data

    def get_sequence_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_model_parallel_rank(self) -> int:
        """This rank's index among the ranks of its data-parallel replica (pipe x tensor)."""
        return self.stage_id * self.tensor + self.tensor_rank

    def get_model_parallel_world_size(self) -> int:
        return self.pipe * self.tensor

    def get_model_parallel_group(self):
        return self._group("model")

    def __repr__(self) -> str:
        return (
            f"ParallelGrid(pipe={self.pipe}, data={self.data}, tensor={self.tensor}; rank {self.global_rank} "
            f"at stage {self.stage_id}, data {self.data_parallel_id}, tensor {self.tensor_rank})"
        )


def _own_group(rank_lists: list[list[int]]):
    """Create a group for every list (collective: every rank creates all of them, in the
    same order) and return the one holding this rank."""
    me = dist.get_rank()
    if len(rank_lists) == 1 and len(rank_lists[0]) == dist.get_world_size():
        return dist.group.WORLD
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks=ranks)
        if me in ranks:
            mine = group
    return mine
