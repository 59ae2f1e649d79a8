"""Dynamic batching: token-budget micro-batches equal DeepSpeed 0.19.8's packing (which never
places the last sample of its order; here it is packed too), stay within max_tokens and the
batch-size bounds, and the learning rate follows the batch size (linear, sqrt, none)."""

import json
import os

import pytest
import torch
from make_deepspeed_reference import (
    BATCHING_CASES,
    LR_STEPS,
    analyzer_dataset,
    lr_optimizer,
    lr_schedulers,
    seqlen_metric,
)

from shardwise.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr import (
    batch_by_seqlens,
    dynamic_batching_kwargs,
    get_dataloader_and_lr_scheduler_for_variable_batch_size,
    lr_scheduler_for_variable_batch_size,
    scale_lr,
)

with open(os.path.join(os.path.dirname(__file__), "deepspeed_reference", "dynamic_batching.json")) as _f:
    REFERENCE = json.load(_f)
SEQLENS = seqlen_metric(analyzer_dataset()).tolist()


def _deepspeed_order_last(case) -> int:
    """The sample DeepSpeed's scan never reaches: the last one in the picking order."""
    if case.get("sequence_picking_order") == "seqlen":
        return max((n, i) for i, n in enumerate(SEQLENS))[1]
    return len(SEQLENS) - 1


@pytest.mark.parametrize("name", list(BATCHING_CASES))
def test_packing_equals_deepspeed(name):
    case = BATCHING_CASES[name]
    without_last = [i for i in range(len(SEQLENS)) if i != _deepspeed_order_last(case)]
    ids, sizes, longest = batch_by_seqlens(SEQLENS, sequence_ids_per_mb=without_last, **case)
    assert [[[b, m] for b, m in ids], sizes, longest] == REFERENCE["batches"][name]
    ids, sizes, _ = batch_by_seqlens(SEQLENS, **case)
    placed = sorted(i for _, mb in ids for i in mb)
    assert len(placed) == len(set(placed))
    for _, mb in ids:
        assert sum(SEQLENS[i] for i in mb) <= case["max_tokens"]
        assert case.get("min_batch_size", 1) <= len(mb) <= case.get("max_batch_size", len(mb))
    if case.get("required_microbatches_of_same_size"):
        assert all(len(ids[k][1]) == len(ids[k + 1][1]) for k in range(0, len(ids), 2))


def test_last_sample_is_packed():
    assert batch_by_seqlens([3, 3, 3, 3], 6)[0] == [(0, [0, 1]), (1, [2, 3])]  # DeepSpeed: [2] alone


def test_random_order_is_seeded_and_long_samples_dropped():
    seqlens = [*SEQLENS[:40], 50]
    first = batch_by_seqlens(seqlens, 9, sequence_picking_order="random", seed=3)
    assert first == batch_by_seqlens(seqlens, 9, sequence_picking_order="random", seed=3)
    assert first != batch_by_seqlens(seqlens, 9, sequence_picking_order="random", seed=4)
    assert 40 not in [i for _, mb in first[0] for i in mb]


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # no training here
@pytest.mark.parametrize("name", ["constant", "halving"])
def test_lr_follows_batch_size_as_deepspeed(name):
    sizes = REFERENCE["batches"]["dataloader"][1]
    scheduler = lr_scheduler_for_variable_batch_size(4, sizes, None, lr_schedulers(lr_optimizer)[name], "sqrt")
    lrs = [scheduler.get_lr()[0]]
    for _ in range(LR_STEPS):
        scheduler.step()
        lrs.append(scheduler.get_lr()[0])
    assert lrs == pytest.approx(REFERENCE["lrs"][name], rel=1e-12)


def test_scale_lr_methods():
    assert [scale_lr(4, 8, 0.1, m) for m in ("linear", "sqrt", "none", None)] == pytest.approx(
        [0.2, 0.1 * 2**0.5, 0.1, 0.1]
    )
    with pytest.raises(ValueError, match="lr_scaling_method"):
        scale_lr(4, 8, 0.1, "cubic")


def test_dataloader_from_config_dict():
    config = {
        "seed": 1,
        "data_sampling": {"dynamic_batching": {"enabled": True, "max_tokens": 10, "lr_scaling_method": "linear"}},
    }
    data = analyzer_dataset()
    loader, scheduler, _ = get_dataloader_and_lr_scheduler_for_variable_batch_size(
        data,
        SEQLENS,
        effective_batch_size=2,
        dataloader_rank=1,
        dataloader_num_replicas=2,
        dataloader_collate_fn=torch.stack,
        lr_scheduler_or_optimizer=lr_optimizer(),
        **dynamic_batching_kwargs(config),
    )
    ids, sizes, _ = batch_by_seqlens(SEQLENS, 10, effective_batch_size=2)
    batches = list(loader)
    assert len(batches) == len(ids) // 2
    assert all(torch.equal(b, data[ids[2 * k + 1][1]]) for k, b in enumerate(batches))
    assert scheduler.get_lr()[0] == pytest.approx(0.1 * sizes[0] / 2)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # no training here
def test_lr_scheduler_resumes_from_state_dict():
    sizes = REFERENCE["batches"]["dataloader"][1]
    whole = lr_scheduler_for_variable_batch_size(4, sizes, None, lr_schedulers(lr_optimizer)["halving"], "linear")
    first = lr_scheduler_for_variable_batch_size(4, sizes, None, lr_schedulers(lr_optimizer)["halving"], "linear")
    for _ in range(3):
        whole.step()
        first.step()
    resumed = lr_scheduler_for_variable_batch_size(4, sizes, None, lr_schedulers(lr_optimizer)["halving"], "linear")
    resumed.load_state_dict(first.state_dict())
    assert resumed.get_lr() == whole.get_lr()
    whole.step()
    resumed.step()
    assert resumed.get_lr() == pytest.approx(whole.get_lr(), rel=1e-12)
