"""Two engine replicas in their own processes behind one ``ReplicaSet``: concurrent greedy
requests land on both and each equals ``generate``, the metrics add up, a replica killed
mid-request fails that request with an error while the other keeps serving, and shutting
down ends every replica process. The metrics' combination is tested as data (cache use: the
mean over the live replicas)."""

import os
import signal
import time

import pytest
import torch
from _serve_server import save_tiny_model

from shardwise.serve import SamplingParams
from shardwise.serve._launch import EngineSpec
from shardwise.serve._replicas import ReplicaSet

transformers = pytest.importorskip("transformers")

PROMPTS = [[5 + i, 40 + 3 * i, 90 - i, 7] for i in range(8)]
NEW = 6
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def _generate(model, prompt, tokens):
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def _tokens(stream):
    events = list(stream.events(timeout=60))
    return [e.token_id for e in events if not e.finished], events[-1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_replicas_share_the_load_and_survive_one_dying(model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    engine = ReplicaSet(EngineSpec(str(model_dir), max_model_len=512, max_num_seqs=4), tokenizer, replicas=2)
    pids = engine.pids
    try:
        streams = [engine.submit(p, GREEDY) for p in PROMPTS]
        for prompt, stream in zip(PROMPTS, streams):
            tokens, last = _tokens(stream)
            assert (tokens, last.finish_reason) == (_generate(model, prompt, NEW), "length"), prompt
        assert min(engine.served) > 0 and sum(engine.served) == len(PROMPTS), engine.served
        metrics = engine.metrics()
        assert metrics.generation_tokens_total == NEW * len(PROMPTS) and metrics.num_requests_running == 0
        assert metrics.prompt_tokens_total == sum(map(len, PROMPTS)) and metrics.kv_cache_usage_perc == 0

        long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        doomed = engine.submit(PROMPTS[0], long)
        spared = engine.submit(PROMPTS[1], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
        victim = next(r for r in engine.replicas if doomed.request_id in r.streams)
        events = doomed.events(timeout=60)
        assert not next(events).finished  # it runs on the victim
        os.kill(victim.process.pid, signal.SIGKILL)
        last = list(events)[-1]
        assert last.finish_reason == "error" and f"replica {victim.index} ended" in last.error, last
        tokens, last = _tokens(spared)
        assert last.finish_reason == "length" and tokens == _generate(model, PROMPTS[1], 100)
        after = [engine.submit(p, GREEDY) for p in PROMPTS[:2]]  # all on the survivor
        assert [_tokens(s)[0] for s in after] == [_generate(model, p, NEW) for p in PROMPTS[:2]]
    finally:
        engine.shutdown()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def test_metrics_of_replicas_add_up():
    from shardwise.serve._api import EngineMetrics
    from shardwise.serve._replicas import _combine

    a = EngineMetrics(2, 1, 0.25, 10, 20, [0.1])
    b = EngineMetrics(1, 0, 0.75, 5, 7, [0.2, 0.3])
    dead = EngineMetrics(3, 3, 0.5, 1, 1, [0.4])
    got = _combine([a, b, dead], [True, True, False])
    assert (got.num_requests_running, got.num_requests_waiting, got.kv_cache_usage_perc) == (3, 1, 0.5)
    assert (got.prompt_tokens_total, got.generation_tokens_total) == (16, 28)
    assert got.time_to_first_token_seconds == [0.1, 0.2, 0.3, 0.4]
