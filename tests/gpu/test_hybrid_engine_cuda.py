"""The hybrid engine on a CUDA GPU under ZeRO-3 (one process, NCCL world of one): greedy
generation with the decode steps as CUDA graphs (``enable_cuda_graph``) equals the model's
own ``generate`` on the weights as they are after each optimizer step (a graph captured
before a step replays the refreshed weights), with and without a shared prefill, and the
captured steps are really replayed. Skipped without a GPU."""

import pytest
import torch

import shardwise
from shardwise.testing.causal_lm import prompts, tiny_lm
from shardwise.zero import GatheredParameters

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("transformers")

NEW = 12


def _current_model(engine, family):
    """A plain model holding the engine's current (gathered) weights."""
    model = tiny_lm(family).cuda()
    with GatheredParameters(list(engine.module.parameters())):
        state = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    _, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(dict(model.named_parameters())) <= set(state)
    return model


def _train_step(engine, ids):
    engine.train()
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    engine.eval()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("shared", [False, True])
def test_graph_decode_follows_the_current_weights(family, shared):
    config = {
        "train_micro_batch_size_per_gpu": 6,
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "hybrid_engine": {"enabled": True, "max_out_tokens": 32, "enable_cuda_graph": True},
    }
    engine, *_ = shardwise.initialize(model=tiny_lm(family), config=config)
    ids = prompts()[0].repeat(2, 1).cuda()
    ids[1, 0] += 1
    ids = ids.repeat_interleave(3, dim=0)  # two prompts, three rows each
    kwargs = {"max_new_tokens": NEW, "do_sample": False}
    outputs = []
    for _ in range(3):
        engine.eval()
        if shared:
            engine.prepare_shared_prefill(2, 3, ids.shape[1])
        got = engine.module.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        want = _current_model(engine, family).generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        assert torch.equal(got, want), (got, want)
        outputs.append(got)
        batch = torch.randint(3, 128, (6, 10), generator=torch.Generator().manual_seed(len(outputs)))
        _train_step(engine, batch.cuda())
    assert not torch.equal(outputs[0], outputs[-1])  # the steps changed what is generated
    steps = engine.inference_view._steps._steps
    assert len(steps) == 1 and all(step.graph is not None for step in steps.values())
