"""The batching engine: continuous batching over a paged KV cache with chunked prefill.

One thread runs the loop: take new requests and cancellations, let the scheduler pick the
step's chunks ([Note: continuous batching]), run them in one forward ([Note: the paged
forward]), draw the next token of every sequence whose chunk reached its end, and finish the
sequences that stop (end of sequence, a stop token, ``max_tokens``, the model's length), whose
blocks return to the pool at once. It serves the interface of [Note: the serving engine
interface]; greedy output equals the model's ``generate``.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardwise.serve._api import (
    EngineMetrics,
    QueueFull,
    RequestStream,
    SamplingParams,
    TokenEvent,
    _eos_ids,
    check_length,
    sample,
)
from shardwise.serve._blocks import BlockAllocator, PrefixCache
from shardwise.serve._paged import PagedDecoder, check_family
from shardwise.serve._scheduler import Scheduler, Sequence


@dataclass
class _Request:
    stream: RequestStream
    params: SamplingParams
    generator: torch.Generator | None
    submitted: float
    first_token: float | None = None


@dataclass(frozen=True)
class PoolSizes:
    """The sizes a batching engine's scheduler and cache are built with (see ``pool_size``)."""

    max_model_len: int
    max_num_seqs: int
    token_budget: int
    block_size: int
    num_blocks: int


def pool_size(
    *, max_model_len: int, max_num_seqs: int = 16, token_budget: int = 256, block_size: int = 16, num_blocks=None
) -> PoolSizes:
    """The engine's sizes with their defaults filled in (``num_blocks``: enough for
    ``max_num_seqs`` sequences of ``max_model_len``); a pool that cannot hold one sequence is
    refused."""
    num_blocks = num_blocks or max_num_seqs * -(-max_model_len // block_size)
    if -(-max_model_len // block_size) > num_blocks:
        raise ValueError(
            f"{num_blocks} blocks of {block_size} tokens cannot hold one sequence of max_model_len="
            f"{max_model_len}; give more blocks or a shorter max_model_len"
        )
    return PoolSizes(max_model_len, max_num_seqs, token_budget, block_size, num_blocks)


class BatchingEngine:
    """Continuous batching for Llama-family models (see the module docstring).

    Args:
        model, tokenizer: a Hugging Face causal LM and its tokenizer (or None).
        max_model_len: longest prompt plus generation (default: the model's positions).
        max_queue: requests waiting beyond the running ones before ``submit`` raises
            :class:`QueueFull`.
        max_num_seqs: sequences in the running batch at most.
        token_budget: tokens per forward (decodes plus prompt chunks).
        block_size: token slots per KV-cache block.
        num_blocks: blocks in the pool (default: enough for ``max_num_seqs`` sequences of
            ``max_model_len``).
        prefix_caching: reuse the blocks of prompt prefixes computed before (see
            [Note: prefix caching]).
        decoder: builds the decoder, ``decoder(model, num_blocks=, block_size=)``
            (default :class:`PagedDecoder`; the tensor-parallel engine's sends each plan to
            its followers, ``_tp.py``). A decoder whose ``failed`` is set after an error
            stops the engine: every request held and every later one ends with that error.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_model_len: int | None = None,
        max_queue: int = 256,
        max_num_seqs: int = 16,
        token_budget: int = 256,
        block_size: int = 16,
        num_blocks: int | None = None,
        prefix_caching: bool = True,
        decoder: Callable | None = None,
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len or getattr(model.config, "max_position_embeddings", 2048)
        check_family(model, self.max_model_len)
        num_blocks = pool_size(
            max_model_len=self.max_model_len,
            max_num_seqs=max_num_seqs,
            token_budget=token_budget,
            block_size=block_size,
            num_blocks=num_blocks,
        ).num_blocks
        self.allocator = BlockAllocator(num_blocks, block_size)
        cache = PrefixCache(self.allocator) if prefix_caching else None
        self.scheduler = Scheduler(
            self.allocator, max_num_seqs=max_num_seqs, token_budget=token_budget, prefix_cache=cache
        )
        self.decoder = (decoder or PagedDecoder)(model, num_blocks=num_blocks, block_size=block_size)
        self.eos_token_ids = _eos_ids(model, tokenizer)
        self.max_queue = max_queue
        self.max_num_seqs = max_num_seqs
        self._step_listeners: list[Callable[[], None]] = []
        self._incoming: queue.Queue = queue.Queue()
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._metrics = EngineMetrics()
        self._ids = itertools.count()
        self._stopping = False
        self._failed: str | None = None
        """Why the engine stopped serving (its decoder failed), or None."""
        self._thread = threading.Thread(target=self._loop, name="shardwise-serve", daemon=True)
        self._thread.start()

    # -- the interface -----------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        check_length(prompt_ids, params, self.max_model_len)
        stream = RequestStream(f"req-{next(self._ids)}", self._cancel)
        generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        request = _Request(stream, params, generator, time.perf_counter())
        with self._lock:  # under the lock: a failure drains what came before it (_fail_all)
            if self._failed is not None:
                stream.put(TokenEvent(None, True, "error", self._failed))
                return stream
            waiting = self._incoming.qsize() + len(self.scheduler.waiting)
            if self._stopping or waiting >= self.max_queue:
                raise QueueFull(f"{waiting} requests are waiting; retry later")
            self._incoming.put(Sequence(stream.request_id, list(prompt_ids), params.max_tokens, payload=request))
        self._wake.set()
        return stream

    def _cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancelled.add(request_id)
        self._wake.set()

    def metrics(self) -> EngineMetrics:
        with self._lock:
            m = self._metrics
            return EngineMetrics(
                num_requests_running=len(self.scheduler.running),
                num_requests_waiting=len(self.scheduler.waiting) + self._incoming.qsize(),
                kv_cache_usage_perc=self.allocator.usage,
                prompt_tokens_total=m.prompt_tokens_total,
                generation_tokens_total=m.generation_tokens_total,
                time_to_first_token_seconds=list(m.time_to_first_token_seconds),
            )

    @property
    def failed(self) -> str | None:
        """Why the engine stopped serving (its decoder failed), or None while it serves."""
        return self._failed

    def on_step(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` in the engine's thread after each turn of its loop, once the events
        of that turn's step (and of its cancellations or failures) were put: a consumer that
        collects events from subscribers can send each step's events together."""
        self._step_listeners.append(fn)

    def shutdown(self) -> None:
        """Stop accepting, finish what runs, stop the loop."""
        with self._lock:
            self._stopping = True
        self._wake.set()
        self._thread.join(timeout=60)

    # -- the loop ------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while self._serve_once():
                self._stepped()
        except Exception as error:  # noqa: BLE001 - the decoder failed: end every request, refuse new ones
            with self._lock:
                self._failed = self.decoder.failed or f"{type(error).__name__}: {error}"
            self._fail_all(self._failed)
            self._stepped()
        else:
            self.decoder.close()

    def _stepped(self) -> None:
        for fn in self._step_listeners:
            fn()

    def _serve_once(self) -> bool:
        """One turn of the loop; False once stopping and idle. Raises when the decoder failed."""
        self._admit()
        if self.scheduler.idle:
            if self._stopping:
                return False
            self.decoder.idle()
            self._wake.wait(timeout=0.5)
            self._wake.clear()
            return True
        try:
            self._step()
        except Exception as error:  # noqa: BLE001 - fail the batch's requests, keep serving
            if self.decoder.failed is not None:
                raise
            self._fail_running(f"{type(error).__name__}: {error}")
        return True

    def _admit(self) -> None:
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
        while True:
            try:
                sequence = self._incoming.get_nowait()
            except queue.Empty:
                break
            with self._lock:
                self._metrics.prompt_tokens_total += len(sequence.prompt)
            self.scheduler.add(sequence)
        for sequence in [*self.scheduler.running, *self.scheduler.waiting]:
            if sequence.request_id in cancelled:
                self._finish(sequence, "abort")

    def _step(self) -> None:
        with self._lock:
            chunks = self.scheduler.schedule()
        if not chunks:
            return
        logits = self.decoder.forward(chunks)
        with self._lock:
            self.scheduler.complete(chunks)
        for chunk, row in zip([c for c in chunks if c.samples], logits):
            self._advance(chunk.sequence, row)

    def _advance(self, sequence: Sequence, logits: torch.Tensor) -> None:
        request: _Request = sequence.payload
        params = request.params
        try:
            token = sample(logits, params, request.generator)
        except Exception as error:  # noqa: BLE001 - a sampling error fails this request only
            self._finish(sequence, "error", f"{type(error).__name__}: {error}")
            return
        now = time.perf_counter()
        with self._lock:
            self._metrics.generation_tokens_total += 1
            if request.first_token is None:
                request.first_token = now
                self._metrics.time_to_first_token_seconds.append(now - request.submitted)
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            self._finish(sequence, "stop")
            return
        sequence.generated.append(token)
        request.stream.put(TokenEvent(token))
        if len(sequence.generated) >= params.max_tokens or sequence.length >= self.max_model_len:
            self._finish(sequence, "length")

    def _finish(self, sequence: Sequence, reason: str, error: str | None = None) -> None:
        with self._lock:
            self.scheduler.release(sequence)
        sequence.payload.stream.put(TokenEvent(None, True, reason, error))

    def _fail_running(self, message: str) -> None:
        for sequence in list(self.scheduler.running):
            self._finish(sequence, "error", message)

    def _fail_all(self, message: str) -> None:
        """Every request held or submitted before ``_failed`` was set ends with ``message``."""
        self._admit()
        for sequence in [*self.scheduler.running, *self.scheduler.waiting]:
            self._finish(sequence, "error", message)
