"""Tensor-parallel layers on 2 ranks (tp2) and 4 ranks (tp2 x dp2: tensor groups [0, 1] and
[2, 3], each training its own model) match single-process PyTorch on the same inputs:
every mapping's forward and backward, an MLP (outputs, every gradient shard, SGD steps),
a vocab-parallel embedding with cross-entropy, and a sequence-parallel LayerNorm -> MLP
block, with the collectives each issues counted.

fp32 results differ from the reference only by summation order (partial products summed
across ranks): relative errors stay below ``TOL``. Every check runs in one spawned job
per world size, because spawning is the expensive part, and is reported by name.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelLayerNorm,
    VocabParallelEmbedding,
    as_tensor_comm,
    copy_to_tensor_region,
    gather_from_sequence_region,
    gather_from_tensor_region,
    reduce_from_tensor_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
    scatter_to_tensor_region,
    vocab_parallel_cross_entropy,
)
from shardwise.testing import run_distributed

TP = 2
TOL = 1e-5
H, FF, S, B, V = 8, 16, 4, 3, 16


class _Report:
    """Relative errors by check name, and failed exact checks."""

    def __init__(self):
        self.errors: dict[str, float] = {}
        self.failures: list[str] = []

    def close(self, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if got.shape != want.shape:
            self.failures.append(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
            return
        scale = want.detach().abs().max().clamp_min(1e-12)
        self.errors[name] = float((got.detach() - want.detach()).abs().max() / scale)

    def check(self, name: str, ok: bool, detail: object = "") -> None:
        if not ok:
            self.failures.append(f"{name}: {detail}")


def _rand(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _chunk(t: torch.Tensor, index: int, dim: int) -> torch.Tensor:
    return t.chunk(TP, dim=dim)[index]


def _calls_of(comm, run) -> dict[str, int]:
    before = dict(comm.calls)
    run()
    return {op: n - before.get(op, 0) for op, n in comm.calls.items() if n != before.get(op, 0)}


def _check_groups(report, rank, comm, solo):
    """The tensor groups are [0, 1] and [2, 3]: a sum over one never sees the other."""
    mine = torch.tensor([float(rank)])
    comm.all_reduce(mine).wait()
    first = rank - rank % TP
    report.check("groups: sum over this tensor group", mine.item() == sum(range(first, first + TP)), mine.item())
    report.check("groups: one Communicator per group", as_tensor_comm(comm.group) is comm)
    x = torch.randn(4, 2, 6, requires_grad=True)
    ys = [
        f(x, solo)
        for f in (
            copy_to_tensor_region,
            reduce_from_tensor_region,
            scatter_to_tensor_region,
            gather_from_tensor_region,
            gather_from_sequence_region,
            reduce_scatter_to_sequence_region,
        )
    ]
    report.check("size-1 group: identity", all(y is x for y in ys))
    layer = ColumnParallelLinear(6, 4, group=solo)
    layer(x).sum().backward()
    report.check("size-1 group: no collective", sum(solo.calls.values()) == 0, dict(solo.calls))


def _check_mappings(report, comm):
    """Each mapping against its definition; inputs and upstream gradients differ per rank."""
    me, ranks = comm.rank, range(TP)
    shared = _rand(1, 4, 2, 6)  # the same on every rank, for the scatters

    def run(name, fn, x, want_out, want_grad):
        x = x.clone().requires_grad_()
        out = fn(x)
        report.close(f"{name} forward", out, want_out)
        out.backward(_rand(100 + me, *out.shape))
        report.close(f"{name} backward", x.grad, want_grad)

    xs = [_rand(10 + r, 4, 2, 6) for r in ranks]
    g_same = [_rand(100 + r, 4, 2, 6) for r in ranks]
    run("copy_to_tensor_region", lambda x: copy_to_tensor_region(x, comm), xs[me], xs[me], sum(g_same))
    run("reduce_from_tensor_region", lambda x: reduce_from_tensor_region(x, comm), xs[me], sum(xs), g_same[me])
    g_half = [_rand(100 + r, 4, 2, 3) for r in ranks]
    run(
        "scatter_to_tensor_region",
        lambda x: scatter_to_tensor_region(x, comm),
        shared,
        _chunk(shared, me, -1),
        torch.cat(g_half, -1),
    )
    g_double = [_rand(100 + r, 4, 2, 12) for r in ranks]
    run(
        "gather_from_tensor_region",
        lambda x: gather_from_tensor_region(x, comm),
        xs[me],
        torch.cat(xs, -1),
        _chunk(g_double[me], me, -1),
    )
    for dim in (0, 1):
        half = list(shared.shape)
        half[dim] //= TP
        g_split = [_rand(100 + r, *half) for r in ranks]
        run(
            f"scatter_to_sequence_region dim {dim}",
            lambda x: scatter_to_sequence_region(x, comm, dim=dim),
            shared,
            _chunk(shared, me, dim),
            torch.cat(g_split, dim),
        )
        double = list(shared.shape)
        double[dim] *= TP
        g_gathered = [_rand(100 + r, *double) for r in ranks]
        run(
            f"gather_from_sequence_region dim {dim}",
            lambda x: gather_from_sequence_region(x, comm, dim=dim),
            xs[me],
            torch.cat(xs, dim),
            _chunk(sum(g_gathered), me, dim),
        )
        run(
            f"reduce_scatter_to_sequence_region dim {dim}",
            lambda x: reduce_scatter_to_sequence_region(x, comm, dim=dim),
            xs[me],
            _chunk(sum(xs), me, dim),
            torch.cat(g_split, dim),
        )


def _check_mlp(report, comm, seed, steps=3, lr=0.1):
    """Column (gather_output=False) -> GELU -> row (input_is_parallel) against nn.Linear."""
    me = comm.rank
    torch.manual_seed(seed)
    ref = nn.Sequential(nn.Linear(H, FF), nn.GELU(), nn.Linear(FF, H))
    torch.manual_seed(seed)
    built = [
        ColumnParallelLinear(H, FF, gather_output=False, group=comm),
        RowParallelLinear(FF, H, input_is_parallel=True, group=comm),
    ]
    column = ColumnParallelLinear.from_linear(ref[0], group=comm)
    row = RowParallelLinear.from_linear(ref[2], group=comm)
    for name, a, b in (("column", built[0], column), ("row", built[1], row)):
        for (pname, p), q in zip(a.named_parameters(), b.parameters()):
            report.check(f"mlp: seeded {name}.{pname} == from_linear", torch.equal(p, q))
    for name, param, full in (
        ("column.weight", column.weight, ref[0].weight),
        ("column.bias", column.bias, ref[0].bias),
        ("row.weight", row.weight, ref[2].weight),
    ):
        report.check(f"mlp: {name} holds 1/tp", param.numel() * TP == full.numel(), param.shape)
    report.check("mlp: row.bias replicated", row.bias.shape == ref[2].bias.shape)

    def model(x):
        return row(F.gelu(column(x)))

    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    opt = torch.optim.SGD([*column.parameters(), *row.parameters()], lr=lr)
    for step in range(steps):
        x, target = _rand(seed * 100 + step, B, S, H), _rand(seed * 100 + 50 + step, B, S, H)
        ref_x, x = x.clone().requires_grad_(), x.requires_grad_()  # as inside a model: the input needs grad
        ref_out = ref(ref_x)
        ref_loss = F.mse_loss(ref_out, target)
        ref_loss.backward()
        result = {}
        forward = _calls_of(comm, lambda: result.update(loss=F.mse_loss(model(x), target)))
        backward = _calls_of(comm, lambda: result["loss"].backward())
        report.close(f"mlp step {step}: loss", result["loss"], ref_loss)
        if step == 0:
            report.check("mlp: one all-reduce forward", forward == {"all_reduce": 1}, forward)
            report.check("mlp: one all-reduce backward", backward == {"all_reduce": 1}, backward)
            for name, param, full, dim in (
                ("column.weight", column.weight, ref[0].weight, 0),
                ("column.bias", column.bias, ref[0].bias, 0),
                ("row.weight", row.weight, ref[2].weight, 1),
            ):
                report.close(f"mlp grad {name}", param.grad, _chunk(full.grad, me, dim))
            report.close("mlp grad row.bias", row.bias.grad, ref[2].bias.grad)
            report.close("mlp grad input", x.grad, ref_x.grad)
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    report.close("mlp after SGD: column.weight", column.weight, _chunk(ref[0].weight, me, 0))
    report.close("mlp after SGD: row.weight", row.weight, _chunk(ref[2].weight, me, 1))
    report.close("mlp after SGD: row.bias", row.bias, ref[2].bias)

    # the other output and input modes of the same layers
    x = _rand(seed, B, S, H).requires_grad_()
    gathered = ColumnParallelLinear.from_linear(ref[0], group=comm, gather_output=True)
    report.close("column gather_output", gathered(x), ref[0](x))
    out, bias = ColumnParallelLinear.from_linear(ref[0], group=comm, gather_output=True, skip_bias_add=True)(x)
    report.close("column gather_output skip_bias_add", out + bias, ref[0](x))
    x_ff = _rand(seed + 1, B, S, FF)
    report.close(
        "row scatters its input",
        RowParallelLinear.from_linear(ref[2], group=comm, input_is_parallel=False)(x_ff),
        ref[2](x_ff),
    )
    out, bias = RowParallelLinear.from_linear(ref[2], group=comm, skip_bias_add=True)(_chunk(x_ff, me, -1))
    report.close("row skip_bias_add", out + bias, ref[2](x_ff))
    twin = copy.deepcopy(row)
    report.check(
        "deepcopy shares the Communicator and keeps the marks",
        twin.comm is comm and twin.weight.partition_dim == 1 and twin.weight is not row.weight,
    )


def _check_vocab(report, comm, seed):
    """VocabParallelEmbedding -> column-parallel head -> vocab-parallel cross-entropy."""
    me = comm.rank
    torch.manual_seed(seed)
    ref_emb, ref_head = nn.Embedding(V, H, padding_idx=3), nn.Linear(H, V, bias=False)
    torch.manual_seed(seed)
    seeded = VocabParallelEmbedding(V, H, group=comm, padding_idx=3)
    report.check(
        "vocab: seeded shard == slice of nn.Embedding", torch.equal(seeded.weight, _chunk(ref_emb.weight, me, 0))
    )
    emb = VocabParallelEmbedding.from_embedding(ref_emb, group=comm)
    head = ColumnParallelLinear.from_linear(ref_head, group=comm)
    report.check("vocab: embedding holds 1/tp", emb.weight.numel() * TP == ref_emb.weight.numel())
    ids = torch.randint(0, V, (S, B), generator=torch.Generator().manual_seed(seed))
    ids[0, 0] = 3
    target = torch.randint(0, V, (S, B), generator=torch.Generator().manual_seed(seed + 1))
    report.close("vocab: embedding forward", emb(ids), ref_emb(ids))
    sp = VocabParallelEmbedding.from_embedding(ref_emb, group=comm, sequence_parallel=True)
    report.close("vocab: sequence-parallel embedding forward", sp(ids), _chunk(ref_emb(ids), me, 0))
    weights = _rand(seed, S, B)
    for smoothing in (0.0, 0.1):
        ref_logits = ref_head(ref_emb(ids))
        ref_loss = F.cross_entropy(
            ref_logits.view(-1, V), target.view(-1), reduction="none", label_smoothing=smoothing
        ).view(S, B)
        (ref_loss * weights).sum().backward()
        loss = vocab_parallel_cross_entropy(head(emb(ids)), target, comm, smoothing)
        (loss * weights).sum().backward()
        report.close(f"vocab eps={smoothing}: per-token loss", loss, ref_loss)
        report.close(f"vocab eps={smoothing}: embedding grad", emb.weight.grad, _chunk(ref_emb.weight.grad, me, 0))
        report.close(f"vocab eps={smoothing}: head grad", head.weight.grad, _chunk(ref_head.weight.grad, me, 0))
        report.check(
            f"vocab eps={smoothing}: padding row gets no grad",
            ref_emb.weight.grad[3].abs().sum() == 0 and (me != 0 or emb.weight.grad[3].abs().sum() == 0),
        )
        for p in (*ref_emb.parameters(), *ref_head.parameters(), *emb.parameters(), *head.parameters()):
            p.grad = None


def _check_sequence_parallel(report, comm, seed):
    """SequenceParallelLayerNorm on the sequence chunk -> column (gathers the sequence) ->
    GELU -> row (reduce-scatters it), against LayerNorm -> Linear -> GELU -> Linear."""
    me = comm.rank
    torch.manual_seed(seed)
    ref_norm, fc1, fc2 = nn.LayerNorm(H), nn.Linear(H, FF), nn.Linear(FF, H)
    with torch.no_grad():
        ref_norm.weight.uniform_(0.5, 1.5), ref_norm.bias.uniform_(-0.5, 0.5)
    norm = SequenceParallelLayerNorm.from_layer_norm(copy.deepcopy(ref_norm), group=comm)
    column = ColumnParallelLinear.from_linear(fc1, group=comm, sequence_parallel=True)
    row = RowParallelLinear.from_linear(fc2, group=comm, sequence_parallel=True)
    x, weights = _rand(seed, S, B, H).requires_grad_(), _rand(seed + 1, S, B, H)
    ref_out = fc2(F.gelu(fc1(ref_norm(x))))
    (ref_out * weights).sum().backward()

    x_local = _chunk(x.detach(), me, 0).clone().requires_grad_()
    result = {}
    forward = _calls_of(comm, lambda: result.update(out=row(F.gelu(column(norm(x_local))))))
    backward = _calls_of(comm, lambda: (result["out"] * _chunk(weights, me, 0)).sum().backward())
    report.close("sp: output chunk", result["out"], _chunk(ref_out, me, 0))
    report.close("sp: input grad chunk", x_local.grad, _chunk(x.grad, me, 0))
    report.close("sp: layernorm weight grad", norm.weight.grad, ref_norm.weight.grad)
    report.close("sp: layernorm bias grad", norm.bias.grad, ref_norm.bias.grad)
    report.close("sp: column weight grad", column.weight.grad, _chunk(fc1.weight.grad, me, 0))
    report.close("sp: column bias grad", column.bias.grad, _chunk(fc1.bias.grad, me, 0))
    report.close("sp: row weight grad", row.weight.grad, _chunk(fc2.weight.grad, me, 1))
    report.close("sp: row bias grad", row.bias.grad, fc2.bias.grad)
    report.check(
        "sp: forward all-gathers and reduce-scatters once", forward == {"all_gather": 1, "reduce_scatter": 1}, forward
    )
    report.check(
        "sp: backward mirrors it and sums the 3 replicated grads",
        backward == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 3},
        backward,
    )


def _check_all(rank, world_size):
    dp = world_size // TP
    tensor_groups = [dist.new_group(list(range(d * TP, (d + 1) * TP))) for d in range(dp)]
    solos = [dist.new_group([r]) for r in range(world_size)]
    comm, solo = as_tensor_comm(tensor_groups[rank // TP]), as_tensor_comm(solos[rank])
    seed = 7 + rank // TP  # each tensor group trains its own model: mixing groups breaks parity
    report = _Report()
    _check_groups(report, rank, comm, solo)
    _check_mappings(report, comm)
    _check_mlp(report, comm, seed)
    _check_vocab(report, comm, seed)
    _check_sequence_parallel(report, comm, seed)
    return report.errors, report.failures


@pytest.mark.parametrize("world_size", [2, 4], ids=["tp2", "tp2xdp2"])
def test_tensor_parallel_matches_single_process(tmp_path, world_size):
    results = run_distributed(_check_all, world_size=world_size, tmp_path=tmp_path)
    problems = []
    for rank, (errors, failures) in enumerate(results):
        assert len(errors) > 40, f"rank {rank} ran only {len(errors)} numeric checks"
        problems += [f"rank {rank}: {name}: relative error {err:.2e}" for name, err in errors.items() if not err <= TOL]
        problems += [f"rank {rank}: {failure}" for failure in failures]
    assert not problems, "\n".join(problems)
