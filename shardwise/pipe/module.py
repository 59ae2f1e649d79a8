"""``PipelineModule``: a model given as a list of layers, cut into pipeline stages.

[Note: a stage builds only its own layers]
Every rank holds the whole list of layer *specs* (``LayerSpec``: a class and its
arguments, cheap to keep) but builds only the layers of its stage, so no rank ever
materialises another stage's parameters. Layers are registered under their global index
(``"3.weight"``) and tied layers under ``tied_modules.<key>``, the names DeepSpeed uses:
a parameter's name says which layer it belongs to, not which stage holds it, so
checkpoints and exports read the same on any number of stages.

Tied layers (``TiedLayerSpec`` with one ``key``: an embedding reused as the output head)
are built once per stage that uses them; the first such stage's weights are broadcast
to the others at start, and their gradients are summed over the stages holding them
before every optimizer step, so the copies stay identical.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import nn

from shardwise.pipe._errors import PipelineError
from shardwise.pipe._partition import partition_balanced, partition_min_max, partition_uniform
from shardwise.pipe._profile import check_sample, layer_costs, sample_device

__all__ = ["LayerSpec", "PipelineError", "PipelineModule", "TiedLayerSpec", "partition_balanced", "partition_uniform"]

logger = logging.getLogger("shardwise")


class LayerSpec:
    """A layer to build later, on the stage that owns it: ``typename(*args, **kwargs)``."""

    def __init__(self, typename: type, *module_args, **module_kwargs):
        if not isinstance(typename, type) or not issubclass(typename, nn.Module):
            raise PipelineError(f"LayerSpec needs an nn.Module class, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        if log:
            logger.info("building %r", self)
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer whose weights are shared by every use of the same ``key`` (DeepSpeed's).

    Args:
        key: uses with the same key share one module (and, across stages, its weights).
        typename, module_args, module_kwargs: as :class:`LayerSpec`.
        forward_fn: called as ``forward_fn(module, x)`` instead of ``module(x)`` (the
            output head that reuses an embedding's weight).
        tied_weight_attr: the attribute(s) of the module that are tied across stages.
    """

    def __init__(
        self,
        key: str,
        typename: type,
        *module_args,
        forward_fn: Callable | None = None,
        tied_weight_attr: str | Sequence[str] = "weight",
        **module_kwargs,
    ):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


def _param_count(layer) -> int:
    """Trainable parameters of one entry of the layer list, counted without allocating."""
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):
            module = layer.build()
        return sum(p.numel() for p in module.parameters() if p.requires_grad)
    return 0


def _type_name(layer) -> str | None:
    """The name ``"type:<regex>"`` matches: the class of a spec or module, a function's
    ``__name__``; None (never matched, as in DeepSpeed) for a callable without one."""
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", None)


class PipelineModule(nn.Module):
    """DeepSpeed's ``PipelineModule``: ``layers`` run one after another, cut into stages.

    torch.distributed must be started (``shardwise.init_distributed()``) before building
    one: the stage boundaries and the grid are decided here.

    Args:
        layers: ``LayerSpec`` / ``TiedLayerSpec`` (built on the owning stage only),
            ``nn.Module`` objects, or plain callables (e.g. a lambda reshaping the input).
        num_stages: pipeline stages (the world must divide into them); or give ``topology``.
        topology: a ``ProcessTopology`` with a ``pipe`` axis (and ``data``, ``model``), or
            a ``ParallelGrid`` built beforehand (so tensor-parallel layer specs can be
            given its groups: ``LayerSpec(ColumnParallelLinear, ..., group=grid)``).
        loss_fn: ``loss_fn(outputs, labels)`` on the last stage; None: the last layer's
            output is the loss.
        seed_layers / seed_fn / base_seed: seed ``base_seed + layer index`` before building
            each layer (with ``seed_fn``, or ``torch.manual_seed``), so a layer's initial
            weights do not depend on the number of stages.
        partition_method: how layers are cut into stages. DeepSpeed's: ``"parameters"``
            (the default: trainable parameter counts as even as possible), ``"uniform"``
            (layer counts), ``"type:<regex>"`` (the number of layers whose class name
            matches, case-insensitively); these give DeepSpeed 0.19.8's boundaries.
            Shardwise's: ``"profile"`` (each layer's forward + backward timed on
            ``partition_sample``, the slowest stage made as fast as it can be: see [Note:
            profiled partition] in ``_profile.py``), or explicit boundaries (a list of
            ``num_stages + 1`` layer indices).
        activation_checkpoint_interval: recompute every this many layers in backward (0: off).
        activation_checkpoint_func: the checkpoint function (``shardwise.checkpointing.checkpoint``).
        checkpointable_layers: class names that may be checkpointed (None: all).
        dynamic_shape: DeepSpeed's flag for activations whose shapes change between
            micro-batches; accepted, and always the case here (every transfer checks its
            shapes, see [Note: pytree transfers with a shape handshake] in ``_transfer.py``).
        virtual_stages: model chunks per stage for the interleaved schedule (shardwise's
            addition): the layers are cut into ``num_stages * virtual_stages`` chunks and
            stage ``s`` holds chunks ``s, s + num_stages, ...`` (see [Note: pipeline chunks]
            in ``_actions.py``). The config's ``pipeline.virtual_stages`` must agree.
        partition_sample: with ``partition_method="profile"`` (only), one micro-batch as
            ``train_batch``'s iterator yields it, an ``(inputs, labels)`` pair, on the
            device the stages run on; every rank gives one (each times every layer, one
            at a time, and all use the mean). The loss is timed with the last layer.
    """

    def __init__(
        self,
        layers,
        num_stages: int | None = None,
        topology=None,
        loss_fn=None,
        seed_layers: bool = False,
        seed_fn=None,
        base_seed: int = 1234,
        partition_method="parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func=None,
        checkpointable_layers=None,
        dynamic_shape: bool = False,
        *,
        virtual_stages: int = 1,
        partition_sample=None,
    ):
        super().__init__()
        from shardwise.parallel import ParallelGrid

        del dynamic_shape  # shapes are always checked per transfer

        if num_stages is None and topology is None:
            raise PipelineError("PipelineModule needs num_stages= or topology=")
        if isinstance(topology, ParallelGrid):  # a grid built first, so layer specs can name its groups
            grid = topology
            if num_stages is not None and num_stages != grid.pipe:
                raise PipelineError(f"num_stages={num_stages} disagrees with the grid's pipe axis ({grid.pipe})")
        elif topology is not None:
            grid = ParallelGrid.from_topology(topology)
            if num_stages is not None and num_stages != grid.pipe:
                raise PipelineError(f"num_stages={num_stages} disagrees with the topology's pipe axis ({grid.pipe})")
        else:
            import torch.distributed as dist

            if not isinstance(num_stages, int) or num_stages < 1 or dist.get_world_size() % num_stages:
                raise PipelineError(
                    f"num_stages={num_stages!r} must be a positive integer dividing the {dist.get_world_size()} rank(s)"
                )
            grid = ParallelGrid.build(pipe=num_stages)
        self._grid = grid
        self.num_stages = grid.pipe
        self.stage_id = grid.stage_id
        self._layer_specs = list(layers)
        if not isinstance(virtual_stages, int) or virtual_stages < 1:
            raise PipelineError(f"virtual_stages must be a positive integer, got {virtual_stages!r}")
        if virtual_stages > 1 and self.num_stages == 1:
            raise PipelineError("virtual_stages > 1 needs at least 2 pipeline stages")
        self.virtual_stages = virtual_stages
        self.num_chunks = self.num_stages * virtual_stages
        if len(self._layer_specs) < self.num_chunks:
            raise PipelineError(
                f"{len(self._layer_specs)} layer(s) cannot fill {self.num_stages} pipeline stages"
                + (f" x {virtual_stages} virtual stages" if virtual_stages > 1 else "")
            )
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.activation_checkpoint_interval = activation_checkpoint_interval
        if activation_checkpoint_func is None:
            from shardwise.runtime.activation_checkpointing.checkpointing import checkpoint

            activation_checkpoint_func = checkpoint
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self.parts = self._partition(partition_method, partition_sample)
        """Layer boundaries of the chunks: chunk ``c`` is layers ``parts[c]:parts[c + 1]``
        (one chunk per stage without virtual stages)."""
        self.chunks = tuple(range(self.stage_id, self.num_chunks, self.num_stages))
        """The chunks this stage holds."""
        self._local_start, self._local_stop = self.parts[self.stage_id], self.parts[self.stage_id + 1]
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.chunk_funcs: dict[int, list] = {}
        for chunk in self.chunks:
            self.chunk_funcs[chunk] = self._build(self.parts[chunk], self.parts[chunk + 1])
        self.forward_funcs = self.chunk_funcs[self.stage_id]
        self._tied_shapes = self._tied_shape_record()
        self._tied_groups = self._tie_across_stages()
        self._synchronize_tied_weights()

    # -- partitioning ---------------------------------------------------------------------

    def _partition(self, method, sample) -> list[int]:
        n, p = len(self._layer_specs), self.num_chunks
        profiled = isinstance(method, str) and method.lower() == "profile"
        if sample is not None and not profiled:
            raise PipelineError(
                f"partition_sample is only read by partition_method='profile', not {method!r}: drop one of them"
            )
        if isinstance(method, (list, tuple)):
            bounds = [int(b) for b in method]
            if (
                len(bounds) != p + 1
                or bounds[0] != 0
                or bounds[-1] != n
                or any(b <= a for a, b in zip(bounds, bounds[1:]))
            ):
                raise PipelineError(
                    f"partition_method={list(method)}: explicit boundaries must be {p + 1} increasing "
                    f"layer indices from 0 to {n}"
                )
            return bounds
        if not isinstance(method, str):
            raise PipelineError(f"partition_method must be a string or a list of boundaries, got {method!r}")
        lowered = method.lower()
        if lowered == "uniform":
            return partition_uniform(n, p)
        if lowered == "parameters":
            return partition_balanced([_param_count(layer) for layer in self._layer_specs], p)
        if lowered.startswith("type:"):
            pattern = method.split(":", 1)[1]
            names = [_type_name(layer) for layer in self._layer_specs]
            weights = [1 if name is not None and re.search(pattern, name, re.IGNORECASE) else 0 for name in names]
            if not any(weights):
                raise PipelineError(
                    f"partition_method={method!r} matches no layer; the layer types are "
                    f"{sorted({name for name in names if name is not None})}"
                )
            return partition_balanced(weights, p)
        if profiled:
            return partition_min_max(self._profiled_costs(sample), p)
        raise PipelineError(
            f"partition_method={method!r} is not one of 'parameters', 'uniform', 'type:<regex>', 'profile' "
            "or a list of boundaries"
        )

    def _profiled_costs(self, sample) -> list[float]:
        """Every layer's forward + backward seconds on ``sample``, the mean over all ranks
        (collective); see [Note: profiled partition] in ``_profile.py``."""
        from shardwise.comm import Communicator

        if sample is None:
            raise PipelineError(
                "partition_method='profile' times the layers on a sample micro-batch: pass "
                "partition_sample=(inputs, labels), one micro-batch as train_batch's iterator yields it"
            )
        check_sample(sample)
        device = sample_device(sample)
        tied: dict[str, nn.Module] = {}

        def build(index: int):
            layer = self._layer_specs[index]
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in tied:
                    tied[layer.key] = layer.build().to(device)
                module = tied[layer.key]
                return module if layer.forward_fn is None else partial(layer.forward_fn, module)
            if isinstance(layer, LayerSpec):
                return layer.build().to(device)
            return layer

        mine = layer_costs(build, len(self._layer_specs), sample, loss_fn=self.loss_fn)
        every = Communicator(None, name="pipeline partition").all_gather_object(mine, tag="layer costs", counted=False)
        costs = [sum(rank[i] for rank in every) / len(every) for i in range(len(mine))]
        if self._grid.global_rank == 0:
            logger.info(
                "profiled layer costs (ms, mean of %d ranks): %s", len(every), [round(c * 1e3, 2) for c in costs]
            )
        return costs

    # -- building -------------------------------------------------------------------------

    def _build(self, start: int, stop: int) -> list:
        """Build layers ``start:stop`` (registered on this module) and return their calls."""
        funcs = []
        for index in range(start, stop):
            layer = self._layer_specs[index]
            if self.seed_layers:
                (self.seed_fn or torch.manual_seed)(self.base_seed + index)
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                module = self.tied_modules[layer.key]
                funcs.append(module if layer.forward_fn is None else partial(layer.forward_fn, module))
            elif isinstance(layer, LayerSpec):
                module = layer.build()
                self.add_module(str(index), module)
                funcs.append(module)
            elif isinstance(layer, nn.Module):
                self.add_module(str(index), layer)
                funcs.append(layer)
            elif callable(layer):
                funcs.append(layer)
            else:
                raise PipelineError(f"layer {index} is {layer!r}: give LayerSpecs, modules or callables")
        return funcs

    def _tied_shape_record(self) -> dict[str, dict[str, tuple]]:
        return {
            key: {a: tuple(_getattr(module, a).shape) for a in self.tied_weight_attrs[key]}
            for key, module in self.tied_modules.items()
        }

    def _tie_across_stages(self) -> dict[str, tuple[list[int], object]]:
        """For every tied key used on more than one stage: the stages using it and the
        group of ranks (same data and tensor coordinates) holding a copy. Collective."""
        import torch.distributed as dist

        grid = self._grid
        users: dict[str, list[int]] = {}
        for chunk in range(self.num_chunks):
            stage = chunk % self.num_stages
            for layer in self._layer_specs[self.parts[chunk] : self.parts[chunk + 1]]:
                if isinstance(layer, TiedLayerSpec) and stage not in users.setdefault(layer.key, []):
                    users[layer.key].append(stage)
        shapes = grid.pipe_comm.all_gather_object(self._tied_shapes, tag="tied layer shapes")
        for key in users:
            seen = {str(s[key]) for s in shapes if key in s}
            if len(seen) > 1:
                raise PipelineError(
                    f"tied key {key!r} has different shapes on different stages: {sorted(seen)}; "
                    "every TiedLayerSpec with one key must build the same weights"
                )
        groups = {}
        for key, stages in sorted(users.items()):
            if len(stages) < 2:
                continue
            mine = None
            for data in range(grid.data):
                for tensor in range(grid.tensor):
                    ranks = [grid.topology().get_rank(pipe=s, data=data, model=tensor) for s in stages]
                    group = dist.new_group(ranks)
                    if grid.global_rank in ranks:
                        mine = (ranks, group)
            if mine is not None:
                groups[key] = (stages, mine)
        return groups

    def _synchronize_tied_weights(self) -> None:
        """Give every stage's copy of a tied weight the first stage's values (collective
        over each tied group), before any optimizer or fp32 master copy is made of them."""
        from shardwise.comm import Communicator

        self._tied_comms = {}
        for key, (_, (_ranks, group)) in self._tied_groups.items():
            comm = self._tied_comms[key] = Communicator(group, name=f"tied weight {key}")
            with torch.no_grad():
                for attr in self.tied_weight_attrs[key]:
                    comm.broadcast(_getattr(self.tied_modules[key], attr).data, src=0, tag=f"tied weight {key}").wait()

    # -- running --------------------------------------------------------------------------

    def forward(self, inputs, chunk: int | None = None):
        """Run this stage's layers (of ``chunk``, with virtual stages) on ``inputs``, what
        the previous stage produced."""
        x = inputs
        interval = self.activation_checkpoint_interval
        funcs = self.forward_funcs if chunk is None else self.chunk_funcs[chunk]
        if interval <= 0 or not torch.is_grad_enabled():
            return _run_range(funcs)(*_as_args(x))
        for start in range(0, len(funcs), interval):
            chunk = funcs[start : start + interval]
            args = _as_args(x)
            # a reentrant recompute needs an input that requires grad (not the token ids)
            needs_grad = any(isinstance(t, torch.Tensor) and t.requires_grad for t in args)
            run = self.activation_checkpoint_func if needs_grad and self._checkpointable(chunk) else _call_directly
            x = run(_run_range(chunk), *args)
        return x

    def _checkpointable(self, funcs) -> bool:
        if self.checkpointable_layers is None:
            return any(isinstance(f, nn.Module) and any(p.requires_grad for p in f.parameters()) for f in funcs)
        return any(type(getattr(f, "func", f)).__name__ in self.checkpointable_layers for f in funcs)

    # -- tied weights -----------------------------------------------------------------------

    def tied_weights(self) -> list[tuple[str, nn.Parameter, list[int], object]]:
        """``(key, parameter, ranks, comm)`` of every tied weight this stage shares with
        others; ``comm`` is the Communicator over the stages holding it."""
        out = []
        for key, (_, (ranks, _group)) in self._tied_groups.items():
            for attr in self.tied_weight_attrs[key]:
                out.append((key, _getattr(self.tied_modules[key], attr), ranks, self._tied_comms[key]))
        return out

    # -- DeepSpeed's accessors --------------------------------------------------------------

    def topology(self):
        return self._grid.topology()

    def mpu(self):
        return self._grid

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def partitions(self) -> list[int]:
        return list(self.parts)

    def stage_owner(self, layer_idx: int) -> int:
        """The stage that holds layer ``layer_idx``."""
        if not 0 <= layer_idx < len(self._layer_specs):
            raise PipelineError(f"layer {layer_idx} is not in this model of {len(self._layer_specs)} layers")
        return (
            next(c for c in range(self.num_chunks) if self.parts[c] <= layer_idx < self.parts[c + 1]) % self.num_stages
        )

    def set_checkpoint_interval(self, interval: int) -> None:
        self.activation_checkpoint_interval = interval


def _getattr(module: nn.Module, dotted: str):
    for part in dotted.split("."):
        module = getattr(module, part)
    return module


def _as_args(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _call_directly(fn, *args):
    return fn(*args)


def _run_range(funcs):
    """Run ``funcs`` in order; each takes the previous output as its one argument (a tuple
    stays a tuple), as DeepSpeed's layers do."""

    def run(*inputs):
        x = inputs[0] if len(inputs) == 1 else inputs
        for fn in funcs:
            x = fn(x)
        return x

    return run
