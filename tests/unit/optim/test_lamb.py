import copy

import pytest
import torch

from shardwise.optim import Lamb


def _reference_step(p, grad, state, group):
    """LAMB for one parameter, written out element-wise from the paper / FusedLamb kernel."""
    beta1, beta2 = group["betas"]
    state["step"] += 1
    t = state["step"]
    m, v = state["m"], state["v"]
    m.mul_(beta1).add_(grad, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    c1 = 1 - beta1**t if group["bias_correction"] else 1.0
    c2 = 1 - beta2**t if group["bias_correction"] else 1.0
    if group["eps_inside_sqrt"]:
        denom = (v / c2 + group["eps"]).sqrt()
    else:
        denom = (v / c2).sqrt() + group["eps"]
    update = (m / c1) / denom + group["weight_decay"] * p
    w_norm, u_norm = p.norm().item(), update.norm().item()
    trust = 1.0
    if w_norm != 0 and u_norm != 0:
        trust = min(max(w_norm / u_norm, group["min_coeff"]), group["max_coeff"])
    p.sub_(group["lr"] * trust * update)


def _run_against_reference(groups, steps, grad_mask=None, seed=0):
    """Step Lamb and the reference on the same gradients; return (lamb params, reference params)."""
    torch.manual_seed(seed)
    opt = Lamb([dict(g) for g in groups])
    reference = [[p.detach().clone() for p in g["params"]] for g in groups]
    ref_state = {}
    for step in range(steps):
        for gi, group in enumerate(opt.param_groups):
            for pi, p in enumerate(group["params"]):
                has_grad = grad_mask is None or grad_mask(step, gi, pi)
                grad = torch.randn_like(p) if has_grad else None
                p.grad = grad
                if has_grad:
                    r = reference[gi][pi]
                    state = ref_state.setdefault(
                        (gi, pi), {"step": 0, "m": torch.zeros_like(r), "v": torch.zeros_like(r)}
                    )
                    _reference_step(r, grad, state, group)
        opt.step()
    return opt, reference


def _assert_matches(opt, reference):
    for group, refs in zip(opt.param_groups, reference):
        for p, r in zip(group["params"], refs):
            torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"weight_decay": 0.01, "betas": (0.8, 0.99), "eps": 1e-6},
        {"eps_inside_sqrt": True, "eps": 1e-4},
        {"bias_correction": False, "weight_decay": 0.1},
        {"min_coeff": 0.5, "max_coeff": 0.8},  # the trust ratio is clamped both ways
        {"min_coeff": 2.0, "max_coeff": 3.0},
    ],
    ids=["defaults", "decay", "eps_inside_sqrt", "no_bias_correction", "clamp_low", "clamp_high"],
)
def test_matches_reference_implementation(options):
    params = [
        torch.nn.Parameter(torch.randn(4, 3)),
        torch.nn.Parameter(torch.randn(7)),
        torch.nn.Parameter(torch.randn(2, 2, 2)),
    ]
    opt, reference = _run_against_reference([{"params": params, "lr": 0.05, **options}], steps=5)
    _assert_matches(opt, reference)


def test_zero_norm_gives_an_unclamped_trust_ratio_of_one():
    # A zero weight with max_coeff < 1: FusedLamb uses 1.0, not min(1, max_coeff).
    params = [torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.randn(5))]
    opt, reference = _run_against_reference([{"params": params, "lr": 0.1, "max_coeff": 0.5}], steps=1)
    _assert_matches(opt, reference)
    assert params[0].detach().abs().max() > 0.09  # moved by lr * 1.0 * ~1, not by lr * 0.5


def test_groups_and_parameters_that_skip_steps_keep_their_own_step_counts():
    groups = [
        {"params": [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3, 2))], "lr": 0.02},
        {"params": [torch.nn.Parameter(torch.randn(6))], "lr": 0.1, "weight_decay": 0.05},
    ]
    opt, reference = _run_against_reference(
        groups, steps=6, grad_mask=lambda step, g, p: not (g == 0 and p == 1 and step % 2)
    )
    _assert_matches(opt, reference)
    assert opt.state[groups[0]["params"][1]]["step"].item() == 3
    assert opt.state[groups[0]["params"][0]]["step"].item() == 6


def test_mixed_dtypes_in_one_group():
    params = [torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(8, dtype=torch.float64))]
    opt, reference = _run_against_reference([{"params": params, "lr": 0.05}], steps=3)
    _assert_matches(opt, reference)
    assert opt.state[params[1]]["exp_avg"].dtype == torch.float64


def test_state_dict_round_trip_continues_identically():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))]
    opt = Lamb(params, lr=0.01, weight_decay=0.01)
    grads = [[torch.randn_like(p) for p in params] for _ in range(6)]

    def apply(optimizer, tensors, step_grads):
        for p, g in zip(tensors, step_grads):
            p.grad = g.clone()
        optimizer.step()

    for g in grads[:3]:
        apply(opt, params, g)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin_opt = Lamb(twins, lr=0.5)  # hyper-parameters come back from the state dict
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for g in grads[3:]:
        apply(opt, params, g)
        apply(twin_opt, twins, g)
    for p, q in zip(params, twins):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_rebuilds_from_its_defaults():
    # The ZeRO strategies rebuild a client optimizer over shards as type(opt)(params, **defaults).
    opt = Lamb([torch.nn.Parameter(torch.ones(2))], lr=0.3, eps_inside_sqrt=True, min_coeff=0.1)
    clone = type(opt)([torch.nn.Parameter(torch.ones(2))], **opt.defaults)
    assert clone.defaults == opt.defaults


def test_decreases_a_loss():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    opt = Lamb(model.parameters(), lr=0.02, weight_decay=0.01)
    losses = []
    for _ in range(60):
        loss = torch.nn.functional.mse_loss(model(x), y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < 0.7 * losses[0]


def test_closure_and_parameters_without_gradients():
    p, frozen = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = Lamb([p, frozen], lr=0.1)

    def closure():
        loss = (p * 2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 6.0
    assert torch.equal(frozen.detach(), torch.ones(3)) and frozen not in opt.state
    assert (p.detach() < 1).all()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"amsgrad": True}, "amsgrad"),
        ({"lr": -1.0}, "lr"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"min_coeff": 2.0, "max_coeff": 1.0}, "min_coeff"),
    ],
)
def test_invalid_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Lamb([torch.nn.Parameter(torch.ones(1))], **kwargs)


def test_sparse_gradients_are_refused():
    p = torch.nn.Parameter(torch.ones(4, 2))
    p.grad = torch.ones(4, 2).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        Lamb([p]).step()
