"""A replica process's side of the wire, without processes: the events of one engine step go
out as one message (not one per token), they rebuild every request's greedy tokens, and a
request the replica's engine refuses ends with an error event naming the refusal."""

import time

import pytest

from shardwise.serve import SamplingParams
from shardwise.serve._batching import BatchingEngine
from shardwise.serve._replicas import _ReplicaServer

pytest.importorskip("transformers")
from serve_models import greedy, tiny_llama  # noqa: E402 - needs transformers

NEW = 6
PROMPTS = [[3, 9, 1], [14, 6, 11, 2], [5], [7, 7, 8, 20, 31]]
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)


class _Wire:
    """Records what the replica sends."""

    def __init__(self):
        self.sent: list[tuple] = []

    def send(self, message: tuple) -> None:
        self.sent.append(message)


def test_a_replica_sends_each_steps_events_as_one_message():
    model = tiny_llama()
    engine = BatchingEngine(model, None, max_model_len=64, max_num_seqs=len(PROMPTS))
    wire = _Wire()
    server = _ReplicaServer(engine, wire)
    try:
        for index, prompt in enumerate(PROMPTS):
            server._submit(f"r{index}", prompt, GREEDY)
        deadline = time.monotonic() + 20
        while server.streams and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not server.streams, "requests never finished"
        server._submit("long", [1] * 100, GREEDY)  # beyond max_model_len: the engine refuses it
        server.flush()
    finally:
        engine.shutdown()
    batches = [m[1] for m in wire.sent if m[0] == "events"]
    assert len(batches) == len(wire.sent)
    tokens: dict[str, list[int]] = {}
    for batch in batches:
        for key, token, _, _, _ in batch:
            tokens.setdefault(key, []).extend([] if token is None else [token])
    assert tokens.pop("long") == [] and tokens == {f"r{i}": greedy(model, p, NEW) for i, p in enumerate(PROMPTS)}
    # one step per token of a request, plus at most one more per request admitted late
    assert len(batches) <= NEW + len(PROMPTS), [len(b) for b in batches]
    key, token, finished, reason, error = batches[-1][-1]
    assert (key, token, finished, reason) == ("long", None, True, "error") and error.startswith("ValueError")
