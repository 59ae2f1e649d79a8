"""The batching engine on a CUDA GPU: decode-only steps padded to buckets and replayed as CUDA
graphs ([Note: decode graphs across batches]) while requests join and leave, with greedy tokens
equal to the model's ``generate`` and the eager engine's (``enforce_eager``) in fp32, and greedy
up to bf16's rounding in bf16 (padded shapes round differently). Skipped without a GPU."""

import pytest
import torch

from shardwise.serve import SamplingParams
from shardwise.serve._batching import BatchingConfig, BatchingEngine
from shardwise.testing.causal_lm import tiny_lm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

WAIT = 120  # seconds any one token may take (the first steps of a bucket capture its graph)
PROMPTS = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 3, 9, 14, 7)]
TOKENS = [24, 4, 32, 10, 16]
"""Each request ends at its own step, so the decode batch shrinks through 5, 4, 3, 2 and 1
rows (buckets 8, 4, 2, 1); the first two requests start alone, the other three join them."""


def _greedy(model, prompt, tokens):
    ids = torch.tensor([prompt], device="cuda")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def _serve(model, *, enforce_eager):
    config = BatchingConfig(max_num_seqs=8, token_budget=64, block_size=4, enforce_eager=enforce_eager)
    engine = BatchingEngine(model, None, max_model_len=64, config=config)
    params = [SamplingParams(max_tokens=t, temperature=0, ignore_eos=True) for t in TOKENS]
    try:
        first = [engine.submit(p, s).events(timeout=WAIT) for p, s in zip(PROMPTS[:2], params[:2])]
        started = [[next(events)] for events in first]  # the first two decode before the others join
        later = [engine.submit(p, s).events(timeout=WAIT) for p, s in zip(PROMPTS[2:], params[2:])]
        events = [head + list(rest) for head, rest in zip(started, first)] + [list(e) for e in later]
        assert [e[-1].finish_reason for e in events] == ["length"] * len(PROMPTS)
        assert engine.metrics().kv_cache_usage_perc == 0
        return [[e.token_id for e in stream[:-1]] for stream in events], engine.decoder.graphs
    finally:
        engine.shutdown()


def _deficits(judge, prompt, tokens):
    """How far each of ``tokens`` after ``prompt`` is below the best logit of ``judge``
    (teacher-forced: one near tie does not shift the tokens after it)."""
    ids = torch.tensor([prompt + tokens], device="cuda")
    with torch.no_grad():
        logits = judge(ids).logits[0, len(prompt) - 1 : -1].float()
    chosen = logits.gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
    return (logits.max(-1).values - chosen).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_graphs_across_changing_batches_equal_the_eager_engine(dtype):
    model = tiny_lm("llama").to("cuda", dtype)
    expected = [_greedy(model, p, t) for p, t in zip(PROMPTS, TOKENS)]  # before the engines: no concurrent CUDA
    assert list(map(len, expected)) == TOKENS
    eager, none = _serve(model, enforce_eager=True)
    graphed, graphs = _serve(model, enforce_eager=False)
    assert none is None and graphs is not None and graphs.failed is None
    if dtype == torch.float32:
        assert graphed == expected and eager == expected
    else:  # padded shapes round bf16 differently: tokens are greedy up to that rounding (fp32 judge, same weights)
        judge = tiny_lm("llama").to("cuda", dtype).float()
        for outputs in (graphed, eager):
            deficits = [d for p, t in zip(PROMPTS, outputs) for d in _deficits(judge, p, t)]
            # bf16 logits are within ~0.3 of fp32's here, and a wrong token is typically several units off
            assert max(deficits) < 1.0 and sum(d == 0 for d in deficits) >= 0.85 * len(deficits), deficits
    rows = {r for r, _ in graphs.steps}
    assert len(rows) >= 3 and all(step.graph is not None for step in graphs.steps.values())
    assert graphs.replays == sum(graphs.runs.values()) > len(graphs.steps)  # every decode step replayed a graph
    assert max(graphs.runs.values()) >= 4  # a kept graph replayed across steps whose batches differ


def test_enforce_eager_on_the_command_line():
    from shardwise.serve._cli import build_engine, parser

    model = tiny_lm("llama").to("cuda")
    for argv, eager in (([], False), (["--enforce-eager"], True)):
        args = parser().parse_args(["model", *argv])
        engine = build_engine("batched", model, None, max_model_len=32, max_queue=4, max_num_seqs=2,
                              enforce_eager=args.enforce_eager)  # fmt: skip
        try:
            assert engine.config.enforce_eager == eager and (engine.decoder.graphs is None) == eager
        finally:
            engine.shutdown()
