"""DeepSpeedDataSampler on 2 gloo ranks: the ranks' slices of a global batch are disjoint, each
cluster's samples are drawn once per pass over it, and a run resumed mid-epoch from rank
0's state_dict yields what the uninterrupted run yields, on every rank."""

import importlib.util
import os
from collections import Counter

from shardwise.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler
from shardwise.testing import run_distributed

_UNIT = os.path.join(os.path.dirname(__file__), "..", "..", "unit", "data_pipeline")
_spec = importlib.util.spec_from_file_location("_sampler_reference", os.path.join(_UNIT, "make_deepspeed_reference.py"))
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)
MICRO, GAS, ROWS, RESUME_AT = 2, 2, 30, 11  # 4-sample rows, 8-sample global batches, 15 of them


def _sampler(rank, cluster_dir):
    import torch.distributed as dist

    config = ref.sampler_configs(os.path.join(_UNIT, "deepspeed_reference", "analyzer"), cluster_dir)["value"]
    return DeepSpeedDataSampler(config, ref.NUM_SAMPLES, MICRO, rank, 2, dist.group.WORLD, GAS, rank)


def _take(sampler, count):
    rows = iter(sampler)
    return [next(rows) for _ in range(count)]


def _run(rank, world_size, root):
    import torch.distributed as dist

    whole = _sampler(rank, os.path.join(root, "whole"))
    rows = _take(whole, ROWS)
    clusters = [c.tolist() for c in whole.data_clusters]
    first = _sampler(rank, os.path.join(root, "resumed"))
    resumed = _take(first, RESUME_AT)
    box = [first.state_dict()]
    dist.broadcast_object_list(box, src=0)  # every rank loads rank 0's state, as a checkpoint does
    second = _sampler(rank, os.path.join(root, "resumed"))
    second.load_state_dict(box[0])
    return rows, resumed + _take(second, ROWS - RESUME_AT), clusters


def test_two_ranks_exactly_once_per_pass_and_resume(tmp_path):
    (rows0, resumed0, clusters), (rows1, resumed1, _) = run_distributed(
        _run, world_size=2, tmp_path=tmp_path, root=str(tmp_path)
    )
    assert resumed0 == rows0 and resumed1 == rows1
    for row0, row1 in zip(rows0, rows1):
        assert len(row0) == len(row1) == MICRO and not set(row0) & set(row1)
    drawn = [i for row0, row1 in zip(rows0, rows1) for i in row0 + row1]
    assert len(clusters) >= 2 and sum(map(len, clusters)) == len({i for c in clusters for i in c})
    for cluster in clusters:
        counts = Counter(i for i in drawn if i in set(cluster))
        per_sample = [counts[i] for i in cluster]
        assert max(per_sample) - min(per_sample) <= 1, (len(cluster), sorted(Counter(per_sample).items()))
    assert set(drawn) <= {i for c in clusters for i in c}
