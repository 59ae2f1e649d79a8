"""A training script written for DeepSpeed, running on shardwise.

The only change from the DeepSpeed original is the import line:

    import deepspeed                 ->   import shardwise as deepspeed

Run it with:  torchrun --nproc_per_node 2 examples/deepspeed_script.py --deepspeed_config examples/configs/zero0.json
"""

import argparse

import torch
import torch.nn as nn

import shardwise as deepspeed


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x):
        return self.layers(x)


def make_dataset(n=512):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    y = x[:, :4].sum(dim=1, keepdim=True) - x[:, 4:8].prod(dim=1, keepdim=True)
    return torch.utils.data.TensorDataset(x, y)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--save_dir", type=str, default=None)
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    torch.manual_seed(0)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=make_dataset()
    )

    loss_fn = nn.MSELoss()
    first = last = None
    for _epoch in range(args.epochs):
        for x, y in trainloader:
            x, y = x.to(model_engine.local_rank if torch.cuda.is_available() else "cpu"), y.to(x.device)
            loss = loss_fn(model_engine(x), y)
            model_engine.backward(loss)
            model_engine.step()
            first = loss.item() if first is None else first
            last = loss.item()
    if args.save_dir:
        model_engine.save_checkpoint(args.save_dir, client_state={"epoch": args.epochs})
        _, client_state = model_engine.load_checkpoint(args.save_dir)
        assert client_state["epoch"] == args.epochs
    if model_engine.global_rank == 0:
        print(
            f"trained {model_engine.global_steps} steps; loss {first:.4f} -> {last:.4f}; "
            f"lr {model_engine.get_lr()[0]:.2e}"
        )


if __name__ == "__main__":
    main()
