"""1-bit Adam through ``shardwise.initialize`` on 2 and 4 gloo ranks.

Before ``freeze_step`` it must equal torch's AdamW on the global batch; after it, a
single-process simulation of the algorithm over the same number of ranks (each rank's
momentum from its own micro-batches, averaged by the compressed exchange). Also: the
gradient all-reduce stops after the warm-up, an fp16 overflow on one rank skips the step
on every rank without touching the error buffers, and a checkpoint resumes bit-identically.
"""

import copy

import pytest
import torch

import shardwise
from shardwise.comm._compressed import compress, decompress
from shardwise.testing import run_distributed
from shardwise.testing.models import TinyMLP, token_batches
from shardwise.testing.parity import reference_run

MICRO, LR, WD, BETAS, EPS, CLIP = 2, 1e-2, 0.01, (0.9, 0.999), 1e-8, 0.05


def _config(freeze_step, gas=1, **extra):
    return {
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 1000,
        "optimizer": {"type": "OneBitAdam", "params": {"lr": LR, "weight_decay": WD, "freeze_step": freeze_step}},
        **extra,
    }


def _train(engine, batches, rank, world_size, gas=1, poison=None):
    """Run the global batches through ``engine``; ``poison``: (step, rank) whose first
    micro-batch's loss becomes inf."""
    for step, (tokens, targets) in enumerate(batches):
        for micro in range(gas):
            start = (micro * world_size + rank) * MICRO
            loss = engine(tokens[start : start + MICRO], targets[start : start + MICRO])
            if poison == (step, rank) and micro == 0:
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()


def _clip_(grads, norm, clip):
    coef = clip / (norm + 1e-6)
    if clip and coef < 1:
        for g in grads:
            g.mul_(coef)


def _simulate(model, batches, world_size, freeze_step, gas=1, clip=0.0):
    """1-bit Adam over ``world_size`` simulated ranks in one process; ``clip``: the
    engine's gradient clipping (after the warm-up by the root mean square of the ranks'
    local gradient norms)."""
    model = copy.deepcopy(model)
    params = list(model.parameters())
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    numel = sum(p.numel() for p in params)
    padded = -(-numel // (8 * world_size)) * 8 * world_size
    chunk = padded // world_size
    worker = [torch.zeros(world_size, chunk) for _ in range(world_size)]
    server = [torch.zeros(1, chunk) for _ in range(world_size)]
    for step, (tokens, targets) in enumerate(batches, start=1):
        grads = []
        for rank in range(world_size):
            total = [torch.zeros_like(p) for p in params]
            for micro in range(gas):
                start = (micro * world_size + rank) * MICRO
                model.zero_grad()
                (model(tokens[start : start + MICRO], targets[start : start + MICRO]) / gas).backward()
                total = [t + p.grad for t, p in zip(total, params)]
            grads.append(total)
        with torch.no_grad():
            if step <= freeze_step:
                g = [sum(gr[i] for gr in grads) / world_size for i in range(len(params))]
                _clip_(g, float(torch.sqrt(sum(t.double().pow(2).sum() for t in g))), clip)
                for i in range(len(params)):
                    m[i].lerp_(g[i], 1 - BETAS[0])
                    v[i].mul_(BETAS[1]).addcmul_(g[i], g[i], value=1 - BETAS[1])
            else:
                squares = [sum(t.double().pow(2).sum() for t in gr) for gr in grads]
                rms = float(torch.sqrt(sum(squares) / world_size))
                for gr in grads:
                    _clip_(gr, rms, clip)
                sent = []
                for rank in range(world_size):
                    local = [mi.lerp(gr, 1 - BETAS[0]) for mi, gr in zip(m, grads[rank])]
                    flat = torch.cat([t.reshape(-1) for t in local] + [torch.zeros(padded - numel)])
                    sent.append(decompress(compress(flat.view(world_size, chunk), worker[rank])))
                out = torch.cat(
                    [
                        decompress(
                            compress(torch.stack([sent[r][j] for r in range(world_size)]).mean(0)[None], server[j])
                        )[0]
                        for j in range(world_size)
                    ]
                )
                pieces = out[:numel].split([p.numel() for p in params])
                m = [piece.view_as(p).clone() for piece, p in zip(pieces, params)]
            c1, c2 = 1 - BETAS[0] ** step, 1 - BETAS[1] ** min(step, freeze_step)
            for p, mi, vi in zip(params, m, v):
                p.mul_(1 - LR * WD)
                p.addcdiv_(mi, (vi.sqrt() / c2**0.5).add_(EPS), value=-LR / c1)
    return model


def _error_buffers(optimizer):
    return {
        f"{name}.{kind}": value.clone()
        for name, buffers in optimizer.rank_state_dict()["exchanges"].items()
        for kind, value in buffers.items()
    }


def _params(module):
    return [p.detach().clone() for p in module.parameters()]


def _run(rank, world_size, save_dir):
    report = {}
    model = TinyMLP(seed=1)
    # warm-up only: torch's AdamW on the global batch
    batches = token_batches(num_steps=4, batch=MICRO * world_size, seed=2)
    engine, optimizer, _, _ = shardwise.initialize(model=copy.deepcopy(model), config=_config(freeze_step=100))
    _train(engine, batches, rank, world_size)
    report["warm-up"] = (_params(engine.module), type(optimizer).__name__, dict(engine.comm.calls))

    # 3 warm-up steps, then compressed, with and without gradient accumulation
    for gas in (1, 2):
        batches = token_batches(num_steps=7, batch=MICRO * gas * world_size, seed=3)
        engine, _, _, _ = shardwise.initialize(
            model=copy.deepcopy(model), config={**_config(freeze_step=3, gas=gas), "steps_per_print": 1}
        )
        _train(engine, batches, rank, world_size, gas=gas)
        report[f"compressed gas{gas}"] = (
            _params(engine.module),
            dict(engine.comm.calls),
            dict(engine.comm.bytes),
            engine._progress.last["data_parallel_bytes_per_step"],
        )

    # gradient clipping on every step: by the global norm in warm-up, by the ranks' RMS after
    batches = token_batches(num_steps=7, batch=MICRO * world_size, seed=3)
    engine, _, _, _ = shardwise.initialize(
        model=copy.deepcopy(model), config={**_config(freeze_step=3), "gradient_clipping": CLIP}
    )
    norms = []
    for step in range(len(batches)):
        _train(engine, batches[step : step + 1], rank, world_size)
        norms.append(engine.get_global_grad_norm())
    report["compressed clip"] = (_params(engine.module), min(norms))

    # fp16: rank 0 overflows at a compressed step; every rank skips it, error buffers untouched
    batches = token_batches(num_steps=5, batch=MICRO * world_size, seed=4)
    engine, optimizer, _, _ = shardwise.initialize(
        model=copy.deepcopy(model),
        config=_config(freeze_step=2, fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1}),
    )
    _train(engine, batches[:3], rank, world_size)
    errors = _error_buffers(optimizer)
    _train(engine, batches[3:4], rank, world_size, poison=(0, 0))
    after = _error_buffers(optimizer)
    untouched = len(errors) == 2 and all(torch.equal(errors[k], after[k]) for k in errors)
    _train(engine, batches[4:], rank, world_size)
    report["fp16 overflow"] = (engine.skipped_steps, untouched, _params(engine.module))

    # checkpoint after compression started; the resumed run continues bit-identically
    batches = token_batches(num_steps=6, batch=MICRO * world_size, seed=5)
    engine, _, _, _ = shardwise.initialize(model=copy.deepcopy(model), config=_config(freeze_step=2))
    _train(engine, batches[:4], rank, world_size)
    engine.save_checkpoint(save_dir, tag="step4")
    _train(engine, batches[4:], rank, world_size)
    straight = _params(engine.module)
    engine, _, _, _ = shardwise.initialize(model=copy.deepcopy(model), config=_config(freeze_step=2))
    engine.load_checkpoint(save_dir, tag="step4")
    _train(engine, batches[4:], rank, world_size)
    report["resumed"] = all(torch.equal(a, b) for a, b in zip(straight, _params(engine.module)))

    # ZeRO stages that partition state refuse a 1-bit optimizer built by the user
    try:
        shardwise.initialize(
            model=copy.deepcopy(model),
            optimizer=shardwise.optim.OneBitAdam(copy.deepcopy(model).parameters()),
            config={
                "gradient_clipping": 0.0,
                "train_micro_batch_size_per_gpu": MICRO,
                "zero_optimization": {"stage": 2},
            },
        )
        report["zero2"] = "accepted"
    except ValueError as exc:
        report["zero2"] = str(exc)
    return report


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("world_size", [2, 4])
def test_onebit_adam(tmp_path, world_size):
    reports = run_distributed(_run, world_size=world_size, tmp_path=tmp_path, save_dir=str(tmp_path / "ckpt"))
    model = TinyMLP(seed=1)
    warm = reference_run(
        model,
        token_batches(num_steps=4, batch=MICRO * world_size, seed=2),
        lr=LR,
        weight_decay=WD,
        clip=0.0,
        foreach=False,
    )
    for rank, report in enumerate(reports):
        params, name, calls = report["warm-up"]
        assert name == "OneBitAdam" and "all_to_all" not in calls
        assert _max_diff(params, list(warm.model.parameters())) < 2e-5, f"rank {rank}: warm-up is not AdamW"
        assert warm.movement() > 0.03

        for gas in (1, 2):
            params, calls, sent, last_step = report[f"compressed gas{gas}"]
            expected = _simulate(
                model,
                token_batches(num_steps=7, batch=MICRO * gas * world_size, seed=3),
                world_size,
                freeze_step=3,
                gas=gas,
            )
            # measured 1.6e-7 (fp32 rounding); the parameters move by 0.1-0.4
            assert _max_diff(params, list(expected.parameters())) < 1e-5, (
                f"rank {rank} gas {gas}: not the simulated 1-bit Adam"
            )
            # 3 gradient all-reduces in warm-up (one bucket), then 4 steps of two compressed collectives
            assert calls["all_to_all"] == calls["all_gather"] == 4, calls
            assert calls["all_reduce"] == 3, calls
            assert sent["all_reduce"] / 3 > 12 * (sent["all_to_all"] + sent["all_gather"]) / 4, sent
            # what the progress line reports for the last step: the compressed exchange only
            assert last_step == {"all_to_all": sent["all_to_all"] / 4, "all_gather": sent["all_gather"] / 4}
            assert all(torch.equal(a, b) for a, b in zip(params, reports[0][f"compressed gas{gas}"][0]))

        params, smallest_norm = report["compressed clip"]
        assert smallest_norm > CLIP, smallest_norm  # every step clipped
        expected = _simulate(
            model, token_batches(num_steps=7, batch=MICRO * world_size, seed=3), world_size, freeze_step=3, clip=CLIP
        )
        assert _max_diff(params, list(expected.parameters())) < 1e-5, f"rank {rank}: clipping is not the simulated"

        skipped, untouched, params = report["fp16 overflow"]
        assert skipped == 1 and untouched, (skipped, untouched)
        assert all(torch.equal(a, b) for a, b in zip(params, reports[0]["fp16 overflow"][2])), "ranks diverged"
        assert report["resumed"], f"rank {rank}: the resumed run differs"
        assert "ZeRO stage 0 only" in report["zero2"], report["zero2"]
