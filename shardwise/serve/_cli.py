"""``shardwise serve MODEL_DIR``: an OpenAI-compatible HTTP server for a Hugging Face model
directory (vLLM's flag names). SIGTERM stops accepting connections, lets running requests
finish and shuts the engine down."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys

logger = logging.getLogger("shardwise.serve")

ENGINES = {
    "batched": "shardwise.serve._batching:BatchingEngine",
    "sequential": "shardwise.serve._api:SequentialEngine",
}
"""Engine classes by ``--engine`` name, imported when chosen."""

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_GRACEFUL_S = 30
"""How long SIGTERM waits for running requests before closing them."""


def require_serve_extra() -> None:
    """Raise ``ImportError`` naming the extra when FastAPI, uvicorn or prometheus-client is missing."""
    missing = [name for name in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"shardwise serve needs {', '.join(missing)}: pip install 'shardwise[serve]'")


def engine_class(name: str):
    """The engine class for ``--engine name``."""
    module_name, _, class_name = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def build_engine(name: str, model, tokenizer, *, max_model_len: int | None, max_queue: int, **batching):
    """An engine of kind ``name``; ``batching`` (:class:`~shardwise.serve._batching.BatchingConfig`
    fields, None meaning the default) goes to the batching engine. The sequential engine runs
    one request at a time and never captures graphs: it logs that the fields are ignored."""
    batching = {field: value for field, value in batching.items() if value is not None}
    if name == "batched":
        from shardwise.serve._paged import FAMILIES

        if model.config.model_type not in FAMILIES:
            logger.warning(
                "the batching engine runs %s models; serving model_type %r with the sequential engine",
                ", ".join(FAMILIES),
                model.config.model_type,
            )
            name = "sequential"
    cls = engine_class(name)
    kwargs = {"max_model_len": max_model_len, "max_queue": max_queue}
    if name == "batched":
        from shardwise.serve._batching import BatchingConfig

        kwargs["config"] = BatchingConfig(**batching)
    elif set(batching) - {"enforce_eager"}:
        logger.warning("%s are ignored: %s runs one request at a time", ", ".join(sorted(batching)), cls.__name__)
    return cls(model, tokenizer, **kwargs)


def load_model(model_dir: str, dtype: str):
    """Model (eval mode, on the accelerator when there is one) and tokenizer from a local
    directory; ``dtype="auto"`` keeps the checkpoint's dtype."""
    import torch
    import transformers

    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
    if torch.cuda.is_available():
        model = model.to("cuda")
    return model.eval(), tokenizer


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardwise serve", description=__doc__)
    p.add_argument("model", help="a local Hugging Face model directory (config, weights, tokenizer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the name clients use (default: MODEL)")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + generated tokens (default: the model's)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="ranks the model is split over (processes on this machine)"
    )
    p.add_argument(
        "--data-parallel-size", type=int, default=1, help="engine replicas, each a process with its own model copy"
    )
    p.add_argument(
        "--engine-own-process",
        action="store_true",
        help="run the engine in a process of its own, as vLLM does (default: in the HTTP server's process, "
        "measured faster on 2 shared cores; tensor-parallel engines always run there)",
    )
    p.add_argument("--dtype", default="auto", choices=_DTYPES, help="auto: the checkpoint's own dtype")
    p.add_argument("--engine", default="batched", choices=sorted(ENGINES))
    p.add_argument("--max-num-seqs", type=int, default=None, help="most requests in the running batch")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens per forward, decodes plus prompt chunks (default: 256 on a CPU, 2048 on a GPU)",
    )
    p.add_argument("--block-size", type=int, default=None, help="token slots per KV-cache block (default 16)")
    p.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        help="KV-cache blocks in the pool, on a CPU too (default: max-num-seqs sequences of max-model-len)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="share the KV-cache blocks of prompt prefixes computed before (default: on)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every step eagerly (default: on a GPU the batching engine replays its decode steps as CUDA graphs)",
    )
    p.add_argument("--max-queue", type=int, default=64, help="most requests waiting; more get HTTP 503")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def engine_spec(args):
    """The :class:`~shardwise.serve._launch.EngineSpec` of ``shardwise serve``'s parsed flags."""
    from shardwise.serve._launch import EngineSpec

    return EngineSpec(
        model=args.model,
        dtype=args.dtype,
        engine=args.engine,
        max_model_len=args.max_model_len,
        max_queue=args.max_queue,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        enable_prefix_caching=args.enable_prefix_caching,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        require_serve_extra()
    except ImportError as error:
        print(f"shardwise serve: {error}", file=sys.stderr)
        return 2
    if args.tensor_parallel_size < 1 or args.data_parallel_size < 1:
        print("shardwise serve: --tensor-parallel-size and --data-parallel-size must be at least 1", file=sys.stderr)
        return 2
    import uvicorn

    from shardwise.serve._http import create_app
    from shardwise.serve._launch import launch

    spec = engine_spec(args)
    launched = launch(spec, replicas=args.data_parallel_size, in_process=not args.engine_own_process)
    engine = launched.engine
    name = args.served_model_name or args.model
    app = create_app(engine, served_model_name=name, api_key=args.api_key)
    logger.info(
        "starting %s as %r with %s on http://%s:%d/v1", args.model, name, type(engine).__name__, args.host, args.port
    )
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=_GRACEFUL_S
    )
    try:
        uvicorn.Server(config).run()
    finally:
        launched.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
