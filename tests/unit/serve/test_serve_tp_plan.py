"""Tensor-parallel serving's control flow without processes: rank 0 sends a heartbeat only
after ``heartbeat_s`` idle, a follower runs the plans it is sent, returns at ``STOP`` and
refuses a message out of order, and a batching engine whose decoder failed ends every
request it holds with the error and answers later ones with it."""

import pytest
import torch

from shardwise.serve import SamplingParams
from shardwise.serve._batching import BatchingEngine
from shardwise.serve._paged import PagedDecoder, StepPlan
from shardwise.serve._tp import IDLE, RUN, STOP, PlanBroadcaster, PlanFormat, follow

transformers = pytest.importorskip("transformers")
FORMAT = PlanFormat(token_budget=8, max_num_seqs=2, max_blocks=4)
PLAN = StepPlan(ids=[5, 6, 7], starts=[0], ends=[3], samples=[True], tables=[[1]])


class _Handle:
    def wait(self):
        pass


class _ScriptedComm:
    """Records what rank 0 broadcasts; hands a follower the scripted messages in turn."""

    rank = 1

    def __init__(self, script=()):
        self.sent, self.script = [], list(script)

    def broadcast(self, tensor, *, src, tag):
        if self.script:
            tensor.copy_(self.script.pop(0))
        else:
            self.sent.append(FORMAT.unpack(tensor.clone())[:2])
        return _Handle()


class _Recorder:
    block_size, keys = 4, torch.zeros(1)

    def __init__(self):
        self.plans = []

    def run(self, plan):
        self.plans.append(plan)
        return torch.zeros(1, 8)


def test_rank_zero_sends_a_heartbeat_only_after_heartbeat_s_idle():
    comm = _ScriptedComm()
    broadcaster = PlanBroadcaster(_Recorder(), comm, FORMAT, heartbeat_s=0.2)
    broadcaster.idle()
    assert comm.sent == []
    broadcaster._last_sent -= 0.3
    broadcaster.idle()
    broadcaster.idle()
    broadcaster.close()
    assert comm.sent == [(0, IDLE), (1, STOP)]


def test_a_follower_runs_its_plans_returns_at_stop_and_refuses_a_skipped_step():
    script = [FORMAT.pack(None, 0, IDLE), FORMAT.pack(PLAN, 1, RUN), FORMAT.pack(None, 2, STOP)]
    decoder = _Recorder()
    assert follow(decoder, _ScriptedComm(script), FORMAT) == 1 and decoder.plans == [PLAN]
    skipped = [FORMAT.pack(PLAN, 0, RUN), FORMAT.pack(None, 2, STOP)]
    with pytest.raises(RuntimeError, match="got step 2, expected 1"):
        follow(_Recorder(), _ScriptedComm(skipped), FORMAT)


class _Failing(PagedDecoder):
    def run(self, plan):
        self.failed = "the tensor-parallel group failed: a follower died"
        raise RuntimeError(self.failed)


def test_an_engine_whose_decoder_failed_fails_every_request():
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                      num_attention_heads=2, max_position_embeddings=64)  # fmt: skip
    engine = BatchingEngine(transformers.LlamaForCausalLM(config).eval(), None, decoder=_Failing)
    try:
        params = SamplingParams(max_tokens=4, temperature=0)
        events = [list(engine.submit([1, 2, 3], params).events(timeout=20)) for _ in range(2)]
        for stream in events:
            assert [(e.finish_reason, e.error) for e in stream] == [("error", engine.failed)]
        assert "a follower died" in engine.failed
    finally:
        engine.shutdown()
