"""The 1-bit optimizers on tensor- and pipeline-parallel grids (4 gloo ranks): they
compress over the data-parallel group only. On tp2 x dp2 (AutoTP, a Llama model) 1-bit
Adam's warm-up matches single-process AdamW; after the warm-up, for all three
optimizers, every rank holds the same full model (the copies every tensor rank holds
included) while the tensor group carries no compressed traffic. On pp2 x dp2
(PipelineModule with the embedding tied to the head) the stage replicas and both
copies of the tied weight stay identical."""

import copy

import torch
import torch.nn.functional as F
import transformers

import shardwise
from shardwise.pipe import PipelineModule
from shardwise.testing import run_distributed
from shardwise.testing.models import pipeline_specs
from shardwise.testing.parity import full_parameters

MICRO, VOCAB, SEQ, LR = 2, 64, 8, 1e-2


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        vocab_size=VOCAB,
    )
    config.use_cache = False
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def _batches(steps, gbs, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (gbs, SEQ), generator=g) for _ in range(steps)]


def _config(freeze_step, optimizer="OneBitAdam", **extra):
    key = "var_freeze_step" if optimizer == "ZeroOneAdam" else "freeze_step"
    params = {"lr": LR, key: freeze_step}
    if optimizer == "ZeroOneAdam":  # variance steps 1, 2, 4; local steps after, synchronised every 2nd
        params.update(var_update_scaler=2, local_step_scaler=1, local_step_clipper=2)
    return {
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 1000,
        "optimizer": {"type": optimizer, "params": params},
        **extra,
    }


def _tensor_parallel(rank, world_size):
    out = {}
    model = _llama()
    dp = world_size // 2
    for optimizer, freeze_step, steps in (
        ("OneBitAdam", 100, 3),
        ("OneBitAdam", 2, 6),
        ("ZeroOneAdam", 4, 8),
        ("OneBitLamb", 2, 6),
    ):
        batches = _batches(steps, MICRO * dp)
        engine, *_ = shardwise.initialize(
            model=copy.deepcopy(model), config=_config(freeze_step, optimizer, tensor_parallel={"autotp_size": 2})
        )
        dp_rank = engine.grid.get_data_parallel_rank()
        losses = []
        for ids in batches:
            chunk = ids[dp_rank * MICRO : (dp_rank + 1) * MICRO]
            loss = engine(input_ids=chunk, labels=chunk).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        split = {
            n: p.numel() for n, p in engine.module.named_parameters() if getattr(p, "tensor_model_parallel", False)
        }
        out[optimizer, freeze_step] = (
            full_parameters(engine),
            dict(engine.comm.calls),
            dict(engine.grid.tensor_comm.calls),
            split,
            losses,
        )
    return out


def _pipeline(rank, world_size):
    specs = pipeline_specs(4, tied=True, vocab=32, width=16)
    model = PipelineModule(
        specs,
        num_stages=2,
        loss_fn=lambda logits, labels: F.cross_entropy(logits.reshape(-1, 32), labels.reshape(-1)),
        seed_layers=True,
        base_seed=1234,
        partition_method="uniform",
    )
    engine, *_ = shardwise.initialize(model=model, config=_config(2, gradient_accumulation_steps=2))
    dp, dp_rank = engine.grid.data, engine.grid.get_data_parallel_rank()
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(6):
        tokens = torch.randint(0, 32, (MICRO * 2 * dp, 6), generator=g)
        micro = [(tokens[(m * dp + dp_rank) * MICRO : (m * dp + dp_rank + 1) * MICRO],) * 2 for m in range(2)]
        losses.append(float(engine.train_batch(iter(micro))))
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return (
        engine.grid.pipe_rank if hasattr(engine.grid, "pipe_rank") else engine.grid.get_pipe_parallel_rank(),
        params,
        dict(engine.comm.calls),
        dict(engine.grid.pipe_comm.calls),
        losses,
    )


def _reference_adamw(model, batches):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    for ids in batches:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def _grids(rank, world_size):
    return _tensor_parallel(rank, world_size), _pipeline(rank, world_size)


def test_onebit_adam_compresses_over_the_data_group(tmp_path):
    reports = run_distributed(_grids, world_size=4, tmp_path=tmp_path)
    model = _llama()
    reference = _reference_adamw(model, _batches(3, MICRO * 2))
    initial = dict(model.named_parameters())
    moved = max((reference[n] - initial[n].detach()).abs().max().item() for n in reference)
    for rank, (tp, _) in enumerate(reports):
        warm, _, _, split, _ = tp["OneBitAdam", 100]
        assert split and all(numel < initial[n].numel() for n, numel in split.items())  # halves held
        diff = max((warm[n] - reference[n]).abs().max().item() for n in reference)
        assert diff < 2e-3 * moved, f"rank {rank}: tp2 x dp2 warm-up is not AdamW ({diff} of {moved})"
        params, data_calls, tensor_calls, _, losses = tp["OneBitAdam", 2]
        # 4 compressed steps, each exchanging the rank's own shards and the copies every
        # tensor rank holds separately (see [Note: copies on several model-parallel ranks])
        assert data_calls["all_to_all"] == data_calls["all_gather"] == 8, data_calls
        assert max((params[n] - reference[n]).abs().max().item() for n in reference) > 1e-3  # trained on
        for case in (("OneBitAdam", 2), ("ZeroOneAdam", 4), ("OneBitLamb", 2)):
            params, data_calls, tensor_calls, _, losses = tp[case]
            assert data_calls.get("all_to_all", 0) > 0 and "all_to_all" not in tensor_calls, (case, data_calls)
            assert all(torch.equal(params[n], reports[0][0][case][0][n]) for n in params), f"{case}: ranks differ"
            # random tokens: nothing to learn, but nothing may blow up either
            assert max(losses) < 1.5 * losses[0], (case, losses)
    for rank, (_, (stage, params, data_calls, pipe_calls, losses)) in enumerate(reports):
        # 4 compressed steps: the stage's own parameters, and the tied weight apart
        assert data_calls["all_to_all"] == data_calls["all_gather"] == 8, data_calls
        assert "all_to_all" not in pipe_calls
        peer = next(r for r, (_, other) in enumerate(reports) if r != rank and other[0] == stage)
        assert all(torch.equal(params[n], reports[peer][1][1][n]) for n in params), "stage replicas differ"
        assert losses[-1] < losses[0], losses
        tied = [n for n in params if n.startswith("tied_modules.")]
        assert tied, sorted(params)
        other = next(r for r, (_, o) in enumerate(reports) if o[0] != stage)
        assert all(torch.equal(params[n], reports[other][1][1][n]) for n in tied), "tied copies differ"
