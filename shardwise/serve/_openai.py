"""OpenAI's request and response shapes for ``/v1/completions`` and ``/v1/chat/completions``:
parsing with precise 400 errors, incremental detokenizing with stop strings, and the JSON of
responses and streamed chunks. No HTTP here (that is ``_http.py``), no engine (``_api.py``).

[Note: incremental detokenizing]
Each new token re-decodes the whole generated sequence and emits the text past what was
already emitted, so tokenizers whose pieces merge (byte-level BPE, word joiners) give the same
text streamed as at once. Text that could still become a stop string (a suffix equal to a stop
string's prefix) or that ends in an incomplete UTF-8 character (U+FFFD) is held back until the
next token decides it; the end of the request releases what is held. A stop string found ends
the text just before it (OpenAI leaves it out) and the front end cancels the request.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from shardwise.serve._api import SamplingParams

MAX_N = 128
"""The most choices one request may ask for."""


class RequestError(Exception):
    """A request the server refuses: ``status`` and OpenAI's error fields."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code

    @property
    def type(self) -> str:
        return {401: "authentication_error", 404: "invalid_request_error", 503: "server_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )

    def body(self) -> dict:
        return error_body(str(self), type_=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass
class GenerationRequest:
    """One parsed request: what to generate and how to answer."""

    chat: bool
    model: str | None
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    max_tokens: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    sampling: dict = field(default_factory=dict)
    """SamplingParams fields other than max_tokens and seed."""
    seed: int | None = None

    def params(self, index: int, max_tokens: int) -> SamplingParams:
        """The engine's parameters for choice ``index`` (seeds ``seed + index``)."""
        seed = None if self.seed is None else self.seed + index
        return SamplingParams(max_tokens=max_tokens, seed=seed, **self.sampling)


def parse_request(body, *, chat: bool) -> GenerationRequest:
    """Validate a decoded JSON body; raise :class:`RequestError` (400) naming the field.
    Unknown fields are ignored, as vLLM does."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    model = _typed(body, "model", str)
    request = GenerationRequest(chat=chat, model=model)
    if chat:
        request.messages = _messages(body)
        newer = _typed(body, "max_completion_tokens", int)
        request.max_tokens = _typed(body, "max_tokens", int) if newer is None else newer
    else:
        request.prompt = _prompt(body)
        # OpenAI's default is 16; an explicit null asks for all that fits (vLLM)
        request.max_tokens = _typed(body, "max_tokens", int, default=None if "max_tokens" in body else 16)
    if request.max_tokens is not None and request.max_tokens < 1:
        raise RequestError(f"max_tokens must be at least 1, got {request.max_tokens}", param="max_tokens")
    request.n = _typed(body, "n", int, default=1)
    if not 1 <= request.n <= MAX_N:
        raise RequestError(f"n must be between 1 and {MAX_N}, got {request.n}", param="n")
    request.stop = _stop(body)
    request.stream = _typed(body, "stream", bool, default=False)
    options = _typed(body, "stream_options", dict) or {}
    request.include_usage = bool(options.get("include_usage", False))
    request.seed = _typed(body, "seed", int)
    if body.get("logprobs") not in (None, False) or body.get("echo"):
        raise RequestError("logprobs and echo are not supported", param="logprobs")
    temperature = _number(body, "temperature", 1.0)
    top_p = _number(body, "top_p", 1.0)
    top_k = _typed(body, "top_k", int, default=0)
    top_k = 0 if top_k == -1 else top_k  # vLLM's "no limit"
    stop_ids = _typed(body, "stop_token_ids", list) or []
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in stop_ids):
        raise RequestError("stop_token_ids must be a list of integers", param="stop_token_ids")
    request.sampling = dict(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        stop_token_ids=tuple(stop_ids),
        ignore_eos=_typed(body, "ignore_eos", bool, default=False),
    )
    try:  # the engine's own checks, before anything is submitted
        request.params(0, request.max_tokens or 1)
    except ValueError as error:
        raise RequestError(str(error)) from None
    return request


def _typed(body: dict, name: str, kind: type, default=None):
    value = body.get(name)
    if value is None:
        return default
    wrong = not isinstance(value, kind) or (kind is int and isinstance(value, bool))
    if wrong:
        raise RequestError(f"{name} must be of type {kind.__name__}, got {type(value).__name__}", param=name)
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{name} must be a number, got {type(value).__name__}", param=name)
    return float(value)


def _prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            return _prompt({"prompt": prompt[0]})
        raise RequestError("one prompt per request: a string or a list of token ids", param="prompt")
    raise RequestError("prompt must be a string or a non-empty list of token ids", param="prompt")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError("each message needs a string role", param="messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text is served
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise RequestError("only text content parts are supported", param="messages")
            message["content"] = "".join(str(p.get("text", "")) for p in content)
        elif content is not None and not isinstance(content, str):
            raise RequestError("message content must be a string or a list of text parts", param="messages")
    return messages


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("stop must be a non-empty string or a list of them", param="stop")
    return stops


class IncrementalDetokenizer:
    """Text of one choice as its tokens arrive (see [Note: incremental detokenizing])."""

    def __init__(self, tokenizer, stop: list[str] = ()):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.token_ids: list[int] = []
        self.text = ""
        """The text emitted so far."""
        self.stopped = False
        """A stop string appeared; no more text comes."""

    def add(self, token_id: int) -> str:
        """Take one token; return the newly safe text (maybe empty)."""
        if self.stopped:
            return ""
        self.token_ids.append(token_id)
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cut = self._stop_position(full)
        if cut is not None:
            self.stopped = True
            return self._emit(full[:cut])
        return self._emit(full[: len(full) - self._held(full)])

    def finish(self) -> str:
        """The request ended: release the text held back."""
        if self.stopped or not self.token_ids:
            return ""
        return self._emit(self.tokenizer.decode(self.token_ids, skip_special_tokens=True))

    def _stop_position(self, full: str) -> int | None:
        longest = max((len(s) for s in self.stop), default=0)
        start = max(0, len(self.text) - longest + 1)
        found = [i for i in (full.find(s, start) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _held(self, full: str) -> int:
        held = 1 if full.endswith("\ufffd") else 0
        for s in self.stop:
            for size in range(min(len(s) - 1, len(full)), held, -1):
                if full.endswith(s[:size]):
                    held = size
                    break
        return held

    def _emit(self, upto: str) -> str:
        if len(upto) <= len(self.text):
            return ""
        new = upto[len(self.text) :]
        self.text = upto
        return new


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def response(request_id: str, model: str, chat: bool, choices: list[tuple[str, str]], usage_: dict) -> dict:
    """The whole answer: ``choices`` are (text, finish_reason) in index order."""
    out = []
    for index, (text, reason) in enumerate(choices):
        choice = {"index": index, "logprobs": None, "finish_reason": reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        out.append(choice)
    kind = "chat.completion" if chat else "text_completion"
    return {
        "id": request_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": out,
        "usage": usage_,
    }


def chunk(request_id: str, model: str, chat: bool, index: int, *, text=None, reason=None, role=False) -> dict:
    """One streamed piece of choice ``index``: new text, its end (``reason``) or, for chat,
    the opening role delta."""
    if chat:
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}
        kind = "text_completion"
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": [choice]}


def usage_chunk(request_id: str, model: str, chat: bool, usage_: dict) -> dict:
    """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {
        "id": request_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": usage_,
    }


def sse(payload) -> str:
    """One server-sent event (``[DONE]`` is sent as is)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"
