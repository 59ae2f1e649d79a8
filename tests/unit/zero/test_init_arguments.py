"""zero.Init's DeepSpeed arguments: what it takes and what it refuses, before any collective."""

import pytest

import shardwise


def test_unknown_remote_device_and_arguments_are_clear_errors():
    with pytest.raises(ValueError, match=r"remote_device='gpu'\): use None, \"cpu\" or \"nvme\""):
        shardwise.zero.Init(remote_device="gpu")
    with pytest.raises(TypeError, match=r"unexpected arguments \['remote_devise'\]"):
        shardwise.zero.Init(remote_devise="cpu")
