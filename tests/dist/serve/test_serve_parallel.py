"""``shardwise serve --tensor-parallel-size 2`` as a real server on a loopback port: it starts
its follower process itself, concurrent greedy completions equal ``generate``, a follower
killed mid-service fails the next request with an error (no hang), and stopping the server
ends every process it started."""

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from _serve_server import Server, greedy_answers, post, save_tiny_model

pytest.importorskip("fastapi")

PROMPTS = [f"w{5 + i} w{40 + 3 * i} w{90 - i}" for i in range(6)]
NEW = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def expected(model_dir):
    return [text for text, _ in greedy_answers(model_dir, PROMPTS, NEW)]


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (Linux /proc)."""
    found, todo = set(), [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = {int(c) for c in (task / "children").read_text().split()}
            except OSError:
                continue
            todo.extend(children - found)
            found |= children
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1] if Path(f"/proc/{pid}").exists() else "X"
    return state != "Z"


def _complete(url: str, prompts: list[str]) -> list[str]:
    def ask(prompt):
        status, _, body = post(url + "/v1/completions", {"prompt": prompt, "max_tokens": NEW, "temperature": 0})
        assert status == 200, body
        return body["choices"][0]["text"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(ask, prompts))


def test_tensor_parallel_server_equals_generate_and_leaves_no_process(model_dir, expected, tmp_path):
    server = Server(model_dir, tmp_path / "server.log", "--tensor-parallel-size", "2", "--max-model-len", "128")
    try:
        server.wait_ready()
        children = descendants(server.proc.pid)
        assert len(children) == 1, children  # the follower
        assert _complete(server.url, PROMPTS) == expected
        (follower,) = children
        os.kill(follower, signal.SIGKILL)  # a dead follower fails the engine: an error, not a hang
        status, _, body = post(server.url + "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": NEW}, timeout=60)
        assert status == 500 and "tensor-parallel group failed" in body["error"]["message"], body
    finally:
        code = server.stop()
    assert code in (0, -signal.SIGTERM), server.log.read_text()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in children), server.log.read_text()
