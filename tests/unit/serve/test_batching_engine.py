"""The batching engine with a tiny Llama: concurrent greedy requests each equal the model's
``generate`` (one forward for everything, prompts cut into chunks, a pool so small that
sequences are preempted and recomputed), seeded sampling equal to the one-at-a-time engine,
a cancelled request frees its blocks at once, and models it cannot run are refused."""

import pytest
import torch

from shardwise.serve import SamplingParams, SequentialEngine
from shardwise.serve._batching import BatchingEngine

transformers = pytest.importorskip("transformers")
from serve_models import greedy, tiny_llama  # noqa: E402 - needs transformers

WAIT = 20  # seconds any one token may take before a test fails instead of hanging


MODEL = tiny_llama()
PROMPTS = [
    torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 9, 1, 14, 6, 11)
]


def _generate(prompt, tokens):
    return greedy(MODEL, prompt, tokens)


def _tokens(stream):
    events = list(stream.events(timeout=WAIT))
    return [e.token_id for e in events[:-1]], events[-1].finish_reason


@pytest.mark.parametrize(
    ("budget", "blocks"), [(256, None), (5, None), (8, 12)], ids=["one-forward", "chunked-prefill", "preempting"]
)
def test_concurrent_greedy_requests_equal_generate(budget, blocks):
    engine = BatchingEngine(MODEL, None, token_budget=budget, block_size=4, num_blocks=blocks, max_num_seqs=4,
                            max_model_len=40)  # fmt: skip
    try:
        streams = [engine.submit(p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)) for p in PROMPTS]
        for prompt, stream in zip(PROMPTS, streams):
            assert _tokens(stream) == (_generate(prompt, 8), "length")
        if blocks is not None:
            assert engine.scheduler.preemptions > 0  # the pool was too small for all four at once
        metrics = engine.metrics()
        assert metrics.kv_cache_usage_perc == 0 and metrics.num_requests_running == 0
        assert metrics.prompt_tokens_total == sum(map(len, PROMPTS)) and metrics.generation_tokens_total == 48
    finally:
        engine.shutdown()


def test_seeded_sampling_equals_the_one_at_a_time_engine():
    params = SamplingParams(max_tokens=10, temperature=0.8, top_k=20, top_p=0.9, seed=3, ignore_eos=True)
    batching, sequential = BatchingEngine(MODEL, None, max_model_len=40), SequentialEngine(MODEL, None)
    try:
        got = [batching.submit(p, params) for p in PROMPTS[:3]]
        expected = [_tokens(sequential.submit(p, params)) for p in PROMPTS[:3]]
        assert [_tokens(s) for s in got] == expected
    finally:
        batching.shutdown()
        sequential.shutdown()


def test_a_cancelled_request_frees_its_blocks_and_others_go_on():
    engine = BatchingEngine(MODEL, None, max_model_len=120, block_size=4)
    try:
        long = engine.submit(PROMPTS[3], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
        events = long.events(timeout=WAIT)
        next(events), next(events)
        long.cancel()
        assert list(events)[-1].finish_reason == "abort"
        short = engine.submit(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert _tokens(short) == (_generate(PROMPTS[0], 4), "length")
        assert engine.metrics().kv_cache_usage_perc == 0 and engine.allocator.num_free == engine.allocator.num_blocks
    finally:
        engine.shutdown()


def test_models_the_engine_cannot_run_are_refused():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(ValueError, match="--engine sequential"):
        BatchingEngine(gpt2, None)
    with pytest.raises(ValueError, match="2 blocks of 4 tokens cannot hold one sequence of max_model_len=40"):
        BatchingEngine(MODEL, None, max_model_len=40, block_size=4, num_blocks=2)
    with pytest.raises(ValueError, match="maximum context length is 40"):
        engine = BatchingEngine(MODEL, None, max_model_len=40)
        try:
            engine.submit(list(range(30)), SamplingParams(max_tokens=20))
        finally:
            engine.shutdown()


def test_prompts_with_a_common_prefix_reuse_its_blocks_and_still_equal_generate():
    engine = BatchingEngine(MODEL, None, max_model_len=60, block_size=4, token_budget=64)
    try:
        system = torch.randint(0, 64, (17,), generator=torch.Generator().manual_seed(9)).tolist()
        prompts = [system + [i, i + 1] for i in range(4)]
        first = engine.submit(prompts[0], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
        assert _tokens(first) == (_generate(prompts[0], 5), "length")
        others = [engine.submit(p, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)) for p in prompts[1:]]
        for prompt, stream in zip(prompts[1:], others):
            assert _tokens(stream) == (_generate(prompt, 5), "length")
        assert engine.scheduler.prefix_cache.hits == 3 * 16  # 4 full blocks of the 17-token prefix, 3 times
        assert engine.metrics().kv_cache_usage_perc == 0
    finally:
        engine.shutdown()
