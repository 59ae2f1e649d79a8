"""A pipeline training script in the style of DeepSpeed's pipeline tutorial (our own
code): deepspeed.init_distributed(), a PipelineModule of layers with a loss_fn, the
training data given to initialize() and engine.train_batch() with no iterator. Only the
package name differs from a DeepSpeed script.

Prints one line `RESULT {json}` on rank 0 for the test to check.
"""

import argparse
import json

import torch
import torch.nn as nn

import shardwise as deepspeed
from shardwise.pipe import LayerSpec, PipelineModule


def get_args():
    parser = argparse.ArgumentParser(description="pipeline-style")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("-s", "--steps", type=int, default=8, help="quit after this many steps")
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=2, help="pipeline parallelism")
    parser.add_argument("--seed", type=int, default=1138, help="PRNG seed")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Dataset(torch.utils.data.Dataset):
    """y = 3x + noise: a regression the stack can learn."""

    def __init__(self, n=256):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=g)
        self.y = self.x @ torch.linspace(
            -1,
            1,
            16 * 4,
        ).reshape(16, 4) + 0.01 * torch.randn(n, 4, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def main():
    args = get_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(args.seed)
    layers = [
        LayerSpec(nn.Linear, 16, 64),
        nn.ReLU(),
        LayerSpec(nn.Linear, 64, 64),
        nn.ReLU(),
        LayerSpec(nn.Linear, 64, 4),
    ]
    net = PipelineModule(
        layers=layers,
        loss_fn=nn.MSELoss(),
        num_stages=args.pipeline_parallel_size,
        partition_method="parameters",
        activation_checkpoint_interval=0,
        dynamic_shape=False,
    )
    config = {
        "gradient_clipping": 0.0,
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 100,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "pipeline": {"seed_layers": False},
    }
    engine, _, _, _ = deepspeed.initialize(
        args=args,
        model=net,
        config=config,
        model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=Dataset(),
    )
    losses = [float(engine.train_batch()) for _ in range(args.steps)]
    if torch.distributed.get_rank() == 0:
        print(
            "RESULT "
            + json.dumps(
                {
                    "losses": losses,
                    "stages": engine.num_stages,
                    "first": engine.is_first_stage(),
                    "gas": engine.gradient_accumulation_steps(),
                    "layers": sorted({n.split(".")[0] for n, _ in engine.module.named_parameters()}),
                    "global_steps": engine.global_steps,
                }
            )
        )


if __name__ == "__main__":
    main()
