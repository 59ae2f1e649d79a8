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


def _train(rank, world_size, sp, stage, optimizer_name, fused=False):
    from shardwise.sequence.loss import causal_lm_loss, fused_causal_lm_loss

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
        if fused:  # the head's logits a few rows at a time, never whole
            hidden = engine(ids[:, mine], positions[:, mine], hidden=True)
            loss = fused_causal_lm_loss(hidden, engine.module.head, labels[:, mine], group=comm, tile_tokens=3)
        else:
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


# each stage once, SGD and AdamW at both world sizes (the whole 4 x 2 grid doubled the time)
@pytest.mark.parametrize(
    ("world", "stage", "optimizer_name"), [(2, 0, "sgd"), (2, 2, "adamw"), (4, 1, "adamw"), (4, 3, "sgd")]
)
def test_sequence_parallel_training_equals_whole_sequences(tmp_path, world, stage, optimizer_name):
    results = run_distributed(
        _train, world_size=world, tmp_path=tmp_path, sp=2, stage=stage, optimizer_name=optimizer_name
    )
    for loss_error, weight_error, moved, mlp_positions, attention_seen in results:
        assert loss_error < 1e-5, (loss_error, world, stage)
        assert weight_error < 1e-5 and moved > 1e-2, (weight_error, moved)
        assert mlp_positions == {SEQ // 2}  # the pieces, never the whole sequence
        assert attention_seen == {(SEQ, HEADS // 2)}  # the whole sequence, half the heads


@pytest.mark.parametrize(("world", "stage", "optimizer_name"), [(2, 0, "sgd"), (4, 2, "adamw")])
def test_the_fused_loss_trains_as_whole_sequences(tmp_path, world, stage, optimizer_name):
    results = run_distributed(
        _train, world_size=world, tmp_path=tmp_path, sp=2, stage=stage, optimizer_name=optimizer_name, fused=True
    )
    for loss_error, weight_error, moved, mlp_positions, _ in results:
        assert loss_error < 1e-5, (loss_error, world, stage)
        assert weight_error < 1e-5 and moved > 1e-2, (weight_error, moved)
        assert mlp_positions == {SEQ // 2}


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


def _composed(rank, world_size, bf16):
    """sp 2 with gradient accumulation 2, every block under activation checkpointing with its
    inputs kept in CPU memory, ZeRO 2, SGD; bf16 optionally."""
    from shardwise import checkpointing
    from shardwise.sequence.loss import causal_lm_loss

    accumulation, lr = 2, 0.2
    data = samples(STEPS * accumulation, 1)
    ref_losses, ref_weights = reference(data, "sgd", lr, accumulation, bf16_start=bf16)
    model = TinyLM()
    model.checkpointed = True
    checkpointing.configure(None, checkpoint_in_cpu=True)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": 0.0,
        "sequence_parallel_size": 2,
        "zero_optimization": {"stage": 2},
        "bf16": {"enabled": bf16},
    }
    engine, _, _, _ = shardwise.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr), config=config
    )
    comm = engine.grid.sequence_comm
    use_sequence_parallel(engine.module, comm)
    mine = slice(comm.rank * SEQ // 2, (comm.rank + 1) * SEQ // 2)
    losses = []
    for ((ids, labels),) in data:
        logits = engine(ids[:, mine], torch.arange(SEQ).expand_as(ids)[:, mine])
        loss = causal_lm_loss(logits, labels[:, mine], group=comm)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    from shardwise.utils import safe_get_full_fp32_param

    state = {k: safe_get_full_fp32_param(p) for k, p in engine.module.named_parameters()}  # the fp32 masters
    initial = TinyLM().state_dict()
    moved = max(float((ref_weights[k] - initial[k]).abs().max()) for k in ref_weights)
    weight_error = max(float((state[k] - ref_weights[k]).abs().max()) for k in state)
    loss_error = max(abs(a - ref[0]) for a, ref in zip(losses, ref_losses))
    return loss_error, weight_error, moved, engine.global_steps


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_accumulation_checkpointing_and_bf16_compose(tmp_path, bf16):
    for loss_error, weight_error, moved, steps in run_distributed(
        _composed, world_size=2, tmp_path=tmp_path, bf16=bf16
    ):
        assert steps == STEPS
        if bf16:  # bf16 rounds each product: well below the weights' movement
            assert loss_error < 0.05 and weight_error < 0.1 * moved, (loss_error, weight_error, moved)
        else:
            assert loss_error < 1e-5 and weight_error < 1e-5, (loss_error, weight_error)


def _saved_for_backward(model, run) -> int:
    """Bytes of the distinct activation storages autograd keeps for backward (parameters and
    their transposed views aside)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(storages.values())


def _activation_memory(rank, world_size):
    ids = torch.randint(0, 32, (2, SEQ), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(SEQ).expand_as(ids)
    reference = TinyLM()
    whole = _saved_for_backward(reference, lambda: reference(ids, positions))
    model = TinyLM()
    config = {"train_micro_batch_size_per_gpu": 2, "sequence_parallel_size": 2}
    engine, _, _, _ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
    comm = engine.grid.sequence_comm
    use_sequence_parallel(engine.module, comm)
    mine = slice(comm.rank * SEQ // 2, (comm.rank + 1) * SEQ // 2)
    piece = _saved_for_backward(engine.module, lambda: engine(ids[:, mine], positions[:, mine]))
    return piece / whole


def test_each_rank_keeps_about_half_the_activations(tmp_path):
    """What autograd keeps for backward (the activations), per rank against the whole sequence
    on one rank: half, plus attention's share of the heads over the whole sequence."""
    for ratio in run_distributed(_activation_memory, world_size=2, tmp_path=tmp_path):
        assert 0.45 < ratio < 0.6, ratio


def _head_loss_sum(head, hidden, labels):
    logits = head(hidden)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")


def _one_accumulated_step(stage, tiled):
    """Weights after one SGD step over 2 accumulated micro-batches (the engine scales each
    loss by 1/2 after the tiled loss), with the head's loss tiled or whole."""
    from shardwise.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss
    from shardwise.sequence.loss import mean_over_sequence

    model = TinyLM()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.0,
        "sequence_parallel_size": 2,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    engine, _, _, _ = shardwise.initialize(model=model, optimizer=optimizer, config=config)
    comm = engine.grid.sequence_comm
    use_sequence_parallel(engine.module, comm)
    mine = slice(comm.rank * SEQ // 2, (comm.rank + 1) * SEQ // 2)
    head = engine.module.head
    for ((ids, labels),) in samples(2, 1):
        hidden = engine(ids[:, mine], torch.arange(SEQ).expand_as(ids)[:, mine], hidden=True)
        targets = labels[:, mine]
        if tiled:
            loss_sum = TiledFusedLogitsLoss.apply(_head_loss_sum, head, hidden, targets, None, 4, [head.weight], "sum")
        else:
            loss_sum = _head_loss_sum(head, hidden, targets)
        engine.backward(mean_over_sequence(loss_sum, (targets != -100).sum(), group=comm))
        engine.step()
    from shardwise.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _tiled_against_whole_loss(rank, world_size):
    out = {}
    for stage in (2, 3):
        tiled, whole = _one_accumulated_step(stage, True), _one_accumulated_step(stage, False)
        start = TinyLM().state_dict()
        out[stage] = (
            max(float((tiled[k] - whole[k]).abs().max()) for k in whole),
            float((whole["head.weight"] - start["head.weight"]).abs().max()),
        )
    return out


def test_the_tiled_logits_loss_under_zero_2_and_3_equals_the_whole_loss(tmp_path):
    """TiledFusedLogitsLoss (gradients from forward at ZeRO 2, recomputed at ZeRO 3) gives the
    weights of the untiled loss after a step over 2 accumulated micro-batches: ZeRO's gradient
    hooks see the head's gradient, and the accumulation's 1/2 after the loss reaches it."""
    for result in run_distributed(_tiled_against_whole_loss, world_size=2, tmp_path=tmp_path):
        for stage, (error, moved) in result.items():
            assert error < 1e-6 and moved > 1e-3, (stage, error, moved)
