"""The HTTP app in process over a scripted engine: an engine error fails that request only (500,
or an error event in a stream) and cancels its other choices; a tokenizer without a chat
template is a 400; the ``serve`` command's refusals and engine choice."""

import asyncio
import json
import logging
import threading
from types import SimpleNamespace

import pytest

from shardwise.serve._api import RequestStream, TokenEvent

pytest.importorskip("fastapi")
pytest.importorskip("httpx")


class Bytes:
    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


class Scripted:
    """Echoes the prompt back token by token; a prompt starting with "!" or a seed of 1 fails
    after one token, and a prompt starting with "~" never ends until cancelled."""

    tokenizer = Bytes()
    max_model_len = 64
    failed = None
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=256))

    def __init__(self):
        self.cancelled: list[str] = []
        self.count = 0

    def submit(self, prompt_ids, params):
        self.count += 1
        stream = RequestStream(f"r{self.count}", self._cancel)
        self.streams = getattr(self, "streams", {})
        self.streams[stream.request_id] = stream
        stream.put(TokenEvent(prompt_ids[0]))
        if prompt_ids[0] == ord("!") or params.seed == 1:
            stream.put(TokenEvent(None, True, "error", "ValueError: sampling failed"))
        elif prompt_ids[0] != ord("~"):
            for token in prompt_ids[1 : params.max_tokens]:
                stream.put(TokenEvent(token))
            stream.put(TokenEvent(None, True, "length"))
        return stream

    def _cancel(self, request_id):
        self.cancelled.append(request_id)
        threading.Timer(0.01, self.streams[request_id].put, (TokenEvent(None, True, "abort"),)).start()

    def metrics(self):
        from shardwise.serve._api import EngineMetrics

        return EngineMetrics()

    def shutdown(self):
        pass


@pytest.fixture
def app_client():
    from fastapi.testclient import TestClient

    from shardwise.serve._http import create_app

    engine = Scripted()
    with TestClient(create_app(engine, served_model_name="m")) as client:
        yield client, engine


def test_an_engine_error_fails_that_request_only(app_client):
    client, engine = app_client
    bad = client.post("/v1/completions", json={"prompt": "!ab", "max_tokens": 3})
    assert bad.status_code == 500 and "sampling failed" in bad.json()["error"]["message"]
    good = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3})
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == "abc"
    mixed = client.post("/v1/completions", json={"prompt": "~x", "n": 3, "seed": 0, "max_tokens": 3})
    assert mixed.status_code == 500
    assert len(engine.cancelled) == 2  # the two unfinished choices


def test_an_engine_error_in_a_stream_is_an_error_event(app_client):
    client, _ = app_client
    with client.stream("POST", "/v1/completions", json={"prompt": "!ab", "stream": True}) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "sampling failed" in json.loads(events[-2])["error"]["message"]
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-2]] == ["!"]  # the token before the error


def test_streamed_choices_merge_by_index(app_client):
    client, _ = app_client
    body = {"prompt": "abcd", "n": 2, "max_tokens": 4, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    texts, reasons = ["", ""], [None, None]
    for event in events[:-1]:
        (choice,) = json.loads(event)["choices"]
        texts[choice["index"]] += choice["text"]
        reasons[choice["index"]] = choice["finish_reason"] or reasons[choice["index"]]
    assert texts == ["abcd", "abcd"] and reasons == ["length", "length"]


def test_token_ids_outside_the_vocabulary_are_a_400(app_client):
    client, _ = app_client
    answer = client.post("/v1/completions", json={"prompt": [5, 256]})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt"


def test_a_tokenizer_without_a_chat_template_is_a_400(app_client):
    client, _ = app_client
    answer = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 400 and "chat template" in answer.json()["error"]["message"]


def test_serve_names_the_extra_when_fastapi_is_missing(monkeypatch, capsys):
    import importlib.util

    from shardwise.serve import _cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "fastapi" else real(name))
    assert _cli.main(["somewhere"]) == 2
    assert "pip install 'shardwise[serve]'" in capsys.readouterr().err


def test_serve_refuses_tensor_parallel_by_name(capsys):
    from shardwise.serve import _cli

    assert _cli.main(["somewhere", "--tensor-parallel-size", "0"]) == 2
    assert "--tensor-parallel-size" in capsys.readouterr().err


def test_families_the_batching_engine_does_not_run_are_served_sequentially(caplog):
    import transformers

    from shardwise.serve import SequentialEngine, _cli
    from shardwise.serve._batching import BatchingEngine

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                 num_attention_heads=2, max_position_embeddings=64)
    )  # fmt: skip
    engines = []
    try:
        with caplog.at_level(logging.WARNING, logger="shardwise.serve"):
            for model in (gpt2, llama):
                engines.append(_cli.build_engine("batched", model, None, max_model_len=64, max_queue=4, max_num_seqs=2))
        assert [type(e) for e in engines] == [SequentialEngine, BatchingEngine]
        assert "serving model_type 'gpt2' with the sequential engine" in caplog.text
    finally:
        for engine in engines:
            engine.shutdown()


class Held(Scripted):
    """Keeps every stream open, with no events, until the test releases it."""

    def __init__(self):
        super().__init__()
        self.held: list[tuple[RequestStream, list[int]]] = []

    def submit(self, prompt_ids, params):
        self.count += 1
        stream = RequestStream(f"r{self.count}", self._cancel)
        self.held.append((stream, prompt_ids))
        return stream


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)


def test_concurrent_streamed_requests_take_no_thread_each():
    import httpx

    from shardwise.serve._http import create_app

    engine, count = Held(), 40
    app = create_app(engine, served_model_name="m")

    def release():  # what the engine's thread does
        for stream, prompt in engine.held:
            for token in prompt:
                stream.put(TokenEvent(token))
            stream.put(TokenEvent(None, True, "length"))

    async def load():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            before = threading.active_count()
            body = {"prompt": "ab", "max_tokens": 2, "stream": True}
            tasks = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(count)]
            await asyncio.wait_for(_until(lambda: len(engine.held) == count), 20)
            during = threading.active_count()
            await asyncio.to_thread(release)
            return before, during, await asyncio.gather(*tasks)

    before, during, answers = asyncio.run(load())
    assert during - before < count // 4, (before, during)
    for answer in answers:
        events = [line[6:] for line in answer.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == "ab"
