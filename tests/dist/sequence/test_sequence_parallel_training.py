"""Training with ``sequence_parallel_size``: each sequence is split over the ranks of its
sequence-parallel group (2, with 1 and 2 data-parallel replicas), the attention is
DeepSpeed-Ulysses, the loss ``shardwise.sequence.loss.causal_lm_loss`` of the pieces'
already shifted labels; per-step losses and final weights equal single-process training on
whole sequences (SGD and AdamW, ZeRO 0-3). Every rank's MLPs see only its piece of the
sequence and its attention the whole sequence with half the heads."""

import pytest
import torch
from sequence_common import HEADS, SEQ, TinyLM, reference, samples, use_sequence_parallel

import shardwise
from shardwise.testing import run_distributed

STEPS = 3


def _train(rank, world_size, sp, stage, optimizer_name):
    from shardwise.sequence.loss import causal_lm_loss

    replicas = world_size // sp
    data = samples(STEPS, replicas)
    ref_losses, ref_weights = reference(data, optimizer_name, 0.2 if optimizer_name == "sgd" else 0.02)
    model = TinyLM()
    optimizer = (torch.optim.SGD if optimizer_name == "sgd" else torch.optim.AdamW)(
        model.parameters(), lr=0.2 if optimizer_name == "sgd" else 0.02
    )
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "sequence_parallel_size": sp,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    engine, _, _, _ = shardwise.initialize(model=model, optimizer=optimizer, config=config)
    assert engine.train_batch_size() == 2 * replicas  # the replicas, not the ranks, count
    comm = engine.grid.sequence_comm
    use_sequence_parallel(engine.module, comm)
    replica, piece = engine.grid.data_parallel_id // sp, comm.rank
    size = SEQ // sp
    losses = []
    for row in data:
        ids, labels = row[replica]
        positions = torch.arange(SEQ).expand_as(ids)
        mine = slice(piece * size, (piece + 1) * size)
        logits = engine(ids[:, mine], positions[:, mine])
        loss = causal_lm_loss(logits, labels[:, mine], group=comm)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    loss_error = max(abs(a - ref[replica]) for a, ref in zip(losses, ref_losses))
    state = engine.module.state_dict() if stage < 3 else None
    if stage == 3:
        from shardwise.zero import GatheredParameters

        with GatheredParameters(list(engine.module.parameters())):
            state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    weight_error = max(float((state[k] - ref_weights[k]).abs().max()) for k in ref_weights)
    moved = max(float((ref_weights[k] - TinyLM().state_dict()[k]).abs().max()) for k in ref_weights)
    mlp_positions = set(engine.module.blocks[0].seen)
    return loss_error, weight_error, moved, mlp_positions, set(engine.module.attention_seen)


@pytest.mark.parametrize("optimizer_name", ["sgd", "adamw"])
@pytest.mark.parametrize(("world", "stage"), [(2, 0), (2, 2), (4, 1), (4, 3)])
def test_sequence_parallel_training_equals_whole_sequences(tmp_path, world, stage, optimizer_name):
    results = run_distributed(
        _train, world_size=world, tmp_path=tmp_path, sp=2, stage=stage, optimizer_name=optimizer_name
    )
    for loss_error, weight_error, moved, mlp_positions, attention_seen in results:
        assert loss_error < 1e-5, (loss_error, world, stage)
        assert weight_error < 1e-5 and moved > 1e-2, (weight_error, moved)
        assert mlp_positions == {SEQ // 2}  # the pieces, never the whole sequence
        assert attention_seen == {(SEQ, HEADS // 2)}  # the whole sequence, half the heads


def _refusals(rank, world_size):
    from shardwise.config import ConfigError

    messages = []
    for extra, error in (
        ({"sequence_parallel_size": 3}, ValueError),
        ({"sequence_parallel_size": "2"}, ConfigError),
        ({"sequence_parallel_size": 2, "tensor_parallel": {"autotp_size": 2}}, ValueError),
    ):
        config = {"train_micro_batch_size_per_gpu": 1, **extra}
        try:
            shardwise.initialize(model=TinyLM(), model_parameters=TinyLM().parameters(), config=config)
        except error as caught:
            messages.append(str(caught))
    return messages


def test_sizes_that_do_not_fit_and_combinations_not_built_are_refused(tmp_path):
    for messages in run_distributed(_refusals, world_size=2, tmp_path=tmp_path):
        assert len(messages) == 3, messages
        assert "does not divide the 2 data-parallel rank(s)" in messages[0]
        assert "must be a positive integer" in messages[1]
        assert "tensor parallelism" in messages[2] and "not available" in messages[2]
