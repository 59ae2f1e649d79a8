"""The FLOPs profiler counts exactly what the analytic formulas say (linear, convolution,
attention, backward), counts parameters once at full size, and prints DeepSpeed's layout."""

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.profiling.flops_profiler import (
    FlopsProfiler,
    FlopsProfilerConfig,
    StepProfiler,
    duration_to_string,
    flops_to_string,
    get_model_profile,
    macs_to_string,
    number_to_string,
    params_to_string,
)

BATCH = 4


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


MLP_FLOPS = 2 * BATCH * 16 * 32 + 2 * BATCH * 32 * 8
MLP_PARAMS = 16 * 32 + 32 + 32 * 8 + 8


class Attention(nn.Module):
    """Self-attention through F.scaled_dot_product_attention."""

    def __init__(self, width=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x):
        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, w))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = Attention()
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(x + self.attention(x))


def test_mlp_flops_macs_params_are_exact():
    model, x = _mlp(), torch.randn(BATCH, 16)
    flops, macs, params = get_model_profile(model, args=[x], print_profile=False, as_string=False)
    assert (flops, macs, params) == (MLP_FLOPS, MLP_FLOPS // 2, MLP_PARAMS)
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(x)
    prof.stop_profile()
    assert prof.module_flops(model[0]) == 2 * BATCH * 16 * 32
    assert prof.module_flops(model[2]) == 2 * BATCH * 32 * 8
    assert prof.module_params(model[2]) == 32 * 8 + 8
    assert prof.get_total_duration() > 0
    prof.end_profile()


def test_ignored_modules_report_nothing_of_their_own_but_count_in_the_total():
    model, x = _mlp(), torch.randn(BATCH, 16)
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=[nn.Linear])
    model(x)
    assert prof.module_flops(model[0]) == 0
    assert prof.get_total_flops() == MLP_FLOPS
    prof.end_profile()


def test_conv2d_flops_are_exact():
    model = nn.Sequential(nn.Conv2d(3, 8, kernel_size=3, padding=1), nn.Conv2d(8, 4, kernel_size=2, stride=2))
    flops, macs, params = get_model_profile(model, input_shape=(2, 3, 10, 10), print_profile=False, as_string=False)
    expected = 2 * 2 * 8 * 10 * 10 * 3 * 3 * 3 + 2 * 2 * 4 * 5 * 5 * 8 * 2 * 2  # 2 * B * Cout * HWout * Cin * k*k
    assert (flops, macs) == (expected, expected // 2)
    assert params == 8 * 3 * 9 + 8 + 4 * 8 * 4 + 4


def test_scaled_dot_product_attention_flops_are_exact():
    model, seq, width, heads = Block(), 5, 16, 2
    x = torch.randn(BATCH, seq, width, requires_grad=True)
    prof = FlopsProfiler(model)
    prof.start_profile()
    out = model(x)
    linears = 2 * BATCH * seq * width * 3 * width + 2 * BATCH * seq * width * width
    head_dim = width // heads
    attention = 2 * (2 * BATCH * heads * seq * seq * head_dim)  # QK^T and the probabilities times V
    assert prof.get_total_flops() == linears + attention
    assert prof.module_flops(model.attention) == linears + attention
    assert prof.module_flops(model.norm) == 0  # elementwise ops are not counted
    assert prof.get_total_macs() == (linears + attention) // 2
    before = prof.counted_flops()
    out.sum().backward()  # linear: input and weight grads; attention: 5 matmuls (scores recomputed)
    assert prof.counted_flops() - before == 2 * linears + 5 * attention // 2
    assert prof.get_total_flops() == linears + attention  # the forward total excludes the backward
    prof.end_profile()


class Tied(nn.Module):
    """A tied embedding and output head, and one layer applied twice."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.layer = nn.Linear(6, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.layer(self.layer(self.embed(tokens))))


def test_shared_weights_count_once_shared_modules_run_twice():
    tokens = torch.randint(0, 10, (BATCH, 3))
    flops, _, params = get_model_profile(Tied(), args=[tokens], print_profile=False, as_string=False)
    assert params == 10 * 6 + 6 * 6 + 6
    rows = BATCH * 3
    assert flops == 2 * (2 * rows * 6 * 6) + 2 * rows * 6 * 10


def test_string_helpers_use_deepspeed_suffixes():
    assert number_to_string(1.5e9) == "1.5 G"
    assert number_to_string(0) == "0 "
    assert number_to_string(2.5e12) == "2.5 T"
    assert number_to_string(1234.5678, units="K", precision=1) == "1.2 K"
    assert macs_to_string(2048) == "2.05 KMACs"
    assert flops_to_string(8.19e13) == "81.9 TFLOPS"
    assert params_to_string(1.3e9) == "1.3 B"
    assert params_to_string(336.23e6) == "336.23 M"
    assert duration_to_string(0.0123) == "12.3 ms"
    assert duration_to_string(4e-5) == "40 us"


def test_as_string_returns_suffixed_strings():
    model = nn.Linear(1000, 1000)
    flops, macs, params = get_model_profile(model, input_shape=(4, 1000), print_profile=False)
    assert (flops, macs, params) == ("8 M", "4 MMACs", "1 M")


def test_printed_profile_has_deepspeed_labels_and_module_tree(tmp_path, capsys):
    model = nn.Sequential(Block(), nn.Linear(16, 4))
    x = torch.randn(BATCH, 5, 16)
    get_model_profile(model, args=[x], warm_up=2, top_modules=2)
    text = capsys.readouterr().out
    for label in (
        "Profile Summary at step 2:",
        "params per GPU:",
        "fwd MACs per GPU:",
        "fwd flops per GPU:",
        "fwd latency:",
        "fwd FLOPS per GPU = fwd flops per GPU / fwd latency:",
        "Top 2 modules in terms of params, MACs or fwd latency at different model depths:",
        "depth 0:",
        "depth 3:",
        "    params      - {",
        "    MACs        - {",
        "    fwd latency - {",
        "Detailed Profile per GPU",
    ):
        assert label in text, label
    assert "\n  (0): Block(\n" in text
    assert "\n      (qkv): Linear(" in text and "% Params, " in text and "in_features=16, out_features=48" in text
    assert text.isascii()
    output = tmp_path / "sub" / "profile.txt"
    get_model_profile(model, args=[x], module_depth=1, output_file=str(output))
    written = output.read_text()
    assert capsys.readouterr().out == ""
    assert "fwd flops per GPU:" in written and "depth 1:" in written and "depth 2:" not in written
    assert "(0): Block(" in written and "(attention)" not in written  # the tree stops at module_depth


def test_bad_print_settings_are_refused():
    model = _mlp()
    with pytest.raises(ValueError, match=r"module_depth .*got -2"):
        get_model_profile(model, input_shape=(2, 16), module_depth=-2)
    prof = FlopsProfiler(model)
    with pytest.raises(ValueError, match=r"module_depth .*got -3"):
        prof.print_model_profile(module_depth=-3)
    with pytest.raises(ValueError, match=r"flops_profiler.module_depth .*got -2"):
        FlopsProfilerConfig(module_depth=-2)
    with pytest.raises(ValueError, match=r"flops_profiler.top_modules .*got 0"):
        FlopsProfilerConfig(top_modules=0)


def test_training_step_counts_backward(tmp_path):
    """Driven like the engine: bwd flops of linear layers = 2x fwd (input and weight grads)."""
    model = _mlp()
    output = tmp_path / "profile.txt"
    config = FlopsProfilerConfig(enabled=True, profile_step=1, output_file=str(output))
    engine = types.SimpleNamespace(
        world_size=1, dp_world_size=1, mp_world_size=1, train_micro_batch_size_per_gpu=lambda: BATCH
    )
    step_profiler = StepProfiler(model, config, engine=engine)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(BATCH, 16, requires_grad=True)
        with step_profiler.phase("forward", step=step):
            loss = model(x).square().sum()
        with step_profiler.phase("backward", step=step):
            loss.backward()
        with step_profiler.phase("step", step=step):
            optimizer.step()
            optimizer.zero_grad()
        assert output.exists() == (step >= 1)
    prof = step_profiler.profiler
    assert prof.get_total_flops() == MLP_FLOPS
    assert prof.step_timing.bwd_flops == 2 * MLP_FLOPS
    assert prof.step_timing.step_latency > 0
    text = output.read_text()
    assert "Profile Summary at step 1:" in text
    for label in (
        "world size:",
        "batch size per GPU:",
        "bwd latency:",
        "bwd flops per GPU:",
        "fwd+bwd flops per GPU:",
        "fwd+bwd latency:",
        "step latency:",
        "iter latency:",
        "FLOPS per GPU = fwd+bwd flops per GPU / iter latency:",
        "achieved TFLOP/s per GPU:",
        "samples/second:",
    ):
        assert label in text, label
    bwd_line = next(line for line in text.splitlines() if line.startswith("bwd flops per GPU:"))
    assert bwd_line.split()[-2:] == number_to_string(2 * MLP_FLOPS).split()
    assert not model._forward_hooks and not model[0]._forward_pre_hooks
