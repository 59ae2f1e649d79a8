"""The hybrid engine's inference view: the training weights, current at every
``generate``, laid out for ``init_inference``'s fast decoder.

[Note: the inference view]
The fast decoder (``inference/_fast.py``) fuses projections and re-stores weights
input-major, making the layers' parameters views of its own tensors. The training
module's parameters cannot be re-bound that way (ZeRO owns their storage: flat buffers,
stage-3 units), so the view is a second instance of the model class, built once from the
model's config on the meta device and given storage of the training dtype: the *inference
copy*. The decoder is built over the copy once; every ``generate`` then refreshes the copy
in place from the training parameters (the copy's parameters are views of the decoder's
tensors, biases included), which costs one copy of the weights. Building the copy and
decoder again costs about twice that (measured on one CPU core: 0.2 against 18 ms for
the test Llama, 0.45 against 0.9 s for a 56M-parameter Llama with a 32000-word vocabulary),
so the copy is refreshed and only built again when ``pin_parameters`` is false.

Filling the copy walks the model in groups: the parameters outside the largest
``ModuleList`` (embeddings, final norm, head) first, then ``tp_gather_partition_size``
layers at a time. Under ZeRO stage 3 each group is gathered (one collective per unit,
the same order on every rank), copied and freed, so at most one group is whole at a
time and nothing stays gathered after ``generate``; at stages 0-2 the parameters are
whole already and the gathers do nothing. LoRA layers (``fuse_lora_weight`` /
``unfuse_lora_weight``) of a group are fused before its copy and unfused after, and
their parameters are then restored bit for bit (fusing and unfusing in floating point
is not exact), so training sees exactly the weights it had.

A family without a fast decoder, and ``generate`` arguments the fast loop does not serve
(beam search, repetition penalty...), run the model class's own ``generate`` on the
inference copy: the training module's ZeRO-3 hooks never see the generation's forwards
(which would gather per token, and before the first backward would enter the recorded
prefetch order). Only a model that cannot be built from its config alone generates on the
training module, every group gathered first and kept whole until the call ends.

With ``enable_cuda_graph`` (a CUDA device, one inference rank) the decode steps run as
CUDA graphs ([Note: decode graphs]) captured over the decoder's tensors. Refreshing the
copy writes into those same tensors, so a graph captured once replays with the weights of
every later step; the graphs (and the KV caches they hold) are dropped with the copy
(``pin_parameters`` false) or with the cache (``release_inference_cache``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.config._hybrid_engine import HybridEngineConfig
from shardwise.inference._generate import GenerationStats, fast_request, run_fast
from shardwise.runtime._inference_rows import first_rank_random_stream, gather_rows, own_rows, samples
from shardwise.tensor_parallel._partition import copy_marks, shard_info
from shardwise.zero import GatheredParameters

logger = logging.getLogger("shardwise")


@dataclass(frozen=True)
class InferenceMemory:
    """What the inference view holds between ``generate`` calls."""

    weights_bytes: int
    """The inference copy of the weights (0 once freed: ``pin_parameters`` false)."""
    cache_bytes: int
    """The kept KV cache (0 once freed: ``release_inference_cache``)."""


@dataclass(frozen=True)
class SharedPrefill:
    """The next ``generate``'s rows come in groups of ``repeats`` copies of one prompt
    (``prepare_shared_prefill``): its prefill runs once per group."""

    source_batch_size: int
    """Distinct prompts."""
    repeats: int
    """Copies of each, adjacent (``prompts.repeat_interleave(repeats, dim=0)``)."""
    prompt_length: int
    """Tokens of each prompt (padding included)."""

    def check(self, input_ids: torch.Tensor) -> None:
        """Refuse input ids that are not this layout, naming what differs."""
        expected = (self.source_batch_size * self.repeats, self.prompt_length)
        if tuple(input_ids.shape) != expected:
            raise ValueError(
                f"prepare_shared_prefill({self.source_batch_size}, {self.repeats}, {self.prompt_length}) expects input "
                f"ids of shape {list(expected)}, got {list(input_ids.shape)}"
            )
        if self.prompt_length < 2:
            raise ValueError("prepare_shared_prefill needs prompts of more than one token")
        groups = input_ids[:: self.repeats].repeat_interleave(self.repeats, dim=0)
        if not torch.equal(groups, input_ids):
            raise ValueError(
                f"prepare_shared_prefill: the rows are not groups of {self.repeats} identical prompts "
                "(lay them out with prompts.repeat_interleave(repeats, dim=0))"
            )


@dataclass(frozen=True)
class GatherGroup:
    """Parameters gathered and copied together, and the LoRA layers among them."""

    params: list[tuple[str, nn.Parameter]]
    """``(name in the model, parameter)``, each parameter once."""
    lora: list[nn.Module]
    """Layers with ``fuse_lora_weight`` / ``unfuse_lora_weight`` whose weights are here."""


def _is_lora(module: nn.Module) -> bool:
    return hasattr(module, "fuse_lora_weight") and hasattr(module, "unfuse_lora_weight")


def gather_plan(module: nn.Module, layers_per_group: int) -> list[GatherGroup]:
    """The groups the inference copy is filled in, in order (the same on every rank): the
    parameters outside the model's largest ``ModuleList`` (embeddings, norms, head), then
    ``layers_per_group`` consecutive entries of that list at a time."""
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList)]
    layers = max(lists, key=len) if lists else nn.ModuleList()
    names = {id(p): n for n, p in module.named_parameters()}
    in_layers = {id(p) for p in layers.parameters()}
    layer_modules = {id(m) for m in layers.modules()}
    groups = [
        GatherGroup(
            params=[(n, p) for n, p in module.named_parameters() if id(p) not in in_layers],
            lora=[m for m in module.modules() if id(m) not in layer_modules and _is_lora(m)],
        )
    ]
    seen = {id(p) for _, p in groups[0].params}
    for start in range(0, len(layers), layers_per_group):
        chunk = nn.ModuleList(layers[start : start + layers_per_group])
        params = [(names[id(p)], p) for p in chunk.parameters() if id(p) not in seen]
        seen.update(id(p) for _, p in params)
        groups.append(
            GatherGroup(
                params=params,
                lora=[m for m in chunk.modules() if _is_lora(m)],
            )
        )
    return groups


@contextlib.contextmanager
def fused_lora(modules: list[nn.Module]):
    """LoRA ``modules`` fused inside the block; after it they are unfused and their
    parameters hold exactly the values they had before (see [Note: the inference view])."""
    with torch.no_grad():
        kept = [[p.detach().clone() for p in m.parameters()] for m in modules]
        for m in modules:
            m.fuse_lora_weight()
        try:
            yield
        finally:
            for m, values in zip(modules, kept):
                m.unfuse_lora_weight()
                for p, value in zip(m.parameters(), values):
                    p.copy_(value)


class _KeptCache:
    """The decoder, handing out one KV cache again while batch and length stay the same
    (``run_fast`` writes every position before it reads it)."""

    def __init__(self, decoder) -> None:
        self.decoder = decoder
        self.cache = None
        self.shape: tuple[int, int] | None = None

    def __getattr__(self, name: str):
        return getattr(self.decoder, name)

    def new_cache(self, batch: int, length: int):
        if self.shape != (batch, length):
            self.cache = None  # free the old one before allocating
            self.cache = self.decoder.new_cache(batch, length)
            self.shape = (batch, length)
        return self.cache

    def nbytes(self) -> int:
        if self.cache is None:
            return 0
        return self.cache.keys.nbytes + self.cache.values.nbytes

    def release(self) -> None:
        self.cache, self.shape = None, None


class InferenceView:
    """Generation from the training module's current weights; see [Note: the inference
    view].

    Args:
        module: the training module (its parameters as the ZeRO strategy holds them).
        config: the ``hybrid_engine`` section.
        keep_whole: a context manager factory keeping every gathered parameter whole until
            it exits (stage 3's ``keep_gathered``; a no-op at other stages).
        tensor_comm: the Communicator of this rank's inference tensor group, for
            ``inference_tp_size`` > 1 (see [Note: inference tensor parallelism]).
    """

    def __init__(self, module: nn.Module, *, config: HybridEngineConfig, keep_whole, tensor_comm=None) -> None:
        self.module = module
        self.config = config
        self._keep_whole = keep_whole
        self.tensor_comm = tensor_comm
        """The inference tensor group (``inference_tp_size`` > 1), or None."""
        self._aliases = _aliases(module)
        self.groups = gather_plan(module, config.tp_gather_partition_size)
        self.no_fast_path: str | None = _fast_family_missing(module)
        """Why generation runs the model class's own ``generate`` (None: the fast decoder)."""
        self._no_copy: str | None = None
        """Why the inference copy cannot be built (then the training module generates)."""
        self._copy: nn.Module | None = None
        self._targets: dict[str, torch.Tensor] = {}
        self._decoder: _KeptCache | None = None
        self._steps = None
        """The captured decode steps (``StaticSteps``) with ``enable_cuda_graph``, or None."""
        self._logged: set[str] = set()
        self._shared: SharedPrefill | None = None
        self._last_shared: SharedPrefill | None = None
        self.last_generation = GenerationStats()
        """Timings of the last ``generate`` call."""
        self.last_fill_s = 0.0
        """Seconds the last call spent gathering and copying the weights."""

    def memory(self) -> InferenceMemory:
        """What is held between calls (the inference copy, the KV cache)."""
        tensors = self._copy.state_dict().values() if self._copy is not None else ()
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}  # views once
        weights = sum(storages.values())
        return InferenceMemory(weights_bytes=weights, cache_bytes=self._decoder.nbytes() if self._decoder else 0)

    def share_next_prefill(self, shared: SharedPrefill) -> None:
        """Run the next ``generate``'s prefill once per group of identical prompts."""
        self._shared = shared

    def shared_prompt_cache(self, source_batch_size: int, repeats: int) -> tuple:
        """The prompt's keys and values of every row after the last shared prefill, one
        ``(keys, values)`` per layer (``[rows, kv_heads, prompt, head_dim]``)."""
        if self.tensor_comm is not None:
            raise RuntimeError(
                "repeat_shared_prefill_cache with hybrid_engine.inference_tp_size > 1: each rank's KV cache holds "
                "its share of the heads for the whole group's rows, not its rows' keys and values; recompute "
                "them in the training forward"
            )
        last = self._last_shared
        if last is None or (last.source_batch_size, last.repeats) != (source_batch_size, repeats):
            raise RuntimeError(
                f"repeat_shared_prefill_cache({source_batch_size}, {repeats}): the last generate ran no shared "
                "prefill of that layout (call prepare_shared_prefill before generate)"
            )
        if self._decoder is None or self._decoder.cache is None:
            raise RuntimeError("repeat_shared_prefill_cache: the KV cache was released (release_inference_cache)")
        cache, prompt = self._decoder.cache, last.prompt_length
        return tuple((cache.keys[i, :, :, :prompt], cache.values[i, :, :, :prompt]) for i in range(len(cache.keys)))

    def generate(self, args: tuple, kwargs: dict):
        """``generate(*args, **kwargs)`` with the current weights (collective under stage 3
        and with an inference tensor group)."""
        if self.tensor_comm is None:
            return self._generate(args, kwargs)
        shared, self._shared = self._agree_on_shared(), None
        sampling = samples(self.module, kwargs)
        rows, args, kwargs = gather_rows(self.tensor_comm, self.module, args, kwargs)
        if shared is not None:  # the ranks' groups, stacked in rank order, are groups still
            tp = self.tensor_comm.world_size
            self._shared = SharedPrefill(shared.source_batch_size * tp, shared.repeats, shared.prompt_length)
        device = next(self.module.parameters()).device
        with first_rank_random_stream(self.tensor_comm, device) if sampling else contextlib.nullcontext():
            out = self._generate(args, kwargs)
        return own_rows(out, rows, self.tensor_comm.rank)

    def _agree_on_shared(self) -> SharedPrefill | None:
        """This rank's ``prepare_shared_prefill`` layout, checked to be every rank's of the
        tensor group (they generate one batch together, so either all share the prefill
        with one layout or none does)."""
        shared = self._shared
        mine = [shared.source_batch_size, shared.repeats, shared.prompt_length] if shared else [0, 0, 0]
        device = next(self.module.parameters()).device
        every = torch.empty((self.tensor_comm.world_size, 3), dtype=torch.long, device=device)
        layout = torch.tensor([mine], dtype=torch.long, device=device)
        self.tensor_comm.all_gather_into_tensor(every, layout, tag="shared prefill layouts").wait()
        if bool((every != every[0]).any()):
            self._shared = None
            raise ValueError(
                "hybrid_engine.inference_tp_size > 1: the ranks of a tensor group generate one batch together, so "
                "each calls prepare_shared_prefill with the same sizes before generate, or none does; got "
                f"(source_batch_size, repeats, prompt_length) = {every.tolist()} (0s: not called)"
            )
        return shared

    def _generate(self, args: tuple, kwargs: dict):
        shared, self._shared, self._last_shared = self._shared, None, None
        request = fast_request(self.module, args, kwargs) if self.no_fast_path is None else self.no_fast_path
        if isinstance(request, str):
            prompt = _prompt_length(args, kwargs)
            _check_length(prompt, _new_tokens(self.module, prompt, kwargs), self.config.max_out_tokens)
            _refuse_shared(shared, request)
        else:
            _check_length(request.input_ids.shape[1], request.max_new_tokens, self.config.max_out_tokens)
            if shared is not None:
                shared.check(request.input_ids)
        self._refresh()
        if self._copy is None:
            _refuse_shared(shared, self._no_copy)
            if self.tensor_comm is not None:
                raise ValueError(
                    f"hybrid_engine.inference_tp_size > 1 needs an inference copy to split, and this model has none: "
                    f"{self._no_copy}"
                )
            return self._own_generate(self.module, self._no_copy, args, kwargs, keep_whole=self._keep_whole)
        try:
            if isinstance(request, str) or self._decoder is None:
                _refuse_shared(shared, self.no_fast_path)
                return self._own_generate(
                    self._copy, request if isinstance(request, str) else self.no_fast_path, args, kwargs
                )
            out, self.last_generation = run_fast(
                self._decoder,
                request,
                max_out_tokens=self.config.max_out_tokens,
                steps=self._steps,
                shared_prefill=shared.repeats if shared is not None else 1,
            )
            self._last_shared = shared
            return out
        finally:
            if self.config.release_inference_cache and self._decoder is not None:
                self._decoder.release()
                self._steps = self._new_steps()
            if not self.config.pin_parameters:
                self._copy, self._targets, self._decoder, self._steps = None, {}, None, None

    def _refresh(self) -> None:
        """Fill the inference copy from the training weights, building it (and the decoder
        over it, for a family that has one) first when there is none."""
        if self._no_copy is not None:
            return
        start = time.perf_counter()
        first = self._copy is None
        if first:
            self._copy, self._no_copy = _empty_copy(self.module, self.tensor_comm)
            if self._copy is None:
                return
            self._targets = dict(self._copy.named_parameters())
        if hasattr(self.module, "generation_config"):  # what the user set, not what the config gives
            self._copy.generation_config = self.module.generation_config
        with torch.no_grad():
            buffers = dict(self._copy.named_buffers())
            for name, buffer in self.module.named_buffers():
                if name in buffers:
                    buffers[name].copy_(buffer)
            for group in self.groups:
                with GatheredParameters([p for _, p in group.params]), fused_lora(group.lora):
                    for name, param in group.params:
                        for alias in self._aliases.get(name, (name,)):
                            if alias in self._targets:
                                _fill(self._targets[alias], param)
        if first and self.no_fast_path is None:
            self._build_decoder()
        self.last_fill_s = time.perf_counter() - start

    def _build_decoder(self) -> None:
        from shardwise.inference._fast import build_decoder

        decoder, why = build_decoder(self._copy)
        if decoder is None:
            self.no_fast_path = why
            return
        self._decoder = _KeptCache(decoder)
        self._targets = dict(self._copy.named_parameters())  # the decoder's views now
        self._steps = self._new_steps()

    def _new_steps(self):
        """Empty captured decode steps over the decoder when ``enable_cuda_graph`` (the
        engine refused it where graphs cannot run), else None."""
        if not self.config.enable_cuda_graph or self._decoder is None:
            return None
        from shardwise.inference._graphs import StaticSteps

        return StaticSteps(self._decoder.decoder, graph=True)

    def _own_generate(self, model: nn.Module, reason: str, args: tuple, kwargs: dict, *, keep_whole=None):
        """The model class's own ``generate`` on ``model`` (the inference copy, or the
        training module with every parameter gathered once for the call by ``keep_whole``)."""
        if reason not in self._logged:
            self._logged.add(reason)
            logger.info("hybrid engine: generate runs the model's own generate for %s", reason)
        start = time.perf_counter()
        with keep_whole() if keep_whole is not None else contextlib.nullcontext():
            if keep_whole is not None:
                for group in self.groups:
                    with GatheredParameters([p for _, p in group.params]):
                        pass  # kept whole until keep_whole ends
            lora = [m for group in self.groups for m in group.lora] if model is self.module else []
            with fused_lora(lora), torch.inference_mode():
                out = type(model).generate(model, *args, **kwargs)
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        prompt = _prompt_length(args, kwargs)
        self.last_generation = GenerationStats(
            batch_size=sequences.shape[0],
            prompt_tokens=prompt,
            new_tokens=sequences.shape[1] - prompt,
            total_s=time.perf_counter() - start,
        )
        return out


def _refuse_shared(shared: SharedPrefill | None, reason: str) -> None:
    if shared is not None:
        raise ValueError(
            f"prepare_shared_prefill needs the fast decoder, and this generate runs the model's own for {reason}"
        )


def _fast_family_missing(module: nn.Module) -> str | None:
    """Why ``module`` has no fast decoder, judged by its ``config.model_type`` (None: it
    may have one; building it decides)."""
    from shardwise.inference._fast import _FAMILIES
    from shardwise.inference._fast_moe import MODEL_TYPES

    families = sorted({*_FAMILIES, *MODEL_TYPES})
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    if model_type not in families:
        return f"model_type {model_type!r} (fast decoders: {families})"
    return None


def _empty_copy(module: nn.Module, tensor_comm=None) -> tuple[nn.Module | None, str | None]:
    """A second instance of ``module``'s class from its config, with uninitialised storage
    of the training dtype on the training device, in eval mode, without gradients, split
    over ``tensor_comm``'s group when given (and None); or None and why not."""
    import copy

    config = getattr(module, "config", None)
    name = type(module).__name__
    if config is None or not hasattr(type(module), "generate"):
        return None, f"a {name} (no config and generate to build an inference copy from)"
    reference = next(module.parameters())
    try:
        with torch.device("meta"):
            twin = type(module)(copy.deepcopy(config))
    except TypeError as exc:
        return None, f"a {name} that cannot be built from its config alone ({exc})"
    if tensor_comm is not None:  # split on the meta device: each rank allocates its slices only
        from shardwise.inference import _sharding

        _sharding.shard_model(twin, tensor_comm, _sharding.inference_policy(twin, None))
    on_meta = dict(twin.named_parameters())
    twin.to_empty(device=reference.device)  # new tensors: tied ones untied, tensor-parallel marks dropped
    if hasattr(twin, "tie_weights") and tensor_comm is None:  # a split head is its own tensor
        twin.tie_weights()
    for name, param in twin.named_parameters():
        copy_marks(on_meta[name], param)
    twin.to(reference.dtype).eval().requires_grad_(False)
    # a head tied to the input embedding is a tensor of its own in a split copy
    missing = {n for n, _ in twin.named_parameters()} - {n for n, _ in module.named_parameters(remove_duplicate=False)}
    if missing:
        return None, f"a {name} built from its config has parameters the model lacks {sorted(missing)}"
    return twin, None


def _aliases(module: nn.Module) -> dict[str, list[str]]:
    """Every name of each parameter, by its first name (a tied head is also the input
    embedding's: a copy split over a tensor group holds it separately)."""
    first: dict[int, str] = {}
    names: dict[str, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(first.setdefault(id(param), name), []).append(name)
    return names


def _fill(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the part of the full parameter ``full`` that ``target`` holds: all of it, or
    its tensor-parallel slice ([Note: tensor-parallel shard rule]: chunk ``index`` of each
    of ``partition_stride`` stacked blocks along ``dim``; GPT-2's Conv1D tensors are
    stored transposed)."""
    info = shard_info(target)
    if info is None:
        _copy_into(target, full)
        return
    transposed = getattr(target, "tensor_parallel_transposed", False)
    dim = full.dim() - 1 - info.dim if transposed else info.dim
    blocks = getattr(target, "partition_stride", 1)
    block = full.shape[dim] // blocks
    piece = block // info.parts
    part = torch.cat([full.narrow(dim, b * block + info.index * piece, piece) for b in range(blocks)], dim=dim)
    _copy_into(target, part.t() if transposed else part)


def _copy_into(target: torch.Tensor, source: torch.Tensor, rows: int = 64) -> None:
    """``target.copy_(source)``; into an input-major ``target`` (a transposed view, see
    [Note: input-major weights]) a block of ``rows`` source rows at a time, so each block's
    reads and writes stay in the cache. One thread of this machine's CPU: a Llama MLP's
    gate (1376 x 512 into its fused 512 x 2752 storage) 1.8 against 13 ms walking the
    target's memory order and 12 ms plain; a 32000 x 512 LM head 86 against 147 and 405 ms.
    On a GPU one copy kernel per tensor (blocks would launch thousands: the fill of a 1B
    Llama took 97 ms on an H200, bench/results/2026-11-28-h200-gpu-checks.md)."""
    if target.device.type != "cpu" or not (target.dim() == 2 and target.stride(0) == 1 and target.stride(1) != 1):
        target.copy_(source)
        return
    out = target.t()
    for start in range(0, source.shape[0], rows):
        out[:, start : start + rows].copy_(source[start : start + rows].t())


def _prompt_length(args: tuple, kwargs: dict) -> int:
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    return ids.shape[1] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else 0


def _new_tokens(module: nn.Module, prompt: int, kwargs: dict) -> int:
    """The new tokens ``generate`` will produce at most, as it reads its arguments."""
    config = kwargs.get("generation_config") or getattr(module, "generation_config", None)
    new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    if new is not None:
        return new
    total = kwargs.get("max_length", getattr(config, "max_length", None))
    return (20 if total is None else total) - prompt


def _check_length(prompt: int, new: int, max_out_tokens: int) -> None:
    if prompt + new > max_out_tokens:
        raise ValueError(
            f"generation would reach {prompt + new} tokens ({prompt} prompt + {new} new), more than "
            f"hybrid_engine.max_out_tokens={max_out_tokens}; lower max_new_tokens or raise hybrid_engine.max_out_tokens"
        )
