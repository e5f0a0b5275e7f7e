"""The zoo's child-process labelling rules (``benchmarks/zoo_measure.py``) on hand-made series, against figures
worked out by hand; and the child-process cases' registration (``benchmarks/zoo_child.py``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks import zoo_cases, zoo_child, zoo_heldout, zoo_measure
from benchmarks.zoo_measure import Trace

pytestmark = pytest.mark.unit

STEPS = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]


@pytest.mark.parametrize(("wnorm", "departure", "blow", "near"), [
    ([1, 1, 1.2, 1.5, 2.1, 3, 3, 3, 3, 3], 2, 4, False),      # departs at 2, doubles its 1.0 at 4, stays: blow-up
    ([1, 1, 1.2, 1.5, 2.1, 1.9, 3, 3, 3, 3], 2, None, True),  # doubles, then comes back below double: near
    ([1, 1, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 2.2, 2.5], 2, None, True),  # doubles 6 steps after departing: near
    ([1, 1, 1.1, 1.2, 1.3, 1.4, 1.4, 1.4, 1.4, 1.4], 2, None, False),  # never reaches 1.5x
    ([1, 1, 1.2, math.nan, math.nan, math.nan, math.nan, math.nan, math.nan, math.nan], 2, 3, False),  # NaN: above
    ([1, 1, 1, 1, 1, 1, 1, 1, 1, 1], None, None, False),      # never departed
])
def test_a_weight_blows_up_when_it_doubles_within_few_steps_of_its_departure_and_stays(wnorm, departure, blow, near):
    w = np.array(wnorm, dtype=np.float64)
    assert zoo_measure.blow_up(STEPS, w, departure) == blow
    assert zoo_measure.near_blow_up(w, STEPS, departure) is near


def test_the_loss_label_is_the_first_step_at_ten_times_the_running_minimum():
    assert zoo_measure.loss_over_running_min(STEPS, [1, 0.5, 0.4, 3.9, 4.0, 9, 9, 9, 9, 9]) == 4
    assert zoo_measure.loss_over_running_min(STEPS, [1, 0.5, math.nan, 1, 1, 1, 1, 1, 1, 1]) == 2
    assert zoo_measure.loss_over_running_min(STEPS, [1.0] * 10) is None


def _trace(names: list[str], wnorm: list[list[float]], loss: list[float] | None = None) -> Trace:
    t = Trace(names=names)
    for s, row in zip(STEPS, wnorm, strict=True):
        t.add(s, 1.0 if loss is None else loss[s], ["live"] * len(names), row, [0.1] * len(names))
    return t


def test_weight_departures_leave_the_twins_range_at_the_same_step():
    twins = [_trace(["w"], [[1.0 + 0.01 * s] for s in STEPS]), _trace(["w"], [[1.1 + 0.01 * s] for s in STEPS])]
    run = _trace(["w"], [[1.05 + 0.01 * s] if s < 6 else [2.0] for s in STEPS])
    assert zoo_measure.weight_departures(run, twins, ["w"]) == {"w": 6}
    assert zoo_measure.weight_departures(twins[0], twins, ["w"]) == {"w": None}  # a twin is inside its own band


def test_recovery_compares_the_last_quarter_with_the_loss_before_the_episode():
    run = _trace(["w"], [[1.0]] * 10, loss=[2, 2, 2, 9, 9, 9, 9, 9, 1.5, 1.5])
    got = zoo_measure.recovery(run, 3)
    assert (got["recovered"], got["loss_before_episode"], got["loss_last_quarter"]) == (True, 2.0, 1.5)
    run = _trace(["w"], [[1.0]] * 10, loss=[2, 2, 2, 9, 9, 9, 9, 9, 9, math.nan])
    assert zoo_measure.recovery(run, 3)["recovered"] is False


def test_identical_until_is_the_last_step_of_a_bitwise_equal_prefix():
    rng = np.random.default_rng(0)
    rec = rng.standard_normal((5, 2, 3))
    rec[:, 1, 0] = np.nan  # a missing field: NaN equals NaN here
    loss = {s: float(s) for s in range(5)}
    other = rec.copy()
    other[3, 0, 2] += 1e-12
    assert zoo_measure.identical_until((list(range(5)), rec, loss), (list(range(5)), rec.copy(), dict(loss))) == 4
    assert zoo_measure.identical_until((list(range(5)), rec, loss), (list(range(5)), other, loss)) == 2
    assert zoo_measure.identical_until((list(range(5)), rec, loss), (list(range(5)), rec, {**loss, 1: 9.0})) == 0
    assert zoo_measure.identical_until((list(range(5)), rec, loss), (list(range(5)), rec, {**loss, 0: 9.0})) is None
    nan = {**loss, 4: math.nan}
    assert zoo_measure.identical_until((list(range(5)), rec, nan), (list(range(5)), rec.copy(), dict(nan))) == 4


def test_healthy_labels_check_the_frozen_and_the_trained_weights():
    run = _trace(["frozen", "head"], [[1.0, 1.0]] * 10, loss=[2.0] * 5 + [1.0] * 5)
    run.w_start, run.w_end = [np.ones(3), np.ones(3)], [np.ones(3), np.full(3, 2.0)]
    labels = zoo_measure.healthy_labels(run, "rule", frozen=["frozen"])
    assert {n: e["status"] for n, e in labels["layers"].items()} == {"frozen": "frozen", "head": "healthy"}
    with pytest.raises(RuntimeError, match="frozen but its weights changed"):
        zoo_measure.healthy_labels(run, "rule", frozen=["frozen", "head"])
    with pytest.raises(RuntimeError, match="trained but its weights never changed"):
        zoo_measure.healthy_labels(run, "rule")
    run.loss = [1.0] * 10
    with pytest.raises(RuntimeError, match="did not learn"):
        zoo_measure.healthy_labels(run, "rule", frozen=["frozen"])


def test_cause_labels_chain_the_status_from_its_start_then_nonfinite():
    run = _trace(["a", "b"], [[1.0, 1.0]] * 10)
    run.states[7] = ["nonfinite", "live"]
    labels = zoo_measure.cause_labels(run, {"a": 3, "b": None}, "exploding", "rule", latest={"a": 5, "b": None})
    assert labels["layers"]["a"] == {"status": "exploding", "onset": 3, "latest_onset": 5, "episodes": [
        {"status": "exploding", "from": 3}, {"status": "nonfinite", "from": 7}]}
    assert labels["layers"]["b"] == {"status": "healthy", "onset": None}
    assert (labels["sick"], labels["culprits"], labels["onset"], labels["first_nan"]) == (True, ["a"], 3, 7)


def test_child_cases_register_in_one_half_each_with_the_child_runner():
    zoo_child.load_cases()
    child = {h: [n for n, c in cases.items() if c.runner is zoo_child.run_in_child]
             for h, cases in (("design", zoo_cases.CASES), ("heldout", zoo_heldout.CASES))}
    assert child["design"] and child["heldout"]
    assert not set(child["design"]) & set(child["heldout"])
