"""A stage that stalls mid-schedule fails the pipeline job fast: its peer's receive
reaches the collective deadline and names the rank and the stages, the job exits
non-zero within the deadline plus a margin (a bound on a hang, not a speed threshold)."""

import sys
from pathlib import Path

import pytest

from shardwise.testing.background import in_background

sys.path.insert(0, str(Path(__file__).parents[1] / "comm"))
from launched_jobs import launch  # noqa: E402 -- the launch-and-kill helper of the comm tests

DEADLINE_S, MARGIN_S = 3, 45
"""The deadline bounds every receive of the job, so it must exceed the longest legitimate
wait of one stage for the other (a few micro-batches of tiny layers: well under a second);
each case waits it out once."""
AT_ONCE = 2
"""Jobs of this module running at once (see shardwise.testing.background): each is mostly
waiting (for its deadline, the grace and the launcher), about half a core on average. Each
job's time counts against its margin, so no more: at 3 and a load of 18 on 2 cores, jobs
went past it."""


def _job_for(item):
    """The launched job of a test of this module, from its parameters."""
    params = item.callspec.params if hasattr(item, "callspec") else {}
    if "launcher" not in params:
        return None
    env = {"SHARDWISE_SHM_P2P": "1" if params["transport"] == "shared memory" else "0"}
    return lambda cwd: launch(
        params["launcher"],
        cwd,
        Path(__file__).parent / "stalling_stage.py",
        str(DEADLINE_S),
        kill_after_s=DEADLINE_S + MARGIN_S + 60,
        env=env,
    )


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    with in_background(request, tmp_path_factory, _job_for, at_once=AT_ONCE) as started:
        yield started


@pytest.mark.parametrize(
    "launcher, transport", [("torchrun", "shared memory"), ("shardwise run", "shared memory"), ("torchrun", "gloo")]
)
def test_a_stalled_stage_fails_the_pipeline_job_within_the_deadline(jobs, request, launcher, transport):
    code, out, elapsed = jobs[request.node.name].result()
    assert code != 0 and "FINISHED" not in out, out[-3000:]
    assert elapsed < DEADLINE_S + MARGIN_S, f"took {elapsed:.0f} s\n{out[-3000:]}"
    assert "CollectiveError" in out and "from rank 1" in out and "pipeline stage 0 <-> stage 1" in out, out[-4000:]
    assert ("(shared memory)" in out) == (transport == "shared memory"), out[-4000:]
