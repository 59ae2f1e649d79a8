"""DeepSpeed's Hybrid Engine: train under ZeRO and generate with the same, current weights.

``initialize`` returns a :class:`HybridEngine` when the config's ``hybrid_engine.enabled``
is true. It trains exactly as the :class:`~shardwise.runtime.engine.Engine` it extends
(it overrides nothing of it) and holds an inference view of the module's weights
(``runtime/_inference_view.py``, see [Note: the inference view]) that ``generate`` refreshes
from the current weights at every call and runs through ``init_inference``'s fast decoder.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from shardwise.config import ConfigError
from shardwise.runtime._inference_view import InferenceMemory, InferenceView, SharedPrefill
from shardwise.runtime.engine import Engine


class _GenerateThroughEngine:
    """``engine.module.generate``: the hybrid engine's ``generate`` (DeepSpeed-Chat calls
    the module's). It holds the engine weakly, so copying or pickling the module does not
    take the engine along."""

    def __init__(self, engine: HybridEngine) -> None:
        self._engine = weakref.ref(engine)

    def __call__(self, *args, **kwargs):
        engine = self._engine()
        if engine is None:
            raise RuntimeError("the hybrid engine this module was trained by is gone; call the model class's generate")
        return engine.generate(*args, **kwargs)


class HybridEngine(Engine):
    """The training engine plus ``generate`` from the current weights (DeepSpeed's
    ``DeepSpeedHybridEngine``).

    ``generate(*args, **kwargs)`` takes Hugging Face ``generate``'s arguments; so does
    ``engine.module.generate``, which goes through it. Each call fills the inference copy
    from the weights as they are now (after every optimizer step), gathering them under
    ZeRO stage 3 in groups of ``hybrid_engine.tp_gather_partition_size`` layers once per
    call, never per token, and freeing them again. Families with a fast decoder (Llama,
    Mistral, Qwen2, GPT-2, GPT-NeoX, OPT and the MoE families of ``init_inference``) decode
    on it for greedy decoding and sampling; other models and arguments run the model
    class's own ``generate`` on the copy (logged once per reason). With
    ``inference_tp_size`` > 1 the copy is split over each group of that many ranks, which
    generate their prompts together. ``eval()`` and ``train()`` are the module's.
    Collective under stage 3 and with ``inference_tp_size`` > 1: every rank calls
    ``generate`` together.
    """

    def __init__(self, *, config, grid, **kwargs) -> None:
        hybrid = config.hybrid_engine
        hybrid.check_world(torch.distributed.get_world_size())
        if grid.tensor > 1:
            raise ValueError(
                f"hybrid_engine with training tensor parallelism ({grid.tensor} ranks): the inference copy is "
                "filled from whole parameters; train without tensor parallelism (ZeRO-3 partitions the weights) or "
                "turn the hybrid engine off"
            )
        super().__init__(config=config, grid=grid, **kwargs)
        keep_whole = self.strategy.keep_gathered if self.train_config.zero.stage == 3 else contextlib.nullcontext
        tensor_comm = None
        if hybrid.inference_tp_size > 1:
            from shardwise.inference._sharding import tensor_comm as build_tensor_comm

            tensor_comm = build_tensor_comm(hybrid.inference_tp_size)
        self.inference_view = InferenceView(self.module, config=hybrid, keep_whole=keep_whole, tensor_comm=tensor_comm)
        """The inference copy of the weights and its decoder (see [Note: the inference view])."""
        if hybrid.enable_cuda_graph:
            _check_cuda_graph(hybrid, self.device, self.inference_view.no_fast_path)
        self.module.generate = _GenerateThroughEngine(self)

    def generate(self, *args, **kwargs):
        """Hugging Face ``generate`` with the current weights; returns what it returns, as
        ordinary tensors that training may use (the token ids feed the PPO forward).
        ``synced_gpus`` (DeepSpeed-Chat passes it under ZeRO-3) is accepted and ignored:
        no rank waits for another between tokens here (the weights are gathered once
        before decoding, and an inference tensor group decodes the same rows together)."""
        kwargs.pop("synced_gpus", None)
        return _trainable(self.inference_view.generate(args, kwargs))

    def prepare_shared_prefill(self, source_batch_size: int, repeats: int, prompt_length: int) -> None:
        """Make the next ``generate`` run each prompt's prefill once for a group of samples
        (GRPO's group of answers per prompt): its input ids must be ``source_batch_size``
        prompts of ``prompt_length`` tokens, each repeated ``repeats`` times in place
        (``prompts.repeat_interleave(repeats, dim=0)``); the prompt's keys and values are
        computed once per group and copied to its rows, then the rows decode on their own.
        The fast decoder only (a model without one is refused at ``generate``)."""
        if repeats < 1 or source_batch_size < 1:
            raise ValueError(
                f"prepare_shared_prefill: source_batch_size and repeats must be positive, got "
                f"{source_batch_size} and {repeats}"
            )
        self.inference_view.share_next_prefill(SharedPrefill(source_batch_size, repeats, prompt_length))

    def repeat_shared_prefill_cache(self, source_batch_size: int, repeats: int) -> tuple:
        """The prompt's keys and values of every row after the last shared prefill
        (``prepare_shared_prefill`` with the same sizes, then ``generate``): one
        ``(keys, values)`` pair per layer, ``[rows, kv_heads, prompt_length, head_dim]``.
        Needs the KV cache kept (``release_inference_cache`` false)."""
        return self.inference_view.shared_prompt_cache(source_batch_size, repeats)

    @property
    def last_generation(self):
        """Timings of the last ``generate`` (``GenerationStats``)."""
        return self.inference_view.last_generation

    def inference_memory(self) -> InferenceMemory:
        """Bytes the inference view holds between ``generate`` calls (the weights' copy, the
        KV cache); 0 for what ``pin_parameters`` false / ``release_inference_cache`` free."""
        return self.inference_view.memory()

    def __repr__(self) -> str:
        return "Hybrid" + super().__repr__()


def _check_cuda_graph(hybrid, device: torch.device, no_fast_path: str | None) -> None:
    """Refuse ``enable_cuda_graph`` where the decode steps cannot be captured."""
    problem = None
    if device.type != "cuda":
        problem = f"it needs a CUDA device and this engine runs on {device.type}"
    elif hybrid.inference_tp_size > 1:
        problem = (
            f"decode steps of an inference tensor group (inference_tp_size={hybrid.inference_tp_size}) are not "
            "captured (their all-reduces would have to be captured with them); use inference_tp_size 1"
        )
    elif no_fast_path is not None:
        problem = f"it captures the fast decoder's step, and this model has none: {no_fast_path}"
    if problem is not None:
        raise ConfigError(f"hybrid_engine.enable_cuda_graph=true: {problem}; set it to false")


def _trainable(out):
    """``generate``'s output with its inference-mode tensors (the decoder runs under
    ``torch.inference_mode``) copied into ordinary ones, which autograd accepts as inputs."""
    if isinstance(out, torch.Tensor):
        return out.clone() if out.is_inference() else out
    if isinstance(out, tuple):
        return type(out)(_trainable(item) for item in out)
    if isinstance(out, dict):  # a ModelOutput (GenerateDecoderOnlyOutput) keeps its class
        for key, value in out.items():
            out[key] = _trainable(value)
    return out


DeepSpeedHybridEngine = HybridEngine
"""DeepSpeed's name (``deepspeed.runtime.hybrid_engine.DeepSpeedHybridEngine``)."""
