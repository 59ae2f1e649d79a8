"""``init_inference`` and the engine it returns.

[Note: inference setup order]
``init_inference`` applies its steps to the model in one order, because each needs the
previous one:
1. split it over the tensor group (on the meta device if it was built there, so no rank
   ever holds the full model);
2. fill it from the checkpoint, each rank reading only its slices of each tensor;
3. cast it to the float dtype and move it to the accelerator;
4. store the linear weights as int8 (``dtype=torch.int8``), after the split, so every
   rank's scales are those of its own shard; a compressed model's ZeroQuant layers go to
   int8 kernels instead (``_int8_kernels.py``);
5. build the fast decoder (``replace_with_kernel_inject``), which fuses the layers'
   final weights.
Experts are split (``moe.ep_size``) after step 2, so the checkpoint is read whole.

[Note: experts at inference]
At inference every rank is given the same inputs. With ``ep_size`` ranks, the experts of
a Hugging Face MoE block keep their rows of the stacked weights on each rank (as AutoEP
splits them, ``moe/_autoep.py``), and since each rank already has every token, no token
moves: a rank computes its experts' share of each token's output and the shares are
summed by one all-reduce over the expert-parallel group. DeepSpeed's ``MoE`` layers,
built with their own ``ep_size``, are given their expert groups and exchange tokens as in
training (each rank then computes the same result).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from shardwise.config._errors import ConfigError
from shardwise.config._inference import InferenceConfig, inference_config
from shardwise.inference._generate import GenerationStats, fast_request, run_fast, run_model_generate

logger = logging.getLogger("shardwise")


class InferenceEngine(nn.Module):
    """A model prepared for inference: call it as the model, ``generate`` as the model.

    Attributes the model has (``config``, ``device``, ``generation_config``...) are read
    through, so a ``transformers.pipeline`` whose ``model`` is the engine works.
    """

    def __init__(
        self,
        model: nn.Module,
        config: InferenceConfig,
        *,
        comm=None,
        decoder=None,
        int8_report: dict | None = None,
        steps=None,
    ) -> None:
        super().__init__()
        self.module = model
        self._config = config
        self._comm = comm
        self._decoder = decoder
        self._steps = steps
        self.int8_report = int8_report
        """``{"layers", "bytes_before", "bytes_after"}`` of the int8 weights (with
        ``"kernel_layers"``, the layers on int8 kernels, for a ZeroQuant model), or None."""
        self.last_generation = GenerationStats()
        """Timings of the last ``generate`` call (time to first token, tokens per second)."""
        self._fallback_logged: set[str] = set()

    @property
    def config(self):  # the model's config, as the model and DeepSpeed's engine give it
        return getattr(self.module, "config", None)

    @property
    def inference_config(self) -> InferenceConfig:
        """The settings this engine was built with."""
        return self._config

    @property
    def mp_world_size(self) -> int:
        """The tensor-parallel degree (DeepSpeed's name)."""
        return self._comm.world_size if self._comm is not None else 1

    @property
    def cuda_graph(self) -> bool:
        """Whether the fast path's decode steps replay as CUDA graphs ([Note: decode graphs])."""
        return self._steps is not None and self._steps.graph

    @property
    def fast_path(self) -> bool:
        """Whether ``generate`` runs the fast decoder (see [Note: the fast decoder])."""
        return self._decoder is not None

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self._modules.get("module")
            if module is None or name.startswith("__"):
                raise
            return getattr(module, name)

    def forward(self, *args, **kwargs):
        """The model's forward (outputs as the model gives them)."""
        with torch.inference_mode():
            return self.module(*args, **kwargs)

    def generate(self, *args, **kwargs):
        """The model's ``generate``: on the fast path when the arguments allow it (see
        ``_generate.py``), else the model's own. Timings land in ``last_generation``."""
        max_out = self._config.max_out_tokens
        if self._decoder is not None:
            request = fast_request(self.module, args, kwargs)
            if not isinstance(request, str):
                out, self.last_generation = run_fast(self._decoder, request, max_out_tokens=max_out, steps=self._steps)
                return out
            if request not in self._fallback_logged:
                self._fallback_logged.add(request)
                logger.info(
                    "init_inference: generate runs the model's own generate for %s (the fast path serves "
                    "greedy decoding and sampling with temperature / top_k / top_p)",
                    request,
                )
        out, self.last_generation = run_model_generate(self.module, args, kwargs, max_out_tokens=max_out)
        return out


def init_inference(model: nn.Module, config: str | os.PathLike | dict | None = None, **kwargs: Any) -> InferenceEngine:
    """Prepare ``model`` for inference and return the engine (DeepSpeed's call).

    ``config`` (a dict or a JSON file) and keyword arguments take DeepSpeed's inference keys
    (``dtype``, ``tensor_parallel={"tp_size": N}``, ``replace_with_kernel_inject``,
    ``checkpoint``, ``injection_policy``, ``max_out_tokens``...); keyword arguments win.
    The steps are in [Note: inference setup order]. With ``tp_size`` > 1 every rank of
    the job calls this with the same model and gets its shard; ranks must then be given
    the same inputs.
    """
    from shardwise.accelerator import get_accelerator
    from shardwise.inference import _sharding

    cfg = inference_config(config, **kwargs)
    model.eval()
    model.requires_grad_(False)
    comm = None
    if cfg.tp_size > 1 or cfg.tp_group is not None:
        comm = _sharding.tensor_comm(cfg.tp_size, cfg.tp_group)
    if comm is not None and comm.world_size > 1:
        _sharding.shard_model(model, comm, _sharding.inference_policy(model, cfg.injection_policy))
    device = get_accelerator().device()
    float_dtype = (
        cfg.dtype if cfg.dtype.is_floating_point else (torch.float16 if device.type == "cuda" else torch.float32)
    )
    if cfg.checkpoint is not None:
        from shardwise.inference._loading import load_checkpoint

        load_checkpoint(model, cfg.checkpoint, base_dir=cfg.base_dir, dtype=float_dtype)  # checks for meta left
    else:
        _check_materialised(model)
    if cfg.ep_size > 1:
        from shardwise.moe._autoep import split_for_inference

        split_for_inference(model, cfg.ep_size, tp=cfg.tp_size)
    model.to(device=device, dtype=float_dtype)
    int8_report = None
    if cfg.int8_weights:
        int8_report = _int8(model, float_dtype)
    decoder = None
    if cfg.replace_with_kernel_inject:
        from shardwise.inference._fast import build_decoder

        if int8_report is not None and int8_report.get("kernel_layers"):
            why = "the fast decoder fuses float or weight-only int8 weights, not ZeroQuant's int8 kernel layers"
        else:
            decoder, why = build_decoder(model)
        if decoder is None:
            logger.warning(
                "init_inference: replace_with_kernel_inject: %s; generation runs the model's own "
                "forward (correct, not faster)",
                why,
            )
    steps = _decode_graphs(cfg, device, decoder, comm.world_size if comm is not None else 1)
    _sharding.log_placement(model, comm.world_size if comm is not None else 1, cfg.dtype)
    return InferenceEngine(model, cfg, comm=comm, decoder=decoder, int8_report=int8_report, steps=steps)


def _decode_graphs(cfg: InferenceConfig, device: torch.device, decoder, tp: int):
    """The CUDA-graph decode steps ([Note: decode graphs]) when ``enable_cuda_graph`` asks
    for them or leaves the choice (None) and they can run; an explicit request that cannot
    run is refused."""
    from shardwise.inference._graphs import StaticSteps

    wanted = cfg.enable_cuda_graph
    if wanted is False:
        return None
    problem = None
    if device.type != "cuda":
        problem = f"it needs a CUDA device and this process runs on {device.type}"
    elif not cfg.replace_with_kernel_inject:
        problem = (
            "it captures the fast path's decode step; set replace_with_kernel_inject=True (the model's own "
            "generate grows its cache every step)"
        )
    elif decoder is None:
        problem = "this model has no fast decoder (see the replace_with_kernel_inject warning above)"
    elif tp > 1:
        problem = f"tensor-parallel decode steps (tp_size={tp}) are not captured; use tp_size=1 or leave it unset"
    elif cfg.ep_size > 1:
        problem = (
            f"expert-parallel decode steps (moe.ep_size={cfg.ep_size}) are not captured (their all-reduce would "
            "have to be captured with them); use ep_size=1 or leave it unset"
        )
    if problem is None:
        return StaticSteps(decoder, graph=True)
    if wanted:
        raise ConfigError(f"enable_cuda_graph=True: {problem}")
    return None


def _int8(model: nn.Module, float_dtype: torch.dtype) -> dict:
    """Step 4 of [Note: inference setup order]. A model compressed by ``init_compression``
    or ``zeroquant`` has its ZeroQuant layers put on int8 kernels ([Note: int8 kernel
    arithmetic]) and its other layers left as the compression config chose; in any other
    model the linear layers store int8 weights (the output head excepted)."""
    from shardwise.compression._layers import CompressedLinear

    if any(isinstance(m, CompressedLinear) for m in model.modules()):
        from shardwise.inference._int8_kernels import pack_int8_layers

        report = pack_int8_layers(model)
        return {**report, "kernel_layers": report["layers"]}
    from shardwise.inference._quant import quantize_linears

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return quantize_linears(model, dtype=float_dtype, skip=(head,) if head is not None else ())


def _check_materialised(model: nn.Module) -> None:
    meta = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise ValueError(
            f"init_inference: the model was built on the meta device and {len(meta)} tensor(s) have no "
            f"values ({', '.join(meta[:5])}{'...' if len(meta) > 5 else ''}); pass checkpoint= (a "
            "safetensors directory, a checkpoint JSON or a shardwise checkpoint) to fill them"
        )
