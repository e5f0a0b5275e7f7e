"""Diagnosis tests: the rules on synthetic record arrays, then on small networks trained here with TensorFlow.

Records are built with ``record.compute`` from numpy arrays (for the trained networks: from the numpy values of
the TF gradients, weights and SGD updates), so these tests depend only on record.py and the health package.
"""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

from tb_gradhealth import health, record
from tb_gradhealth.health import STATUSES, Thresholds, diagnose_run
from tb_gradhealth.health.levels import history, window_median
from tb_gradhealth.health.result import BASE

# --- synthetic records ----------------------------------------------------------------------------------------------


def _grad(rng: np.random.Generator, rms: float, n: int = 64) -> np.ndarray:
    return rng.normal(size=n) * rms


def _records(rms: np.ndarray, seed: int = 0, n: int = 64) -> np.ndarray:
    """Records [S, L] of Gaussian gradients whose RMS is ``rms[s, l]`` (NaN: layer absent; 0: all-zero)."""
    rng = np.random.default_rng(seed)
    s_count, l_count = rms.shape
    out = np.full((s_count, l_count, record.NUM_FIELDS), np.nan)
    for s in range(s_count):
        for i in range(l_count):
            if not np.isnan(rms[s, i]):
                out[s, i] = record.compute(_grad(rng, rms[s, i], n))
    return out


def _names(n: int) -> list[str]:
    return [f"layer_{i}/kernel" for i in range(n)]


def _diag(rms: np.ndarray, **kw) -> health.RunHealth:
    return diagnose_run(_names(rms.shape[1]), np.arange(rms.shape[0]) * 10, _records(rms), **kw)


def _status(h: health.RunHealth) -> list[str]:
    return h.statuses()


def _healthy_grid(steps: int = 8, layers: int = 6, seed: int = 1) -> np.ndarray:
    """RMS of a healthy network: layers within a decade of each other, steps jittering by ~20%."""
    rng = np.random.default_rng(seed)
    base = 10.0 ** rng.uniform(-3.5, -2.5, size=layers)
    return base[None, :] * np.exp(rng.normal(scale=0.2, size=(steps, layers)))


@pytest.mark.unit
def test_healthy_network_has_no_flags():
    h = _diag(_healthy_grid())
    assert h.counts["healthy"] == 6 and h.first_bad is None
    assert all(lh.severity == 0 and lh.first_step is None and lh.reasons == [] for lh in h.layers)


@pytest.mark.unit
def test_vanishing_layer_relative_to_median():
    rms = _healthy_grid()
    rms[:, :3] = 1e-3 * 10.0**-5  # the three layers at the input end 5 decades below the others, every step
    h = _diag(rms)
    lh = h.by_layer()["layer_2/kernel"]
    assert lh.status == "vanishing"
    assert lh.first_step == 0 and lh.step == 70
    assert "decades below the layers nearest the loss" in lh.reasons[0] and "last 8 logged steps" in lh.reasons[0]
    assert _status(h) == ["vanishing"] * 3 + ["healthy"] * 3
    # the cut: the deepest layer of the vanished stack, where the gradient stopped getting through
    assert h.layers[0].layer == "layer_2/kernel"
    assert h.first_bad == {"layer": "layer_2/kernel", "status": "vanishing", "step": 0}


@pytest.mark.unit
def test_a_small_gradient_with_a_sound_one_below_it_is_not_vanishing():
    # A gradient vanishing on its way back from the loss is small in every layer it has still to reach. One layer 5
    # decades below the others while the layer before it gets a sound gradient passed the backward pass on: its
    # small gradient is its own parameters' or inputs' scale (a normalisation's gain), not a vanishing gradient.
    rms = _healthy_grid()
    rms[:, 2] = 1e-3 * 10.0**-5
    h = _diag(rms)
    assert _status(h) == ["healthy"] * 6
    note = h.by_layer()["layer_2/kernel"].reasons
    assert any("decades below the layers nearest the loss" in r and "the backward pass goes through this layer" in r
               for r in note), note
    # the first layer has no layer before it: far below the rest, it is where the gradient vanished
    rms = _healthy_grid()
    rms[:, 0] = 1e-3 * 10.0**-5
    assert _status(_diag(rms)) == ["vanishing"] + ["healthy"] * 5


@pytest.mark.unit
def test_vanishing_needs_sustain_steps_and_first_step_is_onset():
    rms = _healthy_grid(steps=10)
    rms[6:, 1] = 1e-9  # vanishing from row 6 (step 60): 4 logged steps
    assert _status(_diag(rms))[1] == "healthy"
    note = _diag(rms).by_layer()["layer_1/kernel"].reasons
    assert any("flagged as vanishing once it lasts 5" in r for r in note)
    lh = _diag(rms, thresholds=Thresholds(sustain_steps=4)).by_layer()["layer_1/kernel"]
    assert lh.status == "vanishing" and lh.first_step == 60
    # Diagnosing at an earlier step sees only the steps up to it.
    assert _diag(rms, thresholds=Thresholds(sustain_steps=4), at_step=65).by_layer()["layer_1/kernel"].status \
        == "healthy"
    # A single quiet step in the middle is not a disease, and later health resets the run.
    rms2 = _healthy_grid(steps=10)
    rms2[4, 3] = 1e-12
    assert _status(_diag(rms2, thresholds=Thresholds(sustain_steps=1)))[3] == "healthy"


@pytest.mark.unit
def test_window_median_is_numpys_median_of_the_previous_rows():
    rng = np.random.default_rng(7)
    values = rng.standard_normal((150, 3))
    values[rng.random(values.shape) < 0.25] = np.nan
    values[:9, 1] = np.nan  # a column with nothing in its first windows
    asked = rng.random(values.shape) < 0.7  # only the cells asked for are computed
    for window in (1, 4, 7):
        got = window_median(values, window, asked)
        for s in range(values.shape[0]):
            for c in range(values.shape[1]):
                prev = values[max(0, s - window):s, c]
                prev = prev[~np.isnan(prev)]
                if prev.size and asked[s, c]:
                    assert got[s, c] == pytest.approx(float(np.median(prev)), abs=1e-12)
                else:
                    assert np.isnan(got[s, c])


@pytest.mark.unit
def test_the_return_from_a_one_batch_dip_is_no_growth():
    # One batch whose gradient drops by decades pulls the window's mean of logs down with it; the next batch, back
    # where the layer stood, is no rise: no exploding flag or episode at any step, with or without the dip flagged.
    rms = _healthy_grid(steps=16)
    rms[6, 3] = rms[5, 3] * 1e-12
    for sustain in (1, 5):
        for at in range(16):
            h = _diag(rms, thresholds=Thresholds(sustain_steps=sustain), at_step=10 * at)
            assert not any(e["status"] == "exploding" for lh in h.layers for e in lh.episodes), (sustain, at)


@pytest.mark.unit
def test_vanishing_absolute_backstop_catches_uniformly_tiny_network():
    rms = _healthy_grid() * 1e-7  # every layer ~1e-10: relative rules see nothing
    h = _diag(rms)
    assert set(_status(h)) == {"vanishing"}
    assert all("absolute floor" in lh.reasons[0] for lh in h.layers)
    assert set(_status(_diag(rms, thresholds=Thresholds(vanish_rms_below=0)))) == {"healthy"}


@pytest.mark.unit
def test_exploding_relative_absolute_and_trend():
    rms = _healthy_grid(steps=6)
    rms[:, 4] *= 1e5  # 5 decades above the others but still < 1e2 absolute
    h = _diag(rms)
    lh = h.by_layer()["layer_4/kernel"]
    assert lh.status == "exploding" and lh.first_step == 0
    assert "above the layers nearest the loss" in lh.reasons[0]
    # Uniformly 1e6 times larger: the same training with the loss times 1e6 (and the learning rate divided by it),
    # so the same verdicts; uniformly beyond where float32's square overflows: the absolute backstops see it.
    assert set(_status(_diag(_healthy_grid(steps=3) * 1e6))) == {"healthy"}
    huge = _healthy_grid(steps=3) * 1e24
    assert np.isinf(np.float32(huge.min()) ** 2)  # the label: float32 cannot square these gradients
    h2 = _diag(huge)
    assert set(_status(h2)) == {"exploding"}
    assert all("absolute bound" in " ".join(lh.reasons) for lh in h2.layers)
    assert set(_status(_diag(huge, thresholds=Thresholds(
        explode_rms_above=1e38, explode_max_abs_above=1e38)))) == {"healthy"}


@pytest.mark.unit
def test_trend_catches_divergence_before_nan_and_backstops():
    # The whole network grows 3x per logged step from ~1e-3: the trend rule fires while RMS is still far below
    # the absolute bound (1e2) and long before float32 overflow.
    steps = 12
    growth = 3.0 ** np.arange(steps)
    rms = _healthy_grid(steps=steps) * growth[:, None]
    h = _diag(rms)
    first_flag = None
    for s in range(steps):
        hs = _diag(rms[: s + 1])
        if hs.counts["exploding"] == 6:
            first_flag = s
            break
    assert first_flag is not None and first_flag <= 6
    assert rms[first_flag].max() < 1e2
    lh = h.layers[0]
    assert lh.status == "exploding" and any("grew" in r and "within the last 10 logged steps" in r for r in lh.reasons)
    # Steady gradients never trigger the trend rule.
    assert _diag(_healthy_grid(steps=30)).counts["exploding"] == 0


@pytest.mark.unit
def test_layers_reached_by_a_blow_up_going_on_are_dated_where_their_gradient_left_its_range():
    # One layer's gradient blows up from step 30 (x10 a logged step); from step 33 the whole network follows (x10 a
    # step too), and the rules flag those layers only from step 34, when they have grown past their lines. Each is
    # dated where its own gradient left its range within the blow-up (step 33), not where a rule first saw it; the
    # layer it began in stays the answer.
    rms = _healthy_grid(steps=40, layers=6, seed=3)
    rms[30:, 2] *= 10.0 ** (np.arange(10) + 1)
    rms[33:, :] *= 10.0 ** (np.arange(7)[:, None] + 1)
    h = _diag(rms)
    assert set(_status(h)) == {"exploding"} and h.cause["layer"] == "layer_2/kernel"
    by = h.by_layer()
    assert by["layer_2/kernel"].first_step == 300
    followers = [lh for lh in h.layers if lh.layer != "layer_2/kernel"]
    assert {lh.first_step for lh in followers} == {330} and {lh.status_since for lh in followers} == {340}
    assert all(any("the same blow-up reached it there" in r for r in lh.reasons) for lh in followers)
    # A layer that rises too slowly for a rule (x4 a step from step 33) and overflows to NaN at step 35 is reached
    # by the same blow-up: its chain begins NaN/Inf, dated where its gradient rose.
    rms = _healthy_grid(steps=40, layers=6, seed=3)
    rms[30:, 2] *= 10.0 ** (np.arange(10) + 1)
    rms[33:35, 5] *= 4.0 ** np.arange(1, 3)
    rms[35:, 5] = np.nan
    records = _records(rms)
    records[35:, 5] = [record.compute(np.full(64, np.nan)) for _ in range(5)]
    lh = diagnose_run(_names(6), np.arange(40) * 10, records).by_layer()["layer_5/kernel"]
    assert lh.status == "nonfinite" and lh.status_since == 350 and lh.first_step == 330
    # A layer whose gradient stays in its range until a rule flags it keeps that onset: the blow-up going on
    # elsewhere is no evidence that it was reached before.
    rms = _healthy_grid(steps=40, layers=6, seed=3)
    rms[30:, 2] *= 10.0 ** (np.arange(10) + 1)
    rms[36:, 4] *= 10.0 ** (3 * (np.arange(4) + 1))
    assert _diag(rms).by_layer()["layer_4/kernel"].first_step == 360
    # A spike in one layer that is over before another layer blows up is another event: each keeps its own onset.
    rms = _healthy_grid(steps=40, layers=6, seed=3)
    rms[10:13, 2] *= 1e4
    rms[30:, 4] *= 10.0 ** (np.arange(10) + 1)
    by = _diag(rms).by_layer()
    assert by["layer_4/kernel"].status == "exploding" and by["layer_4/kernel"].first_step == 300
    assert by["layer_2/kernel"].status == "healthy" and by["layer_2/kernel"].episodes[0]["from"] == 100


def _blow_up_run(rise: bool = True, recover: bool = False, at_step: int | None = None) -> health.RunHealth:
    """One layer (``layer_2``) blows up from step 280 (x10 a logged step for three steps) and stays 10x up; the loss
    jumps 10x at step 300 and stays there (``recover``: for three steps only). ``rise``: four other layers rise
    20-30x with it from step 280 and stay there, too little for any rule of their own; ``layer_5`` never moves."""
    rms = _healthy_grid(steps=40, layers=6, seed=3)
    rms[28:31, 2] *= [10.0, 1e2, 1e3]
    rms[31:, 2] *= 10.0
    if rise:
        rms[28:30, [0, 1, 3, 4]] *= [[20.0], [30.0]]
        rms[30:, [0, 1, 3, 4]] *= 30.0
    loss = 3.0 * np.exp(np.random.default_rng(0).normal(scale=0.05, size=40))
    loss[30:33 if recover else 40] *= 10.0
    steps = np.arange(40) * 10
    return diagnose_run(_names(6), steps, _records(rms), progress=(steps, loss), at_step=at_step)


@pytest.mark.unit
def test_layers_whose_gradient_rose_with_a_blow_up_are_part_of_it_while_it_goes_on():
    h = _blow_up_run()
    by = h.by_layer()
    assert h.answer["layer"] == "layer_2/kernel" and by["layer_2/kernel"].first_step == 290
    risen = [by[f"layer_{i}/kernel"] for i in (0, 1, 3, 4)]
    assert {lh.status for lh in risen} == {"exploding"} and {lh.first_step for lh in risen} == {290}
    assert all("where the blow-up of layer_2/kernel began" in lh.reasons[0] and "it rose with that blow-up"
               in lh.reasons[0] for lh in risen)
    assert by["layer_5/kernel"].status == "healthy" and by["layer_5/kernel"].episodes == []
    # Before the blow-up nothing is flagged; once the loss is back, the episode is over for every layer it reached,
    # and each keeps it in its history, with the same span as the layer it began in.
    assert set(_status(_blow_up_run(at_step=270))) == {"healthy"}
    by = _blow_up_run(recover=True).by_layer()
    assert set(lh.status for lh in by.values()) == {"healthy"}
    spans = {name: lh.episodes for name, lh in by.items() if lh.episodes}
    assert set(spans) == {f"layer_{i}/kernel" for i in (0, 1, 2, 3, 4)}
    assert len({str(e) for e in spans.values()}) == 1
    # The same blow-up where no other layer's gradient rose: they stay healthy, with no episode.
    by = _blow_up_run(rise=False).by_layer()
    assert by["layer_2/kernel"].status == "exploding"
    assert all(lh.status == "healthy" and lh.episodes == [] for name, lh in by.items() if name != "layer_2/kernel")


@pytest.mark.unit
def test_a_head_bias_the_blow_up_only_reached_does_not_move_the_cause_to_the_head():
    # layer_2 and the output kernel blow up together from step 280; the output bias rises 20-30x with them (swept
    # into the blow-up, no rule of its own) and blows up by itself from step 330. An output kernel exploding beside
    # a calm bias is large because its inputs are: the cause is layer_2 at every step, before the bias's own flags
    # and after them.
    names = [f"layer_{i}/kernel" for i in range(4)] + ["head/kernel", "head/bias"]
    rms = _healthy_grid(steps=40, layers=6, seed=3)
    rms[28:31, [2, 4]] *= np.array([30.0, 1e3, 3e4])[:, None]
    rms[31:, [2, 4]] *= 10.0
    rms[28:30, [0, 1, 3, 5]] *= [[20.0], [30.0]]
    rms[30:, [0, 1, 3, 5]] *= 30.0
    rms[33:, 5] *= 10.0 ** (np.arange(7) + 1)
    loss = 3.0 * np.exp(np.random.default_rng(0).normal(scale=0.05, size=40))
    loss[30:] *= 10.0
    steps, records = np.arange(40) * 10, _records(rms)
    answers = [diagnose_run(names, steps, records, progress=(steps, loss), at_step=s).answer for s in steps[29:]]
    assert {(a["layer"], a["step"]) for a in answers} == {("layer_2/kernel", 290)}


@pytest.mark.unit
def test_trend_ignores_recovery_toward_the_median():
    rms = _healthy_grid(steps=10)
    rms[:, 0] = 1e-3 * np.logspace(-6, -2.5, 10)  # climbing back from 6 to 2.5 decades below: recovery
    assert _status(_diag(rms))[0] == "healthy"


@pytest.mark.unit
def test_dead_is_distinct_from_vanishing():
    rms = _healthy_grid()
    rms[:, 3] = 0.0
    rms[:, 4] = 1e-12
    h = _diag(rms)
    by = h.by_layer()
    assert by["layer_3/kernel"].status == "dead" and by["layer_3/kernel"].zero_fraction == 1.0
    assert "exactly zero" in by["layer_3/kernel"].reasons[0]
    assert by["layer_4/kernel"].status == "vanishing"
    # A dead layer does not drag the median down: the healthy layers stay healthy.
    assert _status(h).count("healthy") == 4
    # Mostly zero (not all) is not dead.
    recs = _records(_healthy_grid())
    g = np.zeros(64)
    g[0] = 1e-3
    recs[:, 0] = record.compute(g)
    assert diagnose_run(_names(6), np.arange(8), recs).statuses()[0] == "healthy"


@pytest.mark.unit
def test_missing_flag_and_absent_layers():
    recs = _records(_healthy_grid(steps=6, layers=4))
    recs[:, 1] = record.compute(None, np.ones(8))
    recs[:, 2] = np.nan  # never logged
    recs[2:, 3] = np.nan  # logged only at the first two steps
    h = diagnose_run(_names(4), np.arange(1, 7), recs)
    by = h.by_layer()
    assert by["layer_1/kernel"].status == "missing" and "None gradient" in by["layer_1/kernel"].reasons[0]
    assert by["layer_1/kernel"].first_step == 1
    assert by["layer_2/kernel"].status == "missing" and by["layer_2/kernel"].step is None
    assert "no record" in by["layer_2/kernel"].reasons[0]
    assert by["layer_3/kernel"].status == "healthy" and by["layer_3/kernel"].step == 2  # its last record
    assert by["layer_0/kernel"].status == "healthy"
    json.dumps(h.to_json(), allow_nan=False)
    # No gradient at the first four logged steps is not yet "missing": an expert or a branch can go unused as long.
    early = diagnose_run(_names(4), np.arange(1, 7), recs, at_step=4).by_layer()["layer_1/kernel"]
    assert early.status == "healthy" and any("flagged as missing once it lasts 5" in r for r in early.reasons)


@pytest.mark.unit
def test_nonfinite_first_step_and_deepest_layer_first():
    rms = _healthy_grid(steps=8, layers=5)
    recs = _records(rms)
    rng = np.random.default_rng(3)

    def bad(scale: float, n_nan: int) -> np.ndarray:
        g = _grad(rng, scale)
        g[:n_nan] = np.nan
        return record.compute(g)

    # At row 4 (step 40) layers 1 and 3 go NaN (3 is deepest: backprop reached it first); from row 5 all do.
    recs[4, 1], recs[4, 3] = bad(1e-3, 2), bad(1e-3, 5)
    for i in range(5):
        recs[5:, i] = bad(1e-3, 64)
    h = diagnose_run(_names(5), np.arange(8) * 10, recs)
    by = h.by_layer()
    assert set(h.statuses()) == {"nonfinite"}
    assert by["layer_3/kernel"].first_step == 40 and by["layer_1/kernel"].first_step == 40
    assert by["layer_0/kernel"].first_step == 50
    assert h.first_bad == {"layer": "layer_3/kernel", "status": "nonfinite", "step": 40}
    assert h.layers[0].layer == "layer_3/kernel"  # the origin ranks first
    assert any("started here" in r and "deepest" in r for r in by["layer_3/kernel"].reasons)
    assert any("first layer to reach nonfinite was layer_3/kernel, at step 40" in r
               for r in by["layer_0/kernel"].reasons)
    assert by["layer_0/kernel"].nan == 64 and by["layer_0/kernel"].to_json()["rms"] is None
    # Before the NaN the run was healthy.
    assert set(diagnose_run(_names(5), np.arange(8) * 10, recs, at_step=39).statuses()) == {"healthy"}


@pytest.mark.unit
def test_recovered_nonfinite_is_a_note_not_a_status():
    recs = _records(_healthy_grid(steps=6, layers=3))
    g = np.full(64, np.inf)
    recs[2, 0] = record.compute(g)  # e.g. a step skipped by dynamic loss scaling
    h = diagnose_run(_names(3), np.arange(6), recs)
    lh = h.by_layer()["layer_0/kernel"]
    assert lh.status == "healthy"
    assert any("NaN/Inf earlier at 1 logged step(s), first at step 2" in r for r in lh.reasons)
    assert diagnose_run(_names(3), np.arange(6), recs, at_step=2).by_layer()["layer_0/kernel"].status \
        == "nonfinite"


@pytest.mark.unit
def test_severity_orders_statuses_and_scales_within():
    rms = _healthy_grid(steps=8, layers=8)
    rms[:, 0] = 1e-10  # vanishing, far
    rms[:, 1] = 1e-3 * 10**-3.6  # vanishing, just past the line
    rms[:, 2] = 0.0  # dead
    rms[:, 3] *= 1e5  # exploding
    recs = _records(rms)
    recs[:, 4] = record.compute(None, np.ones(4))  # missing
    g = _grad(np.random.default_rng(0), 1e-3)
    g[0] = np.nan
    recs[-1, 5] = record.compute(g)  # nonfinite at the last step only
    h = diagnose_run(_names(8), np.arange(8), recs)
    order = [lh.status for lh in h.layers]
    assert order == sorted(order, key=STATUSES.index)
    assert order[:6] == ["nonfinite", "exploding", "vanishing", "vanishing", "dead", "missing"]
    by = h.by_layer()
    assert by["layer_0/kernel"].severity > by["layer_1/kernel"].severity
    sev = [lh.severity for lh in h.layers]
    assert sev == sorted(sev, reverse=True) and sev[-1] == 0
    # Persistence scales severity: the same vanishing for fewer steps ranks lower.
    short = diagnose_run(_names(8), np.arange(8)[-5:], recs[-5:]).by_layer()["layer_0/kernel"]
    assert short.status == "vanishing" and short.severity < by["layer_0/kernel"].severity


@pytest.mark.unit
def test_update_and_grad_to_weight_notes():
    rng = np.random.default_rng(0)
    w = rng.normal(size=64)
    rows = []
    for _ in range(3):
        rows.append([
            record.compute(_grad(rng, 1e-3), w, -1e-3 * _grad(rng, 1.0)),  # update/weight ~1e-3: no note
            record.compute(_grad(rng, 1e-3), w, 0.5 * w),  # update/weight 0.5: lr too high
            record.compute(_grad(rng, 1e-3), w, 1e-8 * w),  # update/weight 1e-8: barely learns
            record.compute(_grad(rng, 1e-3), w * 1e-7),  # grad/weight ~1e4
        ])
    h = diagnose_run(_names(4), np.arange(3), np.array(rows))
    by = h.by_layer()
    assert not any(r.startswith("note") for r in by["layer_0/kernel"].reasons)
    assert any("update/weight" in r and "too high" in r for r in by["layer_1/kernel"].reasons)
    assert any("update/weight" in r and "barely learns" in r for r in by["layer_2/kernel"].reasons)
    assert any("grad/weight" in r for r in by["layer_3/kernel"].reasons)
    assert all(lh.status == "healthy" for lh in h.layers)  # notes never change the status
    assert math.isclose(by["layer_1/kernel"].update_to_weight, 0.5, rel_tol=1e-6)


# --- edge cases -----------------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_single_step_single_layer_and_empty():
    one = _records(np.array([[1e-3]]))
    h = diagnose_run(["w"], np.array([7]), one)
    assert h.step == 7 and h.statuses() == ["healthy"]
    # A run of one logged step confirms over that step, and says it is less certain than a longer run would be.
    tiny = _records(np.array([[1e-12]]))
    lone = diagnose_run(["w"], np.array([7]), tiny).layers[0]
    assert lone.status == "vanishing" and "short run (1 logged step(s))" in lone.reasons[-1]
    assert diagnose_run(["w"], np.array([7]), tiny, Thresholds(sustain_steps=1)).statuses() == ["vanishing"]
    # Two records of it, then a healthy one: the lone pair is confirmed (half of 3 rounds up to 2) when they cover
    # sustain_steps training steps (logged 10 steps apart) ...
    three = _records(np.array([[1e-12], [1e-12], [1e-3]]))
    assert diagnose_run(["w"], np.array([10, 20, 30]), three, at_step=20).statuses() == ["vanishing"]
    # ... not as the first two steps of a run logged at every step, which may go on to many more records
    assert diagnose_run(["w"], np.array([1, 2, 3]), three, at_step=2).statuses() == ["healthy"]
    # ... and a single quiet step inside 10 healthy ones is not (confirmation: sustain_steps).
    quiet = _records(np.r_[np.full(5, 1e-3), [1e-12], np.full(4, 1e-3)][:, None])
    assert diagnose_run(["w"], np.arange(10), quiet, at_step=5).statuses() == ["healthy"]
    zero = _records(np.array([[0.0]]))
    assert diagnose_run(["w"], np.array([7]), zero, Thresholds(sustain_steps=1)).statuses() == ["dead"]
    empty = diagnose_run(["a", "b"], np.zeros(0, np.int64), np.zeros((0, 2, record.NUM_FIELDS)))
    assert empty.step is None and empty.statuses() == ["missing", "missing"]
    json.dumps(empty.to_json(), allow_nan=False)
    all_absent = np.full((3, 2, record.NUM_FIELDS), np.nan)
    assert diagnose_run(["a", "b"], np.arange(3), all_absent).statuses() == ["missing", "missing"]


@pytest.mark.unit
def test_bad_inputs_raise_value_error():
    recs = _records(_healthy_grid(steps=3, layers=2))
    with pytest.raises(ValueError, match="step 5 is before the first logged step 10"):
        diagnose_run(_names(2), np.array([10, 20, 30]), recs, at_step=5)
    with pytest.raises(ValueError, match="ascending"):
        diagnose_run(_names(2), np.array([10, 10, 30]), recs)
    with pytest.raises(ValueError, match="layer names"):
        diagnose_run(_names(3), np.arange(3), recs)
    with pytest.raises(ValueError, match="shape"):
        diagnose_run(_names(2), np.arange(3), recs[..., :5])


@pytest.mark.unit
def test_json_shape_matches_the_contract():
    rms = _healthy_grid()
    rms[:, 0] = 1e-11
    h = _diag(rms).to_json()
    assert set(h) == {"step", "thresholds", "threshold_spec", "summary", "layers"}
    assert set(h["summary"]) == {"counts", "answer", "first_bad", "cause", "onset", "timeline", "earlier", "order",
                                 "loss_trend", "loss_nonfinite"}
    assert h["summary"]["loss_trend"] is None and h["summary"]["loss_nonfinite"] is None  # no loss given
    assert set(h["summary"]["counts"]) == set(STATUSES) and sum(h["summary"]["counts"].values()) == 6
    assert set(h["layers"][0]) == {
        "layer", "index", "status", "severity", "reasons", "fixes", "first_step", "status_since", "episodes", "step",
        "norm", "rms", "max_abs", "mean",
        "nan", "inf", "zero_fraction", "grad_to_weight", "update_to_weight", "noise", "weight_norm", "size", "rank",
        "rank_reason", "last_finite", "idle_steps", "logged_steps"}
    assert set(h["summary"]["answer"]) == {"layer", "index", "status", "step", "now", "now_since", "chain", "story",
                                           "fixes", "flagged", "headline"}
    assert [x["rank"] for x in h["layers"]] == list(range(1, 7)) and h["layers"][0]["rank_reason"] == "cause"
    assert {e["label"] for e in h["summary"]["timeline"][:1]} == {"first to go wrong"}
    assert h["layers"][0]["grad_to_weight"] is None  # not recorded: NaN -> null
    json.dumps(h, allow_nan=False)


@pytest.mark.unit
def test_history_quantities_agree_with_record_derived():
    recs = _records(_healthy_grid())
    recs[2, 1] = record.compute(np.array([np.nan, 1.0, 0.0, -3.0]))
    size, _, nonfinite, zero, rms, max_abs = history(recs)
    d = record.derived(recs)
    np.testing.assert_allclose(rms, d["rms"], rtol=1e-12)
    np.testing.assert_array_equal(max_abs, d["max_abs"])
    np.testing.assert_array_equal(nonfinite, d["nan"] + d["inf"])
    np.testing.assert_array_equal(zero, d["zero"])


@pytest.mark.e2e
def test_health_imports_neither_tensorflow_nor_tensorboard():
    code = ("import sys, tb_gradhealth.health; "
            "bad = [m for m in ('tensorflow', 'tensorboard', 'keras') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=pathlib.Path(__file__).resolve().parents[1])


# --- thresholds -----------------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_thresholds_from_mapping_to_dict_and_spec():
    t = Thresholds.from_mapping({"vanish_decades": "4.5", "sustain_steps": "3", "explode_rms_above": 1e3})
    assert t.vanish_decades == 4.5 and t.sustain_steps == 3 and isinstance(t.sustain_steps, int)
    assert Thresholds.from_mapping(t.to_dict()) == t
    assert Thresholds.from_mapping({}) == Thresholds()
    spec = Thresholds.spec()
    assert [s["name"] for s in spec] == list(Thresholds().to_dict())
    for s in spec:
        assert {"name", "default", "description", "min", "max", "step"} <= set(s)
        assert s["min"] <= s["default"] <= s["max"] and s["step"] > 0 and s["description"]
    json.dumps(spec, allow_nan=False)
    with pytest.raises(AttributeError):
        t.vanish_decades = 1.0  # frozen


@pytest.mark.parametrize("params, named", [
    ({"vanish_decade": "3"}, "vanish_decade"),
    ({"vanish_decades": "abc"}, "vanish_decades"),
    ({"vanish_decades": "nan"}, "vanish_decades"),
    ({"vanish_decades": "-1"}, "vanish_decades"),
    ({"sustain_steps": "2.5"}, "sustain_steps"),
    ({"growth_window": "1"}, "growth_window"),
    ({"explode_rms_above": "inf"}, "explode_rms_above"),
])
@pytest.mark.unit
def test_thresholds_bad_values_name_the_key(params, named):
    with pytest.raises(ValueError, match=named):
        Thresholds.from_mapping(params)


@pytest.mark.unit
def test_thresholds_change_the_diagnosis():
    rms = _healthy_grid()
    rms[:, :3] = 1e-3 * 10**-3.5
    assert _status(_diag(rms))[2] == "vanishing"
    assert _status(_diag(rms, thresholds=Thresholds.from_mapping({"vanish_decades": "4"})))[2] == "healthy"
    h = _diag(rms, thresholds=Thresholds(vanish_decades=4.0)).to_json()
    assert h["thresholds"]["vanish_decades"] == 4.0


# --- depth profile --------------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_profile_bands_and_statuses():
    rms = np.array([[1e-3, 2e-3, 1e-3, 1e-9, 0.0, 1e-3, np.nan]])
    recs = _records(rms)[0]
    p = health.profile(_names(7), recs)
    st = [row["status"] for row in p["layers"]]
    assert st == ["healthy", "healthy", "healthy", "vanishing", "dead", "healthy", "missing"]
    b = p["bands"]
    assert b["median_rms"] == pytest.approx(np.median([r["rms"] for r in p["layers"][:4] + p["layers"][5:6]]),
                                            rel=0.5)
    # The reference: the median of the last three layers with a live gradient (2, 3 and 5), nearest the loss.
    live_rms = [p["layers"][i]["rms"] for i in (2, 3, 5)]
    assert b["reference_rms"] == pytest.approx(float(np.median(live_rms)), rel=1e-9)
    assert b["vanishing_below"] == pytest.approx(b["reference_rms"] * 1e-3)
    assert b["exploding_above"] <= Thresholds().explode_rms_above
    assert p["layers"][6]["rms"] is None and p["layers"][6]["max_abs"] is None
    assert [row["index"] for row in p["layers"]] == list(range(7))
    json.dumps(p, allow_nan=False)
    full = diagnose_run(_names(7), np.arange(1), recs[None])
    assert [row["status"] for row in health.profile(_names(7), recs, statuses=full.statuses())["layers"]] == \
        full.statuses()


# --- scale ----------------------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_scale_1000_by_1000(capsys):
    """1,000 layers x 1,000 logged steps: prints the time (no assert on it: shared CI machines are noisy)."""
    rng = np.random.default_rng(0)
    pool = np.stack([record.compute(_grad(rng, 10.0 ** rng.uniform(-3.5, -2.5))) for _ in range(64)])
    recs = pool[rng.integers(0, 64, size=(1000, 1000))]
    recs[:, 10] = record.compute(_grad(rng, 1e-11))
    recs[500:, 20] = record.compute(np.zeros(64))
    recs[900:, 30] = np.nan
    layers = [f"block_{i // 10}/layer_{i}/kernel" for i in range(1000)]
    t0 = time.perf_counter()
    h = diagnose_run(layers, np.arange(1000) * 100, recs)
    elapsed = time.perf_counter() - t0
    with capsys.disabled():
        print(f"\n[health] diagnose_run 1000 layers x 1000 steps: {elapsed:.3f} s")
    by = h.by_layer()
    assert by[layers[10]].status == "vanishing" and by[layers[20]].status == "dead"
    assert by[layers[20]].first_step == 50000 and by[layers[30]].step == 89900


# --- real networks trained with TensorFlow ----------------------------------------------------------------------
# Small raw-TF models (tf.Variable + matmul, SGD by hand) so that the test controls every variable's name, init and
# gradient path; records come from record.compute on the numpy gradients, weights and applied updates.


@pytest.fixture(scope="module")
def tf():
    return pytest.importorskip("tensorflow")


class _Net:
    """A list of named tf.Variables and a forward function; ``train`` runs SGD and returns the run's records."""

    def __init__(self, tf, seed: int = 0):
        self.tf = tf
        self.rng = np.random.default_rng(seed)
        self.names: list[str] = []
        self.vars: list = []

    def var(self, name: str, value: np.ndarray):
        v = self.tf.Variable(np.asarray(value, dtype=np.float32), name=name.replace("/", "_"))
        self.names.append(name)
        self.vars.append(v)
        return v

    def dense(self, name: str, n_in: int, n_out: int, std: float | None = None, bias: float | None = 0.0):
        std = math.sqrt(2.0 / (n_in + n_out)) if std is None else std  # Glorot normal by default
        w = self.var(f"{name}/kernel", self.rng.normal(size=(n_in, n_out)) * std)
        b = self.var(f"{name}/bias", np.full(n_out, bias)) if bias is not None else None
        return lambda x: x @ w + b if b is not None else x @ w

    def train(self, forward, x: np.ndarray, y: np.ndarray, steps: int, lr: float):
        tf = self.tf
        rows = []
        x, y = tf.constant(x, tf.float32), tf.constant(y, tf.float32)
        for step in range(steps):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(forward(x, step) - y))
            grads = tape.gradient(loss, self.vars)
            row = []
            for g, v in zip(grads, self.vars, strict=True):
                if g is None:
                    row.append(record.compute(None, v.numpy()))
                    continue
                update = -lr * g.numpy()
                row.append(record.compute(g.numpy(), v.numpy(), update))
                v.assign_add(update)
            rows.append(np.stack(row))
        return self.names, np.arange(steps), np.stack(rows)


def _data(seed: int = 0, n: int = 64, d: int = 16, offset: float = 0.0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    return x, (offset + np.sin(x.sum(axis=1, keepdims=True))).astype(np.float32)


def _rms_last(records: np.ndarray) -> np.ndarray:
    return record.derived(records[-1])["rms"]


@pytest.mark.tf
def test_tf_deep_sigmoid_mlp_early_layers_vanish(tf):
    net = _Net(tf)
    depth, width = 14, 16
    layers = [net.dense(f"dense_{i}", 16 if i == 0 else width, 1 if i == depth - 1 else width) for i in range(depth)]

    def forward(x, _step):
        for i, layer in enumerate(layers):
            x = layer(x)
            x = tf.sigmoid(x) if i < depth - 1 else x
        return x

    before = [v.numpy().copy() for v in net.vars]
    names, steps, recs = net.train(forward, *_data(offset=2.0), steps=8, lr=0.01)
    h = diagnose_run(names, steps, recs)
    # Ground truth from what each layer does, not from the diagnosis: how far its parameters moved over the run
    # (RMS change per element; biases start at 0, so not relative to the start), next to the output layer's.
    moved = np.array([np.sqrt(np.mean((v.numpy() - b) ** 2)) for v, b in zip(net.vars, before, strict=True)])
    decades = np.log10(moved) - np.log10(np.median(moved[-2:]))
    status = h.statuses()
    sick = decades < -3.3  # learns over 2,000x slower than the layer next to the loss
    fine = decades > -2.5
    assert sick[:3].all() and sick.sum() >= 3  # the first layers, as Glorot & Bengio describe
    assert all(status[i] == "vanishing" for i in np.flatnonzero(sick)), list(zip(names, status, strict=True))
    assert all(status[i] == "healthy" for i in np.flatnonzero(fine)), list(zip(names, status, strict=True))
    assert set(status) <= {"vanishing", "healthy"}  # the normal layers near the loss are not "exploding"
    assert h.layers[0].index in np.flatnonzero(sick) and h.layers[0].first_step == 0
    assert h.first_bad["layer"] == h.layers[0].layer and h.onset["step"] == 0


@pytest.mark.tf
def test_tf_linear_stack_with_too_large_init_explodes_before_nan(tf):
    net = _Net(tf)
    depth, width = 8, 32
    # std 0.35 on 32 inputs: each layer multiplies the signal by ~2 (Glorot would be ~0.18), 2^8 over the stack.
    layers = [net.dense(f"linear_{i}", 16 if i == 0 else width, 1 if i == depth - 1 else width, std=0.35)
              for i in range(depth)]

    def forward(x, _step):
        for layer in layers:
            x = layer(x)
        return x

    names, steps, recs = net.train(forward, *_data(), steps=8, lr=1e-5)
    d = record.derived(recs)
    nonfinite_rows = np.flatnonzero((d["nan"] + d["inf"]).sum(axis=1) > 0)
    assert nonfinite_rows.size and nonfinite_rows[0] >= 2  # it does diverge to NaN/Inf, a few steps in
    kernels = [i for i, n in enumerate(names) if n.endswith("/kernel")]
    # The gradient's size says nothing by itself (the same run with the loss divided by 1e4 has gradients of ~1):
    # what says "diverging" is each update moving the weights by a large fraction while the gradient grows. Two
    # logged steps before the first NaN, stop_on=("exploding",) halts (some kernel is flagged); at the step before
    # it, every kernel is.
    first_nan = int(nonfinite_rows[0])
    early = diagnose_run(names, steps, recs, at_step=int(steps[first_nan - 2])).statuses()
    assert any(early[i] == "exploding" for i in kernels), list(zip(names, early, strict=True))
    status = diagnose_run(names, steps, recs, at_step=int(steps[first_nan - 1])).statuses()
    assert all(status[i] == "exploding" for i in kernels), list(zip(names, status, strict=True))
    for at in range(first_nan):
        assert set(diagnose_run(names, steps, recs, at_step=int(steps[at])).statuses()) <= {"exploding", "healthy"}
    h0 = diagnose_run(names, steps, recs, at_step=0).by_layer()
    assert any("update/weight" in r for r in h0["linear_0/kernel"].reasons)  # the lr is far too high for it
    h = diagnose_run(names, steps, recs)
    # Cause before consequence: the run went wrong by exploding before the first NaN (measured above), so the
    # first row and the headline name an explosion that began before it, on a layer that is NaN now.
    top = h.layers[0]
    assert h.first_bad == {"layer": top.layer, "status": "nonfinite", "step": top.first_step}
    assert h.cause["layer"] == top.layer and h.cause["status"] == "exploding" and h.cause["now"] == "nonfinite"
    assert top.first_step < top.status_since == int(steps[nonfinite_rows[0]])
    assert [e["status"] for e in top.episodes] == ["exploding", "nonfinite"]
    assert h.cause["story"].startswith(f"exploding from step {top.first_step} -> nonfinite from step")
    assert h.onset["step"] < int(steps[nonfinite_rows[0]]) and h.onset["status"] == "exploding"
    # The layer where NaN/Inf appeared first says so, whatever ranks first.
    origin = [lh for lh in h.layers if any("NaN/Inf started here" in r for r in lh.reasons)]
    assert len(origin) == 1 and origin[0].status == "nonfinite"


@pytest.mark.tf
def test_tf_dead_relu_branch_is_dead_and_the_rest_healthy(tf):
    net = _Net(tf)
    trunk = [net.dense(f"trunk_{i}", 16, 16, std=math.sqrt(2 / 16)) for i in range(3)]
    dead = net.dense("dead_branch", 16, 16, std=math.sqrt(2 / 16), bias=-100.0)  # pre-activations < 0: ReLU off
    head = net.dense("head", 32, 1)

    def forward(x, _step):
        for layer in trunk:
            x = tf.nn.relu(layer(x))
        return head(tf.concat([x, tf.nn.relu(dead(x))], axis=1))

    names, steps, recs = net.train(forward, *_data(), steps=8, lr=0.01)
    h = diagnose_run(names, steps, recs)
    d = record.derived(recs)
    all_zero = (d["zero"] == d["size"]).all(axis=0)  # exactly zero at every step, computed independently
    status = dict(zip(names, h.statuses(), strict=True))
    assert status["dead_branch/kernel"] == "dead" and status["dead_branch/bias"] == "dead"
    assert all((status[n] == "dead") == bool(z) for n, z in zip(names, all_zero, strict=True)), status
    assert set(status.values()) == {"dead", "healthy"}
    assert h.by_layer()["dead_branch/kernel"].first_step == 0


def _batch_norm(net: _Net, tf, name: str, n: int):
    gamma = net.var(f"{name}/gamma", np.ones(n))
    beta = net.var(f"{name}/beta", np.zeros(n))

    def apply(x):
        mean, var = tf.nn.moments(x, axes=[0])
        return tf.nn.batch_normalization(x, mean, var, beta, gamma, 1e-3)

    return apply


@pytest.mark.tf
def test_tf_healthy_bn_relu_network_has_no_flags(tf):
    net = _Net(tf, seed=1)
    width = 32
    blocks = [(net.dense(f"block_{i}/dense", 16 if i == 0 else width, width, std=math.sqrt(2 / width), bias=None),
               _batch_norm(net, tf, f"block_{i}/bn", width)) for i in range(4)]
    head = net.dense("head", width, 1)

    def forward(x, _step):
        for dense, bn in blocks:
            x = tf.nn.relu(bn(dense(x)))
        return head(x)

    names, steps, recs = net.train(forward, *_data(seed=1), steps=12, lr=0.05)
    h = diagnose_run(names, steps, recs)
    assert h.counts["healthy"] == len(names), [(lh.layer, lh.status, lh.reasons) for lh in h.layers]
    assert h.first_bad is None and all(lh.severity == 0 for lh in h.layers)
    for at in steps:  # and at every step along the way
        assert diagnose_run(names, steps, recs, at_step=int(at)).counts["healthy"] == len(names)
    spread = np.ptp(np.log10(_rms_last(recs)))
    assert spread < 3.0  # the layers of a healthy net sit within a few decades: the defaults leave a margin


@pytest.mark.tf
def test_tf_injected_nan_exact_step_and_first_layer(tf):
    net = _Net(tf, seed=2)
    depth, inject_layer, inject_step = 6, 3, 5
    layers = [net.dense(f"dense_{i}", 16, 1 if i == depth - 1 else 16, bias=None) for i in range(depth)]
    poison = tf.Variable(0.0)

    @tf.custom_gradient
    def nan_in_backprop(x):
        def grad(dy):
            return tf.where(poison > 0.5, dy * np.nan, dy)  # NaN flows back into dense_3 and everything shallower

        return tf.identity(x), grad

    def forward(x, step):
        poison.assign(1.0 if step == inject_step else 0.0)
        for i, layer in enumerate(layers):
            x = layer(x)
            if i == inject_layer:
                x = nan_in_backprop(x)
            x = tf.tanh(x) if i < depth - 1 else x
        return x

    names, steps, recs = net.train(forward, *_data(seed=2), steps=8, lr=0.01)
    h = diagnose_run(names, steps, recs)
    assert h.first_bad == {"layer": f"dense_{inject_layer}/kernel", "status": "nonfinite", "step": inject_step}
    assert h.layers[0].layer == f"dense_{inject_layer}/kernel"
    by = h.by_layer()
    for i in range(depth):  # shallower layers got it at the step; deeper ones once the NaN weights ran forward
        lh = by[f"dense_{i}/kernel"]
        assert lh.status == "nonfinite"
        assert lh.first_step == (inject_step if i <= inject_layer else inject_step + 1)
    before = diagnose_run(names, steps, recs, at_step=inject_step - 1)
    assert before.counts["nonfinite"] == 0


@pytest.mark.unit
def test_depth_profile_opens_at_the_last_step_that_shows_something():
    from tb_gradhealth import _payloads, reader

    g = np.random.default_rng(1).standard_normal(16)
    nan = np.full(16, np.nan)
    rows = np.stack([np.stack([record.compute(g * 1e-2), record.compute(g)]),  # step 10: finite
                     np.stack([record.compute(g * 1e-1), record.compute(g)]),  # step 20: finite
                     np.stack([record.compute(nan), record.compute(nan)])])    # step 30: all NaN
    series = reader.RunSeries("r", ("a/kernel", "b/kernel"), np.array([10, 20, 30]), rows)
    body = _payloads.profile_payload(series, Thresholds(), None)
    assert body["step"] == 20 and body["layers"][0]["rms"] is not None
    assert _payloads.profile_payload(series, Thresholds(), 30)["step"] == 30  # asked for: that step


@pytest.mark.unit
def test_status_codes_follow_the_documented_severity_order():
    """The codes order the statuses as docs/DIAGNOSIS.md does (a lower code is worse), the words are what the JSON
    carries, and the module constants are the same members."""
    words = ["nonfinite", "exploding", "vanishing", "dead", "missing", "inert", "healthy", "frozen"]
    assert [s.word for s in sorted(health.Status)] == words == list(health.STATUSES)
    assert list(health.FLAGS) == words[:5] and health.FLAG_CODES == {health.Status.of(w) for w in words[:5]}
    assert health.VANISHING is health.Status.VANISHING and health.Status.of("dead") == health.DEAD == 3
    assert health.Status.EXPLODING < health.Status.DEAD and not health.Status.INERT.is_flag
    assert not health.FROZEN.is_flag and BASE[health.FROZEN] == BASE[health.HEALTHY] == 0
    with pytest.raises(ValueError, match="unknown status 'sick'"):
        health.Status.of("sick")
    rms = _healthy_grid()
    rms[:, 0] = 1e-11
    lh = _diag(rms).by_layer()[_names(6)[0]]
    assert lh.code == health.VANISHING and lh.to_json()["status"] == "vanishing"


@pytest.mark.unit
def test_results_are_built_by_keyword_and_frozen():
    """A diagnosis is a value: its layers and the run cannot be changed after the fact, nor built from a row of
    positional arguments whose order a new field would silently shift."""
    import dataclasses

    rms = _healthy_grid()
    rms[:, 0] = 1e-11
    run = _diag(rms)
    lh = run.layers[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        lh.status = "healthy"
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.layers = []
    with pytest.raises(TypeError):
        health.LayerHealth("a", 0, "healthy", 0.0, [], None, None)
    with pytest.raises(TypeError):
        health.RunHealth(None, Thresholds(), [])
    assert [x.rank for x in run.layers] == list(range(1, 7)) and run.layers[0].rank_reason == "cause"


@pytest.mark.unit
def test_a_frozen_parameter_is_shown_apart_and_never_flagged():
    """A parameter frozen by the user (the record's ``missing`` field at ``record.FROZEN``) is ``frozen``: no rule
    reads it, it has no episode, and the run beside it is judged as without it; a ``None`` gradient of a parameter
    that should learn stays ``missing``."""
    rng = np.random.default_rng(0)
    names = ["backbone/kernel", "backbone/bias", "stray/kernel", "head/kernel", "head/bias"]
    rows = np.stack([np.stack([record.frozen(64 * 64), record.frozen(64), record.missing(),
                               record.compute(rng.normal(size=(64, 8)) * 1e-2, rng.normal(size=(64, 8))),
                               record.compute(rng.normal(size=8) * 1e-2, rng.normal(size=8))]) for _ in range(12)])
    h = diagnose_run(names, np.arange(12), rows)
    by = h.by_layer()
    assert by["backbone/kernel"].status == by["backbone/bias"].status == "frozen"
    assert by["backbone/kernel"].episodes == [] and by["backbone/kernel"].severity == 0
    assert by["stray/kernel"].status == "missing"
    assert by["head/kernel"].status == by["head/bias"].status == "healthy"
    assert h.counts["frozen"] == 2 and h.counts["missing"] == 1
    frozen_only = diagnose_run(names[:2] + names[3:], np.arange(12), rows[:, [0, 1, 3, 4]])
    assert frozen_only.answer is None and frozen_only.counts["frozen"] == 2
