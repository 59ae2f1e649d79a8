"""``shardwise serve --engine-own-process`` (the engine in a process of its own, one replica):
the real server on a free loopback port answers the ``openai`` client with ``generate``'s
greedy text, streamed and not; killing the engine's process fails the running stream with an
error, ``/health`` then answers 503 naming it, and later requests fail instead of hanging."""

import os
import signal
import urllib.error
import urllib.request

import pytest
from _serve_server import Server, greedy_answers, post, save_tiny_model
from test_serve_parallel import descendants

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

PROMPT = "w5 w9 w14"
NEW = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def _health(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_the_engine_in_its_own_process_serves_and_its_death_is_reported(model_dir, tmp_path):
    ((expected, _),) = greedy_answers(model_dir, [PROMPT], NEW)
    server = Server(model_dir, tmp_path / "server.log", "--max-model-len", "256", "--engine-own-process")
    try:
        server.wait_ready()
        (engine_pid,) = descendants(server.proc.pid)  # the replica process runs the engine
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        whole = client.completions.create(model=str(model_dir), prompt=PROMPT, max_tokens=NEW, temperature=0)
        chunks = client.completions.create(
            model=str(model_dir), prompt=PROMPT, max_tokens=NEW, temperature=0, stream=True
        )
        assert whole.choices[0].text == "".join(c.choices[0].text for c in chunks) == expected
        assert _health(server.url) == (200, "")

        running = client.completions.create(
            model=str(model_dir), prompt=PROMPT, max_tokens=200, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        events = iter(running)
        assert next(events).choices[0].text  # it runs in the engine's process
        os.kill(engine_pid, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="replica 0 ended"):
            for _ in events:  # bounded: 200 tokens at most, then [DONE]
                pass
        status, text = _health(server.url)
        assert status == 503 and "replica 0 ended" in text, text
        status, _, body = post(server.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, timeout=30)
        assert status == 500 and "every replica has ended" in body["error"]["message"], body
    finally:
        code = server.stop()
    assert code in (0, -signal.SIGTERM), server.log.read_text()
