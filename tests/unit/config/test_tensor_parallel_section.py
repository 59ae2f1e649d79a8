"""The ``tensor_parallel`` config section."""

import logging

from shardwise.config import load_config


def test_tensor_parallel_performance_switches_say_they_have_no_effect(caplog):
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        load_config(
            {"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": True}},
            world_size=1,
        )
    assert "tensor_parallel.tp_overlap_comm: no effect" in caplog.text
