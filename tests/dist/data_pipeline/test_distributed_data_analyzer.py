"""DistributedDataAnalyzer on 2 gloo ranks writes the same index files as one DataAnalyzer
process, which are DeepSpeed 0.19.8's (tests/unit/data_pipeline/deepspeed_reference)."""

import importlib.util
import os

from shardwise.runtime.data_pipeline.data_sampling.data_analyzer import DistributedDataAnalyzer
from shardwise.testing import run_distributed

_UNIT = os.path.join(os.path.dirname(__file__), "..", "..", "unit", "data_pipeline")
_spec = importlib.util.spec_from_file_location(
    "_analyzer_reference", os.path.join(_UNIT, "make_deepspeed_reference.py")
)
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)
FINAL_FILES = [
    f"seqlen/seqlen_{name}{ext}"
    for name in ("sample_to_metric", "index_to_metric", "index_to_sample", "index_to_sample_percentile_merged")
    for ext in (".bin", ".idx")
] + ["vocab/vocab_metric_value.bin", "vocab/vocab_metric_value.idx"]


def _analyze(rank, world_size, save_path, num_threads):
    import torch.distributed as dist

    DistributedDataAnalyzer(
        ref.analyzer_dataset(),
        num_threads=num_threads,
        batch_size=ref.ANALYZER_KWARGS["batch_size"],
        metric_names=ref.ANALYZER_KWARGS["metric_names"],
        metric_types=ref.ANALYZER_KWARGS["metric_types"],
        metric_functions=[ref.seqlen_metric, ref.vocab_metric],
        save_path=save_path,
        device="cpu",
        comm_group=dist.group.WORLD,
    ).run_map_reduce()


def test_two_ranks_write_the_single_process_index(tmp_path):
    run_distributed(_analyze, world_size=2, tmp_path=tmp_path, save_path=str(tmp_path / "out"), num_threads=2)
    for name in FINAL_FILES:
        with (
            open(tmp_path / "out" / name, "rb") as ours,
            open(os.path.join(_UNIT, "deepspeed_reference", "analyzer", name), "rb") as want,
        ):
            assert ours.read() == want.read(), name
