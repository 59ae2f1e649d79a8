"""The tensor-parallel batching engine on 2 gloo ranks with a tiny Llama: concurrent greedy
requests (prompts cut into chunks, decodes fused with them) each equal the unsplit model's
``generate``; every rank holds half of each split layer and a KV cache of half the heads;
the followers return when the engine shuts down. The plan's packed form is tested as data."""

import copy

import torch

from shardwise.testing import run_distributed
from shardwise.testing.causal_lm import tiny_lm

PROMPTS = [[1 + (7 * i + 3 * j) % 120 for j in range(n)] for i, n in enumerate((3, 9, 1, 14, 6, 11))]
NEW = 8


def _reference(model, prompt):
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def _body(rank, world_size):
    from shardwise.serve import SamplingParams
    from shardwise.serve._tp import TensorParallelOptions, serve_tensor_parallel

    model = tiny_lm("llama")
    reference = copy.deepcopy(model)
    engine = serve_tensor_parallel(model, None, options=TensorParallelOptions(timeout_s=20, heartbeat_s=1),
                                   max_model_len=64, max_num_seqs=4, token_budget=8, block_size=4)  # fmt: skip
    full, held = reference.model.layers[0].self_attn.q_proj.weight, model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(held, full.chunk(world_size, dim=0)[rank])
    if engine is None:  # a follower, returned after the engine's shutdown
        return None
    try:
        assert engine.decoder.decoder.keys.shape[2] == reference.config.num_key_value_heads // world_size
        params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
        streams = [engine.submit(p, params) for p in PROMPTS]
        for prompt, stream in zip(PROMPTS, streams):
            events = list(stream.events(timeout=30))
            assert events[-1].finish_reason == "length", events[-1]
            assert [e.token_id for e in events[:-1]] == _reference(reference, prompt), prompt
        assert engine.metrics().kv_cache_usage_perc == 0
    finally:
        engine.shutdown()
    return engine.decoder.format.size


def test_tensor_parallel_engine_equals_generate(tmp_path):
    results = run_distributed(_body, world_size=2, tmp_path=tmp_path, timeout_s=120)
    assert results[0] > 0 and results[1] is None


def test_plan_round_trips_through_its_packed_form():
    from shardwise.serve._paged import StepPlan
    from shardwise.serve._tp import IDLE, RUN, PlanFormat

    plan_format = PlanFormat(token_budget=8, max_num_seqs=3, max_blocks=4)
    plan = StepPlan(ids=[5, 6, 7, 9], starts=[4, 0], ends=[5, 3], samples=[True, False], tables=[[3, 1], [0]])
    message = plan_format.pack(plan, 7, RUN)
    assert message.shape == (plan_format.size,) and plan_format.unpack(message) == (7, RUN, plan)
    assert plan_format.unpack(plan_format.pack(None, 8, IDLE)) == (8, IDLE, None)
