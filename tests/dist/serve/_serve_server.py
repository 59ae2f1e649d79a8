"""Helpers for the server tests: a tiny Llama saved with ``save_pretrained`` next to a word-level tokenizer with a chat
template (no downloads), and a real ``shardwise serve`` process on a free loopback port."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from shardwise.testing.causal_lm import VOCAB, tiny_lm

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w3{% endif %}"
ROOT = Path(__file__).resolve().parents[3]


def save_tiny_model(path: Path, *, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    import tokenizers
    import transformers
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    backend = tokenizers.Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = WhitespaceSplit()
    backend.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.chat_template = chat_template
    tiny_lm("llama").save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def greedy_answers(model_dir: Path, prompts: list[str], new_tokens: int) -> list[tuple[str, int]]:
    """What the saved model's own ``generate`` answers to each prompt, greedily: (text, prompt tokens)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    out = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            new = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)[0, len(ids) :]
        out.append((tokenizer.decode(new, skip_special_tokens=True), len(ids)))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``shardwise serve`` subprocess; ``url`` is its base URL."""

    def __init__(self, model_dir: Path, log: Path, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "shardwise.cli", "serve", str(model_dir), "--port", str(self.port), *args]
        self.log = log
        with open(log, "w") as out:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.log.read_text()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"no /health in {timeout} s:\n{self.log.read_text()}")

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, then kill after ``timeout``; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def post(url: str, body, *, key: str | None = None, raw: bytes | None = None, timeout: float = 60):
    """(status, headers, decoded JSON body) of a POST."""
    data = raw if raw is not None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as error:
        return error.code, error.headers, json.loads(error.read())
