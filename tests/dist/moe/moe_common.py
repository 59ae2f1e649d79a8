"""The MoE model and the single-process reference the MoE tests share: a small net with one
MoE layer whose experts differ, as every expert rank holds it, trained on per-rank
micro-batches (the reference runs one forward per rank's micro-batch with every expert
local and averages the losses: the global mean loss data parallelism trains on)."""

import torch
from torch import nn

from shardwise.moe.layer import MoE

IN, HIDDEN, OUT, EXPERTS = 6, 8, 3, 4
TOKENS, STEPS, LR = 6, 3, 0.05
AUX = 0.1


class Expert(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(HIDDEN, 12), nn.GELU(), nn.Linear(12, HIDDEN))


class MoENet(nn.Module):
    def __init__(self, ep_size, k, drop_tokens, expert_tp=False):
        super().__init__()
        self.inp = nn.Linear(IN, HIDDEN)
        self.moe = MoE(
            HIDDEN,
            Expert(),
            num_experts=EXPERTS,
            ep_size=ep_size,
            k=k,
            min_capacity=1,
            drop_tokens=drop_tokens,
            use_rts=False,
            top2_2nd_expert_sampling=False,
            enable_expert_tensor_parallelism=expert_tp,
        )
        self.out = nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        h = self.inp(x)
        m, l_aux, _ = self.moe(h)
        return self.out(h + m), l_aux


def make_reference(k, drop_tokens):
    torch.manual_seed(3)
    model = MoENet(1, k, drop_tokens)
    for i, expert in enumerate(model.moe.deepspeed_moe.experts.deepspeed_experts):  # experts differ
        torch.manual_seed(10 + i)
        for p in expert.parameters():
            nn.init.normal_(p, std=0.4)
    return model


def expert_rank_model(reference, ep_size, ep_rank, k, drop_tokens, expert_tp=False):
    """The model as expert rank ``ep_rank`` holds it: the shared weights and its experts."""
    model = MoENet(ep_size, k, drop_tokens, expert_tp)
    local = EXPERTS // ep_size
    state = {}
    for key, value in reference.state_dict().items():
        prefix = "moe.deepspeed_moe.experts.deepspeed_experts."
        if key.startswith(prefix):
            index, rest = key[len(prefix) :].split(".", 1)
            if ep_rank * local <= int(index) < (ep_rank + 1) * local:
                state[f"{prefix}{int(index) - ep_rank * local}.{rest}"] = value
        else:
            state[key] = value
    model.load_state_dict(state)
    return model


def make_batches(world_size):
    g = torch.Generator().manual_seed(5)
    return [
        (torch.randn(world_size, 2, TOKENS, IN, generator=g), torch.randn(world_size, 2, TOKENS, OUT, generator=g))
        for _ in range(STEPS)
    ]


def moe_loss(model, x, y):
    out, l_aux = model(x)
    return nn.functional.mse_loss(out, y) + AUX * l_aux


def make_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=LR)
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def reference_run(model, batches, opt, clip):
    optimizer = make_optimizer(opt, model.parameters())
    losses, norms = [], []
    for x, y in batches:
        loss = sum(moe_loss(model, x[r], y[r]) for r in range(x.shape[0])) / x.shape[0]
        optimizer.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else float("inf"))))
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, norms


def moe_config(stage, opt, clip, dtype, zero=None):
    out = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": clip,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "SGD" if opt == "sgd" else "AdamW",
            "params": {"lr": LR} if opt == "sgd" else {"lr": LR, "weight_decay": 0.01},
        },
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200},
    }
    if dtype == "bf16":
        out["bf16"] = {"enabled": True}
    out["zero_optimization"].update(zero or {})
    return out
