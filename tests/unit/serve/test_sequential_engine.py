"""The one-at-a-time engine: its counters equal the batching engine's after the same requests
(every drawn token counts, an end-of-sequence or stop token included), and a cancel leaves
nothing behind, also one that arrives after the request ended."""

import pytest
import torch

from shardwise.serve import SamplingParams, SequentialEngine
from shardwise.serve._batching import BatchingEngine

transformers = pytest.importorskip("transformers")
from serve_models import greedy, tiny_llama  # noqa: E402 - needs transformers

WAIT = 20  # seconds any one token may take before a test fails instead of hanging


PROMPTS = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9, 3)]


def _run(engine, requests):
    """Each request to its end, one after the other: (tokens, finish reason) per request."""
    answers = []
    for prompt, params in requests:
        events = list(engine.submit(prompt, params).events(timeout=WAIT))
        answers.append(([e.token_id for e in events[:-1]], events[-1].finish_reason))
    return answers


def test_counters_equal_the_batching_engines():
    model = tiny_llama()
    model.generation_config.eos_token_id = greedy(model, PROMPTS[0], 3)[2]  # request 0 ends on it
    stop_token = greedy(model, PROMPTS[2], 2)[1]
    requests = [
        (PROMPTS[0], SamplingParams(max_tokens=8, temperature=0)),
        (PROMPTS[1], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)),
        (PROMPTS[2], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, stop_token_ids=(stop_token,))),
    ]
    results = {}
    for engine in (SequentialEngine(model, None), BatchingEngine(model, None, max_model_len=40)):
        try:
            results[type(engine).__name__] = (_run(engine, requests), engine.metrics())
        finally:
            engine.shutdown()
    (answers, seq), (batched_answers, bat) = results["SequentialEngine"], results["BatchingEngine"]
    assert answers == batched_answers and [r for _, r in answers] == ["stop", "length", "stop"]
    emitted = sum(len(tokens) for tokens, _ in answers)
    assert seq.generation_tokens_total == bat.generation_tokens_total == emitted + 2  # the two stop tokens
    assert seq.prompt_tokens_total == bat.prompt_tokens_total == sum(map(len, PROMPTS))
    assert len(seq.time_to_first_token_seconds) == len(bat.time_to_first_token_seconds) == 3
    assert (seq.num_requests_running, seq.num_requests_waiting) == (bat.num_requests_running, 0) == (0, 0)


def test_cancels_leave_nothing_behind():
    engine = SequentialEngine(tiny_llama(), None)
    try:
        done = engine.submit(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        assert list(done.events(timeout=WAIT))[-1].finish_reason == "length"
        done.cancel()  # after its end: nothing to remember
        assert engine._cancelled == set()
        running = engine.submit(PROMPTS[1], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
        waiting = engine.submit(PROMPTS[2], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
        events = running.events(timeout=WAIT)
        next(events), next(events)
        waiting.cancel()
        running.cancel()
        assert list(events)[-1].finish_reason == "abort"
        assert list(waiting.events(timeout=WAIT))[-1].finish_reason == "abort"
        assert engine._cancelled == set() and engine._live == set()
    finally:
        engine.shutdown()
