"""Which collectives' waits block the Python thread (see [Note: stream-ordered waits])."""

import pytest

from shardwise.comm._collectives import blocking_wait


def test_gloo_waits_block_with_the_deadline():
    assert blocking_wait("gloo", {}) is True
    assert blocking_wait("gloo", {"TORCH_NCCL_BLOCKING_WAIT": "0"}) is True


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, False),
        ({"TORCH_NCCL_BLOCKING_WAIT": "0"}, False),
        ({"TORCH_NCCL_BLOCKING_WAIT": "1"}, True),
        ({"NCCL_BLOCKING_WAIT": "1"}, True),  # the older name
        ({"TORCH_NCCL_BLOCKING_WAIT": "0", "NCCL_BLOCKING_WAIT": "1"}, False),  # the current name wins
    ],
)
def test_nccl_waits_are_stream_ordered_unless_blocking_wait_is_asked_for(environ, expected):
    assert blocking_wait("nccl", environ) is expected
