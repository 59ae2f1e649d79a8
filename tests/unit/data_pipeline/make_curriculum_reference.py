"""Write DeepSpeed 0.19.8's curriculum schedule values to ``curriculum_reference.json``.

Run with a Python that has DeepSpeed 0.19.8 (not a dependency of shardwise):
    /work/ds-env/bin/python tests/unit/data_pipeline/make_curriculum_reference.py

For each config it records, over steps 0..STEPS, ``get_difficulty(step)`` and the current
difficulty after ``update_difficulty(step)`` (called at every step in order), each only
at the steps where the value changes (``[step, value]`` pairs; the first pair is step 0).
"""

import json
import pathlib

from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

STEPS = 5000

CONFIGS = {
    "linear_step8": {
        "min_difficulty": 8,
        "max_difficulty": 1024,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 1000, "difficulty_step": 8},
    },
    "linear_step1": {
        "min_difficulty": 1,
        "max_difficulty": 100,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 3000, "difficulty_step": 1},
    },
    "linear_min_below_step": {
        "min_difficulty": 5,
        "max_difficulty": 70,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 777, "difficulty_step": 16},
    },
    "root2_step8": {
        "min_difficulty": 64,
        "max_difficulty": 2048,
        "schedule_type": "fixed_root",
        "schedule_config": {"total_curriculum_step": 4000, "difficulty_step": 8, "root_degree": 2},
    },
    "root3_step1": {
        "min_difficulty": 2,
        "max_difficulty": 300,
        "schedule_type": "fixed_root",
        "schedule_config": {"total_curriculum_step": 2500, "difficulty_step": 1, "root_degree": 3},
    },
    "root2_min8_step16": {
        "min_difficulty": 8,
        "max_difficulty": 512,
        "schedule_type": "fixed_root",
        "schedule_config": {"total_curriculum_step": 1500, "difficulty_step": 16, "root_degree": 2},
    },
    "discrete_short": {
        "min_difficulty": 1,
        "max_difficulty": 3,
        "schedule_type": "fixed_discrete",
        "schedule_config": {"difficulty": [1, 2, 3], "max_step": [5, 10]},
    },
    "discrete_seqlen": {
        "min_difficulty": 64,
        "max_difficulty": 512,
        "schedule_type": "fixed_discrete",
        "schedule_config": {"difficulty": [64, 128, 256, 512], "max_step": [100, 1000, 3000]},
    },
    "custom": {"min_difficulty": 10, "max_difficulty": 100, "schedule_type": "custom"},
}


def custom_schedule(step):
    """The custom schedule the test gives both schedulers: it overshoots max_difficulty."""
    return min(10 + step // 7, 400)


def changes(values):
    out = []
    for step, value in enumerate(values):
        if not out or out[-1][1] != value:
            out.append([step, value])
    return out


def main():
    reference = {"steps": STEPS, "configs": CONFIGS, "values": {}}
    for name, config in CONFIGS.items():
        probe = CurriculumScheduler(json.loads(json.dumps(config)))
        updated = CurriculumScheduler(json.loads(json.dumps(config)))
        if config["schedule_type"] == "custom":
            probe.set_custom_get_difficulty(custom_schedule)
            updated.set_custom_get_difficulty(custom_schedule)
        reference["values"][name] = {
            "get_difficulty": changes([probe.get_difficulty(s) for s in range(STEPS + 1)]),
            "update_difficulty": changes([updated.update_difficulty(s) for s in range(STEPS + 1)]),
        }
    path = pathlib.Path(__file__).with_name("curriculum_reference.json")
    path.write_text(json.dumps(reference, indent=None, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
