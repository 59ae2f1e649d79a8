"""The OpenAI-compatible HTTP server over an engine (see [Note: the serving engine interface]):
``create_app(engine, served_model_name=...)`` is a FastAPI app with ``/health`` (503 once the
engine stopped serving), ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` and
``/metrics``. Needs the ``serve`` extra.

[Note: engine streams in the event loop]
The front end subscribes to each engine stream (``RequestStream.subscribe``): the engine's
thread hands every event to ``loop.call_soon_threadsafe``, which moves it into one asyncio
queue per HTTP request, so the event loop never blocks, the ``n`` choices of a request merge
in arrival order, and no thread is spent per request (a thousand open streams cost a
thousand queue entries, not a thousand threads). Whatever ends the HTTP side early (a stop
string, a disconnected client, an error) cancels the request's unfinished streams at once,
which frees their cache.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from shardwise.serve import _openai as oai
from shardwise.serve._api import QueueFull
from shardwise.serve._metrics import engine_registry

logger = logging.getLogger(__name__)

_POLL_S = 0.25
"""How often a non-streamed request checks that its client is still there."""


class _Choices:
    """The ``n`` engine streams of one HTTP request, merged (see [Note: engine streams in the
    event loop]), with one detokenizer each."""

    def __init__(self, engine, tokenizer, request: oai.GenerationRequest, prompt_ids: list[int], max_tokens: int):
        self.streams = []
        self.queue: asyncio.Queue = asyncio.Queue()
        self.texts = [oai.IncrementalDetokenizer(tokenizer, request.stop) for _ in range(request.n)]
        self.reasons: list[str | None] = [None] * request.n
        self.completion_tokens = 0
        loop = asyncio.get_running_loop()
        try:
            for index in range(request.n):
                self.streams.append(engine.submit(prompt_ids, request.params(index, max_tokens)))
        except BaseException:
            self.cancel()
            raise
        for index, stream in enumerate(self.streams):
            stream.subscribe(functools.partial(self._deliver, loop, index))

    def _deliver(self, loop, index: int, event) -> None:
        """A stream's subscriber, called in the engine's thread."""
        try:
            loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))
        except RuntimeError:  # the event loop closed: nobody listens any more
            pass

    async def arrived(self) -> list:
        """The ``(index, event)`` pairs that arrived: waits for one, then takes all queued
        (one wake-up and one socket write for what came while the loop was busy)."""
        arrived = [await self.queue.get()]
        while not self.queue.empty():
            arrived.append(self.queue.get_nowait())
        return arrived

    @property
    def done(self) -> bool:
        return all(r is not None for r in self.reasons)

    def cancel(self) -> None:
        for index, stream in enumerate(self.streams):
            if self.reasons[index] is None and not stream.finished:
                stream.cancel()

    def take(self, index: int, event) -> tuple[str, str | None]:
        """Apply one event; return (new text, finish reason or None). An engine error raises
        :class:`RuntimeError` with its message."""
        if self.reasons[index] is not None:
            return "", None  # tokens after a stop string, before the cancel lands
        text, reason = "", None
        if event.token_id is not None:
            self.completion_tokens += 1
            text = self.texts[index].add(event.token_id)
            if self.texts[index].stopped:
                self.streams[index].cancel()
                reason = "stop"
        if event.finished and reason is None:
            if event.finish_reason == "error":
                raise RuntimeError(event.error or "the engine failed this request")
            text += self.texts[index].finish()
            reason = "length" if event.finish_reason == "length" else "stop"
        self.reasons[index] = reason
        return text, reason


def create_app(engine, *, served_model_name: str, api_key: str | None = None) -> FastAPI:
    """The HTTP server for ``engine`` (an object with the engine interface and a ``tokenizer``)
    answering as model ``served_model_name``; with ``api_key``, the ``/v1`` routes require
    ``Authorization: Bearer <api_key>``. The app's shutdown shuts the engine down."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="shardwise", lifespan=lifespan)
    registry = engine_registry(engine)

    @app.exception_handler(oai.RequestError)
    async def refused(request: Request, error: oai.RequestError):
        headers = {"Retry-After": "1"} if error.status == 503 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    async def authorize(request: Request) -> None:
        """The ``/v1`` routes' key check (a dependency: a middleware would hide disconnects;
        async, as a plain function would take a worker thread per request)."""
        if api_key is not None and request.headers.get("authorization", "") != f"Bearer {api_key}":
            raise oai.RequestError("missing or wrong API key", status=401, code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    @app.get("/health")
    async def health():
        failed = engine.failed
        if failed is not None:  # the engine's process or group died: it serves nothing any more
            return PlainTextResponse(f"the engine stopped: {failed}", status_code=503)
        return PlainTextResponse("")

    @v1.get("/models")
    async def models():
        card = {"id": served_model_name, "object": "model", "created": int(time.time()), "owned_by": "shardwise"}
        card["max_model_len"] = getattr(engine, "max_model_len", None)
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @v1.post("/completions")
    async def completions(request: Request):
        return await _generate(engine, served_model_name, request, chat=False)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(engine, served_model_name, request, chat=True)

    app.include_router(v1)
    return app


async def _generate(engine, served_model_name: str, request: Request, chat: bool):
    """Parse, submit and answer one completion or chat request."""
    tokenizer = engine.tokenizer
    parsed = oai.parse_request(await _json(request), chat=chat)
    if parsed.model is not None and parsed.model != served_model_name:
        raise oai.RequestError(
            f"The model `{parsed.model}` does not exist.", status=404, param="model", code="model_not_found"
        )
    prompt_ids = _prompt_ids(engine, parsed)
    max_tokens = parsed.max_tokens or max(1, getattr(engine, "max_model_len", 0) - len(prompt_ids))
    try:
        choices = _Choices(engine, tokenizer, parsed, prompt_ids, max_tokens)
    except QueueFull as error:
        raise oai.RequestError(str(error), status=503) from None
    except ValueError as error:
        raise oai.RequestError(str(error), param="max_tokens" if "max_tokens" in str(error) else None) from None
    answer = _Answer(oai.new_id(chat), served_model_name, chat, len(prompt_ids))
    if parsed.stream:
        return _EventStream(answer.stream(choices, parsed.include_usage), choices)
    return await answer.whole(choices, request)


class _EventStream(StreamingResponse):
    """Server-sent events that cancel the request's unfinished streams however the response
    ends, also when the client leaves before the first event is made."""

    def __init__(self, content, choices: _Choices):
        super().__init__(content, media_type="text/event-stream")
        self._choices = choices

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._choices.cancel()


async def _json(request: Request):
    try:
        return json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as error:
        raise oai.RequestError(f"the body is not valid JSON: {error}") from None


def _prompt_ids(engine, parsed: oai.GenerationRequest) -> list[int]:
    tokenizer = engine.tokenizer
    if not parsed.chat:
        if isinstance(parsed.prompt, str):
            return list(tokenizer.encode(parsed.prompt))
        config = getattr(getattr(engine, "model", None), "config", None)
        vocab = getattr(config, "vocab_size", None) or len(tokenizer)
        bad = [i for i in parsed.prompt if not 0 <= i < vocab]
        if bad:
            raise oai.RequestError(f"token ids {bad[:8]} are outside the vocabulary (0-{vocab - 1})", param="prompt")
        return list(parsed.prompt)
    if not getattr(tokenizer, "chat_template", None):
        raise oai.RequestError("this model's tokenizer has no chat template; use /v1/completions", param="messages")
    try:
        text = tokenizer.apply_chat_template(parsed.messages, add_generation_prompt=True, tokenize=False)
    except Exception as error:  # noqa: BLE001 - a template that rejects these messages is a bad request
        raise oai.RequestError(f"the chat template failed: {error}", param="messages") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


class _Answer:
    """Turns merged choices into OpenAI's response or its stream of chunks."""

    def __init__(self, request_id: str, model: str, chat: bool, prompt_tokens: int):
        self.id, self.model, self.chat, self.prompt_tokens = request_id, model, chat, prompt_tokens

    async def whole(self, choices: _Choices, request: Request):
        texts = [""] * len(choices.reasons)
        clock = asyncio.get_running_loop().time
        check_at = clock() + _POLL_S
        try:
            while not choices.done:
                try:
                    for index, event in await asyncio.wait_for(choices.arrived(), _POLL_S):
                        text, _ = choices.take(index, event)
                        texts[index] += text
                except asyncio.TimeoutError:
                    pass
                if clock() >= check_at:  # tokens may come faster than the poll: check by time
                    if await request.is_disconnected():
                        return JSONResponse({}, status_code=499)
                    check_at = clock() + _POLL_S
        except RuntimeError as error:
            body = oai.error_body(str(error), type_="server_error", code="engine_error")
            return JSONResponse(body, status_code=500)
        finally:
            choices.cancel()
        usage = oai.usage(self.prompt_tokens, choices.completion_tokens)
        return oai.response(self.id, self.model, self.chat, list(zip(texts, choices.reasons)), usage)

    async def stream(self, choices: _Choices, include_usage: bool):
        try:
            if self.chat:
                for index in range(len(choices.reasons)):
                    yield oai.sse(oai.chunk(self.id, self.model, True, index, role=True))
            while not choices.done:
                events, error = [], None
                for index, event in await choices.arrived():
                    try:
                        text, reason = choices.take(index, event)
                    except RuntimeError as failure:
                        error = failure
                        break
                    if text:
                        events.append(oai.sse(oai.chunk(self.id, self.model, self.chat, index, text=text)))
                    if reason is not None:
                        events.append(oai.sse(oai.chunk(self.id, self.model, self.chat, index, reason=reason)))
                if events:
                    yield "".join(events)  # one event per token still, in one write
                if error is not None:
                    raise error
            if include_usage:
                usage = oai.usage(self.prompt_tokens, choices.completion_tokens)
                yield oai.sse(oai.usage_chunk(self.id, self.model, self.chat, usage))
        except RuntimeError as error:  # the response cancels the other choices (_EventStream)
            yield oai.sse(oai.error_body(str(error), type_="server_error", code="engine_error"))
        yield oai.sse("[DONE]")
