"""The batching engine: continuous batching over a paged KV cache with chunked prefill.

One thread runs the loop: take new requests and cancellations, let the scheduler pick the
step's chunks ([Note: continuous batching]), run them in one forward ([Note: the paged
forward]), draw the next token of every sequence whose chunk reached its end, and finish the
sequences that stop (end of sequence, a stop token, ``max_tokens``, the model's length), whose
blocks return to the pool at once. It serves the interface of [Note: the serving engine
interface]; greedy output equals the model's ``generate``.
"""

from __future__ import annotations

import dataclasses
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
from shardwise.serve._decode_graphs import DecodeBuckets
from shardwise.serve._paged import PagedDecoder, check_family
from shardwise.serve._scheduler import Scheduler, Sequence


@dataclass
class _Request:
    stream: RequestStream
    params: SamplingParams
    generator: torch.Generator | None
    submitted: float
    first_token: float | None = None


CPU_TOKEN_BUDGET = 256
"""Tokens per forward by default on a CPU."""
GPU_TOKEN_BUDGET = 2048
"""Tokens per forward by default on a GPU (vLLM's default ``max_num_batched_tokens``)."""


@dataclass(frozen=True, kw_only=True)
class BatchingConfig:
    """How a batching engine schedules and caches: its batch, its token budget, its KV-cache
    pool, and whether decode steps replay CUDA graphs."""

    max_num_seqs: int = 16
    """Sequences in the running batch at most."""
    token_budget: int | None = None
    """Tokens per forward (decodes plus prompt chunks; vLLM's ``max_num_batched_tokens``).
    None: ``CPU_TOKEN_BUDGET`` on a CPU, ``GPU_TOKEN_BUDGET`` on a GPU (see ``budget_on``)."""
    block_size: int = 16
    """Token slots per KV-cache block."""
    num_blocks: int | None = None
    """Blocks in the pool (None: enough for ``max_num_seqs`` sequences of ``max_model_len``)."""
    prefix_caching: bool = True
    """Reuse the blocks of prompt prefixes computed before (see [Note: prefix caching])."""
    enforce_eager: bool = False
    """Run every step eagerly. By default, on a GPU, decode-only steps are padded to buckets and
    replayed as CUDA graphs (see [Note: decode graphs across batches]); ``shardwise serve
    --enforce-eager`` sets this, as in vLLM."""

    def __post_init__(self):
        for name in ("max_num_seqs", "token_budget", "block_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be positive (or None), got {self.num_blocks}")

    def budget_on(self, device: torch.device) -> int:
        """``token_budget`` with its default for ``device`` filled in. A CPU forward costs in
        proportion to its tokens, so a small budget keeps the running decodes' steps short
        while a long prompt is split; a GPU forward of a few hundred tokens costs what one
        token's does (measured on an H200: a 64-token budget made each output token 5.4x
        slower than no chunking), so its budget is thousands."""
        if self.token_budget is not None:
            return self.token_budget
        return GPU_TOKEN_BUDGET if device.type == "cuda" else CPU_TOKEN_BUDGET

    def pool_blocks(self, max_model_len: int) -> int:
        """``num_blocks`` with its default filled in; a pool that cannot hold one sequence of
        ``max_model_len`` is refused."""
        per_sequence = -(-max_model_len // self.block_size)
        num_blocks = self.num_blocks or self.max_num_seqs * per_sequence
        if per_sequence > num_blocks:
            raise ValueError(
                f"{num_blocks} blocks of {self.block_size} tokens cannot hold one sequence of max_model_len="
                f"{max_model_len}; give more blocks or a shorter max_model_len"
            )
        return num_blocks


class BatchingEngine:
    """Continuous batching for Llama-family models (see the module docstring).

    Args:
        model, tokenizer: a Hugging Face causal LM and its tokenizer (or None).
        max_model_len: longest prompt plus generation (default: the model's positions).
        max_queue: requests waiting beyond the running ones before ``submit`` raises
            :class:`QueueFull`.
        config: the batch, the budget, the pool and the CUDA-graph switch
            (:class:`BatchingConfig`; its fields are also taken as keywords,
            ``max_num_seqs=8``, and override ``config``'s).
        decoder: builds the decoder, ``decoder(model, num_blocks=, block_size=)``
            (default :class:`PagedDecoder`, with decode graphs on a GPU unless
            ``config.enforce_eager``; the tensor-parallel engine's sends each plan to
            its followers, ``_tp.py``, and runs eagerly). A decoder whose ``failed`` is set
            after an error stops the engine: every request held and every later one ends
            with that error.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_model_len: int | None = None,
        max_queue: int = 256,
        config: BatchingConfig | None = None,
        decoder: Callable | None = None,
        **config_fields,
    ):
        try:
            config = dataclasses.replace(config or BatchingConfig(), **config_fields)
        except TypeError as error:
            raise TypeError(f"BatchingEngine: {error}; its keywords are BatchingConfig's fields") from None
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config
        self.max_model_len = max_model_len or getattr(model.config, "max_position_embeddings", 2048)
        check_family(model, self.max_model_len)
        num_blocks = config.pool_blocks(self.max_model_len)
        self.allocator = BlockAllocator(num_blocks, config.block_size)
        cache = PrefixCache(self.allocator) if config.prefix_caching else None
        self.scheduler = Scheduler(
            self.allocator,
            max_num_seqs=config.max_num_seqs,
            token_budget=config.budget_on(next(model.parameters()).device),
            prefix_cache=cache,
        )
        if decoder is None:
            self.decoder = PagedDecoder(
                model, num_blocks=num_blocks, block_size=config.block_size, buckets=self._buckets(model)
            )
        else:
            self.decoder = decoder(model, num_blocks=num_blocks, block_size=config.block_size)
        self.eos_token_ids = _eos_ids(model, tokenizer)
        self.max_queue = max_queue
        self.max_num_seqs = config.max_num_seqs
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

    def _buckets(self, model) -> DecodeBuckets | None:
        """The decode buckets on a GPU unless ``enforce_eager`` (None: every step eager)."""
        if self.config.enforce_eager or not next(model.parameters()).is_cuda:
            return None
        return DecodeBuckets(
            max_rows=self.config.max_num_seqs, max_blocks=-(-self.max_model_len // self.config.block_size)
        )

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
        sequences = [chunk.sequence for chunk in chunks if chunk.samples]
        for sequence, token in zip(sequences, next_tokens(logits, [s.payload for s in sequences])):
            if isinstance(token, Exception):  # a sampling error fails this request only
                self._finish(sequence, "error", f"{type(token).__name__}: {token}")
            else:
                self._advance(sequence, token)

    def _advance(self, sequence: Sequence, token: int) -> None:
        request: _Request = sequence.payload
        params = request.params
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


def next_tokens(logits: torch.Tensor, requests: list[_Request]) -> list[int | Exception]:
    """Each row's next token: the greedy rows' in one ``argmax`` over the batch and one copy
    to the host (one device sync per step, not one per sequence), the sampled rows' one by
    one with their own parameters and generator (a seeded request draws what it would alone).
    A row whose sampling fails gets the exception instead of a token."""
    tokens: list[int | Exception] = [0] * len(requests)
    greedy = [i for i, request in enumerate(requests) if request.params.temperature == 0]
    if greedy:
        rows = logits if len(greedy) == len(requests) else logits[greedy]
        for i, token in zip(greedy, torch.argmax(rows, dim=-1).tolist()):
            tokens[i] = token
    for i, request in enumerate(requests):
        if request.params.temperature != 0:
            try:
                tokens[i] = sample(logits[i], request.params, request.generator)
            except Exception as error:  # noqa: BLE001 - reported for this row only
                tokens[i] = error
    return tokens
