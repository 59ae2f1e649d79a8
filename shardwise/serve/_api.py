"""What the HTTP front end and an engine agree on: sampling parameters, a request's stream of
tokens, the engine's counters, and a reference engine that serves one request at a time.

[Note: the serving engine interface]
An engine takes token ids and :class:`SamplingParams` (``submit``) and returns a
:class:`RequestStream`: an iterator of :class:`TokenEvent`, one per generated token and a last
one with ``finished=True`` and the reason (``"stop"``: an end-of-sequence or stop token,
``"length"``: ``max_tokens`` or the model's length, ``"abort"``: cancelled, ``"error"``: this
request failed, with its message). Everything text-level (detokenizing, stop strings, ``n``
choices, chat templates) belongs to the front end, which cancels a request once a stop string
appears; cancelling frees whatever the request held at once. ``submit`` raises
:class:`QueueFull` when the engine is at capacity (HTTP 503) and ``ValueError`` for a prompt
that cannot be served (HTTP 400). ``metrics()`` returns :class:`EngineMetrics`. ``failed``
is why the engine stopped serving (its process or its tensor-parallel group died; ``/health``
then answers 503 with it), None while it serves. Engines run their own thread; all methods
are thread-safe. The engines of this package also take ``on_step(fn)`` (called after each
step's events were put; a replica process sends them as one message) and say how many
requests run at once (``max_num_seqs``).
"""

from __future__ import annotations

import inspect
import itertools
import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The engine holds as many requests as it accepts; retry later (HTTP 503)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen (OpenAI's names; ``temperature=0`` is greedy)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 keeps every token."""
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


@dataclass(frozen=True)
class TokenEvent:
    """One generated token (``token_id``), or the end of the request (``finished``)."""

    token_id: int | None
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class EngineMetrics:
    """Counters for ``/metrics`` (Prometheus names ``shardwise:<field>``)."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage_perc: float = 0.0
    """Fraction (0-1) of the KV cache's blocks in use."""
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    """Tokens drawn, an end-of-sequence or stop token included (computed, though not sent;
    vLLM counts the same way): a request that stops counts one more than the tokens it sent."""
    time_to_first_token_seconds: list[float] = field(default_factory=list)
    """Every request's time to its first token so far (the front end keeps the histogram)."""


class RequestStream:
    """The tokens of one submitted request, as they are generated (see
    [Note: the serving engine interface]). Iterate it, or ``subscribe`` a callback (one
    consumer per stream); ``cancel()`` ends it early."""

    def __init__(self, request_id: str, canceller):
        self.request_id = request_id
        self._events: queue.Queue[TokenEvent] = queue.Queue()
        self._cancel = canceller
        self._lock = threading.Lock()
        self._listener = None
        self._subscribed = False
        self.finished = False

    def put(self, event: TokenEvent) -> None:
        """Called by the engine: queue ``event``, or hand it to the subscribed callback."""
        with self._lock:
            if not self._subscribed:
                self._events.put(event)
                return
            self._deliver(event)

    def subscribe(self, fn) -> None:
        """Call ``fn(event)`` for every event of this stream, exactly once each and in order:
        at once (in this thread) for the events put so far, then from the thread that puts
        each later one, usually the engine's. ``fn`` must be quick, must not raise (an
        exception is logged and that event is lost to it) and must not call back into this
        stream or its engine. The stream is not iterable afterwards."""
        with self._lock:  # a concurrent put waits until the events before it are delivered
            if self._subscribed:
                raise RuntimeError(f"request {self.request_id}: the stream already has a subscriber")
            self._subscribed, self._listener = True, fn
            while not self._events.empty():
                self._deliver(self._events.get_nowait())

    def _deliver(self, event: TokenEvent) -> None:
        """Hand one event to the subscriber (the caller holds ``_lock``)."""
        if self._listener is None:
            return  # the stream finished before: nothing more is expected
        try:
            self._listener(event)
        except Exception:  # noqa: BLE001 - the engine thread must not fail for a subscriber's bug
            logger.exception("request %s: the stream's subscriber failed", self.request_id)
        if event.finished:
            self.finished, self._listener = True, None

    def cancel(self) -> None:
        self._cancel(self.request_id)

    def __iter__(self) -> Iterator[TokenEvent]:
        return self.events()

    def events(self, timeout: float | None = None) -> Iterator[TokenEvent]:
        """The events as they come; ``TimeoutError`` when none arrives for ``timeout`` seconds."""
        if self._subscribed:
            raise RuntimeError(f"request {self.request_id}: a subscriber takes this stream's events")
        while not self.finished:
            try:
                event = self._events.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"request {self.request_id}: no token for {timeout} s") from None
            self.finished = event.finished
            yield event


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from ``logits`` [vocab] (fp32 arithmetic): greedy at temperature 0, else
    temperature, then top-k, then top-p (nucleus) filtering and a draw from ``generator``."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        ordered, order = torch.sort(probs, descending=True)
        outside = ordered.cumsum(0) - ordered > params.top_p  # keep the smallest prefix reaching top_p
        probs = probs.scatter(0, order, ordered.masked_fill(outside, 0))
    return int(torch.multinomial(probs if generator is None else probs.to(generator.device), 1, generator=generator))


class SequentialEngine:
    """The reference engine: one request at a time through the model's own forward with its
    KV cache (``past_key_values``), in submission order. Correct and simple; the batching
    engine is tested against it."""

    max_num_seqs = 1
    failed = None
    """It never stops serving: a request's failure ends that request only."""

    def __init__(self, model, tokenizer, *, max_model_len: int | None = None, max_queue: int = 64):
        self.model = model.eval()
        self.tokenizer = tokenizer
        config = model.config
        self.max_model_len = max_model_len or getattr(config, "max_position_embeddings", 2048)
        self.eos_token_ids = _eos_ids(model, tokenizer)
        # transformers 5.x renamed past_key_values to cache
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._queue: queue.Queue = queue.Queue(max_queue)
        self._live: set[str] = set()
        """Requests submitted and not finished: only these can be cancelled."""
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._metrics = EngineMetrics()
        self._ids = itertools.count()
        self._running = 0
        self._step_listeners: list = []
        self._thread = threading.Thread(target=self._loop, name="shardwise-serve", daemon=True)
        self._stop = False
        self._thread.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        check_length(prompt_ids, params, self.max_model_len)
        stream = RequestStream(f"req-{next(self._ids)}", self._cancel_request)
        with self._lock:
            self._live.add(stream.request_id)
        try:
            self._queue.put_nowait((stream, list(prompt_ids), params, time.perf_counter()))
        except queue.Full:
            with self._lock:
                self._live.discard(stream.request_id)
            raise QueueFull(f"{self._queue.maxsize} requests are waiting; retry later") from None
        return stream

    def _cancel_request(self, request_id: str) -> None:
        """Mark a waiting or running request; a cancel after its end is a no-op, so that
        nothing is remembered for a request that will never look again."""
        with self._lock:
            if request_id in self._live:
                self._cancelled.add(request_id)

    def metrics(self) -> EngineMetrics:
        with self._lock:
            m = self._metrics
            return EngineMetrics(
                num_requests_running=self._running,
                num_requests_waiting=self._queue.qsize(),
                kv_cache_usage_perc=0.0,
                prompt_tokens_total=m.prompt_tokens_total,
                generation_tokens_total=m.generation_tokens_total,
                time_to_first_token_seconds=list(m.time_to_first_token_seconds),
            )

    def on_step(self, fn) -> None:
        """Call ``fn()`` in the engine's thread after each event it puts (one token is its step)."""
        self._step_listeners.append(fn)

    def _stepped(self) -> None:
        for fn in self._step_listeners:
            fn()

    def shutdown(self) -> None:
        self._stop = True
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop:
            item = self._queue.get()
            if item is None:
                break
            with self._lock:
                self._running = 1
            stream = item[0]
            try:
                end = self._serve(*item)
            except Exception as error:  # noqa: BLE001 - one request's failure ends that request only
                end = TokenEvent(None, True, "error", f"{type(error).__name__}: {error}")
            with self._lock:
                self._running = 0
                self._live.discard(stream.request_id)
                self._cancelled.discard(stream.request_id)
            stream.put(end)  # after the bookkeeping: a caller that saw the end sees it done
            self._stepped()

    @torch.no_grad()
    def _serve(self, stream: RequestStream, prompt: list[int], params: SamplingParams, submitted: float) -> TokenEvent:
        """Generate ``stream``'s tokens; return its last event (not put yet). Counts every
        token drawn, an end-of-sequence or stop token included (as the batching engine does)."""
        generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        device = next(self.model.parameters()).device
        ids = torch.tensor([prompt], device=device)
        past, produced = None, 0
        with self._lock:
            self._metrics.prompt_tokens_total += len(prompt)
        limit = min(params.max_tokens, self.max_model_len - len(prompt))
        while True:
            with self._lock:
                if stream.request_id in self._cancelled:
                    return TokenEvent(None, True, "abort")
            out = self.model(input_ids=ids, use_cache=True, **{self._cache_arg: past})
            past = out[self._cache_arg if self._cache_arg in out else "past_key_values"]
            token = sample(out.logits[0, -1], params, generator)
            produced += 1
            with self._lock:
                self._metrics.generation_tokens_total += 1
                if produced == 1:
                    self._metrics.time_to_first_token_seconds.append(time.perf_counter() - submitted)
            stop = (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids
            if stop:
                return TokenEvent(None, True, "stop")
            stream.put(TokenEvent(token))
            self._stepped()
            if produced >= limit:
                return TokenEvent(None, True, "length")
            ids = torch.tensor([[token]], device=device)


def check_length(prompt_ids: list[int], params: SamplingParams, max_model_len: int) -> None:
    """A prompt that cannot be served: empty, or with ``max_tokens`` beyond the model's length."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if len(prompt_ids) + params.max_tokens > max_model_len:
        raise ValueError(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{len(prompt_ids)} and max_tokens asks for {params.max_tokens} more"
        )


def _eos_ids(model, tokenizer) -> set[int]:
    ids = getattr(model.generation_config, "eos_token_id", None) if hasattr(model, "generation_config") else None
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return set()
    return {int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])}
