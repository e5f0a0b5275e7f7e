"""The diagnosis zoo's scorer: its metric arithmetic on a tiny labelled run, against hand-computed figures.

The run is built from numpy records (``record.compute``); the diagnosis is a stand-in with a rule simple enough to
work out by hand (NaN -> nonfinite, RMS < 1e-6 -> vanishing), so the test checks the scorer, not the diagnosis.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from tb_gradhealth import record

pytestmark = pytest.mark.unit

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "diagnosis_zoo.py"
_spec = importlib.util.spec_from_file_location("diagnosis_zoo", _PATH)
zoo = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("diagnosis_zoo", zoo)  # dataclasses look their module up there
_spec.loader.exec_module(zoo)

LAYERS = ["a/kernel", "b/kernel", "c/kernel"]
STEPS = np.array([10, 20, 30, 40, 50, 60])


def _records() -> np.ndarray:
    """a: RMS 1e-9 from step 30; b: NaN from step 50; c: RMS 1e-9 at step 60 only; otherwise RMS ~1."""
    rng = np.random.default_rng(0)
    rows = []
    for s in STEPS:
        row = []
        for name in LAYERS:
            g = rng.standard_normal(16)
            if (name == "a/kernel" and s >= 30) or (name == "c/kernel" and s == 60):
                g = g * 1e-9
            if name == "b/kernel" and s >= 50:
                g[3] = np.nan
            row.append(record.compute(g))
        rows.append(np.stack(row))
    return np.stack(rows)


@dataclass
class _LH:
    layer: str
    status: str
    first_step: int | None
    episodes: list = field(default_factory=list)


@dataclass
class _RH:
    layers: list[_LH]
    first_bad: dict | None


_SEVERITY = {"nonfinite": 0, "vanishing": 1, "healthy": 2}


def _fake_diagnose(layers, steps, records, thresholds, at_step):
    """NaN -> nonfinite, RMS < 1e-6 -> vanishing; first_step = start of the trailing run of that status."""
    end = int(np.searchsorted(steps, at_step, side="right"))
    d = record.derived(records[:end])
    raw = np.where(d["nan"] > 0, "nonfinite", np.where(d["rms"] < 1e-6, "vanishing", "healthy"))
    out = []
    for i, name in enumerate(layers):
        st = raw[-1, i]
        j = end - 1
        while j > 0 and raw[j - 1, i] == st:
            j -= 1
        eps = [] if st == "healthy" else [{"status": str(st), "from": int(steps[j]), "to": int(steps[end - 1])}]
        out.append(_LH(name, str(st), None if st == "healthy" else int(steps[j]), eps))
    ranked = sorted(out, key=lambda lh: (_SEVERITY[lh.status], LAYERS.index(lh.layer)))
    bad = [lh for lh in ranked if lh.status != "healthy"]
    first_bad = {"layer": bad[0].layer, "status": bad[0].status, "step": bad[0].first_step} if bad else None
    return _RH(ranked, first_bad)


def _labels(sick: bool) -> dict:
    layers = {"a/kernel": {"status": "vanishing", "onset": 20}, "b/kernel": {"status": "nonfinite", "onset": 50},
              "c/kernel": {"status": "healthy", "onset": None}}
    if not sick:
        layers = {n: {"status": "healthy", "onset": None} for n in LAYERS}
    return {"case": "tiny", "sick": sick, "layers": layers, "culprits": ["b/kernel"], "onset": 20 if sick else None,
            "first_nan": 50 if sick else None, "diverges": sick, "rule": "hand-made"}


def _scored(sick: bool):
    d = zoo.diagnose_steps(LAYERS, STEPS, _records(), diagnose=_fake_diagnose, thresholds=object())
    return zoo.score_run(_labels(sick), d)


def test_pair_counts_precision_recall_onsets_and_halt():
    r = _scored(sick=True)
    # vanishing: labelled for a at 20..60 (5 pairs), diagnosed for a at 30..60 (4) and for c at 60 (1)
    assert r.pairs["vanishing"] == {"tp": 4, "fp": 1, "fn": 1}
    assert r.pairs["nonfinite"] == {"tp": 2, "fp": 0, "fn": 0}
    p = zoo.pooled([r])
    assert p["vanishing"]["precision"] == pytest.approx(0.8) and p["vanishing"]["recall"] == pytest.approx(0.8)
    assert p["exploding"]["precision"] is None and p["exploding"]["recall"] is None
    # rank #1 and first_bad at the last step: b (nonfinite), a labelled culprit
    assert (r.rank1, r.first_bad, r.rank1_ok, r.first_bad_ok, r.same) == ("b/kernel", "b/kernel", True, True, True)
    onsets = {o["layer"]: o for o in r.layer_onsets}
    # a: labelled from 20 (index 1), diagnosed from 30 (index 2): one logged step late by both measures
    assert (onsets["a/kernel"]["err_first_step"], onsets["a/kernel"]["err_first_flag"]) == (1, 1)
    assert (onsets["b/kernel"]["err_first_step"], onsets["b/kernel"]["err_first_flag"]) == (0, 0)
    assert set(onsets) == {"a/kernel", "b/kernel"}
    assert (r.run_onset_label, r.run_onset_diag, r.run_onset_error) == (20, 30, 1)
    # stop_on: halted at the first nonfinite (50) = the first NaN: lead 0, not before the onset
    assert (r.stop.halt, r.stop.lead, r.stop.premature) == (50, 0, False)
    g = {x["goal"].split(" ")[0] + " " + x["goal"].split(" ")[1]: x["pass"] for x in zoo.goals([r])}
    # no healthy run: both healthy-run goals hold vacuously; the one divergence halts with lead 0 (< 3)
    assert (g["0 flagged"], g["recall 100%"], g["rank #1"], g["onset (first_step,"], g["stop_on halts"],
            g["stop_on never"]) == (True, True, True, True, False, True)
    # flagged pairs on the sick run: 4 + 1 vanishing (1 wrong: c at 60) and 2 nonfinite: 6 of 7 right (< 95%)
    assert g["precision >="] is False


def test_a_divergence_whose_first_nan_comes_too_early_for_the_lead_is_not_measurable():
    labels = _labels(sick=True)
    labels["first_nan"] = 20  # the second logged step: at most 1 logged step of lead is possible
    d = zoo.diagnose_steps(LAYERS, STEPS, _records(), diagnose=_fake_diagnose, thresholds=object())
    r = zoo.score_run(labels, d)
    assert r.stop.lead_possible == 1
    goal = next(g for g in zoo.goals([r]) if g["goal"].startswith("stop_on halts"))
    assert goal["pass"] and goal["figure"].startswith("0 of 0 measurable divergences")
    assert "tiny: not measurable (first NaN at step 20, after 1 logged step(s); halted at 50)" in goal["figure"]
    labels["first_nan"] = 40  # three logged steps before it: measurable, and a halt at 50 is no lead
    r = zoo.score_run(labels, d)
    goal = next(g for g in zoo.goals([r]) if g["goal"].startswith("stop_on halts"))
    assert not goal["pass"] and goal["figure"].startswith("0 of 1 measurable divergences")


def test_healthy_run_flag_counts():
    r = _scored(sick=False)
    assert r.flagged_last == ["a/kernel", "b/kernel", "c/kernel"]
    assert r.flagged_any == ["a/kernel", "b/kernel", "c/kernel"]
    assert r.pairs["vanishing"] == {"tp": 0, "fp": 5, "fn": 0}
    assert r.stop.halt == 50 and r.stop.lead is None
    assert r.episode_layers == ["a/kernel", "b/kernel", "c/kernel"]
    goals = zoo.goals([r])
    assert [g["pass"] for g in goals if "healthy" in g["goal"]] == [False, False, False]


def test_a_halt_on_a_doubtful_layer_alone_does_not_count_against_a_healthy_run():
    labels = _labels(sick=False)
    labels["layers"]["b/kernel"]["doubtful"] = True  # the only layer that goes nonfinite (from step 50)
    d = zoo.diagnose_steps(LAYERS, STEPS, _records(), diagnose=_fake_diagnose, thresholds=object())
    r = zoo.score_run(labels, d)
    assert (r.stop.halt, r.stop.halt_clear) == (50, None)
    goal = next(g for g in zoo.goals([r]) if g["goal"].startswith("stop_on never"))
    assert goal["pass"] and goal["figure"] == "0 of 1 healthy runs halted; halted on doubtful layers only: tiny at 50"
    labels["layers"]["b/kernel"].pop("doubtful")
    r = zoo.score_run(labels, d)
    goal = next(g for g in zoo.goals([r]) if g["goal"].startswith("stop_on never"))
    assert r.stop.halt_clear == 50 and not goal["pass"] and goal["figure"] == "1 of 1 healthy runs halted (tiny at 50)"


def test_a_past_episode_on_a_healthy_run_counts_though_the_run_ends_clean():
    """c is vanishing at step 60 only: diagnosed at step 50 the run is clean except for a and b; cut at 50, a
    diagnosis whose last step is clean still carries the episodes it had at earlier steps."""
    d = zoo.diagnose_steps(LAYERS, STEPS[:4], _records()[:4], diagnose=_fake_diagnose, thresholds=object())
    d.status[-1] = dict.fromkeys(LAYERS, "healthy")  # the last step reads clean
    r = zoo.score_run(_labels(sick=False), d)
    assert r.flagged_last == [] and r.episode_layers == ["a/kernel"]
    past = next(g for g in zoo.goals([r]) if g["goal"].startswith("0 healthy runs with any episode"))
    assert not past["pass"] and "tiny: a/kernel" in past["figure"]


@pytest.mark.parametrize(("onset", "latest", "err", "ok", "lead"), [
    (20, 40, 0, True, 1),    # a is diagnosed from 30: inside [20, 40 + 1 logged step], one logged step before 40
    (20, 20, 0, True, -1),   # 30 is the loss label's step + 1 logged step: the latest that is right
    (10, 10, 1, False, -2),  # one logged step after the window: wrong (the window has no tolerance of its own)
    (40, 50, 1, False, 2),   # before the departure from the twins: a blow-up dated while the run was its twin
])
def test_a_global_cause_scores_its_onset_against_the_window_from_departure_to_the_loss(onset, latest, err, ok, lead):
    labels = _labels(sick=True)
    labels["layers"]["a/kernel"] = {"status": "vanishing", "onset": onset, "latest_onset": latest}
    d = zoo.diagnose_steps(LAYERS, STEPS, _records(), diagnose=_fake_diagnose, thresholds=object())
    a = next(o for o in zoo.score_run(labels, d).layer_onsets if o["layer"] == "a/kernel")
    assert (a["err_first_step"], a["onset_ok"], a["lead_over_loss"]) == (err, ok, lead)


def test_episodes_and_doubtful_layers():
    entry = {"status": "exploding", "onset": 30,
             "episodes": [{"status": "exploding", "from": 30}, {"status": "nonfinite", "from": 50}]}
    assert [zoo.expected_status(entry, s) for s in (20, 30, 49, 50, 60)] == [
        "healthy", "exploding", "exploding", "nonfinite", "nonfinite"]
    labels = _labels(sick=True)
    labels["layers"]["c/kernel"]["doubtful"] = True
    d = zoo.diagnose_steps(LAYERS, STEPS, _records(), diagnose=_fake_diagnose, thresholds=object())
    r = zoo.score_run(labels, d)
    assert r.pairs["vanishing"] == {"tp": 4, "fp": 0, "fn": 1} and r.doubtful_pairs == len(STEPS)
    assert zoo.pooled([r])["vanishing"]["precision"] == pytest.approx(1.0)


@pytest.mark.parametrize("factor", [1e-3, 1e-1, 1e2])
def test_scaled_gradients_match_records_of_the_scaled_gradient(factor):
    """The sweep's rescaled records equal ``record.compute`` of the gradient times the factor (weights kept)."""
    rng = np.random.default_rng(3)
    g = rng.standard_normal(64) * np.logspace(-3, 1, 64)
    w = rng.standard_normal(64)
    got = zoo.scaled_gradients(record.compute(g, w)[None, None], factor)[0, 0]
    want = record.compute(g * factor, w)
    np.testing.assert_allclose(got, want, rtol=1e-6, equal_nan=True)  # float32 rounding of g * factor


def test_a_culprit_is_matched_by_its_layer_and_the_exact_variable_is_counted_apart():
    # The label names b/kernel; a diagnosis naming b/bias (the same layer, its largest variable by the product's
    # rule) names the culprit's layer, but not the labelled variable itself; naming c/kernel names neither.
    labels = _labels(sick=True)
    labels["layers"]["b/bias"] = {"status": "healthy", "onset": None, "doubtful": True}
    for named, layer_ok, exact in (("b/bias", True, False), ("c/kernel", False, False), ("b/kernel", True, True)):
        d = zoo.diagnose_steps(LAYERS, STEPS, _records(), diagnose=_fake_diagnose, thresholds=object())
        d.rank1, d.rank1_status, d.first_bad = named, "nonfinite", named
        r = zoo.score_run(labels, d)
        assert (r.rank1_ok, r.first_bad_ok, r.rank1_exact) == (layer_ok, layer_ok, exact), named
        goal = next(g for g in zoo.goals([r]) if g["goal"].startswith("rank #1 is the culprit"))
        assert goal["pass"] is layer_ok
        assert goal["figure"].startswith(f"{int(layer_ok)} of 1 single-culprit runs ({int(exact)} naming")


def _quiet(d):
    """The per-step diagnosis with every layer healthy and no episode (the fake's records are sick)."""
    d.status = [dict.fromkeys(LAYERS, "healthy") for _ in STEPS]
    d.episode_layers, d.episode_starts = [], {}
    return d


@pytest.mark.parametrize(("word", "flagged", "read"), [("missing", True, 0), ("frozen", False, 1)])
def test_missing_is_a_flag_and_frozen_is_not(word, flagged, read):
    """A parameter labelled frozen: diagnosed missing it flags a healthy run (a pair counted as a false missing),
    diagnosed frozen it does not, and counts as read frozen."""
    labels = _labels(sick=False)
    labels["layers"]["a/kernel"] = {"status": "frozen", "onset": None}
    d = _quiet(zoo.diagnose_steps(LAYERS, STEPS, _records(), diagnose=_fake_diagnose, thresholds=object()))
    for row in d.status:
        row["a/kernel"] = word
    r = zoo.score_run(labels, d)
    assert r.flagged_any == (["a/kernel"] if flagged else [])
    assert r.pairs["missing"] == {"tp": 0, "fp": len(STEPS) if flagged else 0, "fn": 0}
    assert (r.frozen, r.frozen_read) == (["a/kernel"], ["a/kernel"][:read])
    goals = {g["goal"]: g for g in zoo.goals([r])}
    assert goals["0 flagged layers on every healthy run (any logged step)"]["pass"] is not flagged
    frozen = goals["every variable labelled frozen reads frozen at the last step"]
    assert frozen["pass"] is bool(read) and frozen["figure"] == f"{read} of 1 frozen variables in 1 runs"


def test_a_run_that_never_recovered_must_read_flagged_at_its_last_step():
    labels = _labels(sick=True)
    labels["recovered"] = False
    d = zoo.diagnose_steps(LAYERS, STEPS, _records(), diagnose=_fake_diagnose, thresholds=object())
    goal = "runs that never recovered read ok at their last step (no layer flagged): 0"
    r = zoo.score_run(labels, d)
    assert r.recovered is False and r.flagged_at_end
    assert next(g for g in zoo.goals([r]) if g["goal"] == goal)["figure"] == "0 of 1 unrecovered runs read ok"
    d.status[-1] = dict.fromkeys(LAYERS, "healthy")  # the episode is over by the diagnosis' reading
    r = zoo.score_run(labels, d)
    g = next(g for g in zoo.goals([r]) if g["goal"] == goal)
    assert not g["pass"] and g["figure"] == "1 of 1 unrecovered runs read ok (tiny)"
    labels["recovered"] = True  # a run that came back may read ok
    assert next(g for g in zoo.goals([zoo.score_run(labels, d)]) if g["goal"] == goal)["pass"]


@pytest.mark.parametrize(("prefix", "inside"), [(20, []), (30, ["a/kernel@30"]), (50, ["a/kernel@30", "b/kernel@50"])])
def test_episodes_inside_a_clean_twins_identical_prefix_are_counted(prefix, inside):
    """The fake's episodes begin at 30 (a), 50 (b) and 60 (c): those at or before the prefix's last step count."""
    labels = _labels(sick=True)
    labels["identical_until"] = prefix
    d = zoo.diagnose_steps(LAYERS, STEPS, _records(), diagnose=_fake_diagnose, thresholds=object())
    assert d.episode_starts == {"a/kernel": [30], "b/kernel": [50], "c/kernel": [60]}
    r = zoo.score_run(labels, d)
    assert r.prefix_episodes == inside
    g = next(g for g in zoo.goals([r]) if g["goal"] == "episodes beginning inside a clean twin's identical prefix: 0")
    assert g["pass"] is not inside
    assert g["figure"].startswith(f"{len(inside)} episodes in {int(bool(inside))} of 1 runs with an identical prefix")


@pytest.mark.parametrize(("name", "layer"), [("dense_1/kernel", "dense_1"), ("fc1.weight", "fc1"),
                                             ("transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_attn"),
                                             ("params/head/kernel", "params/head"), ("bias", "bias")])
def test_a_variables_layer_is_its_name_up_to_the_last_slash_or_dot(name, layer):
    assert zoo.layer_of(name) == layer
