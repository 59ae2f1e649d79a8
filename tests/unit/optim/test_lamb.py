import pytest
import torch

from shardwise.optim import Lamb


def _reference_step(p, grad, state, *, lr, betas, eps, wd, lo, hi, step):
    """LAMB written out per parameter, from the paper."""
    m, v = state
    m.mul_(betas[0]).add_(grad, alpha=1 - betas[0])
    v.mul_(betas[1]).addcmul_(grad, grad, value=1 - betas[1])
    m_hat = m / (1 - betas[0] ** step)
    v_hat = v / (1 - betas[1] ** step)
    update = m_hat / (v_hat.sqrt() + eps) + wd * p
    w_norm, u_norm = p.norm(), update.norm()
    ratio = (w_norm / u_norm).clamp(lo, hi) if w_norm > 0 and u_norm > 0 else torch.tensor(1.0)
    p.sub_(lr * ratio * update)


def test_matches_reference_implementation():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.zeros(5))]
    reference = [p.detach().clone() for p in params]
    states = [(torch.zeros_like(p), torch.zeros_like(p)) for p in reference]
    opt = Lamb(params, lr=0.05, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-6, min_coeff=0.01, max_coeff=10)
    for step in range(1, 5):
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        with torch.no_grad():
            for p, g, s in zip(reference, grads, states):
                _reference_step(p, g, s, lr=0.05, betas=(0.9, 0.99), eps=1e-6, wd=0.01, lo=0.01, hi=10, step=step)
    for p, r in zip(params, reference):
        torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6)


def test_decreases_a_loss():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    opt = Lamb(model.parameters(), lr=0.05)
    first = None
    for _ in range(50):
        loss = torch.nn.functional.mse_loss(model(x), y)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.8 * first


def test_amsgrad_refused():
    with pytest.raises(ValueError, match="amsgrad"):
        Lamb([torch.nn.Parameter(torch.ones(1))], amsgrad=True)
