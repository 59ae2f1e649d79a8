"""Under ZeRO-3 on 2 ranks the FLOPs profiler reports the full parameter count (not the
rank's shard) and the same forward and backward FLOPs as one process."""

import torch
from torch import nn

import shardwise
from shardwise.profiling.flops_profiler import FlopsProfilerConfig, StepProfiler, params_to_string
from shardwise.testing import run_distributed
from shardwise.testing.parity import STAGE3_PARTITION_ALL

MICRO, WIDTH = 4, 12


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, WIDTH)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))
        self.head = nn.Linear(WIDTH, 20, bias=False)
        self.head.weight = self.embed.weight  # tied: counted once

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = torch.relu(layer(h))
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), tokens.flatten())


def _profile_steps(model, phases, tokens, output_file=None, engine=None):
    """Run two steps through ``phases`` (forward, backward, step callables), profiling step 1."""
    config = FlopsProfilerConfig(enabled=True, profile_step=1, output_file=output_file)
    step_profiler = StepProfiler(model, config, engine=engine)
    forward, backward, step = phases
    for global_step in range(2):
        with step_profiler.phase("forward", step=global_step):
            loss = forward(tokens)
        with step_profiler.phase("backward", step=global_step):
            backward(loss)
        with step_profiler.phase("step", step=global_step):
            step()
    prof = step_profiler.profiler
    return prof.get_total_params(), prof.get_total_flops(), prof.step_timing.bwd_flops


def _zero3_rank(rank, world_size, output_dir):
    torch.manual_seed(0)
    config = {
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 1000,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, **STAGE3_PARTITION_ALL},
    }
    engine, _, _, _ = shardwise.initialize(model=Model(), config=config)
    local = sum(p.numel() for p in engine.module.parameters())
    tokens = torch.randint(0, 20, (MICRO, 5), generator=torch.Generator().manual_seed(rank))
    output_file = f"{output_dir}/rank{rank}.txt"
    numbers = _profile_steps(
        engine.module, (engine, engine.backward, engine.step), tokens, output_file=output_file, engine=engine
    )
    with open(output_file) as stream:
        return local, numbers, stream.read()


def test_zero3_profile_reports_full_params_and_one_process_flops(tmp_path):
    torch.manual_seed(0)
    reference = Model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    tokens = torch.randint(0, 20, (MICRO, 5), generator=torch.Generator().manual_seed(0))
    expected = _profile_steps(reference, (reference, torch.Tensor.backward, optimizer.step), tokens)
    full = sum(p.numel() for p in reference.parameters())
    assert expected[0] == full == 20 * WIDTH + 2 * (WIDTH * WIDTH + WIDTH)
    assert expected[1] == MICRO * 5 * (2 * (2 * WIDTH * WIDTH) + 2 * WIDTH * 20)
    assert expected[2] > expected[1]

    results = run_distributed(_zero3_rank, world_size=2, tmp_path=tmp_path, output_dir=str(tmp_path))
    for rank, (local, numbers, text) in enumerate(results):
        assert local < full, f"rank {rank}: the parameters are not partitioned, the test proves nothing"
        assert numbers == expected, f"rank {rank}: (params, fwd flops, bwd flops) {numbers} != {expected}"
        assert "world size:" in text and "data parallel size:" in text
        world_line = next(line for line in text.splitlines() if line.startswith("world size:"))
        assert world_line.split()[-1] == "2"
        params_line = next(line for line in text.splitlines() if line.startswith("params per GPU:"))
        assert params_line.split(":")[1].strip() == params_to_string(full), params_line
