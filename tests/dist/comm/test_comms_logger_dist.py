"""The comms logger on 2 gloo ranks: the library's collectives (a Communicator, its
point-to-point transfers, the 1-bit compressed exchange) and DeepSpeed's functional API
are timed under DeepSpeed's names with DeepSpeed's message sizes; ``prof_ops`` and
``prof=True`` select; disabled logs nothing; ``log_summary`` prints each op with its
count and reduces the straggler analysis across the ranks. One spawn checks every case."""

import contextlib
import io
import logging
import time

import torch

from shardwise.testing import run_distributed

FP32 = 4


def _counts(summary: dict) -> dict[str, dict[int, int]]:
    return {name: {size: row["count"] for size, row in sizes.items()} for name, sizes in summary.items()}


def _communicator_case(comm):
    from shardwise.comm import CompressedAllReduce
    from shardwise.comm._p2p import recv, send

    for _ in range(2):
        comm.all_reduce(torch.ones(1000)).wait()
    comm.broadcast(torch.ones(100), src=1).wait()
    comm.all_gather_into_tensor(torch.empty(500), torch.ones(250)).wait()
    comm.reduce_scatter_tensor(torch.empty(250), torch.ones(500)).wait()
    comm.reduce_scatter_scratch(torch.ones(500))[0].wait()  # an all-reduce on gloo, logged as what it is for
    if comm.rank == 0:
        send(comm, torch.ones(30), 1).wait()
    else:
        recv(comm, torch.empty(30), 0).wait()
    before = dict(comm.bytes)
    CompressedAllReduce(comm, 1024)(torch.ones(1024))
    sent = {op: comm.bytes[op] - before.get(op, 0) for op in ("all_to_all", "all_gather")}
    return sent


def _functional_case():
    import shardwise.comm as dist

    dist.all_reduce(torch.ones(1000))
    dist.all_reduce(torch.ones(1000), log_name="grads")
    dist.all_reduce(torch.ones(1000), async_op=True).wait()
    dist.broadcast(torch.ones(100), 0)
    dist.all_gather_into_tensor(torch.empty(500), torch.ones(250))
    dist.all_gather([torch.empty(250), torch.empty(250)], torch.ones(250))
    dist.reduce_scatter_tensor(torch.empty(250), torch.ones(500))
    dist.barrier()


def _issue_from_here(comm):
    import shardwise.comm as dist

    dist.all_reduce(torch.ones(10))
    comm.all_reduce(torch.ones(10)).wait()


def _body(rank, world_size):
    import shardwise.comm as dist
    from shardwise.comm import Communicator, comms_logger

    comm = Communicator(timeout_s=30)
    out = {}

    dist.configure(enabled=True, prof_all=True)
    out["communicator_sent"] = _communicator_case(comm)
    out["communicator"] = _counts(comms_logger.summary())
    with contextlib.redirect_stdout(io.StringIO()):  # send on rank 0, recv on rank 1: not paired
        out["unpaired"] = sorted(dist.log_summary(show_straggler=True, return_dict=True)["straggler_analysis"])

    dist.reset_log()
    _functional_case()
    out["functional"] = _counts(comms_logger.summary())

    dist.reset_log()
    dist.configure(prof_all=False, prof_ops=["all_reduce"])
    comm.all_reduce(torch.ones(8)).wait()
    comm.broadcast(torch.ones(8)).wait()
    dist.all_reduce(torch.ones(8))
    dist.broadcast(torch.ones(8), 0)
    dist.broadcast(torch.ones(16), 0, prof=True)
    dist.all_gather_into_tensor(torch.empty(4), torch.ones(2), log_name="all_reduce")
    out["prof_ops"] = _counts(comms_logger.summary())

    dist.reset_log()
    dist.configure(prof_all=True, debug=True)
    _issue_from_here(comm)
    out["debug"] = _counts(comms_logger.summary())

    dist.reset_log()
    dist.configure(enabled=False, debug=False)
    _communicator_case(comm)
    _functional_case()
    out["disabled"] = (dist.get_comm_operation_count(), comms_logger.summary())

    dist.configure(enabled=True, verbose=True)
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("shardwise.comm._logger").addHandler(handler)
    for _ in range(3):
        comm.all_reduce(torch.ones(1000)).wait()
    dist.broadcast(torch.ones(100), 1)
    logging.getLogger("shardwise.comm._logger").removeHandler(handler)
    out["verbose"] = records
    dist.configure(verbose=False)
    if rank == 1:
        time.sleep(0.1)  # rank 0 waits in this all-reduce: a 100 ms straggler effect on rank 0
    comm.all_reduce(torch.ones(7)).wait()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = dist.log_summary(show_straggler=True, return_dict=True)
    out["printed"] = printed.getvalue()
    out["straggler"] = result["straggler_analysis"]
    out["after_summary"] = _counts(comms_logger.summary())  # the summary's own collectives are not logged
    dist.configure(enabled=False)
    return out


def _check_cases(results):
    for rank, out in enumerate(results):
        p2p = {"send": {120: 1}} if rank == 0 else {"recv": {120: 1}}
        sent = out["communicator_sent"]
        assert out["communicator"] == {
            "all_reduce": {1000 * FP32: 2},
            "broadcast": {100 * FP32: 1},
            # the compressed exchange: its all-to-all's input, its all-gather's one-rank input
            "all_gather_into_tensor": {250 * FP32: 1, sent["all_gather"] // 2: 1},
            "reduce_scatter_tensor": {500 * FP32: 2},
            **p2p,
            "all_to_all_single": {sent["all_to_all"]: 1},
        }, (rank, out["communicator"])
        assert out["unpaired"] == [
            "all_gather_into_tensor",
            "all_reduce",
            "all_to_all_single",
            "broadcast",
            "reduce_scatter_tensor",
        ]
        assert out["functional"] == {
            "all_reduce": {1000 * FP32: 2},
            "grads": {1000 * FP32: 1},
            "broadcast": {100 * FP32: 1},
            "all_gather_into_tensor": {250 * FP32: 1},
            "all_gather": {250 * FP32: 1},
            "reduce_scatter_tensor": {500 * FP32: 1},
            "barrier": {0: 1},
        }, (rank, out["functional"])
        assert out["prof_ops"] == {"all_reduce": {8 * FP32: 2, 2 * FP32: 1}, "broadcast": {16 * FP32: 1}}
        assert out["debug"] == {"all_reduce | [Caller Func: _issue_from_here]": {10 * FP32: 2}}
        assert out["disabled"] == (0, {})
        assert out["after_summary"] == {"all_reduce": {7 * FP32: 1, 1000 * FP32: 3}, "broadcast": {100 * FP32: 1}}
        for name, sizes in out["straggler"].items():
            for row in sizes.values():
                assert row["total_straggler_ms"] >= 0 and row["count"] >= 1, (name, row)
        assert set(out["straggler"]) == {"all_reduce", "broadcast"}
    # the fastest rank's latency is the same on both; the rank that waited sees the difference
    late = [out["straggler"]["all_reduce"][7 * FP32] for out in results]
    assert late[0]["total_comm_lat_ms"] == late[1]["total_comm_lat_ms"] < 50
    assert late[0]["total_straggler_ms"] > 50 and late[1]["total_straggler_ms"] == 0


def _check_report(results):
    verbose = results[0]["verbose"]
    assert len(verbose) == 4 and verbose[0].startswith("comm op: all_reduce | time (ms): ")
    assert "| msg size: 3.91 KB | algbw (Gbps): " in verbose[0] and "| busbw (Gbps): " in verbose[0]
    assert verbose[3].startswith("comm op: broadcast | ")
    assert results[1]["verbose"] == []  # rank 0 only, as in DeepSpeed
    printed = results[0]["printed"].splitlines()
    assert results[1]["printed"] == ""
    assert printed[0].split() == [
        "Comm.",
        "Op",
        "Message",
        "Size",
        "Count",
        "Total",
        "Latency(ms)",
        "Avg",
        "Latency(ms)",
        "tput_avg",
        "(Gbps)",
        "busbw_avg",
        "(Gbps)",
    ]
    assert printed[1] == "all_reduce" and printed[2].split()[:3] == ["28.0", "B", "1"]
    assert printed[3].split()[:3] == ["3.91", "KB", "3"]  # sizes ascending
    assert printed[4] == "broadcast" and printed[5].split()[:3] == ["400.0", "B", "1"]
    assert printed[7] == "Breakdown with straggler effect"
    assert printed[10] == "all_reduce" and printed[11].split()[:3] == ["28.0", "B", "1"]


def test_comms_logger_on_two_ranks(tmp_path):
    results = run_distributed(_body, world_size=2, tmp_path=tmp_path, timeout_s=120)
    _check_cases(results)
    _check_report(results)
