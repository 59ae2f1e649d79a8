"""Sorted dispatch against capacity padding: one MoE layer, one process, forward + backward.

The same gate (``shardwise.moe``'s ``TopKGate``, DeepSpeed's rules) and the same experts
(MLPs, 4x) route one rank's tokens four ways, alternated, one thread:

- ``sorted-dropless``: shardwise's ``MoE(drop_tokens=False)``: every route kept, tokens
  sorted by expert, each expert on exactly its rows, all experts in one grouped matmul per
  linear layer (``torch._grouped_mm``, see [Note: grouped experts]) where it runs.
- ``sorted-dropless-loop``: the same with one module call per expert (``use_grouped_mm = False``).
- ``sorted-cap``: shardwise's ``MoE`` at ``--capacity``: the same path, over-capacity routes
  dropped.
- ``padded-cap``: the layout of DeepSpeed 0.19.8's ``MOELayer`` with the same routes at
  ``--capacity``: each kept route's token gathered into its slot of an ``[E, C, M]`` buffer
  (zero rows where an expert has fewer than ``C`` tokens), every expert on its ``C`` rows,
  each route's output gathered back from its slot and weighted (index gathers, as 0.19.8
  does; older DeepSpeed used dense ``[S, E, C]`` einsums, far slower).
- ``padded-dropless``: the same with ``C`` the largest expert's count (DeepSpeed's
  ``drop_tokens=False``).
- ``deepspeed-cap`` / ``deepspeed-dropless`` (with ``--deepspeed``, where ``deepspeed`` imports):
  DeepSpeed's own ``MoE`` layer with the same weights (its state dict names are shardwise's), in a
  one-rank process group (ep 1, so no all-to-all).

No expert parallelism (the all-to-all is measured by ``bench_moe.py``), so this isolates the
cost of the layout::

    python bench/bench_moe_dispatch.py --tokens 4096 --hidden 256 --experts 8 --k 2
    python bench/bench_moe_dispatch.py --device cuda --dtype bfloat16 --tokens 32768 --hidden 1024
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
from torch import nn

from shardwise.moe import _grouped
from shardwise.moe.layer import MoE


class _MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x):
        return self.out(nn.functional.gelu(self.fc(x)))


def _padded(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """``layer``'s gate and experts (ep 1) with a capacity-padded ``[E, C, M]`` buffer."""
    routes = layer.deepspeed_moe.gate.route(x)
    (s, m), k, e, c = x.shape, routes.expert.shape[1], layer.num_experts, routes.capacity
    # each route's place in the flat buffer; dropped routes go to one extra slot, cut off
    place = torch.where(routes.kept, routes.expert * c + routes.slot, e * c).reshape(-1)
    token_of_place = torch.full((e * c + 1,), s, dtype=torch.long, device=x.device)
    token_of_place.scatter_(0, place, torch.arange(s, device=x.device).repeat_interleave(k))
    buffer = torch.cat([x, x.new_zeros(1, m)]).index_select(0, token_of_place[:-1]).view(e, c, m)
    experts = layer.deepspeed_moe.experts.deepspeed_experts
    out = torch.cat([expert(buffer[i]) for i, expert in enumerate(experts)] + [x.new_zeros(1, m)])
    routed = out.index_select(0, place).view(s, k, m)
    return (routed * routes.weight.unsqueeze(-1)).sum(1)


def _layers(args) -> dict[str, MoE]:
    torch.manual_seed(0)
    common = dict(hidden_size=args.hidden, expert=_MLP(args.hidden), num_experts=args.experts, k=args.k)
    capped = MoE(**common, capacity_factor=args.capacity, drop_tokens=True)
    dropless = MoE(**common, drop_tokens=False)
    dropless.load_state_dict(capped.state_dict())
    loop = MoE(**common, drop_tokens=False)
    loop.load_state_dict(capped.state_dict())
    loop.deepspeed_moe.use_grouped_mm = False
    layers = {"cap": capped, "dropless": dropless, "dropless-loop": loop}
    return {name: layer.to(args.device, getattr(torch, args.dtype)) for name, layer in layers.items()}


def _deepspeed_layers(args, weights: dict) -> dict:
    """DeepSpeed's MoE layers with ``weights``, in a one-rank process group."""
    try:
        import deepspeed
        from deepspeed.moe.layer import MoE as DeepSpeedMoE
    except ImportError as error:
        raise SystemExit(f"--deepspeed needs DeepSpeed in this Python ({error}); pip install deepspeed") from error
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    deepspeed.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo")
    torch.manual_seed(0)
    common = dict(hidden_size=args.hidden, expert=_MLP(args.hidden), num_experts=args.experts, k=args.k)
    layers = {}
    for mode, drop in (("ds_cap", True), ("ds_dropless", False)):
        layer = DeepSpeedMoE(**common, capacity_factor=args.capacity, drop_tokens=drop)
        layer.load_state_dict(weights)
        layer.set_deepspeed_parallelism()
        layers[mode] = layer.to(args.device, getattr(torch, args.dtype))
    return layers


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _step(name: str, layers: dict[str, MoE], x: torch.Tensor) -> float:
    layout, _, mode = name.partition("-")
    if layout == "deepspeed":
        layout, mode = "sorted", f"ds_{mode}"  # its own forward
    layer = layers[mode]
    layer.zero_grad(set_to_none=False)
    _sync(x.device.type)
    start = time.perf_counter()
    out = layer(x)[0] if layout == "sorted" else _padded(layer, x)
    out.float().pow(2).mean().backward()
    _sync(x.device.type)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help="one rank's tokens (micro-batch x sequence)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--capacity", type=float, default=1.25)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--device", default="cpu", help="cpu (one thread) or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--deepspeed", action="store_true", help="add DeepSpeed's own MoE layer (ep 1)")
    parser.add_argument("--profile", default="", help="comma-separated variants to profile (one step each)")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    layers = _layers(args)
    if args.deepspeed:
        layers.update(_deepspeed_layers(args, layers["cap"].state_dict()))
    x = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(1))
    x = x.to(args.device, getattr(torch, args.dtype))
    variants = ["sorted-dropless", "sorted-dropless-loop", "sorted-cap", "padded-cap", "padded-dropless"]
    variants += ["deepspeed-cap", "deepspeed-dropless"] if args.deepspeed else []
    times: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.rounds + 1):
        for v in variants if r % 2 == 0 else variants[::-1]:
            t = _step(v, layers, x)
            if r:  # round 0 warms up
                times[v].append(t)
    with torch.no_grad():
        routes = {m: layers[m].deepspeed_moe.gate.route(x) for m in ("cap", "dropless")}
        tol = 1e-5 if args.dtype == "float32" else 2e-2
        same = torch.allclose(layers["cap"](x)[0].float(), _padded(layers["cap"], x).float(), atol=tol)
        moe = layers["dropless"].deepspeed_moe
        grouped = moe._grouped_plan(list(moe.experts.deepspeed_experts))
        grouped = (args.device, x.dtype) in _grouped.FAST_ON and grouped is not None and grouped.usable(x)
    rows = {
        "sorted-dropless": int(routes["dropless"].kept.sum()),
        "sorted-dropless-loop": int(routes["dropless"].kept.sum()),
        "sorted-cap": int(routes["cap"].kept.sum()),
        "padded-cap": args.experts * routes["cap"].capacity,
        "padded-dropless": args.experts * routes["dropless"].capacity,
        "deepspeed-cap": args.experts * routes["cap"].capacity,
        "deepspeed-dropless": args.experts * routes["dropless"].capacity,
    }
    base = statistics.median(times["padded-cap"])
    where = "1 CPU thread" if args.device == "cpu" else torch.cuda.get_device_name()
    print(
        f"one MoE layer, {args.tokens} tokens x hidden {args.hidden}, {args.experts} experts (4x MLP), "
        f"top-{args.k}, capacity factor {args.capacity}, {args.dtype}; forward + backward, {where}, "
        f"median of {args.rounds}; grouped matmul used by sorted-dropless: {grouped}\n"
    )
    print("| layout | median ms | min-max ms | vs padded-cap | expert rows computed |")
    print("| --- | --- | --- | --- | --- |")
    for v in variants:
        med = statistics.median(times[v])
        print(
            f"| {v} | {1000 * med:.1f} | {1000 * min(times[v]):.1f}-{1000 * max(times[v]):.1f} "
            f"| {med / base:.3f} | {rows[v]} |"
        )
    print(f"\nsorted-cap output equals padded-cap output (atol {tol}): {same}")
    for variant in filter(None, args.profile.split(",")):
        _profile(variant, layers, x)


def _profile(variant: str, layers: dict, x: torch.Tensor) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if x.is_cuda else [])
    with profile(activities=activities) as prof:
        _step(variant, layers, x)
    key = "self_cuda_time_total" if x.is_cuda else "self_cpu_time_total"
    print(f"\n{variant}, one step:\n" + prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=50))


if __name__ == "__main__":
    main()
