"""Ranks that diverge fail the whole job within the collective deadline, at every ZeRO stage.

The last rank runs one training step more than rank 0, which then stalls (as a rank stuck
in data loading would). The waiting rank must raise CollectiveError naming the collective
within ``comm.timeout_s``, exit at once (no exit barrier, no teardown of a group with a
collective in flight), and the launcher must then stop rank 0. The same holds for a
collective a user script issues through the functional API (``dist.all_reduce``), and a
rank that leaves with ``sys.exit(3)`` ends the job at once, while ``sys.exit(0)`` keeps
the clean exit through the exit barrier.
"""

from pathlib import Path

import pytest
from launched_jobs import launch

from shardwise.testing.background import in_background

SCRIPT = Path(__file__).with_name("diverged_script.py")
TIMEOUT_S = 3
"""The collective deadline of the jobs. Every collective of the job runs under it, so it
must exceed how far apart two ranks reach one collective on a loaded machine (well under
a second between the ranks' steps here), and each case waits it out once."""
MARGIN_S = 40
"""Start-up of two ranks on a loaded 2-core CI machine (~5 s when quiet), the grace for
the peers' states (half the deadline here) and the launcher stopping rank 0. This bounds
a hang, not a speed: without the fix the job ends only when rank 0's stall (STALL_S)
does, or never."""
STALL_S = 150
KILL_AFTER_S = 120
USER_SCRIPT = Path(__file__).with_name("user_script.py")
USER_MARGIN_S = 30
"""For the user script under torchrun: start-up of two ranks on a loaded 2-core machine
(~5 s when quiet), the grace for the peers' states (half the deadline) and torchrun
stopping rank 0. Without the functional API's deadline the diverged rank waits for gloo's
timeout (30 min by default, and for ever in a reduce-scatter); a rank that left with
sys.exit(3) through the exit barrier waits until rank 0's stall ends (USER_STALL_S)."""
USER_TIMEOUT_S = 5
"""The user script's deadline: given as the group's own timeout it also bounds the group's
start-up rendezvous, which waits for the slower rank's imports, so it keeps more room."""
USER_STALL_S = 90
USER_KILL_AFTER_S = 60


AT_ONCE = 2
"""Jobs of this module running at once (see shardwise.testing.background): each is mostly
waiting (for its deadline, the grace and the launcher), about half a core on average. Each
job's time counts against its margin, so no more: at 3 and a load of 18 on 2 cores, jobs
went past it."""


def _run_diverged(launcher, *script_args):
    return lambda cwd: launch(
        launcher,
        cwd,
        SCRIPT,
        "--timeout_s",
        str(TIMEOUT_S),
        "--stall_s",
        str(STALL_S),
        *script_args,
        kill_after_s=KILL_AFTER_S,
    )


def _run_user_script(*script_args):
    return lambda cwd: launch(
        "torchrun", cwd, USER_SCRIPT, "--stall_s", str(USER_STALL_S), *script_args, kill_after_s=USER_KILL_AFTER_S
    )


def _job_for(item):
    """The launched job of a test of this module, from its name and parameters."""
    params = item.callspec.params if hasattr(item, "callspec") else {}
    match item.originalname:
        case "test_diverged_ranks_fail_fast_under_shardwise_run":
            return _run_diverged("shardwise run", "--stage", str(params["stage"]))
        case "test_diverged_ranks_fail_fast_under_torchrun":
            offload = ["--offload"] if params["offload"] else []
            return _run_diverged("torchrun", "--stage", str(params["stage"]), *offload)
        case "test_a_diverged_functional_collective_fails_the_job_within_the_deadline":
            # The deadline comes from the engine's comm.timeout_s (the group keeps torch's 30 min,
            # which gloo would wait for, and which its reduce-scatter ignores) or from the group's
            # own timeout (which gloo enforces too, but without naming the collective).
            source = "--engine_timeout_s" if params["deadline_from"] == "engine" else "--group_timeout_s"
            return _run_user_script("--op", params["op"], source, str(USER_TIMEOUT_S))
        case "test_sys_exit_with_a_failure_status_on_one_rank_ends_the_job_at_once":
            return _run_user_script("--exit", "3")
        case "test_sys_exit_0_on_one_rank_leaves_through_the_exit_barrier":
            return _run_user_script("--exit", "0", "--stall_s", "3")
    return None


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    with in_background(request, tmp_path_factory, _job_for, at_once=AT_ONCE) as started:
        yield started


def _check(code, out, elapsed, kind):
    assert code != 0, out[-3000:]
    assert (
        f"CollectiveError: rank 1 waited in data-parallel group rank 1: {kind} #" in out
        and f"[gradient bucket 0] which did not complete within {TIMEOUT_S} s" in out
    ), out[-3000:]
    assert elapsed < TIMEOUT_S + MARGIN_S, f"the job took {elapsed:.1f} s:\n{out[-3000:]}"


# stage 0 and 2 under torchrun (all_reduce, reduce_scatter); the launcher's report once
@pytest.mark.parametrize("stage, kind", [(3, "reduce_scatter")])
def test_diverged_ranks_fail_fast_under_shardwise_run(jobs, request, stage, kind):
    code, out, elapsed = jobs[request.node.name].result()
    _check(code, out, elapsed, kind)
    assert "shardwise run: rank 1 (local rank 1" in out and "failed first" in out


@pytest.mark.parametrize("stage, offload, kind", [(0, False, "all_reduce"), (2, True, "reduce_scatter")])
def test_diverged_ranks_fail_fast_under_torchrun(jobs, request, stage, offload, kind):
    _check(*jobs[request.node.name].result(), kind)


# each op and each source of the deadline once
@pytest.mark.parametrize("op, deadline_from", [("all_reduce", "group"), ("reduce_scatter_tensor", "engine")])
def test_a_diverged_functional_collective_fails_the_job_within_the_deadline(jobs, request, op, deadline_from):
    code, out, elapsed = jobs[request.node.name].result()
    assert code != 0, out[-3000:]
    assert (
        f"CollectiveError: rank 1 waited in world group rank 1: {op} #2 (4 x float32) which did "
        f"not complete within {USER_TIMEOUT_S} s." in out
    ), out[-3000:]
    assert elapsed < USER_TIMEOUT_S + USER_MARGIN_S, f"the job took {elapsed:.1f} s:\n{out[-3000:]}"


def test_sys_exit_with_a_failure_status_on_one_rank_ends_the_job_at_once(jobs, request):
    code, out, elapsed = jobs[request.node.name].result()
    assert code != 0 and "exitcode  : 3" in out, out[-3000:]
    assert "rank 1 passed the exit barrier" not in out, out[-3000:]
    assert elapsed < USER_MARGIN_S, f"the job took {elapsed:.1f} s:\n{out[-3000:]}"


def test_sys_exit_0_on_one_rank_leaves_through_the_exit_barrier(jobs, request):
    code, out, _ = jobs[request.node.name].result()
    assert code == 0, out[-3000:]
    assert "rank 0 done" in out and "rank 0 passed the exit barrier" in out, out[-3000:]
    assert out.index("rank 0 done") < out.index("rank 1 passed the exit barrier"), out[-3000:]
    assert "terminate called" not in out and "SIGABRT" not in out, out[-3000:]
