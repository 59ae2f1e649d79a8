"""1-bit Adam in one process: its arguments, config errors, the warm-up against torch's
AdamW, and the per-rank state it checkpoints."""

import logging

import pytest
import torch

from shardwise.config import ConfigError, load_config
from shardwise.optim import OneBitAdam, build_optimizer
from shardwise.runtime.fp16.onebit.adam import OnebitAdam


def _params(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(5, 3, generator=generator)),
        torch.nn.Parameter(torch.randn(3, generator=generator)),
    ]


def test_deepspeed_name_and_defaults():
    assert OnebitAdam is OneBitAdam
    opt = OneBitAdam(_params())
    assert opt.freeze_step == 100000 and opt.comm_backend_name == "nccl"
    assert opt.defaults["lr"] == 1e-3 and opt.defaults["betas"] == (0.9, 0.999) and opt.defaults["eps"] == 1e-8
    assert opt.defaults["weight_decay"] == 0.0 and not opt.averages_gradients_itself()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"freeze_step": -1}, "freeze_step must be an integer >= 1"),
        ({"freeze_step": 0}, "freeze_step must be an integer >= 1"),
        ({"amsgrad": True}, "amsgrad"),
        ({"comm_backend_name": "gloo2"}, "comm_backend_name 'gloo2' is not one of nccl, mpi, hccl, compressed"),
        ({"max_grad_norm": 1.0}, "gradient_clipping"),
        ({"betas": (0.9, 1.5)}, "betas in [0, 1)"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        OneBitAdam(_params(), **kwargs)


@pytest.mark.parametrize("backend", ["nccl", "mpi", "hccl", "compressed"])
def test_deepspeeds_backend_names_are_accepted(backend):
    opt = OneBitAdam(_params(), comm_backend_name=backend, cuda_aware=True)
    assert (opt.comm_backend_name, opt.cuda_aware) == (backend, True)
    config = load_config(
        world_size=1,
        config={
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "OneBitAdam", "params": {"comm_backend_name": backend, "cuda_aware": True}},
        },
    )
    built = build_optimizer(config.optimizer, _params())
    assert (type(built), built.comm_backend_name, built.cuda_aware) == (OneBitAdam, backend, True)


def test_config_builds_it_and_names_misspelt_keys():
    config = load_config(
        world_size=1,
        config={
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {
                "type": "OneBitAdam",
                "params": {"lr": 1e-3, "freeze_step": 7, "cuda_aware": False, "comm_backend_name": "nccl"},
            },
        },
    )
    opt = build_optimizer(config.optimizer, _params())
    assert isinstance(opt, OneBitAdam) and opt.freeze_step == 7
    bad = load_config(
        world_size=1,
        config={"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "OneBitAdam", "params": {"freeze_stp": 7}}},
    )
    with pytest.raises(ValueError, match="did you mean 'freeze_step'"):
        build_optimizer(bad.optimizer, _params())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_config_refuses_zero_stages_that_partition(stage):
    with pytest.raises(
        ConfigError, match=f"optimizer.type .onebitadam. runs with ZeRO stage 0 only \\(zero_optimization.stage {stage}"
    ):
        load_config(
            world_size=1,
            config={
                "train_micro_batch_size_per_gpu": 1,
                "zero_optimization": {"stage": stage},
                "optimizer": {"type": "OneBitAdam", "params": {}},
            },
        )


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_warm_up_is_torch_adamw(weight_decay):
    ours, theirs = _params(), _params()
    opt = OneBitAdam(ours, lr=0.1, weight_decay=weight_decay, freeze_step=50)
    ref = torch.optim.AdamW(theirs, lr=0.1, weight_decay=weight_decay, foreach=False)
    generator = torch.Generator().manual_seed(1)
    for _ in range(5):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape, generator=generator)
            b.grad = a.grad.clone()
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    assert set(opt.state[ours[0]]) == {"step", "exp_avg", "exp_avg_sq"}


def test_variance_freezes_after_the_warm_up():
    params = _params()
    opt = OneBitAdam(params, lr=0.1, freeze_step=2)
    for step in range(4):
        for p in params:
            p.grad = torch.full_like(p, float(step + 1))
        opt.step()
        if step == 1:
            frozen = opt.state[params[0]]["exp_avg_sq"].clone()
            assert opt.averages_gradients_itself()
    assert torch.equal(opt.state[params[0]]["exp_avg_sq"], frozen)


def test_rank_state_from_another_world_size_starts_from_zero(caplog):
    opt = OneBitAdam(_params(), freeze_step=1)
    assert opt.rank_state_dict() == {}  # nothing before the first compressed step
    with caplog.at_level(logging.INFO, logger="shardwise"):
        opt.load_rank_state_dict(
            {"world_size": 4, "exchanges": {"own": {"worker_error": torch.ones(8), "server_error": torch.ones(2)}}}
        )
    assert "error-feedback buffers are from 4 data-parallel ranks, this run has 1" in caplog.text


def test_a_backend_without_all_to_all_is_refused():
    from shardwise.optim.onebit._base import check_collectives

    check_collectives("OneBitAdam", "gloo")
    check_collectives("OneBitAdam", "cpu:gloo,cuda:nccl")
    with pytest.raises(ValueError, match="backend 'fake' is not known to provide"):
        check_collectives("OneBitAdam", "fake")


def test_after_the_warm_up_masked_and_never_measured_elements_stay_put():
    # row 0 gets no gradient during the warm-up (variance 0), row 1 is masked by DeepSpeed's
    # exp_avg_mask; both must not move afterwards, when every row gets a gradient
    weight = torch.nn.Parameter(torch.ones(3, 2))
    mask = torch.tensor([[1.0], [0.0], [1.0]])
    opt = OneBitAdam([{"params": [weight], "exp_avg_mask": mask}], lr=0.1, freeze_step=1)
    weight.grad = torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    opt.step()
    before = weight.detach().clone()
    weight.grad = torch.ones(3, 2)
    opt.step()
    assert torch.equal(weight[:2], before[:2])
    assert (weight[2] - before[2]).abs().min() > 0.05  # the rest moves on


def test_state_views_of_the_flat_buffer_survive_a_new_order(monkeypatch):
    """[Note: exchanged tensors live in the flat buffer]: the state tensors become views of
    the flat buffer, and a call with the same tensors in another order (views of the buffer
    in the wrong places) still averages the right values."""
    from shardwise.optim.onebit import _base

    optimizer = OneBitAdam([torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(5))], freeze_step=1)

    class _Identity:  # a one-rank stand-in for the exchange: the average of one rank is its value
        numel = 8

        def __call__(self, flat):
            flat.mul_(2)  # visible: every element doubled in place

    class _Comm:
        world_size, rank = 2, 0

    monkeypatch.setattr(optimizer, "communicator", lambda: _Comm())
    optimizer._exchanges["all"] = _Identity()
    a, b = torch.arange(3.0), torch.arange(5.0) + 10
    optimizer.compressed_average_([a, b], tag="momentum", state=True)
    flat = optimizer._flats[("all", True)]
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert torch.equal(flat, torch.cat([torch.arange(3.0), torch.arange(5.0) + 10]) * 2)
    optimizer._exchanges["all"].numel = 8
    optimizer.compressed_average_([b, a], tag="momentum", state=True)  # the other order
    assert torch.equal(a, torch.arange(3.0) * 4) and torch.equal(b, (torch.arange(5.0) + 10) * 4)
    assert not _base._live_in([a, b], flat)  # re-pointed in the new order


def test_exp_avg_mask_param_group_survives_a_checkpoint(tmp_path):
    """DeepSpeed's per-group ``exp_avg_mask`` (a tensor in the param group) is saved with
    the optimizer and restored by ``load_checkpoint``, replacing the new run's mask."""
    import shardwise
    from shardwise.testing.models import TinyMLP, token_batches

    def engine_with_mask(seed, fill):
        model = TinyMLP(seed=seed)
        params = list(model.parameters())
        mask = torch.full_like(params[0], fill)
        optimizer = OneBitAdam(
            [{"params": params[:1], "exp_avg_mask": mask}, {"params": params[1:]}], lr=1e-2, freeze_step=2
        )
        engine, *_ = shardwise.initialize(
            model=model, optimizer=optimizer, config={"gradient_clipping": 0.0, "train_micro_batch_size_per_gpu": 4}
        )
        return engine

    engine = engine_with_mask(1, 1.0)
    engine.optimizer.param_groups[0]["exp_avg_mask"][0] = 0.0  # a row masked, as for padding tokens
    for tokens, targets in token_batches(num_steps=4, batch=4, seed=2):
        engine.backward(engine(tokens, targets))
        engine.step()
    engine.save_checkpoint(str(tmp_path))
    resumed = engine_with_mask(3, 0.5)
    resumed.load_checkpoint(str(tmp_path))
    torch.testing.assert_close(
        resumed.optimizer.param_groups[0]["exp_avg_mask"],
        engine.optimizer.param_groups[0]["exp_avg_mask"],
        rtol=0,
        atol=0,
    )
    assert all(torch.equal(a, b) for a, b in zip(engine.module.parameters(), resumed.module.parameters()))
