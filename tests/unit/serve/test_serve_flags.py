"""``shardwise serve``'s vLLM flags for the batching engine reach its scheduler, pool and
cache, through the spec that replicas and tensor-parallel ranks are built from; the token
budget's default depends on the device."""

import pytest
import torch

from shardwise.serve._batching import CPU_TOKEN_BUDGET, GPU_TOKEN_BUDGET, BatchingConfig
from shardwise.serve._cli import build_engine, engine_spec, parser
from shardwise.serve._launch import EngineSpec

transformers = pytest.importorskip("transformers")
from serve_models import tiny_llama  # noqa: E402 - needs transformers

MODEL = tiny_llama()


def test_the_flags_reach_the_engine():
    args = parser().parse_args(["model", "--max-num-seqs", "3", "--max-num-batched-tokens", "24", "--block-size",
                                "8", "--num-gpu-blocks-override", "30", "--no-enable-prefix-caching"])  # fmt: skip
    spec = engine_spec(args)
    assert EngineSpec.from_json(spec.to_json()) == spec  # what a replica or a follower rank gets
    engine = build_engine("batched", MODEL, None, max_model_len=40, max_queue=4, **spec.batching())
    engine.shutdown()
    assert engine.config == BatchingConfig(max_num_seqs=3, token_budget=24, block_size=8, num_blocks=30,
                                           prefix_caching=False)  # fmt: skip
    assert (engine.scheduler.token_budget, engine.allocator.block_size) == (24, 8)
    assert engine.scheduler.prefix_cache is None


def test_without_flags_the_budget_is_the_devices_default():
    spec = engine_spec(parser().parse_args(["model"]))
    assert spec.batching() == {}
    engine = build_engine("batched", MODEL, None, max_model_len=40, max_queue=4, **spec.batching())
    engine.shutdown()
    assert engine.scheduler.token_budget == CPU_TOKEN_BUDGET == 256
    assert engine.scheduler.prefix_cache is not None
    assert BatchingConfig().budget_on(torch.device("cuda", 0)) == GPU_TOKEN_BUDGET == 2048
    assert BatchingConfig(token_budget=64).budget_on(torch.device("cuda", 0)) == 64
