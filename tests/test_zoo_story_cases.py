"""The zoo's story cases: how a clean twin's identical prefix and a loss episode around a learning-rate jump are
measured, on hand-made runs (numpy ``Writer`` logdirs and loss series) whose answers are known by construction."""

from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks import zoo_story_cases as story
from tb_gradhealth.writer import Writer

pytestmark = pytest.mark.unit

LAYERS = ("dense/kernel", "dense/bias")


def _write(logdir: str, *, changed_grad_at: int | None = None, changed_loss_at: int | None = None,
           layers: tuple[str, ...] = LAYERS, steps: int = 6) -> str:
    """A run of ``steps`` logged steps with fixed gradients and losses, one gradient value made 1% larger (or the
    loss one float32 ulp larger) from the given step on."""
    rng = np.random.default_rng(0)
    grads = [{n: rng.standard_normal(8).astype(np.float32) for n in layers} for _ in range(steps)]
    with Writer(logdir) as w:
        for s in range(1, steps + 1):
            g = {n: v.copy() for n, v in grads[s - 1].items()}
            if changed_grad_at is not None and s >= changed_grad_at:
                g[layers[0]][3] *= np.float32(1.01)
            loss = np.float32(1.0 / s)
            if changed_loss_at is not None and s >= changed_loss_at:
                loss = np.nextafter(loss, np.float32(2.0))
            w.add_gradients(s, g)
            w.add_loss(s, loss)
    return logdir


@pytest.mark.parametrize(("grad_at", "loss_at", "want"), [
    (None, None, 6),   # identical at every logged step
    (4, None, 3),      # one gradient value 1% larger from step 4
    (None, 5, 4),      # the loss one ulp apart from step 5
    (1, None, None),   # different from the first logged step
])
def test_identical_until_is_the_last_step_of_equal_records_and_losses(tmp_path, grad_at, loss_at, want):
    twin = _write(str(tmp_path / "twin"))
    run = _write(str(tmp_path / "run"), changed_grad_at=grad_at, changed_loss_at=loss_at)
    assert story.identical_until(run, twin) == want


def test_identical_until_refuses_a_twin_with_other_variables(tmp_path):
    twin = _write(str(tmp_path / "twin"), layers=("other/kernel", "dense/bias"))
    with pytest.raises(RuntimeError, match="other variables"):
        story.identical_until(_write(str(tmp_path / "run")), twin)


def _losses(after: list[float], *, before: float = 0.05, start: float = 1.5, at: int = 21) -> list[float]:
    """Steps 1-10 at ``start``, then ``before`` (steps 11 to ``at - 1``, with a little noise), then ``after``."""
    noise = [0.0, 0.004, -0.003, 0.002, -0.004, 0.001, 0.003, -0.002, 0.0, 0.004]
    pre = [before + noise[i % 10] for i in range(at - 11)]
    return [start] * 10 + pre + after


TWINS = [[1.5] * 10 + [0.05] * 40, [1.4] * 10 + [0.045] * 40]


def test_a_loss_that_jumps_and_stays_above_its_level_did_not_recover():
    loss = _losses([0.05, 3.0, 40.0, 2.0] + [1.39] * 25)  # the jump at 21: a step later it rises, then sits at chance
    ep = story.loss_episode(loss, TWINS, at=21)
    assert (ep.level, ep.rise, ep.peak, ep.back, ep.recovered) == (pytest.approx(0.054), 22, 23, None, False)


def test_a_nan_loss_counts_as_above_its_level():
    ep = story.loss_episode(_losses([0.05, 3.0, math.inf, math.nan] + [math.nan] * 25), TWINS, at=21)
    assert (ep.rise, ep.peak, ep.recovered) == (22, 23, False)


def test_a_loss_back_inside_its_range_before_the_jump_recovered_from_the_first_step_it_is_back():
    loss = _losses([0.05, 3.0, 1.0, 0.5, 0.2, 0.06, 0.05] + [0.03] * 22)
    ep = story.loss_episode(loss, TWINS, at=21)
    assert (ep.rise, ep.peak, ep.back, ep.recovered) == (22, 22, 27, True)


@pytest.mark.parametrize(("loss", "why"), [
    (_losses([0.05, 3.0, 0.04] + [1.39] * 26), "neither recovered nor unrecovered"),  # back once, ends up
    (_losses([0.05] * 29), "never rose"),
    (_losses([0.05, 3.0] + [1.39] * 27, before=1.0), "had not learned"),  # its level is not below its start
])
def test_a_run_the_rule_cannot_label_raises(loss, why):
    with pytest.raises(RuntimeError, match=why):
        story.loss_episode(loss, TWINS, at=21)
