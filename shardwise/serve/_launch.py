"""Starting an engine for ``shardwise serve``: in this process, or tensor-parallel over this
process and ``N - 1`` follower processes it starts on this machine.

[Note: serving processes]
With ``--tensor-parallel-size N`` the serving process is rank 0 of an ``N``-rank process
group (gloo on CPU, NCCL on GPUs, rank ``r`` on GPU ``first_device + r``) whose rendezvous
is a TCP store on a free loopback port; it starts the followers (``python -m
shardwise.serve._launch``) with the :class:`EngineSpec`, and every rank loads the model
from the directory and keeps its shard ([Note: tensor-parallel serving]). A follower ends
when rank 0's engine stops (its ``STOP`` message), when a collective fails (rank 0 died:
its sockets close), or when its parent process is gone (checked every second), so a server
killed outright leaves no follower behind. Followers run in their own session, so a
terminal's Ctrl-C reaches the server alone, which stops them in order. :meth:`Launched.close`
waits for the followers and kills those still alive after a grace period.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta

logger = logging.getLogger("shardwise.serve")

_STARTUP_S = 600
"""How long the ranks wait for each other to load the model and join the group."""
_FOLLOWER_EXIT_S = 30


@dataclass(frozen=True)
class EngineSpec:
    """What an engine is built from; plain data, so it travels to follower and replica
    processes as JSON."""

    model: str
    """A local Hugging Face model directory."""
    dtype: str = "auto"
    engine: str = "batched"
    max_model_len: int | None = None
    max_queue: int = 64
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    """The token budget per forward (None: the batching engine's default for the device)."""
    block_size: int | None = None
    num_gpu_blocks_override: int | None = None
    """KV-cache blocks in the pool (vLLM's name; on a CPU too)."""
    enable_prefix_caching: bool | None = None
    enforce_eager: bool = False
    """Run every step eagerly (no CUDA graphs; tensor-parallel engines always do)."""
    tensor_parallel_size: int = 1
    first_device: int = 0
    """The GPU of rank 0 (rank ``r`` uses ``first_device + r``); unused on CPU."""
    timeout_s: float = 60.0
    """Deadline of every collective of a tensor-parallel engine."""

    def batching(self) -> dict:
        """The :class:`~shardwise.serve._batching.BatchingConfig` fields this spec sets."""
        fields = {
            "max_num_seqs": self.max_num_seqs,
            "token_budget": self.max_num_batched_tokens,
            "block_size": self.block_size,
            "num_blocks": self.num_gpu_blocks_override,
            "prefix_caching": self.enable_prefix_caching,
            "enforce_eager": self.enforce_eager or None,
        }
        return {name: value for name, value in fields.items() if value is not None}

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EngineSpec:
        return cls(**json.loads(text))


@dataclass
class Launched:
    """A running engine and the follower processes it started."""

    engine: object
    followers: list[subprocess.Popen] = field(default_factory=list)

    @property
    def follower_pids(self) -> list[int]:
        return [p.pid for p in self.followers]

    def close(self) -> None:
        """Shut the engine down (its followers get ``STOP``), then wait for the followers
        and kill those still alive after a grace period."""
        self.engine.shutdown()
        failed = bool(self.followers) and self.engine.failed is not None
        deadline = time.monotonic() + (1 if failed else _FOLLOWER_EXIT_S)
        for process in self.followers:
            try:
                process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel follower %d did not end; killing it", process.pid)
                process.kill()
                process.wait()
        if self.followers and not failed:
            import torch.distributed as dist

            dist.destroy_process_group()


def launch(spec: EngineSpec, *, replicas: int = 1, in_process: bool = True) -> Launched:
    """The engine of ``spec`` in this process (rank 0), with its followers when
    ``tensor_parallel_size`` > 1 (see [Note: serving processes]); with ``replicas`` > 1, or
    with ``in_process=False`` and ``tensor_parallel_size`` 1, a
    :class:`~shardwise.serve._replicas.ReplicaSet` of that many engines in their own
    processes (see [Note: serving replicas]). A replica process launches its own engine in
    process (else each replica would start another replica, and none would become ready)."""
    from shardwise.serve._cli import build_engine, load_model

    if replicas > 1 or (not in_process and spec.tensor_parallel_size == 1):
        import transformers

        from shardwise.serve._replicas import ReplicaSet

        tokenizer = transformers.AutoTokenizer.from_pretrained(spec.model)
        return Launched(ReplicaSet(spec, tokenizer, replicas=replicas))
    tp = spec.tensor_parallel_size
    if tp == 1:
        _use_device(spec.first_device)
        model, tokenizer = load_model(spec.model, spec.dtype)
        engine = build_engine(
            spec.engine,
            model,
            tokenizer,
            max_model_len=spec.max_model_len,
            max_queue=spec.max_queue,
            **spec.batching(),
        )
        return Launched(engine)
    if spec.engine != "batched":
        raise ValueError(f"--tensor-parallel-size {tp} needs the batched engine, not --engine {spec.engine}")
    port = _free_port()
    followers = [
        subprocess.Popen(
            [sys.executable, "-m", "shardwise.serve._launch", spec.to_json(), str(rank), str(port)],
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a terminal's Ctrl-C reaches the server only, which stops them in order
        )
        for rank in range(1, tp)
    ]
    try:
        engine = _tensor_parallel_rank(spec, 0, port)
    except BaseException:
        for process in followers:
            process.kill()
            process.wait()
        raise
    logger.info("tensor-parallel engine over %d ranks; follower pids %s", tp, [p.pid for p in followers])
    return Launched(engine, followers)


def _tensor_parallel_rank(spec: EngineSpec, rank: int, port: int):
    """Join the group as ``rank``, load the model, run :func:`serve_tensor_parallel`."""
    import torch.distributed as dist

    from shardwise.serve._cli import load_model
    from shardwise.serve._tp import TensorParallelOptions, serve_tensor_parallel

    cuda = _use_device(spec.first_device + rank)
    model, tokenizer = load_model(spec.model, spec.dtype)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=spec.tensor_parallel_size,
        timeout=timedelta(seconds=_STARTUP_S),
    )
    kwargs = {"max_model_len": spec.max_model_len, "max_queue": spec.max_queue, **spec.batching()}
    options = TensorParallelOptions(timeout_s=spec.timeout_s, heartbeat_s=min(5.0, spec.timeout_s / 4))
    return serve_tensor_parallel(model, tokenizer, options=options, **kwargs)


def _use_device(index: int) -> bool:
    """Make GPU ``index`` this process's device when there are GPUs; whether there are."""
    import torch

    if not torch.cuda.is_available():
        return False
    torch.cuda.set_device(index)
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_with_parent() -> None:
    """End this process (status 1) once its parent is gone: a daemon thread checks every second."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(1)

    threading.Thread(target=watch, name="shardwise-parent-watch", daemon=True).start()


def _follower_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardwise.serve._launch")
    parser.add_argument("spec", help="the EngineSpec as JSON")
    parser.add_argument("rank", type=int)
    parser.add_argument("port", type=int, help="the rendezvous port on 127.0.0.1")
    args = parser.parse_args(argv)
    logging.basicConfig(level="INFO", format=f"%(levelname)s follower {args.rank}: %(message)s")
    exit_with_parent()
    try:
        _tensor_parallel_rank(EngineSpec.from_json(args.spec), args.rank, args.port)
    except Exception:
        logger.exception("tensor-parallel follower %d failed", args.rank)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # a failed collective may still be in flight: no process-group teardown
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_follower_main(sys.argv[1:]))
