"""The comms logger without a process group: bandwidth formulas, selection, the summary
table's layout and the configuration entry points ([Note: the comms logger])."""

import io
import logging
from types import SimpleNamespace

import pytest
import torch

import shardwise.comm as dist
from shardwise.comm import CommsLogger, CommsLoggerConfig, comms_logger, comms_logger_from_config
from shardwise.comm._logger import bandwidth_gbps, format_size, trimmed_mean

CPU = torch.device("cpu")
WIDTH = 20


@pytest.fixture
def global_logger():
    """The process-wide logger, emptied, and restored (settings and records) afterwards."""
    saved = comms_logger.config, comms_logger.enabled
    comms_logger.reset()
    yield comms_logger
    comms_logger.apply(saved[0])
    comms_logger.enabled = saved[1]
    comms_logger.reset()


def _logger(**settings) -> CommsLogger:
    log = CommsLogger()
    log.apply(CommsLoggerConfig(enabled=True, **settings))
    return log


@pytest.mark.parametrize(
    "op, size, world, tput, busbw",
    [
        # 4000 bytes in 1 ms = 0.032 Gbit/s
        ("all_reduce", 4000, 2, 0.064, 0.032),  # tput 2S/t, busbw S/t * 2(n-1)/n
        ("all_reduce", 4000, 4, 0.064, 0.048),
        ("inference_all_reduce", 4000, 4, 0.064, 0.048),
        ("all_gather_into_tensor", 4000, 4, 0.128, 0.096),  # n inputs arrive: nS/t, * (n-1)/n
        ("all_gather", 4000, 2, 0.064, 0.032),
        ("reduce_scatter_tensor", 16000, 4, 0.128, 0.096),  # the whole input: S/t, * (n-1)/n
        ("reduce_scatter", 16000, 4, 0.128, 0.096),
        ("all_to_all_single", 4000, 4, 0.032, 0.024),
        ("broadcast", 4000, 4, 0.032, 0.032),
        ("send", 4000, 2, 0.032, 0.032),
        ("recv", 4000, 2, 0.032, 0.032),
        ("barrier", 0, 2, 0.0, 0.0),
    ],
)
def test_bandwidth_formulas(op, size, world, tput, busbw):
    assert bandwidth_gbps(op, size, 1.0, world) == pytest.approx((tput, busbw))
    assert bandwidth_gbps(op, size, 2.0, world) == pytest.approx((tput / 2, busbw / 2))


def test_bandwidth_of_an_unknown_op_names_it():
    with pytest.raises(ValueError, match="'all_shuffle'"):
        bandwidth_gbps("all_shuffle", 10, 1.0, 2)
    assert bandwidth_gbps("all_reduce", 10, 0.0, 2) == (0.0, 0.0)


def test_sizes_and_trimmed_mean():
    assert [format_size(n) for n in (0, 1, 1023, 1024, 4000, 1024**2, 3 * 1024**2, 1024**6)] == [
        "0B",
        "1.0 B",
        "1023.0 B",
        "1.0 KB",
        "3.91 KB",
        "1.0 MB",
        "3.0 MB",
        "1024.0 PB",
    ]
    assert trimmed_mean([]) == 0.0
    assert trimmed_mean([5.0]) == 5.0
    # ten values: the smallest and the largest are dropped
    assert trimmed_mean([1000.0, 1, 2, 3, 4, 5, 6, 7, 8, -1000.0]) == pytest.approx(4.5)


def test_selection_by_prof_all_prof_ops_and_prof():
    everything = _logger()
    assert everything.start("broadcast", "broadcast", 4, 2, CPU) is not None
    chosen = _logger(prof_all=False, prof_ops=["all_reduce", "grads"])
    assert chosen.start("all_reduce", "all_reduce", 4, 2, CPU) is not None
    assert chosen.start("all_reduce", "grads", 4, 2, CPU) is not None
    assert chosen.start("broadcast", "broadcast", 4, 2, CPU) is None
    assert chosen.start("broadcast", "broadcast", 4, 2, CPU, prof=True) is not None


def test_debug_names_the_caller():
    timer = _logger(debug=True).start("all_reduce", "all_reduce", 4, 2, CPU)
    assert timer.name == "all_reduce | [Caller Func: test_debug_names_the_caller]"


def test_a_timer_records_its_call():
    log = _logger()
    for _ in range(3):
        log.start("all_reduce", "all_reduce", 4000, 2, CPU).stop()
    log.start("all_reduce", "all_reduce", 8, 2, CPU).stop()
    assert log.op_names() == ["all_reduce"]
    assert log.total_count() == 4
    summary = log.summary()["all_reduce"]
    assert sorted(summary) == [8, 4000]
    assert summary[4000]["count"] == 3 and summary[4000]["total_latency_ms"] >= 0
    log.reset()
    assert log.total_count() == 0 and log.summary() == {}


def _parse_table(text: str) -> dict[str, dict[str, list[str]]]:
    """{op: {size string: [count, total, avg, tput, busbw]}} from the printed table, cut at
    the fixed 20-character columns."""
    lines = text.splitlines()
    header = [lines[0][i : i + WIDTH].strip() for i in range(0, 7 * WIDTH, WIDTH)]
    assert header == [
        "Comm. Op",
        "Message Size",
        "Count",
        "Total Latency(ms)",
        "Avg Latency(ms)",
        "tput_avg (Gbps)",
        "busbw_avg (Gbps)",
    ]
    table, op = {}, None
    for line in lines[1:]:
        if not line.startswith(" "):
            op = line
            table[op] = {}
            continue
        cells = [line[i : i + WIDTH].strip() for i in range(WIDTH, 7 * WIDTH, WIDTH)]
        table[op][cells[0]] = cells[1:]
    return table


def test_summary_table_layout():
    log = _logger()
    for latency in (1.0, 2.0, 3.0):
        log.append("all_reduce", "all_reduce", latency, 4000, 2)
    log.append("all_gather_into_tensor", "all_gather_into_tensor", 1.0, 1024, 2)
    log.append("all_reduce", "all_reduce", 1.0, 8, 2)
    out = io.StringIO()
    result = log.log_all(print_log=True, return_dict=True, file=out)
    table = _parse_table(out.getvalue())
    assert list(table) == ["all_reduce", "all_gather_into_tensor"]
    assert list(table["all_reduce"]) == ["8.0 B", "3.91 KB"]  # ascending sizes
    assert table["all_reduce"]["3.91 KB"] == ["3", "6.00", "2.00", "0.04", "0.02"]
    assert table["all_gather_into_tensor"]["1.0 KB"] == ["1", "1.00", "1.00", "0.02", "0.01"]
    row = result["summary"]["all_reduce"][4000]
    assert (row["count"], row["total_latency_ms"], row["msg_size_str"]) == (3, 6.0, "3.91 KB")
    assert result["straggler_analysis"] is None
    assert result["metadata"]["world_size"] == 1


def test_straggler_without_peers_is_zero():
    log = _logger()
    log.append("broadcast", "broadcast", 2.0, 400, 2)
    out = io.StringIO()
    result = log.log_all(show_straggler=True, return_dict=True, file=out)
    assert result["straggler_analysis"]["broadcast"][400]["total_straggler_ms"] == 0.0
    assert "Breakdown with straggler effect" in out.getvalue()
    assert "Total straggler(ms)" in out.getvalue()


def test_verbose_logs_each_call(caplog):
    log = _logger(verbose=True)
    with caplog.at_level(logging.INFO, logger="shardwise.comm._logger"):
        log.append("all_reduce", "grads", 1.0, 4000, 2)
    assert caplog.messages == [
        "comm op: grads | time (ms): 1.00 | msg size: 3.91 KB | algbw (Gbps): 0.06 | busbw (Gbps): 0.03"
    ]


def test_configure_as_deepspeed(global_logger):
    assert not global_logger.enabled  # off unless asked
    dist.configure(enabled=True)
    assert global_logger.enabled and global_logger.config.prof_all
    dist.configure(prof_all=False, prof_ops=["all_reduce"], verbose=True, debug=True)
    assert global_logger.config == CommsLoggerConfig(
        enabled=True, prof_all=False, prof_ops=("all_reduce",), verbose=True, debug=True
    )
    dist.configure(deepspeed_config={"train_batch_size": 8, "comms_logger": {"enabled": False}})
    assert not global_logger.enabled and global_logger.config.prof_all
    dist.configure(deepspeed_config={"train_batch_size": 8})  # no section: unchanged
    assert not global_logger.enabled
    with pytest.raises(ValueError, match=r"got a int without \['enabled'"):
        dist.configure(deepspeed_config=42)


def test_comms_logger_from_config(global_logger):
    assert comms_logger_from_config(None) == CommsLoggerConfig()
    applied = comms_logger_from_config({"enabled": True, "prof_all": False, "prof_ops": ["broadcast"]})
    assert global_logger.enabled and global_logger.config is applied and applied.prof_ops == ("broadcast",)
    comms_logger_from_config(CommsLoggerConfig(enabled=False))
    assert not global_logger.enabled
    typed = SimpleNamespace(enabled=True, prof_all=False, prof_ops=("all_reduce",), verbose=False, debug=True)
    assert comms_logger_from_config(typed) == CommsLoggerConfig(
        enabled=True, prof_all=False, prof_ops=("all_reduce",), debug=True
    )
    dist.configure(deepspeed_config=SimpleNamespace(comms_logger={"enabled": False}))
    assert not global_logger.enabled
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['prof_op'\]"):
        comms_logger_from_config({"enabled": True, "prof_op": ["all_reduce"]})
    with pytest.raises(ValueError, match="comms_logger.verbose must be true or false, got 'yes'"):
        comms_logger_from_config({"verbose": "yes"})
    with pytest.raises(ValueError, match="comms_logger.prof_ops must be a list"):
        comms_logger_from_config({"prof_ops": "all_reduce"})


def test_nothing_logged_reports_empty(global_logger, capsys):
    assert dist.log_summary() is None
    assert capsys.readouterr().out.startswith("Comm. Op")
    result = dist.log_summary(show_straggler=True, return_dict=True)
    assert (result["summary"], result["straggler_analysis"]) == ({}, {})
    assert (dist.has_comm_data(), dist.get_comm_operation_count(), dist.get_logged_comm_ops()) == (False, 0, [])
    global_logger.append("broadcast", "broadcast", 1.0, 4, 2)
    assert (dist.has_comm_data(), dist.get_comm_operation_count(), dist.get_logged_comm_ops()) == (
        True,
        1,
        ["broadcast"],
    )
    dist.reset_log()
    assert not dist.has_comm_data()
