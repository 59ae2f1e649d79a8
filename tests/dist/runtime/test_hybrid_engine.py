"""The hybrid engine on 2 gloo ranks, tiny Llama (hidden 64, 2 layers): under ZeRO-2 and
ZeRO-3, after each of 3 training steps greedy ``engine.generate`` (and
``engine.module.generate``) equals a single-process replica trained the same way, token
for token, and the losses equal the replica's; under ZeRO-3 no parameter is left gathered
after generate, and each unit is gathered once per generate (not once per token). LoRA
layers (DeepSpeed-Chat's fuse / unfuse methods; the first layer's bases frozen, as with
its only_optimize_lora): generation equals the fused replica's,
the base weights after generate are bit-identical to before, and training goes on equal
to the replica's. With ``inference_tp_size`` 2 greedy generation equals the replica's,
a sample equals one process sampling both ranks' rows from the first rank's seed, and a
tied head (OPT) is split too."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.testing import run_distributed
from shardwise.testing.causal_lm import VOCAB, tiny_lm
from shardwise.testing.parity import STAGE3_PARTITION_ALL

MICRO, STEPS, LR, NEW = 2, 3, 2e-2, 8


class LoraLinear(nn.Module):
    """DeepSpeed-Chat's LoRA layer, in its shape: ``weight`` / ``bias`` as the linear layer
    had, low-rank ``lora_right_weight`` / ``lora_left_weight``, fused on request."""

    def __init__(self, linear: nn.Linear, rank: int = 4, scaling: float = 2.0) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.lora_right_weight = nn.Parameter(torch.randn(linear.in_features, rank) * 0.3)
        self.lora_left_weight = nn.Parameter(torch.randn(rank, linear.out_features) * 0.3)
        self.lora_scaling, self.fused = scaling, False

    def _delta(self) -> torch.Tensor:
        return self.lora_scaling * (self.lora_right_weight @ self.lora_left_weight).t()

    def fuse_lora_weight(self) -> None:
        if not self.fused:
            self.weight.data += self._delta()
        self.fused = True

    def unfuse_lora_weight(self) -> None:
        if self.fused:
            self.weight.data -= self._delta()
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.fused:
            return out
        return out + (x @ self.lora_right_weight @ self.lora_left_weight) * self.lora_scaling


def _model(lora: bool) -> nn.Module:
    model = tiny_lm("llama")
    if lora:
        torch.manual_seed(1)
        for layer in model.model.layers:
            layer.self_attn.q_proj = LoraLinear(layer.self_attn.q_proj)
            layer.self_attn.v_proj = LoraLinear(layer.self_attn.v_proj)
        # DeepSpeed-Chat's only_optimize_lora on the first layer: frozen bases, partitioned at stage 3
        for lora_layer in (model.model.layers[0].self_attn.q_proj, model.model.layers[0].self_attn.v_proj):
            lora_layer.weight.requires_grad_(False)
    return model


def _model_generate(model: nn.Module, prompt: torch.Tensor, lora: bool, **kwargs) -> torch.Tensor:
    """The replica's greedy generation (its LoRA layers fused, on a copy)."""
    if lora:
        model = copy.deepcopy(model)
        for module in model.modules():
            if isinstance(module, LoraLinear):
                module.fuse_lora_weight()
    return model.generate(prompt, do_sample=False, **kwargs)


def _full_weights(engine) -> dict:
    from shardwise.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _body(rank, world_size, stage, lora):
    import shardwise

    model = _model(lora)
    replica = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(replica.parameters(), lr=LR, weight_decay=0.0)
    zero = {"stage": stage, **(STAGE3_PARTITION_ALL if stage == 3 else {})}
    engine, _, _, _ = shardwise.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "zero_optimization": zero,
            "hybrid_engine": {"enabled": True, "max_out_tokens": 32, "tp_gather_partition_size": 1},
        },
    )
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, VOCAB, (2, 5), generator=generator) + rank
    report = {
        "hybrid": type(engine).__name__,
        "tokens": [],
        "losses": [],
        "left_gathered": [],
        "base_changed": [],
        "gathers": [],
    }
    # before the first step: arguments the fast loop does not serve generate on the inference copy
    issued = sum(engine.comm.calls.values())
    penalised = engine.generate(prompt, max_new_tokens=4, do_sample=False, repetition_penalty=1.5)
    expected = _model_generate(replica, prompt, lora, max_new_tokens=4, repetition_penalty=1.5)
    report["penalised"] = (penalised.tolist(), expected.tolist())
    report["inference_tensor"] = penalised.is_inference()  # its ids feed training (a PPO forward)
    report["gathers"].append((sum(engine.comm.calls.values()) - issued, len(engine.strategy.buckets)))
    for _ in range(STEPS):
        batch = torch.randint(3, VOCAB, (MICRO * world_size, 12), generator=generator)
        mine = batch[rank * MICRO : (rank + 1) * MICRO]
        before = _full_weights(engine) if lora else {}
        issued = sum(engine.comm.calls.values())
        out = engine.generate(prompt, max_new_tokens=NEW, do_sample=False)
        report["gathers"].append((sum(engine.comm.calls.values()) - issued, len(engine.strategy.buckets)))
        through_module = engine.module.generate(prompt, max_new_tokens=NEW, do_sample=False)
        report["left_gathered"].append(stage == 3 and any(p.numel() for p in engine.module.parameters()))
        if lora:
            after = _full_weights(engine)
            report["base_changed"].append(sorted(n for n in before if not torch.equal(before[n], after[n])))
        expected = _model_generate(replica, prompt, lora, max_new_tokens=NEW)
        report["tokens"].append((out.tolist(), through_module.tolist(), expected.tolist()))
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        replica_loss = replica(input_ids=batch, labels=batch).loss
        replica_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = engine.comm.all_reduce_scalars([loss.item()])[0] / world_size
        report["losses"].append((mean, replica_loss.item()))
    return report


def _check(report, *, stage, lora):
    assert report["hybrid"] == "HybridEngine"
    assert report["penalised"][0] == report["penalised"][1], "the model's own generate on the copy"
    assert not report["inference_tensor"], "generate returned an inference-mode tensor, which autograd refuses"
    for step, (out, through_module, expected) in enumerate(report["tokens"]):
        assert out == expected, f"step {step}: generate differs from the replica trained the same way"
        assert through_module == out, f"step {step}: engine.module.generate differs from engine.generate"
    assert len({str(t[0]) for t in report["tokens"]}) > 1, "training must change the generations for this test"
    for step, (mine, replica) in enumerate(report["losses"]):
        assert mine == pytest.approx(replica, rel=1e-4), f"step {step}"
    assert not any(report["left_gathered"]), "stage-3 parameters left gathered after generate"
    if stage == 3:  # each unit gathered once per generate, not once per token
        assert all(issued == units for issued, units in report["gathers"]), report["gathers"]
    if lora:
        assert report["base_changed"] == [[]] * STEPS, "generate changed the training weights"


@pytest.mark.parametrize("stage", [2, 3])
def test_generate_uses_the_current_weights(tmp_path, stage):
    for report in run_distributed(_body, world_size=2, tmp_path=tmp_path, stage=stage, lora=False):
        _check(report, stage=stage, lora=False)


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_is_fused_for_generation_only(tmp_path, stage):
    for report in run_distributed(_body, world_size=2, tmp_path=tmp_path, stage=stage, lora=True):
        _check(report, stage=stage, lora=True)


def _tensor_parallel_body(rank, world_size):
    import shardwise

    model = _model(lora=False)
    replica = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(replica.parameters(), lr=LR, weight_decay=0.0)
    engine, _, _, _ = shardwise.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "zero_optimization": {"stage": 3, **STAGE3_PARTITION_ALL},
            "hybrid_engine": {"enabled": True, "inference_tp_size": 2},
        },
    )
    generator = torch.Generator().manual_seed(5)
    prompts = torch.randint(3, VOCAB, (world_size, 2, 5), generator=generator)
    report = {"tokens": [], "losses": []}
    for _ in range(2):
        batch = torch.randint(3, VOCAB, (MICRO * world_size, 12), generator=generator)
        out = engine.generate(prompts[rank], max_new_tokens=NEW, do_sample=False)
        expected = replica.generate(prompts[rank], max_new_tokens=NEW, do_sample=False)
        report["tokens"].append((out.tolist(), expected.tolist()))
        loss = engine(
            input_ids=batch[rank * MICRO : (rank + 1) * MICRO], labels=batch[rank * MICRO : (rank + 1) * MICRO]
        ).loss
        engine.backward(loss)
        engine.step()
        replica_loss = replica(input_ids=batch, labels=batch).loss
        replica_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    full_bytes = sum(p.numel() * p.element_size() for p in replica.parameters())
    report["held"] = engine.inference_memory().weights_bytes / full_bytes
    # GRPO's layout: each rank's prompts repeated, the prefill run once per group of the tensor group's batch
    grouped = prompts[rank].repeat_interleave(2, dim=0)
    engine.prepare_shared_prefill(2, 2, 5)
    report["shared"] = (engine.generate(grouped, max_new_tokens=NEW, do_sample=False).tolist(),
                        replica.generate(grouped, max_new_tokens=NEW, do_sample=False).tolist())  # fmt: skip
    try:
        engine.repeat_shared_prefill_cache(2, 2)
    except RuntimeError as exc:
        report["cache_refused"] = str(exc)
    # sampling: the ranks' own streams differ, the group draws from its first rank's (seed
    # 100), as one process generating both ranks' rows would; rank 1 gets its own back
    torch.manual_seed(100 + rank)
    sampled = engine.generate(prompts[rank], max_new_tokens=NEW, do_sample=True, top_k=20)
    own = torch.rand(1).item()
    torch.manual_seed(100)
    expected = replica.generate(prompts.reshape(-1, 5), max_new_tokens=NEW, do_sample=True, top_k=20)
    report["sampled"] = (sampled.tolist(), expected[rank * 2 : (rank + 1) * 2].tolist())
    report["own_stream"] = own == torch.rand(1, generator=torch.Generator().manual_seed(101)).item()
    # a head tied to the input embedding (OPT) is split as a tensor of its own
    tied = tiny_lm("opt")
    tied_engine, _, _, _ = shardwise.initialize(
        model=copy.deepcopy(tied),
        config={
            "train_micro_batch_size_per_gpu": MICRO,
            "zero_optimization": {"stage": 3, **STAGE3_PARTITION_ALL},
            "hybrid_engine": {"enabled": True, "inference_tp_size": 2},
        },
    )
    report["tied"] = (
        tied_engine.generate(prompts[rank], max_new_tokens=NEW, do_sample=False).tolist(),
        tied.generate(prompts[rank], max_new_tokens=NEW, do_sample=False).tolist(),
    )
    try:
        shardwise.initialize(
            model=_model(lora=False),
            config={
                "train_micro_batch_size_per_gpu": MICRO,
                "tensor_parallel": {"autotp_size": 2},
                "hybrid_engine": {"enabled": True},
            },
        )
    except ValueError as exc:
        report["training_tp"] = str(exc)
    return report


def test_inference_tp_size_2_generates_each_ranks_batch_with_split_weights(tmp_path):
    reports = run_distributed(_tensor_parallel_body, world_size=2, tmp_path=tmp_path)
    assert reports[0]["sampled"] != reports[1]["sampled"], "each rank returns its own rows"
    for report in reports:
        for step, (out, expected) in enumerate(report["tokens"]):
            assert out == expected, f"step {step}: the tensor-parallel generation differs from the replica's"
        assert report["tokens"][0][0] != report["tokens"][1][0], "training must change the generations"
        assert report["held"] < 0.6, "each rank holds about half of the weights"
        sampled, expected = report["sampled"]
        assert sampled == expected, "the group's sample differs from one process sampling its rows"
        assert report["own_stream"] or report is reports[0], "rank 1's own random stream is given back"
        assert report["tied"][0] == report["tied"][1], "a tied head, split over the tensor group"
        assert report["shared"][0] == report["shared"][1], "a shared prefill over the tensor group's batch"
        assert "repeat_shared_prefill_cache with hybrid_engine.inference_tp_size > 1" in report["cache_refused"]
        assert "hybrid_engine with training tensor parallelism (2 ranks)" in report["training_tp"]
