"""``summary.txt`` in DeepSpeed's layout, with every configuration listed after it."""

from shardwise.autotuning import Candidate, Outcome, Status
from shardwise.autotuning._report import summary_text


def _cells(line):
    return [cell.strip() for cell in line.split("|")[1:-1]]


def test_summary_layout():
    outcomes = [
        Outcome(Candidate(0, 1, 1), Status.MEASURED, metrics={"throughput": 10.0, "latency": 5.0}),
        Outcome(Candidate(1, 1, 1), Status.MEASURED, metrics={"throughput": 30.0, "latency": 2.0}),
        Outcome(Candidate(1, 2, 1), Status.FAILED, error="exit code 1: a | b"),
    ]
    text = summary_text(outcomes, {Candidate(2, 1, 1): "too big"}, metric="throughput", seconds=75.4)
    lines = text.splitlines()
    assert _cells(lines[0]) == ["tuning_space", "num_experiments", "best_metric_val", "best_exp_name"]
    assert lines[1].startswith("|:---") and lines[1].count("|") == 5
    assert [_cells(line) for line in lines[2:5]] == [
        ["z0", "1", "10", "z0_gas1_tmbspg1"],
        ["z1", "2", "30", "z1_gas1_tmbspg1"],
        ["global", "3", "30", "z1_gas1_tmbspg1"],
    ]
    assert "Tuning completed in 0:01:15. Total number of experiments: 3." in text
    rows = {_cells(line)[0]: _cells(line) for line in lines if line.startswith("| z")}
    assert rows["z1_gas1_tmbspg2"][1:] == ["failed", "", "", "", "exit code 1: a / b"]
    assert rows["z2_gas1_tmbspg1"][1] == "pruned" and rows["z2_gas1_tmbspg1"][5] == "too big"


def test_summary_ranks_by_flops():
    outcomes = [
        Outcome(Candidate(0, 1, 1), Status.MEASURED, metrics={"throughput": 30.0, "latency": 2.0, "flops": 2e9}),
        Outcome(Candidate(1, 1, 1), Status.MEASURED, metrics={"throughput": 10.0, "latency": 5.0, "flops": 3e9}),
    ]
    lines = summary_text(outcomes, {}, metric="flops", seconds=1.0).splitlines()
    assert _cells(lines[4]) == ["global", "2", "3e+09", "z1_gas1_tmbspg1"]
    header = next(line for line in lines if line.startswith("| exp_name"))
    assert _cells(header) == ["exp_name", "status", "throughput", "latency", "flops", "error"]
    rows = {_cells(line)[0]: _cells(line) for line in lines if line.startswith("| z")}
    assert rows["z0_gas1_tmbspg1"][2:5] == ["30", "2", "2e+09"]
