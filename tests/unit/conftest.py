"""Every single-process test leaves the process as it found it, whatever order the tests run
in: a default process group the test initialised (``shardwise.initialize`` makes a world of
one) is destroyed, and the environment variables it set (``MASTER_ADDR``, ``RANK``...) are
put back."""

import os

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _leave_the_process_as_found():
    environ = dict(os.environ)
    had_group = dist.is_available() and dist.is_initialized()
    yield
    if dist.is_available() and dist.is_initialized() and not had_group:
        dist.destroy_process_group()
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
