"""A model written with shardwise's Megatron-style layers, trained by the engine with the
grid as its ``mpu``: tp2 x dp2 at ZeRO 0-3, with and without sequence parallelism, matches
the same model built from plain PyTorch layers and trained in one process."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.parallel import ParallelGrid
from shardwise.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelLayerNorm,
    VocabParallelEmbedding,
    scatter_to_sequence_region,
    vocab_parallel_cross_entropy,
)
from shardwise.testing import run_distributed
from shardwise.testing.models import token_batches
from shardwise.testing.parity import STAGE3_PARTITION_ALL, full_parameters

V, H, S, MICRO, STEPS, LR, CLIP = 32, 16, 8, 2, 3, 1.0, 0.5


class Plain(nn.Module):
    """Embedding -> pre-norm MLP block -> untied head, sequence-first inside."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.embed = nn.Embedding(V, H)
        self.norm = nn.LayerNorm(H)
        self.fc1 = nn.Linear(H, 4 * H)
        self.fc2 = nn.Linear(4 * H, H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, tokens, targets):
        h = self.embed(tokens).transpose(0, 1)  # [S, B, H]
        h = h + self.fc2(F.gelu(self.fc1(self.norm(h))))
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.transpose(0, 1).flatten())


class Megatron(nn.Module):
    """``Plain`` split over the tensor group: vocab-parallel embedding, column -> row MLP,
    vocab-parallel head and loss; with ``sequence_parallel`` the block runs on this rank's
    sequence chunk (LayerNorm included) with all-gather / reduce-scatter instead of
    all-reduce."""

    def __init__(self, plain: Plain, grid, *, sequence_parallel: bool):
        super().__init__()
        plain = copy.deepcopy(plain)
        sp = sequence_parallel
        self.grid, self.sp = grid, sp
        self.embed = VocabParallelEmbedding.from_embedding(plain.embed, group=grid)
        self.norm = SequenceParallelLayerNorm.from_layer_norm(plain.norm, group=grid) if sp else plain.norm
        self.fc1 = ColumnParallelLinear.from_linear(plain.fc1, group=grid, gather_output=False, sequence_parallel=sp)
        self.fc2 = RowParallelLinear.from_linear(plain.fc2, group=grid, input_is_parallel=True, sequence_parallel=sp)
        self.head = ColumnParallelLinear.from_linear(plain.head, group=grid, gather_output=False, sequence_parallel=sp)

    def forward(self, tokens, targets):
        h = self.embed(tokens).transpose(0, 1)
        if self.sp:
            h = scatter_to_sequence_region(h, self.grid.tensor_comm)  # [S / tp, B, H]
        h = h + self.fc2(F.gelu(self.fc1(self.norm(h))))
        logits = self.head(h)  # [S, B, V / tp]: the head gathers the sequence under sp
        return vocab_parallel_cross_entropy(logits, targets.transpose(0, 1), self.grid).mean()


def _train(rank, world_size):
    grid = ParallelGrid.build(tensor=2)
    dp, dp_rank = grid.data, grid.get_data_parallel_rank()
    out = {}
    for sp in (False, True):
        for stage in (0, 1, 2, 3):
            plain = Plain()
            batches = token_batches(num_steps=STEPS, batch=MICRO * 2 * dp, seq=S, vocab=V, seed=8)
            reference = copy.deepcopy(plain)
            opt = torch.optim.SGD(reference.parameters(), lr=LR)
            ref_norms = []
            for tokens, targets in batches:
                reference(tokens, targets).backward()
                ref_norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)))
                opt.step()
                opt.zero_grad()
            config = {
                "train_micro_batch_size_per_gpu": MICRO,
                "gradient_accumulation_steps": 2,
                "gradient_clipping": CLIP,
                "optimizer": {"type": "SGD", "params": {"lr": LR}},
                "steps_per_print": 1000,
                "zero_optimization": {
                    "stage": stage,
                    "reduce_bucket_size": 500,
                    **(STAGE3_PARTITION_ALL if stage == 3 else {}),
                },
            }
            engine, *_ = shardwise.initialize(
                model=Megatron(plain, grid, sequence_parallel=sp), mpu=grid, config=config
            )
            norms = []
            for tokens, targets in batches:
                for micro in range(2):
                    start = (micro * dp + dp_rank) * MICRO
                    engine.backward(engine(tokens[start : start + MICRO], targets[start : start + MICRO]))
                    engine.step()
                norms.append(engine.get_global_grad_norm())
            got = full_parameters(engine)
            moved = max(
                (p.detach() - q.detach()).abs().max().item() for p, q in zip(reference.parameters(), plain.parameters())
            )
            diff = max((got[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())
            out[(sp, stage)] = (
                diff,
                moved,
                norms,
                ref_norms,
                tuple(engine.module.fc1.weight.shape) if stage != 3 else tuple(engine.module.fc1.weight.ds_shape),
            )
    # fp16: an overflow on one tensor rank's shard only makes every rank skip the step
    engine, *_ = shardwise.initialize(
        model=Megatron(Plain(), grid, sequence_parallel=False),
        mpu=grid,
        config={
            "gradient_clipping": 0.0,
            "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "fp16": {"enabled": True, "initial_scale_power": 4},
            "steps_per_print": 1000,
        },
    )
    tokens, targets = token_batches(num_steps=1, batch=MICRO, seq=S, vocab=V, seed=9)[0]
    engine.backward(engine(tokens, targets))
    if grid.tensor_rank == 1:
        with torch.no_grad():
            engine.module.fc1.weight.grad[0, 0] = float("inf")  # after the data-parallel all-reduce
    engine.step()
    out["overflow"] = (engine.was_step_applied(), engine.get_loss_scale())
    return out


def test_megatron_layers_train_under_every_zero_stage(tmp_path):
    reports = run_distributed(_train, world_size=4, tmp_path=tmp_path)
    for rank, report in enumerate(reports):
        # skipped everywhere (hysteresis 2 keeps the scale at 2**4 after one overflow)
        assert report.pop("overflow") == (False, 16.0), f"rank {rank}: the overflow on tensor rank 1 was not agreed"
        for (sp, stage), (diff, moved, norms, ref_norms, fc1_shape) in report.items():
            case = f"rank {rank} sequence_parallel={sp} stage {stage}"
            assert diff < 1e-4 * moved, f"{case}: max |diff| {diff:.3g}, training moved {moved:.3g}"
            assert max(ref_norms) > CLIP, f"{case}: clipping never happened"
            for mine, ref in zip(norms, ref_norms):
                assert abs(mine - ref) <= 1e-5 * ref, f"{case}: norm {mine} vs {ref}"
            assert fc1_shape == (2 * H, H), f"{case}: fc1 holds {fc1_shape}, not half of ({4 * H}, {H})"
