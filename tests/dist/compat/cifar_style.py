"""A training script in the style of DeepSpeed's CIFAR-10 tutorial (our own code): the
argparse pattern with --local_rank, the tutorial's top-of-file imports, comm and
accelerator calls, a data loader from initialize(), checkpoint with client_state, and
consolidation of the checkpoint to fp32. Only the package name differs from a DeepSpeed
script (`import shardwise as deepspeed`, `shardwise.<module>` for `deepspeed.<module>`).

Prints one line `RESULT {json}` on rank 0 for the test to check.
"""

import argparse
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise as deepspeed
import shardwise.comm as dist
from shardwise.accelerator import get_accelerator
from shardwise.moe.utils import split_params_into_different_moe_groups_for_optimizer
from shardwise.runtime.utils import see_memory_usage, set_random_seed
from shardwise.utils import (
    RepeatingLoader,  # noqa: F401 (unused: importing it from shardwise.utils, as from deepspeed.utils, is the check)
    log_dist,
    logger,
    safe_get_full_fp32_param,
    safe_get_full_grad,
)
from shardwise.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR-style")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("-e", "--epochs", default=2, type=int, help="number of total epochs")
    parser.add_argument("--stage", default=2, type=int, help="ZeRO stage")
    parser.add_argument("--ckpt", default="ckpt", type=str)
    parser.add_argument("--moe-param-group", default=False, action="store_true")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(4 * 3 * 3, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = torch.flatten(x, 1)
        return self.fc2(F.relu(self.fc1(x)))


def main():
    args = add_argument()
    deepspeed.init_distributed()
    set_random_seed(1234)
    g = torch.Generator().manual_seed(0)
    trainset = torch.utils.data.TensorDataset(
        torch.randn(64, 3, 8, 8, generator=g), torch.randint(0, 10, (64,), generator=g)
    )
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    if args.moe_param_group:
        parameters = split_params_into_different_moe_groups_for_optimizer(
            {"params": [p for p in net.parameters() if p.requires_grad], "name": "parameters"}
        )
    ds_config = {
        "train_batch_size": 16,
        "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_num_steps": 4}},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": False},
        "fp16": {"enabled": False, "fp16_master_weights_and_grads": False},
        "wall_clock_breakdown": False,
        "zero_optimization": {
            "stage": args.stage,
            "allgather_partitions": True,
            "reduce_scatter": True,
            "allgather_bucket_size": 50000000,
            "reduce_bucket_size": 50000000,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "cpu_offload": False,
        },
    }
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset, config=ds_config
    )
    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    see_memory_usage("after initialize", force=False)
    criterion = nn.CrossEntropyLoss()
    losses, grad_norms = [], []
    for epoch in range(args.epochs):
        running_loss = 0.0
        for i, (inputs, labels) in enumerate(trainloader):  # noqa: B007 (i counts the batches for the log below)
            inputs, labels = inputs.to(local_device), labels.to(local_device)
            loss = criterion(model_engine(inputs), labels)
            model_engine.backward(loss)
            grad = safe_get_full_grad(model_engine.module.fc2.weight)  # collective: every rank
            grad_norms.append(float(grad.norm()))
            model_engine.step()
            running_loss += loss.item()
            losses.append(loss.item())
        log_dist(f"epoch {epoch} loss {running_loss / (i + 1):.4f}", ranks=[0])
    # the mean loss of the last step across ranks, with DeepSpeed's comm API
    last = torch.tensor([losses[-1]], device=local_device)
    dist.all_reduce(last, op=dist.ReduceOp.SUM)
    gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.tensor([float(dist.get_rank())]))
    flag = torch.tensor([7.0 if dist.get_rank() == 0 else 0.0])
    dist.broadcast(flag, src=0)
    dist.barrier()

    model_engine.save_checkpoint(args.ckpt, client_state={"epoch": args.epochs, "losses": losses[-3:]})
    live = {n: safe_get_full_fp32_param(p) for n, p in model_engine.module.named_parameters()}
    _, client_state = model_engine.load_checkpoint(args.ckpt)
    result = {
        "world_size": dist.get_world_size(),
        "local_rank_arg": args.local_rank,
        "local_rank": local_rank,
        "env_local_rank": int(os.environ["LOCAL_RANK"]),
        "dist_local_rank": dist.get_local_rank(),
        "device": local_device,
        "backend": get_accelerator().communication_backend_name(),
        "steps": model_engine.global_steps,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "mean_last": float(last) / dist.get_world_size(),
        "gathered": [float(t) for t in gathered],
        "broadcast": float(flag),
        "client_state": client_state["epoch"],
        "grad_norm_positive": all(n > 0 for n in grad_norms),
        "stage": model_engine.zero_optimization_stage(),
        "lr": model_engine.get_lr()[0],
    }
    if dist.get_rank() == 0:
        consolidated = get_fp32_state_dict_from_zero_checkpoint(args.ckpt)
        result["consolidated_vs_live"] = max((consolidated[n] - v).abs().max().item() for n, v in live.items())
        logger.info("checkpoint consolidated")
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
