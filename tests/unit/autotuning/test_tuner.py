"""The search as data (see [Note: autotuning search]): order, stopping rules, the best one,
and failed or hung experiments recorded and passed over; no process is started."""

import pytest

from shardwise.autotuning import Candidate, Outcome, Status, search
from shardwise.autotuning._report import nothing_runnable
from shardwise.autotuning._tuner import best_outcome
from shardwise.config._autotuning import autotuning_config

SPACE = [Candidate(stage, micro, 1) for stage in (0, 1) for micro in (1, 2, 4)]


def _fake(throughputs, broken=()):
    """A run_one that records the order and measures ``throughputs[name]``; names in
    ``broken`` fail (odd) or hang (even position)."""
    order = []

    def run_one(candidate):
        order.append(candidate.name)
        if candidate.name in broken:
            status = Status.FAILED if broken.index(candidate.name) % 2 == 0 else Status.HUNG
            return Outcome(candidate, status, error="boom")
        value = throughputs[candidate.name]
        flops = 1e9 * (10 * candidate.stage - candidate.micro_batch)  # not the throughput's order
        return Outcome(
            candidate, Status.MEASURED, metrics={"throughput": value, "latency": 1000 / value, "flops": flops}
        )

    return run_one, order


def _values(**overrides):
    values = {c.name: 10.0 * c.micro_batch - c.stage for c in SPACE}
    return {**values, **overrides}


def test_gridsearch_runs_in_order_and_the_best_is_the_highest_throughput():
    run_one, order = _fake(_values())
    outcomes = search(list(reversed(SPACE)), autotuning_config({}), run_one)
    assert order == [c.name for c in SPACE]
    assert best_outcome(outcomes, "throughput").candidate == Candidate(0, 4, 1)


def test_latency_picks_the_lowest():
    run_one, _ = _fake(_values())
    outcomes = search(SPACE, autotuning_config({"metric": "latency"}), run_one)
    assert best_outcome(outcomes, "latency").candidate == Candidate(0, 4, 1)


@pytest.mark.parametrize("tuner_type", ["gridsearch", "model_based"])
def test_flops_picks_the_highest(tuner_type):
    run_one, _ = _fake(_values())
    tuning = autotuning_config({"metric": "flops", "tuner_type": tuner_type, "tuner_early_stopping": 50})
    outcomes = search(SPACE, tuning, run_one)
    assert len(outcomes) == len(SPACE)
    # the highest flops, not the highest throughput (z0_gas1_tmbspg4) nor the lowest flops (the same one)
    assert best_outcome(outcomes, "flops").candidate == Candidate(1, 1, 1)


def test_failed_and_hung_experiments_are_recorded_and_the_search_goes_on():
    run_one, order = _fake(_values(), broken=("z0_gas1_tmbspg2", "z0_gas1_tmbspg4"))
    outcomes = search(SPACE, autotuning_config({}), run_one)
    assert len(order) == len(SPACE)
    assert [o.status for o in outcomes[1:3]] == [Status.FAILED, Status.HUNG]
    assert best_outcome(outcomes, "throughput").candidate == Candidate(1, 4, 1)


def test_num_trials_and_early_stopping():
    run_one, order = _fake(_values())
    search(SPACE, autotuning_config({"tuner_num_trials": 2}), run_one)
    assert len(order) == 2
    declining = {c.name: 100.0 - i for i, c in enumerate(SPACE)}  # the first one stays best
    run_one, order = _fake(declining)
    search(SPACE, autotuning_config({"tuner_early_stopping": 3}), run_one)
    assert len(order) == 4  # the best, then 3 that did not beat it


def test_random_is_a_seeded_shuffle():
    orders = []
    for _ in range(2):
        run_one, order = _fake(_values())
        search(SPACE, autotuning_config({"tuner_type": "random"}), run_one)
        orders.append(order)
    assert orders[0] == orders[1] and sorted(orders[0]) == sorted(c.name for c in SPACE)
    assert orders[0] != [c.name for c in SPACE]


def test_model_based_starts_from_the_heuristic_then_follows_the_cost_model():
    run_one, order = _fake(_values())
    search(SPACE, autotuning_config({"tuner_type": "model_based", "tuner_num_trials": 3}), run_one)
    assert order[0] == "z0_gas1_tmbspg4"  # lowest stage, largest micro-batch
    assert len(set(order)) == 3


def test_nothing_measured_lists_what_each_failed_with(tmp_path):
    run_one, _ = _fake({}, broken=("z0_gas1_tmbspg1", "z0_gas1_tmbspg2"))
    outcomes = search(SPACE[:2], autotuning_config({}), run_one)
    assert best_outcome(outcomes, "throughput") is None
    error = str(nothing_runnable(outcomes, {Candidate(3, 1, 1): "too big"}, tmp_path))
    assert "no runnable configuration found" in error
    for line in ("z3_gas1_tmbspg1: pruned: too big", "z0_gas1_tmbspg1: failed: boom", "z0_gas1_tmbspg2: hung: boom"):
        assert line in error


@pytest.mark.parametrize("tuner_type", ["gridsearch", "random", "model_based"])
def test_each_candidate_runs_at_most_once(tuner_type):
    run_one, order = _fake(_values())
    search(SPACE, autotuning_config({"tuner_type": tuner_type, "tuner_early_stopping": 50}), run_one)
    assert sorted(order) == sorted(c.name for c in SPACE)
