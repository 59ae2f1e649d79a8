"""``shardwise run --autotuning``: the launcher flags each experiment gets, the ranks it
plans for, and the errors given before anything is launched."""

import json

import pytest

from shardwise.launcher import build_parser, main
from shardwise.launcher.main import _launcher_flags, planned_ranks


@pytest.mark.parametrize(
    "argv",
    [
        ["--autotuning", "tune", "--nproc", "2", "s.py", "--deepspeed", "c.json"],
        ["--nproc", "2", "--autotuning=run", "s.py", "--deepspeed", "c.json"],
    ],
)
def test_experiments_get_the_launcher_flags_without_autotuning(argv):
    args = build_parser().parse_args(argv)
    assert _launcher_flags(argv, args) == ["--nproc", "2"]
    assert args.script == "s.py" and args.script_args == ["--deepspeed", "c.json"]


def test_planned_ranks_follow_the_flags(tmp_path):
    assert planned_ranks(build_parser().parse_args(["--nproc", "3", "s.py"])) == (1, 3)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=4\nworker-1 slots=4\n")
    args = build_parser().parse_args(["-H", str(hostfile), "--num_gpus", "2", "s.py"])
    assert planned_ranks(args) == (2, 2)


def test_no_config_argument(tmp_path, capsys):
    script = tmp_path / "s.py"
    script.write_text("")
    assert main(["--autotuning", "tune", "--nproc", "2", str(script), "--lr", "1"]) == 2
    assert "needs the DeepSpeed config among the script's arguments" in capsys.readouterr().err


def test_contradictory_bounds_are_refused_before_any_launch(tmp_path, capsys):
    script, config = tmp_path / "s.py", tmp_path / "c.json"
    script.write_text("raise SystemExit('must not run')")
    tuning = {"min_train_micro_batch_size_per_gpu": 4, "max_train_micro_batch_size_per_gpu": 2}
    config.write_text(json.dumps({"autotuning": tuning}))
    assert main(["--autotuning", "tune", "--nproc", "2", str(script), "--deepspeed", str(config)]) == 2
    assert "min_train_micro_batch_size_per_gpu (4) is greater than" in capsys.readouterr().err
