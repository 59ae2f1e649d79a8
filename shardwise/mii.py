"""DeepSpeed-MII's Python API over shardwise's serving engine: ``import shardwise.mii as mii``.

- ``mii.pipeline(model)`` loads a model in this process; ``pipe(prompts, max_new_tokens=...)``
  returns one :class:`Response` per prompt (all prompts are submitted at once, so the engine
  batches them). ``pipe.destroy()`` stops the engine.
- ``mii.serve(model, deployment_name=...)`` starts ``shardwise serve`` (the OpenAI-compatible
  HTTP server) in a subprocess on a free loopback port and returns a :class:`Client`;
  ``mii.client(deployment_name)`` finds it again from any process of this user;
  ``client.generate(prompts, streaming_fn=...)`` and ``client.terminate_server()``.

MII's generation keywords are taken (``max_new_tokens``, ``max_length``, ``do_sample``,
``temperature``, ``top_p`` (default 0.9), ``top_k``, ``ignore_eos``, ``return_full_text``);
others are refused by name. ``mii.serve(..., tensor_parallel=N, replica_num=R)`` runs ``R``
engines behind one server, each with its own model copy split over ``N`` processes of this
machine (``shardwise serve --tensor-parallel-size N --data-parallel-size R``);
``mii.pipeline`` runs in one process and refuses ``tensor_parallel`` above 1.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Client", "Response", "client", "pipeline", "serve"]

_GENERATE_KEYS = {
    "max_new_tokens",
    "max_length",
    "do_sample",
    "temperature",
    "top_p",
    "top_k",
    "ignore_eos",
    "return_full_text",
    "seed",
}
_START_TIMEOUT_S = 600


@dataclass
class Response:
    """One prompt's answer (MII's fields)."""

    generated_text: str
    prompt_length: int
    generated_length: int
    finish_reason: str
    """``"stop"`` (end of sequence) or ``"length"`` (``max_new_tokens`` / ``max_length``)."""

    def __str__(self) -> str:
        return self.generated_text

    __repr__ = __str__


def _check_generate_keys(kwargs: dict) -> None:
    unknown = sorted(set(kwargs) - _GENERATE_KEYS)
    if unknown:
        raise ValueError(f"unsupported generation arguments: {', '.join(unknown)}")


def _check_parallel(tensor_parallel: int, replica_num: int) -> None:
    if tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be at least 1, got {tensor_parallel}")
    if replica_num < 1:
        raise ValueError(f"replica_num must be at least 1, got {replica_num}")


def _sampling(kwargs: dict) -> dict:
    """OpenAI's sampling fields for MII's generation keywords."""
    greedy = not kwargs.get("do_sample", True)
    temperature = kwargs.get("temperature")
    return {
        "temperature": 0.0 if greedy else (1.0 if temperature is None else float(temperature)),
        "top_p": float(kwargs.get("top_p", 0.9)),
        "top_k": int(kwargs.get("top_k") or 0),
        "ignore_eos": bool(kwargs.get("ignore_eos", False)),
        "seed": kwargs.get("seed"),
    }


def _max_new_tokens(kwargs: dict, prompt_length: int, max_model_len: int) -> int:
    limit = min(kwargs.get("max_length") or max_model_len, max_model_len) - prompt_length
    return max(1, min(kwargs.get("max_new_tokens") or limit, limit))


class Pipeline:
    """A model in this process behind a serving engine (see :func:`pipeline`)."""

    def __init__(self, engine, max_length: int | None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_length = max_length or engine.max_model_len

    def __call__(self, prompts: str | list[str], **kwargs) -> list[Response]:
        """Generate for every prompt at once; one :class:`Response` per prompt, in order."""
        from shardwise.serve import SamplingParams

        _check_generate_keys(kwargs)
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        sampling = _sampling(kwargs)
        submitted = []
        try:
            for prompt in prompts:
                ids = list(self.tokenizer.encode(prompt))
                max_tokens = _max_new_tokens(kwargs, len(ids), self.max_length)
                stream = self.engine.submit(ids, SamplingParams(max_tokens=max_tokens, **sampling))
                submitted.append((prompt, ids, stream))
            return [self._collect(prompt, ids, stream, kwargs) for prompt, ids, stream in submitted]
        finally:  # a refused prompt or a failed one: the others stop too
            for _, _, stream in submitted:
                if not stream.finished:
                    stream.cancel()

    def _collect(self, prompt, ids, stream, kwargs) -> Response:
        tokens, reason = [], "length"
        for event in stream:
            if event.token_id is not None:
                tokens.append(event.token_id)
            if event.finished:
                if event.finish_reason == "error":
                    raise RuntimeError(f"generation failed: {event.error}")
                reason = event.finish_reason
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if kwargs.get("return_full_text"):
            text = prompt + text
        return Response(text, len(ids), len(tokens), reason)

    def destroy(self) -> None:
        """Stop the engine and free the model."""
        self.engine.shutdown()


def pipeline(
    model_name_or_path: str,
    *,
    max_length: int | None = None,
    all_rank_output: bool = False,
    tensor_parallel: int = 1,
    engine: str = "batched",
    dtype: str = "auto",
) -> Pipeline:
    """A non-persistent pipeline (MII's ``mii.pipeline``) for a local Hugging Face model
    directory: ``pipe(prompts, max_new_tokens=..., do_sample=...)`` returns
    :class:`Response` objects. ``max_length`` caps prompt + generated tokens;
    ``all_rank_output`` has no effect with one rank."""
    from shardwise.serve._cli import build_engine, load_model

    if tensor_parallel != 1:
        raise ValueError(
            f"mii.pipeline runs in this process: tensor_parallel={tensor_parallel} is served by "
            f"mii.serve(..., tensor_parallel={tensor_parallel})"
        )
    model, tokenizer = load_model(model_name_or_path, dtype)
    built = build_engine(engine, model, tokenizer, max_model_len=max_length, max_queue=1024, max_num_seqs=None)
    return Pipeline(built, max_length)


def _registry(deployment_name: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", deployment_name)
    return Path(tempfile.gettempdir()) / f"shardwise-mii-{os.getuid()}" / f"{safe}.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(
    model_name_or_path: str,
    *,
    deployment_name: str | None = None,
    tensor_parallel: int = 1,
    replica_num: int = 1,
    max_length: int | None = None,
    port: int | None = None,
    engine: str = "batched",
) -> Client:
    """A persistent deployment (MII's ``mii.serve``): ``shardwise serve`` in a subprocess on
    ``127.0.0.1:port`` (a free port by default) named ``deployment_name`` (default: the model
    path), with ``replica_num`` engines, each with its model split over ``tensor_parallel``
    processes; returns its :class:`Client` once the server answers ``/health``."""
    _check_parallel(tensor_parallel, replica_num)
    name = deployment_name or model_name_or_path
    port = port or _free_port()
    cmd = [sys.executable, "-m", "shardwise.cli", "serve", str(model_name_or_path), "--port", str(port)]
    cmd += ["--served-model-name", name, "--engine", engine, "--log-level", "warning"]
    cmd += ["--tensor-parallel-size", str(tensor_parallel), "--data-parallel-size", str(replica_num)]
    if max_length:
        cmd += ["--max-model-len", str(max_length)]
    process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not _healthy(url):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the deployment {name!r} did not start (exit code {process.poll()})")
        time.sleep(0.25)
    path = _registry(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"url": url, "pid": process.pid, "model": name}))
    return Client(name, url, process.pid, process=process)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def client(deployment_name: str) -> Client:
    """The :class:`Client` of a running deployment (MII's ``mii.client``)."""
    path = _registry(deployment_name)
    if not path.exists():
        raise ValueError(f"no running deployment named {deployment_name!r}")
    info = json.loads(path.read_text())
    return Client(info["model"], info["url"], info["pid"])


class Client:
    """Talks to a deployment over its OpenAI-compatible HTTP API."""

    def __init__(self, deployment_name: str, url: str, pid: int, *, process: subprocess.Popen | None = None):
        self.deployment_name, self.url, self.pid, self._process = deployment_name, url, pid, process

    def __call__(self, prompts, **kwargs) -> list[Response]:
        return self.generate(prompts, **kwargs)

    def generate(self, prompts: str | list[str], streaming_fn=None, **kwargs) -> list[Response]:
        """One :class:`Response` per prompt (prompts run concurrently). With ``streaming_fn``
        (one prompt only, as MII), it is called with ``[Response]`` for every new piece of
        text, and the whole response is returned at the end."""
        _check_generate_keys(kwargs)
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if streaming_fn is not None:
            if len(prompts) != 1:
                raise RuntimeError("streaming takes a single prompt")
            return [self._stream(prompts[0], streaming_fn, kwargs)]
        with ThreadPoolExecutor(min(len(prompts), 32) or 1) as pool:
            return list(pool.map(lambda p: self._one(p, kwargs), prompts))

    def _body(self, prompt: str, kwargs: dict, stream: bool) -> bytes:
        body = {"model": self.deployment_name, "prompt": prompt, "stream": stream, **_sampling(kwargs)}
        if kwargs.get("max_new_tokens"):
            body["max_tokens"] = kwargs["max_new_tokens"]
        else:
            body["max_tokens"] = None  # the server fills the model's length
        if stream:
            body["stream_options"] = {"include_usage": True}
        return json.dumps(body).encode()

    def _post(self, data: bytes):
        request = urllib.request.Request(
            self.url + "/v1/completions", data=data, headers={"Content-Type": "application/json"}
        )
        return urllib.request.urlopen(request, timeout=600)

    def _one(self, prompt: str, kwargs: dict) -> Response:
        with self._post(self._body(prompt, kwargs, False)) as r:
            answer = json.loads(r.read())
        choice, usage = answer["choices"][0], answer["usage"]
        text = (prompt if kwargs.get("return_full_text") else "") + choice["text"]
        return Response(text, usage["prompt_tokens"], usage["completion_tokens"], choice["finish_reason"])

    def _stream(self, prompt: str, callback, kwargs: dict) -> Response:
        text, reason, usage = "", "length", {"prompt_tokens": 0, "completion_tokens": 0}
        with self._post(self._body(prompt, kwargs, True)) as r:
            for line in r:
                data = line.decode().strip()
                if not data.startswith("data: ") or data == "data: [DONE]":
                    continue
                chunk = json.loads(data[6:])
                if "error" in chunk:
                    raise RuntimeError(f"generation failed: {chunk['error']['message']}")
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    reason = choice["finish_reason"] or reason
                    if choice["text"]:
                        text += choice["text"]
                        callback([Response(choice["text"], 0, 0, "none")])
        full = (prompt if kwargs.get("return_full_text") else "") + text
        return Response(full, usage["prompt_tokens"], usage["completion_tokens"], reason)

    def terminate_server(self, timeout: float = 60) -> None:
        """Stop the deployment (SIGTERM: running requests finish first) and forget its name."""
        _registry(self.deployment_name).unlink(missing_ok=True)
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        if self._process is not None:
            try:
                self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _alive(self.pid):
            time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
