"""CurriculumScheduler: values equal DeepSpeed 0.19.8's for every schedule type (from
``curriculum_reference.json``, written by ``make_curriculum_reference.py``), its state
API, and clear errors for bad schedules."""

import copy
import json
import pathlib

import pytest

from shardwise.config import ConfigError
from shardwise.runtime.data_pipeline import CurriculumScheduler

_REFERENCE = json.loads(pathlib.Path(__file__).with_name("curriculum_reference.json").read_text())


def _custom_schedule(step):  # the same function make_curriculum_reference.py gives DeepSpeed's
    return min(10 + step // 7, 400)


def _expand(changes, steps):
    """Every step's value from the ``[step, value]`` change points."""
    values, points = [], dict(changes)
    for step in range(steps + 1):
        values.append(points.get(step, values[-1] if values else None))
    return values


def _scheduler(name):
    scheduler = CurriculumScheduler(copy.deepcopy(_REFERENCE["configs"][name]))
    if scheduler.state["schedule_type"] == "custom":
        scheduler.set_custom_get_difficulty(_custom_schedule)
    return scheduler


@pytest.mark.parametrize("name", sorted(_REFERENCE["configs"]))
def test_values_equal_deepspeed(name):
    steps = _REFERENCE["steps"]
    expected = _REFERENCE["values"][name]
    probe, updated = _scheduler(name), _scheduler(name)
    got = [probe.get_difficulty(s) for s in range(steps + 1)]
    assert got == _expand(expected["get_difficulty"], steps)
    assert all(type(v) is int for v in got)
    assert [updated.update_difficulty(s) for s in range(steps + 1)] == _expand(expected["update_difficulty"], steps)


def test_reference_covers_every_schedule_type():
    kinds = {config["schedule_type"] for config in _REFERENCE["configs"].values()}
    assert kinds == {"fixed_linear", "fixed_root", "fixed_discrete", "custom"}


def test_state_round_trip_continues_the_schedule():
    first = _scheduler("root2_step8")
    for step in range(1, 700):
        first.update_difficulty(step)
    second = _scheduler("root2_step8")
    second.set_state(copy.deepcopy(first.get_state()))
    assert second.get_current_difficulty() == first.get_current_difficulty() > 64
    resumed = [second.update_difficulty(s) for s in range(700, 900)]
    assert resumed == [first.update_difficulty(s) for s in range(700, 900)]
    second.set_current_difficulty(2048)  # at max_difficulty the schedule stops
    assert second.update_difficulty(1) == 2048


def _config(schedule_type="fixed_linear", **schedule):
    return {
        "min_difficulty": 8,
        "max_difficulty": 64,
        "schedule_type": schedule_type,
        "schedule_config": schedule or {"total_curriculum_step": 10, "difficulty_step": 8},
    }


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"max_difficulty": 8, "schedule_type": "fixed_linear"}, r"needs 'min_difficulty'"),
        ({**_config(), "min_difficulty": 65}, r"min_difficulty=65 is above .*max_difficulty=64"),
        (_config("fixed_cubic"), r"schedule_type must be one of .*fixed_linear"),
        (_config(total_curriculum_step=10), r"schedule_config needs 'difficulty_step'"),
        (_config("fixed_root", total_curriculum_step=10, difficulty_step=8), r"needs 'root_degree'"),
        ({k: v for k, v in _config().items() if k != "schedule_config"}, r"schedule_config is missing"),
        (_config(total_curriculum_step=0, difficulty_step=8), r"total_curriculum_step must be a positive"),
        (_config("fixed_discrete", difficulty=[8, 32, 16], max_step=[5, 10]), r"difficulty must be increasing"),
        (_config("fixed_discrete", difficulty=[8, 16, 32], max_step=[10, 10]), r"max_step must be increasing"),
        (_config("fixed_discrete", difficulty=[8, 16], max_step=[5, 10]), r"max_step needs one fewer"),
        (_config(total_curriculum_step=10, difficulty_stpe=8), r"did you mean .*difficulty_step"),
    ],
)
def test_bad_schedules_are_refused_by_name(config, match):
    with pytest.raises(ConfigError, match=match):
        CurriculumScheduler(config)


def test_custom_schedule_without_a_function_says_how_to_give_one():
    scheduler = CurriculumScheduler({"min_difficulty": 1, "max_difficulty": 9, "schedule_type": "custom"})
    with pytest.raises(RuntimeError, match=r"set_custom_curriculum_learning_schedule"):
        scheduler.update_difficulty(1)


def test_deepspeed_import_path():
    from shardwise.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler as Same

    assert Same is CurriculumScheduler
