"""Experiments of a script started with torchrun or accelerate launch (see [Note: autotuning
launchers]): the line after ``--autotuning tune|run`` is split by that launcher's own parser,
and every experiment is that line with the experiment's config."""

import sys

import pytest

from shardwise.autotuning import AutotuningError
from shardwise.autotuning._experiment import Launch, split_config_arg
from shardwise.autotuning._launchers import parse_launcher_line
from shardwise.launcher.main import main


def _commands(line):
    args, index = split_config_arg(list(line.script_args))
    launch = Launch(launcher_args=line.launcher_args, script=line.script, script_args=tuple(args),
                    config_index=index, arg_mappings={"train_micro_batch_size_per_gpu": "--bs"},
                    launcher=line.launcher)  # fmt: skip
    user = launch.user_command("/r/z1/ds_config.json", {"train_micro_batch_size_per_gpu": 4})
    return user, launch.process_command(user)


def test_torchrun_lines_start_each_experiment_with_torchrun():
    line = parse_launcher_line("torchrun", ["--nnodes", "1", "--nproc_per_node", "2", "--master_port", "29511",
                                            "train.py", "--deepspeed", "ds.json", "--bs", "8"])  # fmt: skip
    assert (line.num_nodes, line.ranks_per_node, line.script) == (1, 2, "train.py")
    user, process = _commands(line)
    flags = ["--nnodes", "1", "--nproc_per_node", "2", "--master_port", "29511"]
    assert user == ["torchrun", *flags, "train.py", "--deepspeed", "/r/z1/ds_config.json", "--bs", "4"]
    assert process == [sys.executable, "-m", "torch.distributed.run", *user[1:]]


def test_accelerate_lines_start_each_experiment_with_accelerate_launch():
    pytest.importorskip("accelerate")
    line = parse_launcher_line("accelerate", ["launch", "--num_processes", "4", "--num_machines", "2",
                                              "train.py", "--deepspeed_config", "ds.json"])  # fmt: skip
    assert (line.num_nodes, line.ranks_per_node) == (2, 2)
    user, process = _commands(line)
    flags = ["--num_processes", "4", "--num_machines", "2"]
    assert user == ["accelerate", "launch", *flags, "train.py", "--deepspeed_config", "/r/z1/ds_config.json",
                    "--bs", "4"]  # fmt: skip
    assert process == [sys.executable, "-m", "accelerate.commands.launch", *user[2:]]


@pytest.mark.parametrize(
    "first, rest, message",
    [
        ("torchrun", ["--nproc_per_node", "auto", "t.py"], "--nproc_per_node auto: the tuner builds its search"),
        ("torchrun", ["--nnodes", "1:4", "t.py"], "--nnodes 1:4"),
        ("accelerate", ["launch", "t.py"], "without --num_processes"),
        ("accelerate", ["config"], "the tuner starts 'accelerate launch ...' lines"),
    ],
)
def test_open_world_sizes_are_refused_by_name(first, rest, message):
    if first == "accelerate":
        pytest.importorskip("accelerate")
    with pytest.raises(AutotuningError, match=message):
        parse_launcher_line(first, rest)


def test_shardwise_run_flags_before_a_torchrun_line_are_refused(tmp_path, capsys):
    script = tmp_path / "t.py"
    script.write_text("")
    argv = ["--nproc", "2", "--autotuning", "tune", "torchrun", "--nproc_per_node", "2", str(script), "--deepspeed",
            "ds.json"]  # fmt: skip
    assert main(argv) == 2
    assert "shardwise run flags '--nproc 2' before a torchrun line" in capsys.readouterr().err
