"""Fixtures of the DeepSpeed-compatibility unit tests."""

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-rank gloo process group (file store in ``tmp_path``), destroyed after the
    test, so the process is left as it was found (a group that exists already is used
    and left alone)."""
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        if started:
            dist.destroy_process_group()
