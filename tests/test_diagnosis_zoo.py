"""The diagnosis zoo's scorer: its metric arithmetic on a tiny labelled run, against hand-computed figures.

The run is built from numpy records (``record.compute``); the diagnosis is a stand-in with a rule simple enough to
work out by hand (NaN -> nonfinite, RMS < 1e-6 -> vanishing), so the test checks the scorer, not the diagnosis.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from tensorboard.compat.proto import event_pb2

from tb_gradhealth import cli, health, origin, progress, reader, record, testing, writer

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
    answer: dict | None = None


_SEVERITY = {"nonfinite": 0, "vanishing": 1, "healthy": 2}


def _series(steps=STEPS, records=None) -> reader.RunSeries:
    return reader.RunSeries(run=".", layers=tuple(LAYERS), steps=np.asarray(steps),
                            records=_records()[: len(steps)] if records is None else records)


def _fake_diagnose(series, thresholds, at_step, progress):
    """NaN -> nonfinite, RMS < 1e-6 -> vanishing; first_step = start of the trailing run of that status."""
    layers, steps = series.layers, series.steps
    end = int(np.searchsorted(steps, at_step, side="right"))
    d = record.derived(series.records[:end])
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
    d = zoo.diagnose_steps(_series(), diagnose=_fake_diagnose, thresholds=object())
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
    d = zoo.diagnose_steps(_series(), diagnose=_fake_diagnose, thresholds=object())
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
    d = zoo.diagnose_steps(_series(), diagnose=_fake_diagnose, thresholds=object())
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
    d = zoo.diagnose_steps(_series(STEPS[:4]), diagnose=_fake_diagnose, thresholds=object())
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
    d = zoo.diagnose_steps(_series(), diagnose=_fake_diagnose, thresholds=object())
    a = next(o for o in zoo.score_run(labels, d).layer_onsets if o["layer"] == "a/kernel")
    assert (a["err_first_step"], a["onset_ok"], a["lead_over_loss"]) == (err, ok, lead)


def test_episodes_and_doubtful_layers():
    entry = {"status": "exploding", "onset": 30,
             "episodes": [{"status": "exploding", "from": 30}, {"status": "nonfinite", "from": 50}]}
    assert [zoo.expected_status(entry, s) for s in (20, 30, 49, 50, 60)] == [
        "healthy", "exploding", "exploding", "nonfinite", "nonfinite"]
    labels = _labels(sick=True)
    labels["layers"]["c/kernel"]["doubtful"] = True
    d = zoo.diagnose_steps(_series(), diagnose=_fake_diagnose, thresholds=object())
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
        d = zoo.diagnose_steps(_series(), diagnose=_fake_diagnose, thresholds=object())
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
    d = _quiet(zoo.diagnose_steps(_series(), diagnose=_fake_diagnose, thresholds=object()))
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
    d = zoo.diagnose_steps(_series(), diagnose=_fake_diagnose, thresholds=object())
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
    d = zoo.diagnose_steps(_series(), diagnose=_fake_diagnose, thresholds=object())
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


# --- the report's evidence, the live feed and a stable cause ------------------------------------------------------

_REAL = ["a/kernel", "b/kernel", "c/kernel"]
_NAN_FROM = 9


def _written_run(logdir, *, block: bool = False) -> None:
    """A run written by the numpy ``Writer``: 12 logged steps, NaN in every layer from step 9 (made on the way
    forward in layer ``b``, as a replay stored beside it says), the loss and the skip flag at every step. ``block``:
    each 4 steps' records written after their losses, as a writer that reads its records back in blocks does."""
    rng = np.random.default_rng(0)
    w = writer.Writer(str(logdir), seed=0)
    grads = {}
    for s in range(1, 13):
        grads[s] = {n: rng.standard_normal(64) for n in _REAL}
        if s >= _NAN_FROM:
            for g in grads[s].values():
                g[:5] = np.nan
    t = 1000.0
    for first in range(1, 13, 4):
        block_steps = range(first, first + 4)
        for s in block_steps:
            w.add_loss(s, 2.0 / s if s < _NAN_FROM else float("nan"), wall_time=(t := t + 1))
            w.add_scalars(s, {progress.SKIPPED_TAG: float(s == 3)}, wall_time=(t := t + 1))
            if not block:
                w.add_gradients(s, grads[s], wall_time=(t := t + 1))
        if block:
            for s in block_steps:
                w.add_gradients(s, grads[s], wall_time=(t := t + 1))
    w.close()
    origin.write(str(logdir), origin.NanOrigin(step=_NAN_FROM, found=True, framework="numpy", op="Log", layer="b",
                                               direction="forward"))


def _read(logdir):
    (series,) = reader.read_logdir(str(logdir)).runs
    return series


def test_the_scorer_reads_what_the_report_reads_and_diagnoses_each_step_as_report_step_does(tmp_path, capsys):
    _written_run(tmp_path)
    series = _read(tmp_path)
    found = zoo.evidence(tmp_path, series)
    # the evidence is what was written: the loss, the skip flags and the stored origin
    ls, lv = found.progress.loss
    assert ls.tolist() == list(range(1, 13))
    np.testing.assert_allclose(lv[: _NAN_FROM - 1], [2.0 / s for s in range(1, _NAN_FROM)], rtol=1e-6)
    assert np.isnan(lv[_NAN_FROM - 1:]).all()
    assert found.progress.skipped[1].tolist() == [float(s == 3) for s in range(1, 13)]
    assert found.progress.origin == (_NAN_FROM, "b") and found.origin.layer == "b"
    blind = zoo.evidence(tmp_path, series, loss=False).progress  # --gradients-only: the loss alone is left out
    assert blind.loss is None and blind.origin == found.progress.origin
    np.testing.assert_array_equal(blind.skipped, found.progress.skipped)

    seen = {}
    d = zoo.diagnose_steps(series, progress=found.progress, each=lambda s, h: seen.setdefault(s, h))
    assert sorted(seen) == d.steps == list(range(1, 13))
    for s in d.steps:
        assert cli.main(["report", str(tmp_path), "--step", str(s), "--json", "--fail-on", "none"]) == 0
        (body,) = json.loads(capsys.readouterr().out)["runs"]
        mine = seen[s].to_json()
        assert mine["summary"]["answer"] == body["summary"]["answer"], s
        assert [(x["layer"], x["status"], x["episodes"]) for x in mine["layers"]] == [
            (x["layer"], x["status"], x["episodes"]) for x in body["layers"]], s
        assert d.status[d.steps.index(s)] == {x["layer"]: x["status"] for x in body["layers"]}
        assert d.answers[d.steps.index(s)] == body["summary"]["answer"]
    # the origin is evidence here: the answer names the layer the replay found, not the deepest NaN layer
    assert d.answers[-1]["layer"] == "b/kernel"
    unsaid = zoo.diagnose_steps(series, progress=found.progress._replace(origin=None))
    assert unsaid.answers[-1]["layer"] != "b/kernel"


def _event(step, tag=None, wall=0.0):
    e = event_pb2.Event(step=step, wall_time=wall)
    if tag is not None:
        e.summary.value.add(tag=tag, simple_value=1.0)
    return e


def test_events_are_fed_in_the_order_written_across_files_and_the_loss_can_be_left_out(tmp_path):
    first, second = tmp_path / "events.out.tfevents.1.a", tmp_path / "events.out.tfevents.2.b"
    write = (lambda path, events: testing.write_events(str(path), [e.SerializeToString() for e in events],
                                                       with_version=False))
    write(first, [_event(0, wall=0.0), _event(1, "loss", 1.0), _event(2, "loss", 3.0), _event(3, "x", 5.0)])
    write(second, [_event(0, wall=0.5), _event(1, "rec", 2.0), _event(3, "loss", 5.0), _event(2, "rec", 4.0)])
    got = zoo.written_order([str(first), str(second)])
    # by wall time; the tie at 5.0 goes to the first file; within a file by position
    assert [(e.step, [v.tag for v in e.summary.value]) for e in got] == [
        (0, []), (0, []), (1, ["loss"]), (1, ["rec"]), (2, ["loss"]), (2, ["rec"]), (3, ["x"]), (3, ["loss"])]
    dropped = zoo.written_order([str(first), str(second)], drop=("loss",))
    assert [[v.tag for v in e.summary.value] for e in dropped] == [[], [], [], ["rec"], [], ["rec"], ["x"], []]


def _block_events():
    """A header, the losses of steps 1-3, then their records (a block), step 4's loss and record, and the header of
    a file opened late (no summary: no part of any step)."""
    return [_event(0), _event(1, "loss"), _event(2, "loss"), _event(3, "loss"), _event(1, "rec"), _event(2, "rec"),
            _event(3, "rec"), _event(4, "loss"), _event(4, "rec"), _event(0)]


def test_a_step_is_checked_once_every_event_of_it_or_before_is_in():
    # step 1 is complete after its record (the 5th event), 2 after the 6th, 3 after the 7th, 4 after the 9th
    assert zoo.check_points(_block_events(), [1, 2, 3, 4]).tolist() == [5, 6, 7, 9]
    assert zoo.check_points(_block_events(), [2, 4]).tolist() == [6, 9]
    assert zoo.check_points([], [1]).tolist() == [0]


class _FakeLive:
    """A live run that answers with how many events it was fed and keeps the origin it was handed."""

    def __init__(self):
        self.fed, self.origins = [], {}

    def add_event(self, event):
        self.fed.append(event)

    def diagnose(self, thresholds, step, origin):
        self.origins[step] = origin
        return _RH([], None, {"headline": f"{len(self.fed)} events"})


def test_the_live_feed_is_diagnosed_at_each_check_point_and_a_differing_step_is_counted():
    found = origin.NanOrigin(step=3, found=True, layer="b")
    feed = zoo.LiveReplay(_block_events(), [1, 2, 3, 4], thresholds=object(), origin=found, make_live=_FakeLive)
    for step, n in ((1, 5), (2, 6), (3, 7), (4, 8)):  # step 4 after 9 events: the replay's 8 is a mismatch
        feed(step, _RH([], None, {"headline": f"{n} events"}))
    assert feed.checked == 4 and len(feed.live.fed) == 9
    assert feed.mismatches == [(4, "answer: replay '8 events', live '9 events'")]
    # steps 1 and 2 were checked with step 3's loss (and 2's) already in
    assert feed.ahead == 2
    # the origin is handed over from its step on, as a writer that found it then
    assert feed.live.origins == {1: None, 2: None, 3: found, 4: found}


def _health(answer=None, layers=()):
    return _RH([_LH(name, status, None, list(eps)) for name, status, eps in layers], None, answer)


_EP = [{"status": "exploding", "from": 3, "to": 5, "peak": math.nan}]


@pytest.mark.parametrize(("live", "what"), [
    (_health({"headline": "a: exploding since step 3", "fixes": ["x"]}, [("a", "exploding", _EP)]), None),
    (_health(None, [("a", "exploding", _EP)]), "answer: replay 'a: exploding since step 3', live None"),
    (_health({"headline": "a: exploding since step 3", "fixes": ["y"]}, [("a", "exploding", _EP)]),
     "answer 'a: exploding since step 3': fixes differ"),
    (_health({"headline": "a: exploding since step 3", "fixes": ["x"]}, [("a", "nonfinite", _EP)]),
     "a: replay exploding, live nonfinite"),
    (_health({"headline": "a: exploding since step 3", "fixes": ["x"]},
             [("a", "exploding", [{**_EP[0], "from": 4}])]),
     "a: episodes replay exploding 3..5, live exploding 4..5"),
    (_health({"headline": "a: exploding since step 3", "fixes": ["x"]}, []), "a: not in the live diagnosis"),
    (_health({"headline": "a: exploding since step 3", "fixes": ["x"]},
             [("a", "exploding", _EP), ("b", "healthy", [])]), "b: only in the live diagnosis"),
])
def test_difference_names_what_differs_between_two_diagnoses_of_a_step(live, what):
    replay = _health({"headline": "a: exploding since step 3", "fixes": ["x"]}, [("a", "exploding", _EP)])
    assert zoo.difference(replay, live) == what  # NaN in an episode equals NaN


def test_a_real_live_run_agrees_with_the_replay_and_a_changed_replay_is_caught(tmp_path):
    _written_run(tmp_path, block=True)
    series = _read(tmp_path)
    found = zoo.evidence(tmp_path, series)
    thresholds = health.Thresholds()
    feed = zoo.LiveReplay(zoo.written_order(found.paths), series.steps, thresholds=thresholds, origin=found.origin)
    zoo.diagnose_steps(series, progress=found.progress, thresholds=thresholds, each=feed)
    assert (feed.checked, feed.mismatches) == (12, [])
    assert feed.ahead == 9  # steps 1-3 of each block of 4 were checked with the block's later losses in
    # the replay of other records (layer a's gradient 1e6 times larger from step 5) is not what the live run says
    records = series.records.copy()
    for name in ("min", "max", "mean"):
        records[4:, 0, record.INDEX[name]] *= 1e6
    changed = zoo.scaled_gradients(series.records[4:, :1], 1e6)
    records[4:, :1] = changed
    other = reader.RunSeries(run=series.run, layers=series.layers, steps=series.steps, records=records)
    feed = zoo.LiveReplay(zoo.written_order(found.paths), series.steps, thresholds=thresholds, origin=found.origin)
    zoo.diagnose_steps(other, progress=found.progress, thresholds=thresholds, each=feed)
    assert feed.checked == 12 and feed.mismatches and feed.mismatches[0][0] == 5


def _answer(layer, start, *chain):
    return {"layer": layer, "step": start, "chain": [{"status": st} for st in chain],
            "headline": f"{layer}: {chain[0]} since step {start}"}


@pytest.mark.parametrize(("now", "violation"), [
    (_answer("a", 30, "exploding", "nonfinite"), False),   # the same chain, its status moved along it
    (_answer("a", 30, "exploding"), False),                # the same chain
    (_answer("b", 20, "vanishing"), False),                # a chain that began earlier (though less severe)
    (_answer("b", 40, "nonfinite"), False),                # a more severe chain (though later)
    (_answer("b", 40, "vanishing", "nonfinite"), False),   # its worst status is more severe
    (None, False),                                         # recovered
    (_answer("b", 30, "dead"), True),                      # less severe, not earlier
    (_answer("a", 36, "exploding"), True),                 # the same worst status, begun later
    (_answer("b", 30, "exploding"), True),                 # the same worst status and start, another layer
])
def test_a_cause_may_only_give_way_to_the_same_chain_an_earlier_one_or_a_worse_one(now, violation):
    before = _answer("a", 30, "exploding")
    got = zoo.cause_violations([10, 11], [before, now])
    assert got == ([(11, f"a: exploding since step 30 -> {now['headline']}")] if violation else [])


def test_after_a_recovery_a_new_story_begins_and_violations_are_scored_per_step():
    x30, x50 = _answer("a", 30, "exploding"), _answer("a", 50, "exploding")
    assert zoo.cause_violations([1, 2, 3], [x30, None, x50]) == []
    answers = [None, x30, x50, x30, _answer("b", 30, "dead")]
    assert zoo.cause_violations([1, 2, 3, 4, 5], answers) == [
        (3, "a: exploding since step 30 -> a: exploding since step 50"),
        (5, "a: exploding since step 30 -> b: dead since step 30")]
    d = zoo.diagnose_steps(_series(), diagnose=_fake_diagnose, thresholds=object())
    d.answers = [None, x30, x50, x30, None, None]
    r = zoo.score_run(_labels(sick=True), d)
    assert r.cause_violations == [(30, "a: exploding since step 30 -> a: exploding since step 50")]
    goal = next(g for g in zoo.goals([r]) if g["goal"].startswith("a stable cause"))
    assert not goal["pass"] and goal["figure"] == "1 violating (run, logged step) pairs in 1 of 1 runs (tiny: 1)"
    assert "tiny  30    a: exploding since step 30 -> a: exploding since step 50" in zoo.report([r])


def test_the_live_goal_counts_differing_steps_and_the_report_prints_each_runs_first():
    d = zoo.diagnose_steps(_series(), diagnose=_fake_diagnose, thresholds=object())
    r = zoo.score_run(_labels(sick=True), d)
    assert not any(g["goal"].startswith("live answer") for g in zoo.goals([r]))  # not fed: not measured
    r.live_checked, r.live_ahead = 6, 2
    r.live_mismatches = [(40, "a/kernel: replay vanishing, live healthy"), (50, "b/kernel: replay nonfinite, live "
                                                                                "healthy")]
    goal = next(g for g in zoo.goals([r]) if g["goal"].startswith("live answer"))
    assert not goal["pass"] and goal["figure"] == "2 of 6 (run, logged step) pairs differ, in 1 of 1 runs (tiny: 2)"
    text = zoo.report([r])
    assert "step 40: a/kernel: replay vanishing, live healthy" in text and "step 50" not in text
    r.live_mismatches = []
    assert next(g for g in zoo.goals([r]) if g["goal"].startswith("live answer"))["pass"]


def test_a_cause_named_by_another_variable_of_its_layer_is_the_same_chain():
    def answer(layer: str, step: int) -> dict:
        return {"layer": layer, "step": step, "status": "exploding", "now": "exploding", "headline": layer,
                "chain": [{"status": "exploding", "from": step, "to": step + 1}]}

    same = [answer("rnn/cell/bias", 2), answer("rnn/cell/recurrent_kernel", 2)]
    assert zoo.cause_violations([1, 2], same) == []
    other = [answer("rnn/cell/bias", 2), answer("out/kernel", 2)]
    assert zoo.cause_violations([1, 2], other) == [(2, "rnn/cell/bias -> out/kernel")]
