"""Engines in processes of their own behind one front end (``shardwise serve
--engine-own-process``; MII's ``replica_num``, vLLM's ``--data-parallel-size``).

[Note: serving replicas]
:class:`ReplicaSet` implements [Note: the serving engine interface] over ``R`` replica
processes (``python -m shardwise.serve._replicas``), each with its own copy of the model and
its own engine, built from the :class:`~shardwise.serve._launch.EngineSpec` (so a replica
may itself be tensor-parallel and start its own followers; replica ``i`` then uses GPUs
``i * N .. i * N + N - 1``). With ``R = 1`` it only moves the engine out of the HTTP
process: uvicorn, JSON and detokenizing no longer share a GIL with the model's forward. The
front end holds one socket pair per replica (a ``multiprocessing`` connection: pickled
tuples) and one reader thread per replica:

- ``submit`` checks what the front end can check (the length against ``max_model_len``; the
  requests a replica holds against its capacity, ``max_queue + max_num_seqs``, else
  ``QueueFull``), picks the live replica with the fewest unfinished requests (ties in turn),
  sends ``("submit", key, prompt_ids, params)`` and returns at once: no round trip. A replica
  whose engine still refuses (its queue counts requests its loop has not admitted yet) ends
  that request with an error event naming the refusal;
- a replica subscribes to each request's stream and sends the events of one engine step
  together, ``("events", [(key, token_id, finished, finish_reason, error), ...])`` (the
  engine's ``on_step``), which the reader thread hands to the streams;
- ``cancel`` sends ``("cancel", key)``; ``metrics`` asks every live replica and sums the
  counters; ``kv_cache_usage_perc`` is the mean over the live replicas (each one's fraction
  of its own pool, and the pools are equal);
- ``shutdown`` sends ``("shutdown",)``: each replica drains, stops its followers, and exits.

A replica that dies (its socket closes) fails the requests it held with an error and gets no
new ones; the others keep serving; once none is left, ``failed`` says why (``/health`` answers
503). A replica whose front end dies sees its socket close, shuts down and exits.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
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
"""How long the front end waits for a live replica's answer to a metrics query."""
_EXIT_S = 60


@dataclass(eq=False)
class _Replica:
    index: int
    process: subprocess.Popen
    conn: Connection
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    streams: dict[str, RequestStream] = field(default_factory=dict)
    """The unfinished requests it holds, by request id (their key on the wire)."""
    metrics_reply: list = field(default_factory=list)
    metrics_ready: threading.Event = field(default_factory=threading.Event)
    last_metrics: EngineMetrics = field(default_factory=EngineMetrics)
    info: dict = field(default_factory=dict)
    """The replica's ``ready`` message: ``max_model_len``, ``capacity`` (requests it holds at
    most: running and waiting) and its followers' ``pids``."""
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

    @property
    def failed(self) -> str | None:
        """Why the set stopped serving (every replica ended), or None while one serves."""
        with self._lock:
            dead = [r.dead for r in self.replicas]
        return None if any(d is None for d in dead) else "; ".join(dead)

    # -- the interface -----------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        check_length(prompt_ids, params, self.max_model_len)
        key = f"req-{next(self._ids)}"
        with self._lock:
            replica = self._least_loaded()
            if replica is None:
                stream = RequestStream(key, lambda _: None)
                stream.put(TokenEvent(None, True, "error", "every replica has ended"))
                return stream
            if len(replica.streams) >= replica.info["capacity"]:
                raise QueueFull(f"{len(replica.streams)} requests are running or waiting; retry later")
            stream = RequestStream(key, lambda _: self._cancel(replica, key))
            replica.streams[key] = stream
            replica.served += 1
        try:
            replica.send(("submit", key, list(prompt_ids), params))
        except OSError as error:
            self._died(replica, f"replica {replica.index}: {error}")  # fails the stream
        return stream

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
        """The live replica holding the fewest requests (ties in turn); the caller holds ``_lock``."""
        live = [r for r in self.replicas if r.dead is None]
        if not live:
            return None
        turn = next(self._turn)
        return min(live, key=lambda r: (len(r.streams), (r.index - turn) % len(self.replicas)))

    def _cancel(self, replica: _Replica, key: str) -> None:
        try:
            replica.send(("cancel", key))
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
                case ("events", batch):
                    self._dispatch(replica, batch)
                case ("metrics", metrics):
                    replica.metrics_reply.append(metrics)
                    replica.metrics_ready.set()
        code = replica.process.poll()
        self._died(replica, f"replica {replica.index} ended" + (f" (exit code {code})" if code is not None else ""))

    def _dispatch(self, replica: _Replica, batch: list[tuple]) -> None:
        """Hand one step's events to their streams (outside the lock: subscribers run here)."""
        deliveries = []
        with self._lock:
            streams = replica.streams
            for key, token_id, finished, reason, error in batch:
                stream = streams.pop(key, None) if finished else streams.get(key)
                if stream is not None:
                    deliveries.append((stream, TokenEvent(token_id, finished, reason, error)))
        for stream, event in deliveries:
            stream.put(event)

    def _died(self, replica: _Replica, why: str) -> None:
        """Fail what ``replica`` held; it gets no new requests."""
        with self._lock:
            if replica.dead is not None:
                return
            replica.dead = why
            streams, replica.streams = replica.streams, {}
        logger.error("%s; its %d request(s) fail, the other replicas keep serving", why, len(streams))
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
        launched = launch(spec, in_process=True)  # the engine runs here, not in yet another replica
    except Exception as error:  # noqa: BLE001 - the front end reports it
        conn.send(("failed", f"{type(error).__name__}: {error}"))
        raise
    engine = launched.engine
    if launched.followers:  # a tensor-parallel engine that failed is a dead replica: end, so the front end sees it
        threading.Thread(target=_exit_when_failed, args=(engine,), name="replica-watch", daemon=True).start()
    info = {"max_model_len": engine.max_model_len, "capacity": spec.max_queue + engine.max_num_seqs}
    conn.send(("ready", {**info, "pids": launched.follower_pids}))
    _ReplicaServer(engine, conn).run()
    launched.close()
    return 0


def _exit_when_failed(engine) -> None:
    while engine.failed is None:
        time.sleep(0.5)
    logger.error("the engine failed (%s); this replica ends", engine.failed)
    os._exit(1)


class _ReplicaServer:
    """The replica's side of the connection: this thread reads the front end's messages; the
    engine's subscribers collect events in ``outbox``, and whoever ends a step (the engine's
    thread, through ``on_step``; this thread after each message) sends what was collected as
    one message."""

    def __init__(self, engine, conn: Connection):
        self.engine, self.conn = engine, conn
        self.send_lock = threading.Lock()
        """Held from taking the outbox to sending it, so batches go out in order."""
        self.outbox: collections.deque = collections.deque()
        self.streams: dict[str, RequestStream] = {}
        engine.on_step(self.flush)

    def flush(self) -> None:
        """Send the events collected so far as one ``("events", ...)`` message."""
        with self.send_lock:
            batch = []
            while self.outbox:
                batch.append(self.outbox.popleft())
            if not batch:
                return
            try:
                self.conn.send(("events", batch))
            except OSError:
                pass  # the front end is gone; run() returns and the engine shuts down

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
                case ("submit", key, prompt_ids, params):
                    self._submit(key, prompt_ids, params)
                case ("cancel", key):
                    stream = self.streams.get(key)
                    if stream is not None:
                        stream.cancel()
                case ("metrics",):
                    self.send(("metrics", self.engine.metrics()))
                case ("shutdown",):
                    return
            self.flush()

    def _submit(self, key: str, prompt_ids: list[int], params: SamplingParams) -> None:
        try:
            stream = self.engine.submit(prompt_ids, params)
        except (QueueFull, ValueError) as error:
            self.outbox.append((key, None, True, "error", f"{type(error).__name__}: {error}"))
            return
        self.streams[key] = stream
        stream.subscribe(functools.partial(self._collect, key))

    def _collect(self, key: str, event: TokenEvent) -> None:
        """A stream's subscriber (the engine's thread): keep the event for the next flush."""
        if event.finished:
            self.streams.pop(key, None)
        self.outbox.append((key, event.token_id, event.finished, event.finish_reason, event.error))


if __name__ == "__main__":
    sys.exit(_replica_main(sys.argv[1:]))
