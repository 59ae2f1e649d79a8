"""One experiment's files, deadline and outcome, with a light stand-in for the launched job
(a plain Python script instead of ``shardwise run``), and where the config argument is found."""

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from shardwise.autotuning import AutotuningError, Candidate, Status
from shardwise.autotuning._experiment import Launch, descendants, run_experiment, split_config_arg
from shardwise.autotuning._main import Resources, _Experiments
from shardwise.config._autotuning import autotuning_config

# micro-batch 1: crash; 2: hang with a child in a session of its own (as torchrun starts
# ranks); 3: exit cleanly without metrics; 4: write metrics; 5: write a model-info file
JOB = """
import json, os, subprocess, sys, time
config = json.load(open(sys.argv[sys.argv.index("--deepspeed_config") + 1]))
micro = config["train_micro_batch_size_per_gpu"]
if micro == 1:
    sys.exit("injected failure")
if micro == 2:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    open(sys.argv[sys.argv.index("--pids") + 1], "w").write(f"{os.getpid()} {child.pid}")
    time.sleep(600)
if micro == 4:
    json.dump({"throughput": 5.0, "latency": 2.0}, open(config["autotuning"]["metric_path"], "w"))
if micro == 5:
    json.dump({"num_params": 123}, open(config["autotuning"]["model_info_path"], "w"))
"""


@dataclass(frozen=True, kw_only=True)
class _PlainLaunch(Launch):
    def process_command(self, user_command):
        return [sys.executable, self.script, *user_command[3 + len(self.launcher_args) :]]


def _launch(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    return _PlainLaunch(launcher_args=("--nproc", "2"), script=str(script),
                        script_args=("--deepspeed_config", "x.json", "--pids", str(tmp_path / "pids.txt")),
                        config_index=1, arg_mappings={})  # fmt: skip


def _run(tmp_path, micro, timeout_s=30.0):
    launch, pids = _launch(tmp_path), tmp_path / "pids.txt"
    folder = tmp_path / "results" / f"m{micro}"
    metric_path = str(folder / "metrics.json")
    config = {"train_micro_batch_size_per_gpu": micro, "autotuning": {"metric_path": metric_path}}
    outcome = run_experiment(Candidate(1, micro, 1), config, launch=launch, folder=folder,
                             exps_dir=tmp_path / "exps", timeout_s=timeout_s)  # fmt: skip
    return outcome, folder, pids


def _gone(pid):
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rpartition(")")[2].split()[0] == "Z"


def test_a_hanging_job_is_ended_with_every_process_below_it(tmp_path):
    outcome, folder, pids = _run(tmp_path, 2, timeout_s=2.0)  # the job writes its pids within 0.3 s at load 8
    assert outcome.status is Status.HUNG and "still running after 2 s" in outcome.error
    job, child = map(int, pids.read_text().split())
    assert _gone(job) and _gone(child)


def test_a_crash_is_recorded_with_its_error(tmp_path):
    outcome, folder, _ = _run(tmp_path, 1)
    assert outcome.status is Status.FAILED and "exit code 1: injected failure" in outcome.error


def test_a_clean_exit_without_metrics_is_named(tmp_path):
    outcome, _, _ = _run(tmp_path, 3)
    assert outcome.status is Status.NO_METRIC and "without reaching autotuning.end_profile_step=5" in outcome.error


def test_measured_experiment_files_have_deepspeeds_layout(tmp_path):
    outcome, folder, _ = _run(tmp_path, 4)
    assert outcome.status is Status.MEASURED and outcome.metrics["throughput"] == 5.0
    assert {p.name for p in folder.iterdir()} == {
        "ds_config.json", "exp.json", "cmd.txt", "stdout.log", "stderr.log", "metrics.json"
    }  # fmt: skip
    exp = json.loads((tmp_path / "exps" / "z1_gas1_tmbspg4.json").read_text())
    assert exp["name"] == "z1_gas1_tmbspg4" and exp["ds_config"]["train_micro_batch_size_per_gpu"] == 4
    cmd = (folder / "cmd.txt").read_text().split()
    assert cmd[:4] == ["shardwise", "run", "--nproc", "2"]
    assert cmd[cmd.index("--deepspeed_config") + 1] == str((folder / "ds_config.json").resolve())


def test_descendants_walks_the_tree():
    assert os.getpid() in descendants(os.getppid())


@pytest.mark.parametrize(
    "args,expected,index",
    [
        (["--deepspeed_config", "c.json", "--x"], ["--deepspeed_config", "c.json", "--x"], 1),
        (["--deepspeed", "--deepspeed_config=c.json"], ["--deepspeed", "--deepspeed_config", "c.json"], 2),
        (["--lr", "1", "--deepspeed", "ds.json"], ["--lr", "1", "--deepspeed", "ds.json"], 3),
    ],
)
def test_the_config_argument_is_found(args, expected, index):
    assert split_config_arg(args) == (expected, index)


def test_no_config_argument_is_a_clear_error():
    with pytest.raises(AutotuningError, match="'--deepspeed ds_config.json' or '--deepspeed_config ds_config.json'"):
        split_config_arg(["--deepspeed", "--lr", "1"])


def test_arg_mappings_pass_the_experiment_values_to_the_script():
    launch = Launch(launcher_args=(), script="s.py", script_args=("--deepspeed", "a.json", "--bs", "8"),
                    config_index=1, arg_mappings={"train_micro_batch_size_per_gpu": "--bs",
                                                  "zero_optimization.stage": "--stage"})  # fmt: skip
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
    assert launch.user_command("b.json", config) == [
        "shardwise", "run", "s.py", "--deepspeed", "b.json", "--bs", "2", "--stage", "3"
    ]  # fmt: skip


@pytest.mark.parametrize("micro", [5, 1])
def test_the_first_experiment_counts_the_parameters_then_pruning_applies(tmp_path, micro):
    # 123 fp32 parameters need 1968 bytes of model states at stage 0: 1000 prunes the rest
    tuning = autotuning_config({"results_dir": str(tmp_path / "r"), "exps_dir": str(tmp_path / "e"),
                                "memory_per_rank": 1000})  # fmt: skip
    space = [Candidate(0, micro, 1), Candidate(0, 4, 1)]
    resources = Resources(num_nodes=1, ranks_per_node=1, on_cpu=False)
    runner = _Experiments({}, tuning, _launch(tmp_path), resources, None, {}, space)
    if micro == 5:
        assert runner(space[0]).status is Status.NO_METRIC  # the stand-in job writes only the count
        assert runner.num_params == 123
        assert runner(space[1]) is None and "memory estimator" in runner.rejected[space[1]]
        assert [p.name for p in (tmp_path / "e").iterdir()] == ["z0_gas1_tmbspg5.json"]
        return
    with pytest.raises(AutotuningError, match=r"wrote no parameter count \(failed: exit code 1: injected failure\)"):
        runner(space[0])


def test_ranking_by_flops_a_model_without_counted_flops_is_refused(tmp_path):
    tuning = autotuning_config({"results_dir": str(tmp_path / "r"), "exps_dir": str(tmp_path / "e"), "metric": "flops"})
    resources = Resources(num_nodes=1, ranks_per_node=1, on_cpu=False)
    runner = _Experiments({}, tuning, _launch(tmp_path), resources, 123, {}, [Candidate(0, 4, 1)])
    with pytest.raises(AutotuningError, match='z0_gas1_tmbspg4 counted no FLOPs.*use "throughput" or "latency"'):
        runner(Candidate(0, 4, 1))  # the stand-in job's metrics have no flops
