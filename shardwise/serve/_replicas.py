"""Several engines behind one front end (MII's ``replica_num``, vLLM's
``--data-parallel-size``).

[Note: serving replicas]
:class:`ReplicaSet` implements [Note: the serving engine interface] over ``R`` replica
processes (``python -m shardwise.serve._replicas``), each with its own copy of the model and
its own engine, built from the :class:`~shardwise.serve._launch.EngineSpec` (so a replica
may itself be tensor-parallel and start its own followers; replica ``i`` then uses GPUs
``i * N .. i * N + N - 1``). The front end holds one socket pair per replica (a
``multiprocessing`` connection: pickled tuples) and one reader thread per replica:

- ``submit`` picks the live replica with the fewest unfinished requests (ties in turn),
  sends ``("submit", id, prompt_ids, params)`` and waits for its ``("ack", id, refusal)``,
  so a full queue (``QueueFull``) or a prompt the replica refuses (``ValueError``) is raised
  to the caller as with one engine; the replica streams ``("event", id, TokenEvent)`` back;
- ``cancel`` sends ``("cancel", id)``; ``metrics`` asks every live replica and sums the
  counters; ``kv_cache_usage_perc`` is the mean over the live replicas (each one's fraction
  of its own pool, and the pools are equal);
- ``shutdown`` sends ``("shutdown",)``: each replica drains, stops its followers, and exits.

A replica that dies (its socket closes) fails the requests it held with an error and gets no
new ones; the others keep serving. A replica whose front end dies sees its socket close,
shuts down and exits.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from shardwise.serve._api import EngineMetrics, QueueFull, RequestStream, SamplingParams, TokenEvent, check_length
from shardwise.serve._launch import EngineSpec

logger = logging.getLogger("shardwise.serve")

_START_S = 600
_REPLY_S = 30
"""How long the front end waits for a live replica's answer to a submit or a metrics query."""
_EXIT_S = 60


@dataclass(eq=False)
class _Replica:
    index: int
    process: subprocess.Popen
    conn: Connection
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    streams: dict[str, RequestStream] = field(default_factory=dict)
    acks: dict[str, list] = field(default_factory=dict)
    """Request id -> [event, refusal] of a submit awaiting its ack."""
    metrics_reply: list = field(default_factory=list)
    metrics_ready: threading.Event = field(default_factory=threading.Event)
    last_metrics: EngineMetrics = field(default_factory=EngineMetrics)
    info: dict = field(default_factory=dict)
    """The replica's ``ready`` message: ``max_model_len`` and its followers' ``pids``."""
    dead: str | None = None
    served: int = 0

    def send(self, message: tuple) -> None:
        with self.send_lock:
            self.conn.send(message)


class ReplicaSet:
    """``replicas`` engines of ``spec`` in their own processes, behind one engine interface
    (see [Note: serving replicas]). ``tokenizer`` is the front end's (for the HTTP layer)."""

    def __init__(self, spec: EngineSpec, tokenizer, *, replicas: int):
        if replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {replicas}")
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._metrics_lock = threading.Lock()
        self._ids = itertools.count()
        self._turn = itertools.count()
        self.replicas = [self._start(spec, index) for index in range(replicas)]
        try:
            for replica in self.replicas:
                self._wait_ready(replica)
        except BaseException:
            self._kill_all()
            raise
        self.max_model_len = min(r.info["max_model_len"] for r in self.replicas)
        for replica in self.replicas:
            threading.Thread(target=self._read, args=(replica,), name=f"replica-{replica.index}", daemon=True).start()

    @property
    def served(self) -> list[int]:
        """Requests each replica was given."""
        return [r.served for r in self.replicas]

    @property
    def pids(self) -> list[int]:
        """Every process this set started: the replicas and their followers."""
        return [pid for r in self.replicas for pid in (r.process.pid, *r.info.get("pids", ()))]

    # -- the interface -----------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        check_length(prompt_ids, params, self.max_model_len)
        request_id = f"req-{next(self._ids)}"
        while True:
            replica = self._least_loaded()
            if replica is None:
                stream = RequestStream(request_id, lambda _: None)
                stream.put(TokenEvent(None, True, "error", "every replica has ended"))
                return stream
            stream, refusal = self._submit_to(replica, request_id, list(prompt_ids), params)
            if refusal is None:
                return stream  # it may have finished already: the reader no longer holds it
            kind, message = refusal
            if kind == "QueueFull":
                raise QueueFull(message)
            if kind == "ValueError":
                raise ValueError(message)
            # the replica died meanwhile: try the next one

    def metrics(self) -> EngineMetrics:
        with self._metrics_lock:
            live = [r for r in self.replicas if r.dead is None]
            for replica in live:
                replica.metrics_ready.clear()
                try:
                    replica.send(("metrics",))
                except OSError:
                    continue
            for replica in live:
                if replica.metrics_ready.wait(_REPLY_S) and replica.metrics_reply:
                    replica.last_metrics = replica.metrics_reply.pop()
        return _combine([r.last_metrics for r in self.replicas], [r.dead is None for r in self.replicas])

    def shutdown(self) -> None:
        """Every replica drains its requests and exits; those that do not are killed."""
        for replica in self.replicas:
            if replica.dead is None:
                try:
                    replica.send(("shutdown",))
                except OSError:
                    pass
        deadline = time.monotonic() + _EXIT_S
        for replica in self.replicas:
            try:
                replica.process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                logger.warning("replica %d did not end; killing it", replica.index)
                replica.process.kill()
                replica.process.wait()

    # -- the replicas --------------------------------------------------------------------

    def _start(self, spec: EngineSpec, index: int) -> _Replica:
        ours, theirs = socket.socketpair()
        own = dataclasses.replace(spec, first_device=spec.first_device + index * spec.tensor_parallel_size)
        process = subprocess.Popen(
            [sys.executable, "-m", "shardwise.serve._replicas", own.to_json(), str(index), str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a terminal's Ctrl-C reaches the front end only, which stops them in order
        )
        theirs.close()
        return _Replica(index, process, Connection(ours.detach()))

    def _wait_ready(self, replica: _Replica) -> None:
        deadline = time.monotonic() + _START_S
        while not replica.conn.poll(0.2):
            if replica.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"replica {replica.index} did not start (exit code {replica.process.poll()})")
        kind, info = replica.conn.recv()
        if kind != "ready":
            raise RuntimeError(f"replica {replica.index} failed to start: {info}")
        replica.info = info

    def _least_loaded(self) -> _Replica | None:
        with self._lock:
            live = [r for r in self.replicas if r.dead is None]
            if not live:
                return None
            turn = next(self._turn)
            return min(live, key=lambda r: (len(r.streams), (r.index - turn) % len(self.replicas)))

    def _submit_to(self, replica: _Replica, request_id: str, prompt_ids, params):
        """(the request's stream, None) once ``replica`` took it, else (None, (kind, message))."""
        ack = [threading.Event(), None]
        stream = RequestStream(request_id, lambda rid: self._cancel(replica, rid))
        with self._lock:
            if replica.dead is not None:
                return None, ("dead", replica.dead)
            replica.streams[request_id] = stream
            replica.acks[request_id] = ack
        try:
            replica.send(("submit", request_id, prompt_ids, params))
        except OSError as error:
            self._died(replica, f"replica {replica.index}: {error}")
        if not ack[0].wait(_REPLY_S):
            self._died(replica, f"replica {replica.index} did not answer a submit within {_REPLY_S} s")
        with self._lock:
            replica.acks.pop(request_id, None)
            if ack[1] is not None:
                replica.streams.pop(request_id, None)
            else:
                replica.served += 1
        return (stream, None) if ack[1] is None else (None, ack[1])

    def _cancel(self, replica: _Replica, request_id: str) -> None:
        try:
            replica.send(("cancel", request_id))
        except OSError:
            pass  # the replica is gone; its requests end with an error

    def _read(self, replica: _Replica) -> None:
        """The replica's messages, until its socket closes (see [Note: serving replicas])."""
        while True:
            try:
                message = replica.conn.recv()
            except (EOFError, OSError):
                break
            match message:
                case ("ack", request_id, refusal):
                    with self._lock:
                        ack = replica.acks.get(request_id)
                    if ack is not None:
                        ack[1] = refusal
                        ack[0].set()
                case ("event", request_id, event):
                    with self._lock:
                        streams = replica.streams
                        stream = streams.pop(request_id, None) if event.finished else streams.get(request_id)
                    if stream is not None:
                        stream.put(event)
                case ("metrics", metrics):
                    replica.metrics_reply.append(metrics)
                    replica.metrics_ready.set()
        code = replica.process.poll()
        self._died(replica, f"replica {replica.index} ended" + (f" (exit code {code})" if code is not None else ""))

    def _died(self, replica: _Replica, why: str) -> None:
        """Fail what ``replica`` held; it gets no new requests."""
        with self._lock:
            if replica.dead is not None:
                return
            replica.dead = why
            streams, replica.streams = replica.streams, {}
            acks, replica.acks = replica.acks, {}
        logger.error("%s; its %d request(s) fail, the other replicas keep serving", why, len(streams))
        for request_id, ack in acks.items():
            streams.pop(request_id, None)
            ack[1] = ("dead", why)
            ack[0].set()
        for stream in streams.values():
            stream.put(TokenEvent(None, True, "error", why))
        replica.metrics_ready.set()

    def _kill_all(self) -> None:
        for replica in self.replicas:
            replica.process.kill()
            replica.process.wait()


def _combine(metrics: list[EngineMetrics], live: list[bool]) -> EngineMetrics:
    """Counters summed; running and waiting of the live replicas; cache use their mean."""
    usage = [m.kv_cache_usage_perc for m, alive in zip(metrics, live) if alive]
    return EngineMetrics(
        num_requests_running=sum(m.num_requests_running for m, alive in zip(metrics, live) if alive),
        num_requests_waiting=sum(m.num_requests_waiting for m, alive in zip(metrics, live) if alive),
        kv_cache_usage_perc=sum(usage) / len(usage) if usage else 0.0,
        prompt_tokens_total=sum(m.prompt_tokens_total for m in metrics),
        generation_tokens_total=sum(m.generation_tokens_total for m in metrics),
        time_to_first_token_seconds=[t for m in metrics for t in m.time_to_first_token_seconds],
    )


def _replica_main(argv: list[str]) -> int:
    """A replica process: build the engine, say ``ready``, serve the front end's messages."""
    from shardwise.serve._launch import exit_with_parent, launch

    spec, index, fd = EngineSpec.from_json(argv[0]), int(argv[1]), int(argv[2])
    logging.basicConfig(level="INFO", format=f"%(levelname)s replica {index}: %(message)s")
    exit_with_parent()
    conn = Connection(fd)
    try:
        launched = launch(spec)
    except Exception as error:  # noqa: BLE001 - the front end reports it
        conn.send(("failed", f"{type(error).__name__}: {error}"))
        raise
    engine = launched.engine
    if launched.followers:  # a tensor-parallel engine that failed is a dead replica: end, so the front end sees it
        threading.Thread(target=_exit_when_failed, args=(engine,), name="replica-watch", daemon=True).start()
    conn.send(("ready", {"max_model_len": engine.max_model_len, "pids": launched.follower_pids}))
    _ReplicaServer(engine, conn).run()
    launched.close()
    return 0


def _exit_when_failed(engine) -> None:
    while engine.failed is None:
        time.sleep(0.5)
    logger.error("the engine failed (%s); this replica ends", engine.failed)
    os._exit(1)


class _ReplicaServer:
    """The replica's side of the connection: one thread reads, one thread per request sends
    its events."""

    def __init__(self, engine, conn: Connection):
        self.engine, self.conn = engine, conn
        self.send_lock = threading.Lock()
        self.streams: dict[str, RequestStream] = {}

    def send(self, message: tuple) -> None:
        with self.send_lock:
            self.conn.send(message)

    def run(self) -> None:
        """Serve until ``shutdown`` or until the front end's socket closes."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                return
            match message:
                case ("submit", request_id, prompt_ids, params):
                    self._submit(request_id, prompt_ids, params)
                case ("cancel", request_id):
                    stream = self.streams.get(request_id)
                    if stream is not None:
                        stream.cancel()
                case ("metrics",):
                    self.send(("metrics", self.engine.metrics()))
                case ("shutdown",):
                    return

    def _submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        try:
            stream = self.engine.submit(prompt_ids, params)
        except (QueueFull, ValueError) as error:
            self.send(("ack", request_id, (type(error).__name__, str(error))))
            return
        self.streams[request_id] = stream
        self.send(("ack", request_id, None))
        threading.Thread(target=self._pump, args=(request_id, stream), daemon=True).start()

    def _pump(self, request_id: str, stream: RequestStream) -> None:
        try:
            for event in stream:
                self.send(("event", request_id, event))
        except OSError:
            pass  # the front end is gone; run() returns and the engine shuts down
        finally:
            self.streams.pop(request_id, None)


if __name__ == "__main__":
    sys.exit(_replica_main(sys.argv[1:]))
