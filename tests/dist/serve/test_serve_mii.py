"""DeepSpeed-MII's API: ``mii.pipeline`` in process and ``mii.serve`` / ``mii.client`` over a
real server process give greedy text equal to ``generate``, MII's response fields, streaming
through ``streaming_fn``, replicas (no process left after ``terminate_server``), and refuse
what is not built by name."""

import os

import pytest
from _serve_server import greedy_answers, save_tiny_model

import shardwise.mii as mii

pytest.importorskip("fastapi")

PROMPTS = ["w5 w17 w9", "w100 w3 w44 w45"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def expected(model_dir):
    return greedy_answers(model_dir, PROMPTS, 6)


def test_pipeline_greedy_equals_generate(model_dir, expected):
    pipe = mii.pipeline(str(model_dir))
    try:
        responses = pipe(PROMPTS, max_new_tokens=6, do_sample=False)
    finally:
        pipe.destroy()
    assert [(r.generated_text, r.prompt_length) for r in responses] == expected
    assert all(r.finish_reason in ("stop", "length") and 0 < r.generated_length <= 6 for r in responses)
    assert str(responses[0]) == responses[0].generated_text


def test_serve_client_and_terminate(model_dir, expected):
    client = mii.serve(str(model_dir), deployment_name="tiny-mii")
    try:
        answers = client.generate(PROMPTS, max_new_tokens=6, do_sample=False)
        assert [(r.generated_text, r.prompt_length) for r in answers] == expected
        again = mii.client("tiny-mii")
        pieces = []
        streamed = again.generate(PROMPTS[0], max_new_tokens=6, do_sample=False, streaming_fn=pieces.append)
        assert "".join(p[0].generated_text for p in pieces) == expected[0][0] == streamed[0].generated_text
        assert streamed[0].generated_length == answers[0].generated_length
    finally:
        client.terminate_server()
    assert client._process.poll() is not None
    with pytest.raises(ValueError, match="no running deployment"):
        mii.client("tiny-mii")


def test_serve_replicas(model_dir, expected):
    from test_serve_parallel import descendants

    # replica_num=2 with tensor_parallel=2 (each replica with its follower) passes too; one
    # process per replica keeps the suite short (test_serve_parallel.py covers the followers)
    client = mii.serve(str(model_dir), deployment_name="tiny-mii-replicas", replica_num=2)
    processes = descendants(client.pid)
    try:
        assert len(processes) == 2  # the replicas
        answers = client.generate(PROMPTS * 2, max_new_tokens=6, do_sample=False)
        assert [(r.generated_text, r.prompt_length) for r in answers] == expected * 2
    finally:
        client.terminate_server()
    assert not any(os.path.exists(f"/proc/{pid}") for pid in processes)


@pytest.mark.parametrize(
    "call, kwargs, name",
    [(mii.serve, {"replica_num": 0}, "replica_num"), (mii.serve, {"tensor_parallel": 0}, "tensor_parallel"),
     (mii.pipeline, {"tensor_parallel": 2}, "tensor_parallel")],
)  # fmt: skip
def test_what_is_not_built_is_refused_by_name(call, kwargs, name):
    with pytest.raises(ValueError, match=name):
        call("unused", **kwargs)


def test_unknown_generation_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="num_beams"):
        mii.Client("x", "http://127.0.0.1:9", 0).generate("w5", num_beams=2)
