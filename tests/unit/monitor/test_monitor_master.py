"""MonitorMaster without a process group: what each monitor writes, a missing package or an
unwritable directory refused at construction by name, a monitor failing mid-run switched off
with one log line, and Comet's per-tag sample interval."""

import logging
import sys
import types

import pytest

from shardwise.config import load_config
from shardwise.config._errors import ConfigError
from shardwise.monitor import MonitorMaster
from shardwise.monitor import monitor as monitor_module


def _monitor_config(**sections):
    return load_config({"train_micro_batch_size_per_gpu": 1, **sections}, world_size=1).monitor


def test_disabled_monitors_build_nothing_and_ignore_events():
    master = MonitorMaster(_monitor_config(tensorboard={"enabled": False}))
    assert not master.enabled and master.monitors == []
    master.write_events([("a", 1.0, 1)])


def test_a_missing_package_names_the_extra(monkeypatch):
    real = monitor_module.importlib.util.find_spec
    monkeypatch.setattr(
        monitor_module.importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a)
    )
    with pytest.raises(ImportError, match=r"TensorBoard monitor .*pip install 'shardwise\[monitor\]'"):
        MonitorMaster(_monitor_config(tensorboard={"enabled": True}))


def test_an_unwritable_output_path_fails_at_construction(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match=r"csv_monitor.output_path: cannot write to"):
        MonitorMaster(_monitor_config(csv_monitor={"enabled": True, "output_path": str(blocker)}))


@pytest.mark.parametrize(
    "section, message",
    [
        ({"tensorboard": {"enabled": True, "output_dir": "x"}}, "did you mean 'tensorboard.output_path'"),
        ({"csv_monitor": {"enabled": "yes"}}, "csv_monitor.enabled must be true or false"),
        ({"flops_profiler": {"enabled": True, "module_depth": -2}}, "module_depth must be an integer >= -1"),
        ({"comms_logger": {"enabled": True, "prof_ops": "all_reduce"}}, "prof_ops must be a list"),
        ({"comet": {"enabled": True, "mode": "append"}}, "comet.mode must be one of"),
    ],
)
def test_bad_sections_are_refused_by_name(section, message):
    with pytest.raises(ConfigError, match=message):
        _monitor_config(**section)


def test_a_failing_monitor_is_logged_once_and_switched_off(tmp_path, caplog):
    master = MonitorMaster(_monitor_config(csv_monitor={"enabled": True, "output_path": str(tmp_path)}))
    csv = master.csv_monitor
    csv.log_dir = str(tmp_path / "gone" / "away")  # every write now fails, as on a full or lost disk
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        for step in range(3):
            master.write_events([("Train/Samples/train_loss", 1.0, step)])
    warnings = [r.getMessage() for r in caplog.records if "failed to write events" in r.getMessage()]
    assert len(warnings) == 1 and "csvMonitor" in warnings[0] and "training continues" in warnings[0]


def test_csv_files_one_per_tag(tmp_path):
    master = MonitorMaster(
        _monitor_config(csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "job"})
    )
    master.write_events([("Train/Samples/lr", 0.1, 4), ("My tag", 2, 4), ("Train/Samples/lr", 0.2, 8)])
    assert (tmp_path / "job" / "Train_Samples_lr.csv").read_text().splitlines() == ["step,lr", "4,0.1", "8,0.2"]
    assert (tmp_path / "job" / "My_tag.csv").read_text().splitlines() == ["step,My tag", "4,2.0"]


def test_comet_logs_each_tag_once_per_sample_interval(monkeypatch):
    calls = []

    class Experiment:
        def set_name(self, name):
            calls.append(("name", name))

        def log_metric(self, name, value, step):
            calls.append((name, value, step))

        def end(self):
            calls.append(("end",))

    def start(**kwargs):
        calls.append(("start", kwargs["project"], kwargs["online"]))
        return Experiment()

    monkeypatch.setitem(sys.modules, "comet_ml", types.SimpleNamespace(start=start))
    monkeypatch.setattr(monitor_module.importlib.util, "find_spec", lambda name, *a: object())
    master = MonitorMaster(
        _monitor_config(
            comet={"enabled": True, "project": "p", "online": False, "experiment_name": "e", "samples_log_interval": 10}
        )
    )
    master.write_events([("loss", 1.0, 0), ("loss", 2.0, 5), ("lr", 0.1, 5), ("loss", 3.0, 10)])
    master.close()
    assert calls == [
        ("start", "p", False),
        ("name", "e"),
        ("loss", 1.0, 0),
        ("lr", 0.1, 5),
        ("loss", 3.0, 10),
        ("end",),
    ]
