"""A stage that stalls mid-schedule fails the pipeline job fast: its peer's receive
reaches the collective deadline and names the rank and the stages, the job exits
non-zero within the deadline plus a margin (a bound on a hang, not a speed threshold)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "comm"))
from test_diverged_ranks import _launch  # noqa: E402 -- the launch-and-kill helper of the comm tests

DEADLINE_S, MARGIN_S = 4, 45
"""The deadline bounds every receive of the job, so it must exceed the longest legitimate
wait of one stage for the other (a few micro-batches of tiny layers: well under a second);
each case waits it out once."""


@pytest.mark.parametrize("launcher, transport", [("torchrun", "shared memory"), ("shardwise run", "shared memory"),
                                                  ("torchrun", "gloo")])
def test_a_stalled_stage_fails_the_pipeline_job_within_the_deadline(tmp_path, monkeypatch, launcher, transport):
    monkeypatch.setenv("SHARDWISE_SHM_P2P", "1" if transport == "shared memory" else "0")
    code, out, elapsed = _launch(launcher, tmp_path, Path(__file__).parent / "stalling_stage.py", str(DEADLINE_S),
                                 kill_after_s=DEADLINE_S + MARGIN_S + 60)
    assert code != 0 and "FINISHED" not in out, out[-3000:]
    assert elapsed < DEADLINE_S + MARGIN_S, f"took {elapsed:.0f} s\n{out[-3000:]}"
    assert "CollectiveError" in out and "from rank 1" in out and "pipeline stage 0 <-> stage 1" in out, out[-4000:]
    assert ("(shared memory)" in out) == (transport == "shared memory"), out[-4000:]
