"""The real ``shardwise serve`` process (one per module) on a tiny Llama, through the ``openai``
client and raw HTTP: greedy answers equal ``generate``, streaming, chat, ``n`` with seeds, stop
strings, every refusal, an aborted stream, and the metrics after the load."""

import http.client
import json
import re
import signal
import socket
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from _serve_server import Server, post, save_tiny_model

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

NAME = "tiny"
KEY = "sk-test"
MAX_LEN = 1024


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    args = ["--served-model-name", NAME, "--api-key", KEY, "--max-model-len", str(MAX_LEN), "--max-queue", "8"]
    args += ["--max-num-seqs", "4"]  # with --max-queue 8: at most 12 held, so n=64 is refused
    srv = Server(model_dir, log, *args)
    try:
        srv.wait_ready()
        yield srv
    finally:
        code = srv.stop()
    # SIGTERM drains and shuts the engine down (uvicorn re-raises the signal after its shutdown)
    assert code in (0, -signal.SIGTERM) and "Application shutdown complete" in log.read_text(), log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(model_dir):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)

    def greedy(prompt_ids: list[int], max_tokens: int) -> str:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False)
        return tokenizer.decode(out[0, len(prompt_ids) :], skip_special_tokens=True)

    greedy.tokenizer = tokenizer
    return greedy


PROMPTS = [f"w{5 + i} w{40 + 3 * i} w{90 - i}" for i in range(8)]


def test_concurrent_greedy_requests_equal_generate(client, reference):
    def ask(prompt):
        return client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, PROMPTS))
    for prompt, answer in zip(PROMPTS, answers):
        ids = reference.tokenizer.encode(prompt)
        assert answer.choices[0].text == reference(ids, 8), prompt
        assert answer.object == "text_completion" and answer.model == NAME
        assert answer.usage.prompt_tokens == len(ids)
        assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    assert any(a.choices[0].text for a in answers)


def test_streamed_text_equals_whole(client):
    whole = client.completions.create(model=NAME, prompt=[7, 8, 9], max_tokens=12, temperature=0)
    chunks = list(
        client.completions.create(
            model=NAME,
            prompt=[7, 8, 9],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_uses_the_template(client, reference):
    messages = [{"role": "user", "content": "w11 w12 w13"}]
    answer = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0)
    ids = reference.tokenizer.encode("w11 w12 w13 w3")
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == reference(ids, 6)
    chunks = list(
        client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer.choices[0].message.content


def test_n_choices_with_a_seed_are_the_single_seeded_requests(client):
    common = dict(model=NAME, prompt="w20 w21", max_tokens=10, temperature=1.0, extra_body={"top_k": 50})
    both = client.completions.create(n=2, seed=7, **common)
    assert [c.index for c in both.choices] == [0, 1]
    for i in range(2):
        one = client.completions.create(seed=7 + i, **common)
        assert both.choices[i].text == one.choices[0].text
    assert both.usage.completion_tokens == 20


def test_stop_strings_end_the_text_before_them(client):
    full = client.completions.create(model=NAME, prompt="w30 w31", max_tokens=10, temperature=0).choices[0].text
    words = full.split()
    assert len(words) >= 4, full
    stop = words[3]
    want = full[: full.find(stop)]
    for stream in (False, True):
        got = client.completions.create(
            model=NAME, prompt="w30 w31", max_tokens=10, temperature=0, stop=[stop], stream=stream
        )
        if stream:
            chunks = [c.choices[0] for c in got]
            text, reason = "".join(c.text for c in chunks), chunks[-1].finish_reason
        else:
            text, reason = got.choices[0].text, got.choices[0].finish_reason
        assert (text, reason) == (want, "stop")


def test_refusals(server, client):
    url = server.url + "/v1/completions"
    status, _, body = post(url, None, key=KEY, raw=b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, _, body = post(url, {"model": NAME, "prompt": "w5", "max_tokens": "many"}, key=KEY)
    assert (status, body["error"]["param"]) == (400, "max_tokens")
    status, _, body = post(url, {"model": NAME, "prompt": "w5", "temperature": -1}, key=KEY)
    assert status == 400
    too_long = {"model": NAME, "prompt": list(range(5, 105)) * 2, "max_tokens": MAX_LEN}
    status, _, body = post(url, too_long, key=KEY)
    assert status == 400 and "maximum context length" in body["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="w5", max_tokens=2)
    status, _, body = post(url, {"model": NAME, "prompt": "w5"}, key="wrong")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, _, _ = post(url, {"model": NAME, "prompt": "w5"})
    assert status == 401


def test_a_full_queue_answers_503_with_retry_after(server):
    body = {"model": NAME, "prompt": "w5", "max_tokens": 200, "ignore_eos": True, "n": 64}
    status, headers, answer = post(server.url + "/v1/completions", body, key=KEY)
    assert status == 503 and headers.get("Retry-After") == "1"
    assert answer["error"]["type"] == "server_error"


def _metrics(server) -> dict[str, float]:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {m[0]: float(m[1]) for m in re.findall(r"^(shardwise:\S+) (\S+)$", text, re.M)}


def _settle(server, timeout: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = _metrics(server)
        if m["shardwise:num_requests_running"] == 0 and m["shardwise:num_requests_waiting"] == 0:
            return m
        time.sleep(0.1)
    raise TimeoutError(f"requests still running: {m}")


def test_an_aborted_stream_is_cancelled_and_others_go_on(server, client):
    before = _settle(server)
    body = {"model": NAME, "prompt": "w5 w6", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Authorization": f"Bearer {KEY}"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.read(6) == b"data: "  # it runs
    conn.sock.close()
    conn.close()
    after = _settle(server)
    assert after["shardwise:generation_tokens_total"] - before["shardwise:generation_tokens_total"] < 1000
    answer = client.completions.create(model=NAME, prompt="w8", max_tokens=3, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_a_client_that_leaves_before_its_whole_answer_is_cancelled(server):
    before = _settle(server)
    body = json.dumps({"model": NAME, "prompt": "w5 w6", "max_tokens": 1000, "ignore_eos": True}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        deadline = time.monotonic() + 30
        while _metrics(server)["shardwise:num_requests_running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # it runs
    after = _settle(server)
    assert after["shardwise:generation_tokens_total"] - before["shardwise:generation_tokens_total"] < 1000


def test_metrics_count_the_load_and_return_to_idle(server, client):
    before = _settle(server)

    def ask(prompt):
        return client.completions.create(
            model=NAME, prompt=prompt, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
        )

    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(ask, PROMPTS[:3]))
    after = _settle(server)
    grew = {k: after[k] - before[k] for k in after}
    assert grew["shardwise:prompt_tokens_total"] == sum(a.usage.prompt_tokens for a in answers) == 9
    assert grew["shardwise:generation_tokens_total"] == 12
    assert grew["shardwise:time_to_first_token_seconds_count"] == 3
    assert after["shardwise:kv_cache_usage_perc"] == 0


def test_sigterm_lets_a_running_stream_finish(server):  # last: it stops the module's server
    body = {"model": NAME, "prompt": "w5 w6", "max_tokens": 240, "ignore_eos": True, "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Authorization": f"Bearer {KEY}"})
    response = conn.getresponse()
    assert response.read(6) == b"data: "
    server.proc.send_signal(signal.SIGTERM)
    rest = response.read().decode()
    conn.close()
    assert rest.rstrip().endswith("data: [DONE]")
    assert '"finish_reason":"length"' in rest
    server.proc.wait(30)
    with pytest.raises(OSError):
        urllib.request.urlopen(server.url + "/health", timeout=5)
