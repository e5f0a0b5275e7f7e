"""The run's answer is one definition: rank 1, first_bad, cause, timeline[0] and the headline name the same layer and
step on every run (docs/API.md, ``summary.answer``), checked over many generated runs and the demo-like runs; the
vanishing cause is the most vanished layer (or the cut); the numbers views print; the profile's step and bands;
``last_finite`` against float64 references of the generated gradients."""

from __future__ import annotations

import json
import math
import threading
import warnings

import numpy as np
import pytest

from tb_gradhealth import _payloads, health, numbers, reader, record
from tb_gradhealth import testing as gl
from tb_gradhealth.health import FLAGS, STATUSES, diagnose_run

pytestmark = pytest.mark.unit


# --- the invariants, on a JSON body -----------------------------------------------------------------------------


def _episode_starts(layers: list[dict], status: str) -> list[tuple[int, str]]:
    return [(e["from"], x["layer"]) for x in layers for e in x["episodes"] if e["status"] == status]


def check_answer(body: dict) -> None:
    """Every invariant of docs/API.md's ``summary.answer``, from the JSON alone."""
    json.dumps(body, allow_nan=False)
    sm, layers = body["summary"], body["layers"]
    answer, timeline = sm["answer"], sm["timeline"]
    assert [x["rank"] for x in layers] == list(range(1, len(layers) + 1))
    assert all(isinstance(x[k], int) and not isinstance(x[k], bool) for x in layers for k in ("nan", "inf", "size"))
    flagged = [x for x in layers if x["status"] in FLAGS]
    if not flagged:
        assert answer is None and sm["first_bad"] is None and sm["cause"] is None and timeline == []
        assert all(e["label"] == "earlier, recovered" for e in sm["earlier"])
        return
    top = layers[0]
    assert answer["layer"] == top["layer"] == sm["first_bad"]["layer"] == timeline[0]["layer"] == sm["cause"]["layer"]
    assert answer["step"] == timeline[0]["step"] == sm["first_bad"]["step"] == sm["cause"]["step"]
    assert answer["index"] == top["index"] and answer["now"] == top["status"] == sm["first_bad"]["status"]
    assert isinstance(answer["step"], int) and answer["flagged"] == len(flagged)
    # rank 1 has the worst status there is; the others follow by severity
    assert STATUSES.index(top["status"]) == min(STATUSES.index(x["status"]) for x in layers)
    assert top["rank_reason"] == "cause" and {x["rank_reason"] for x in layers[1:]} <= {"severity"}
    sev = [x["severity"] for x in layers[1:]]
    assert sev == sorted(sev, reverse=True)
    # the chain is the layer's episodes from the chain's start on, and the headline says it
    chain = answer["chain"]
    assert chain[0]["from"] == answer["step"] and chain[0]["status"] == answer["status"]
    assert chain[-1]["status"] == answer["now"] and answer["now_since"] >= answer["step"]
    assert answer["story"] == " -> ".join(f"{e['status']} from step {e['from']}" for e in chain)
    assert answer["headline"].startswith(f"{answer['layer']}: {answer['status']} since step {answer['step']}")
    if answer["now_since"] != answer["step"]:
        assert answer["headline"].endswith(f" since step {answer['now_since']}")
    assert answer["fixes"] == top["fixes"] == sm["cause"]["fixes"]
    if top["first_step"] is not None:
        assert top["first_step"] == answer["step"] and top["status_since"] == answer["now_since"]
    # the timeline: chronological, labelled, each later entry the first layer to reach its status from the answer on
    steps = [e["step"] for e in timeline]
    assert steps == sorted(steps)
    assert timeline[0]["label"] == "first to go wrong"
    assert len({e["status"] for e in timeline}) == len(timeline)
    for e in timeline[1:]:
        assert e["label"] == f"first layer to reach {e['status']}"
        starts = [s for s in _episode_starts(layers, e["status"]) if s[0] >= answer["step"]]
        assert (e["step"], e["layer"]) in starts and e["step"] == min(s for s, _ in starts)
    for e in [*timeline, *sm["earlier"]]:
        assert e["layers"] == sum(any(p["status"] == e["status"] for p in x["episodes"]) for x in layers) or (
            e is timeline[0] and not top["episodes"])
    for e in sm["earlier"]:
        assert e["step"] < answer["step"] and (e["step"], e["layer"]) in _episode_starts(layers, e["status"])
        assert e["label"] in ("earlier, recovered", f"earlier, lasted past step {answer['step']}")


# --- generated runs -----------------------------------------------------------------------------------------------


def _random_run(seed: int) -> tuple[list[str], np.ndarray, np.ndarray, dict]:
    """A run of 2-6 Dense-like layers (kernel 64 values, bias 8 or 32) over 3-24 logged steps with random episodes:
    a vanishing stretch of the first layers (that may recover), an explosion from some step on, NaN from a later
    step on (partial or whole), a dead layer, absent records. Returns the names, steps, records and the float64
    gradients they were computed from (``{(row, column): values}``)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 7))
    names = [f"layer_{j}/{k}" for j in range(n) for k in ("kernel", "bias")]
    sizes = [64 if i % 2 == 0 else int(rng.choice([8, 32])) for i in range(len(names))]
    s_count = int(rng.integers(3, 25))
    log = np.log10(1e-3) + rng.uniform(-0.3, 0.3, len(names))[None, :] + rng.normal(0, 0.1, (s_count, len(names)))
    if rng.random() < 0.5:  # the first layers vanish (a cut or a decay), maybe only for a while
        k = int(rng.integers(1, len(names)))
        a, b = sorted(rng.integers(0, s_count + 1, 2))
        log[a:b + (s_count if rng.random() < 0.5 else 0), :k] -= rng.uniform(4, 8) + 0.5 * np.arange(k)[::-1]
    if rng.random() < 0.5:  # an explosion, deeper layers larger
        a = int(rng.integers(0, s_count))
        log[a:] += (np.arange(s_count - a)[:, None] + 1) * rng.uniform(0.5, 2.0) * np.linspace(0.5, 1, len(names))
    nan_from = int(rng.integers(1, s_count)) if rng.random() < 0.4 else None
    nan_cols = sorted(rng.choice(len(names), int(rng.integers(1, len(names) + 1)), replace=False))
    dead = int(rng.integers(0, len(names))) if rng.random() < 0.3 else None
    dead_from = int(rng.integers(0, s_count))
    absent = rng.random((s_count, len(names))) < (0.1 if rng.random() < 0.3 else 0.0)
    absent[-1] = False
    records = np.full((s_count, len(names), record.NUM_FIELDS), np.nan)
    grads = {}
    for s in range(s_count):
        for i in range(len(names)):
            if absent[s, i]:
                continue
            g = rng.standard_normal(sizes[i]) * 10.0 ** min(log[s, i], 30.0)
            if dead is not None and i == dead and s >= dead_from:
                g[:] = 0.0
            if nan_from is not None and s >= nan_from and i in nan_cols:
                g[: int(rng.integers(1, sizes[i] + 1))] = np.nan
            grads[(s, i)] = g
            records[s, i] = record.compute(g, rng.standard_normal(sizes[i]) * 0.1, hist_sample=None)
    steps = np.cumsum(rng.integers(1, 4, s_count)) * 10
    return names, steps, records, grads


def _body(names, steps, records, at_step=None, **kw) -> dict:
    return diagnose_run(names, steps, records, at_step=at_step, **kw).to_json()


@pytest.mark.parametrize("seed", range(120))
def test_the_answer_is_one_layer_and_one_step_everywhere(seed):
    names, steps, records, _ = _random_run(seed)
    check_answer(_body(names, steps, records))
    mid = int(steps[len(steps) // 2])  # and at an earlier step
    check_answer(_body(names, steps, records, at_step=mid))


def test_generated_runs_cover_the_cases_the_invariants_are_about():
    """The generator is not vacuous: its runs include every flagged status as the answer, chains of several
    statuses, timelines of several entries and earlier episodes."""
    answers, chains, timelines, earlier = set(), 0, 0, 0
    for seed in range(120):
        names, steps, records, _ = _random_run(seed)
        sm = _body(names, steps, records)["summary"]
        if sm["answer"]:
            answers.add(sm["answer"]["now"])
            chains += len({e["status"] for e in sm["answer"]["chain"]}) > 1
            timelines += len(sm["timeline"]) > 1
        earlier += bool(sm["earlier"])
    assert {"nonfinite", "exploding", "vanishing"} <= answers
    assert chains >= 5 and timelines >= 5 and earlier >= 3


def test_the_demo_like_runs_hold_the_invariants(tmp_path):
    gl.make_demo_logdir(str(tmp_path))
    for series in reader.read_logdir(str(tmp_path)).runs:
        body = _payloads.health_payload(series, health.Thresholds(), None)
        check_answer(body)
        for step in series.steps[:: max(1, series.num_steps // 5)]:
            check_answer(_payloads.health_payload(series, health.Thresholds(), int(step)))


def test_last_finite_is_the_latest_all_finite_record_against_float64():
    checked = 0
    for seed in range(120):
        names, steps, records, grads = _random_run(seed)
        h = diagnose_run(names, steps, records)
        for lh in h.layers:
            rows = [s for s in range(len(steps)) if (s, lh.index) in grads]
            last = grads[(rows[-1], lh.index)]
            if np.isfinite(last).all():
                assert lh.last_finite is None
                continue
            good = [s for s in rows if np.isfinite(grads[(s, lh.index)]).all()]
            if not good:
                assert lh.last_finite is None
                continue
            g = grads[(good[-1], lh.index)]
            lf = lh.last_finite
            assert lf["step"] == int(steps[good[-1]])
            assert lf["norm"] == pytest.approx(float(np.sqrt(np.sum(g * g))), rel=1e-6, abs=1e-300)
            assert lf["max_abs"] == pytest.approx(float(np.max(np.abs(g))), rel=1e-6, abs=1e-300)
            checked += 1
    assert checked >= 10


# --- which layer is the cause ----------------------------------------------------------------------------------


def _stack(log_rms: np.ndarray, steps: int = 12, seed: int = 0) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Records of a Dense stack whose kernel (256 values) and bias (16) have RMS ``10 ** log_rms[layer]`` at every
    step, with 5% noise."""
    rng = np.random.default_rng(seed)
    names = [f"dense_{j}/{k}" for j in range(len(log_rms)) for k in ("kernel", "bias")]
    out = np.empty((steps, len(names), record.NUM_FIELDS))
    for s in range(steps):
        for i in range(len(names)):
            size = 256 if i % 2 == 0 else 16
            g = rng.standard_normal(size) * 10.0 ** log_rms[i // 2] * np.exp(rng.normal(0, 0.05))
            out[s, i] = record.compute(g, rng.standard_normal(size) * 0.1, hist_sample=None)
    return names, np.arange(steps), out


def test_a_smooth_decay_is_blamed_on_its_most_vanished_layer():
    # 10 layers; the gradient falls 0.5 decades per layer toward the input (a sigmoid stack): dense_0 is lowest.
    names, steps, recs = _stack(-2.0 - 0.5 * np.arange(10)[::-1])
    body = _body(names, steps, recs)
    check_answer(body)
    assert body["summary"]["answer"]["layer"] == "dense_0/kernel"
    assert body["summary"]["answer"]["headline"] == "dense_0/kernel: vanishing since step 0"


def test_a_cut_is_blamed_on_the_cut_layer():
    # The gradient is cut to 1e-7 at dense_3: dense_0..3 are as low as each other (a plateau), dense_4.. are not.
    level = np.array([-9.2, -9.0, -9.3, -9.1, -2.4, -2.2, -2.1, -2.0])
    names, steps, recs = _stack(level)
    body = _body(names, steps, recs)
    check_answer(body)
    assert body["summary"]["answer"]["layer"] == "dense_3/kernel"


def test_exploding_then_nonfinite_names_one_layer_with_both_onsets():
    # Every layer grows 10x a step from step 4; at step 9 every layer but the output one is NaN (the output layer's
    # gradient is computed first and stays finite): the deepest NaN layer, dense_4, by its kernel.
    rng = np.random.default_rng(3)
    names = [f"dense_{j}/{k}" for j in range(6) for k in ("kernel", "bias")]
    recs = np.empty((12, len(names), record.NUM_FIELDS))
    for s in range(12):
        for i in range(len(names)):
            size = 128 if i % 2 == 0 else 32
            g = rng.standard_normal(size) * 1e-3 * 10.0 ** max(0, s - 3) * (1 + 0.2 * (i // 2))
            if s >= 9 and i < 10:
                g[:] = np.nan
            recs[s, i] = record.compute(g, rng.standard_normal(size) * 0.1, hist_sample=None)
    h = diagnose_run(names, np.arange(12), recs)
    body = h.to_json()
    check_answer(body)
    a = body["summary"]["answer"]
    assert a["layer"] == "dense_4/kernel" and a["now"] == "nonfinite" and a["now_since"] == 9
    assert a["status"] == "exploding" and a["step"] < 9
    assert a["headline"] == f"dense_4/kernel: exploding since step {a['step']}, nonfinite since step 9"
    nonfinite = next(e for e in body["summary"]["timeline"] if e["status"] == "nonfinite")
    assert nonfinite == {"status": "nonfinite", "step": 9, "layer": "dense_4/kernel", "layers": 10,
                         "label": "first layer to reach nonfinite"}
    others = [x for x in h.layers[1:] if x.status == "nonfinite"]
    assert all(any("first layer to reach nonfinite was dense_4/kernel, at step 9" in r for r in x.reasons)
               for x in others)
    assert not any("first nonfinite layer" in r for x in h.layers for r in x.reasons)
    top = h.layers[0]
    assert any("(nonfinite since step 9)" in r for r in top.reasons)
    assert any(r.startswith(f"trouble since step {a['step']} (exploding from step {a['step']}") for r in top.reasons)
    # Its values before the NaN, where the row's own are null: the float64 RMS of step 8's kernel gradient.
    assert top.to_json()["rms"] is None and top.last_finite["step"] == 8


def test_earlier_recovered_episodes_are_apart_from_the_timeline():
    # dense_0 vanishes at steps 0-5 and recovers; from step 12 every layer explodes.
    rng = np.random.default_rng(5)
    names = [f"dense_{j}/kernel" for j in range(5)]
    recs = np.empty((20, 5, record.NUM_FIELDS))
    for s in range(20):
        for i in range(5):
            scale = 1e-3 * (1e-6 if (i == 0 and s < 6) else 1.0) * 10.0 ** max(0, s - 11)
            recs[s, i] = record.compute(rng.standard_normal(256) * scale, rng.standard_normal(256), hist_sample=None)
    body = _body(names, np.arange(20), recs)
    check_answer(body)
    sm = body["summary"]
    assert sm["answer"]["status"] == "exploding" and sm["answer"]["step"] >= 11
    assert [(e["status"], e["layer"], e["label"]) for e in sm["earlier"]] == [
        ("vanishing", "dense_0/kernel", "earlier, recovered")]
    assert sm["onset"]["step"] == sm["earlier"][0]["step"] == 0


# --- numbers ---------------------------------------------------------------------------------------------------


def test_numbers_print_counts_exactly_severities_rounded_magnitudes_to_three_figures():
    assert numbers.format_count(1024) == "1,024" and numbers.format_count(1_000_001) == "1,000,001"
    assert numbers.format_count(0) == "0" and numbers.format_count(np.int64(65536)) == "65,536"
    assert numbers.format_severity(6052.0) == "6,052" and numbers.format_severity(4449.6) == "4,450"
    assert numbers.format_magnitude(1.2345e-5) == "1.23e-05" and numbers.format_magnitude(456.7) == "457"
    assert numbers.format_magnitude(0.012345) == "0.0123"
    for missing in (None, math.nan, math.inf):
        assert numbers.format_count(missing) == numbers.format_magnitude(missing) == "-"


# --- the depth profile --------------------------------------------------------------------------------------------


def _series(tmp_path, names, steps, recs):
    gl.write_records(str(tmp_path / "run"), names, [int(s) for s in steps], recs)
    return reader.read_logdir(str(tmp_path)).runs[0]


def test_profile_opens_on_the_last_step_where_every_layer_is_finite(tmp_path):
    names, steps, recs = _stack(np.full(4, -3.0), steps=10)
    recs[7:, 2:] = record.compute(np.full(256, np.nan), hist_sample=None)[None, None]  # NaN from step 7 on
    recs[9, 0] = record.compute(np.full(256, np.nan), hist_sample=None)
    series = _series(tmp_path, names, steps, recs)
    p = _payloads.profile_payload(series, health.Thresholds(), None)
    assert p["step"] == 6 and all(x["rms"] is not None for x in p["layers"])


def test_profile_falls_back_to_the_step_with_the_most_finite_layers(tmp_path):
    names, steps, recs = _stack(np.full(3, -3.0), steps=6)
    nan = record.compute(np.full(256, np.nan), hist_sample=None)
    recs[:, 0] = nan  # never finite
    recs[4:, 1] = nan
    series = _series(tmp_path, names, steps, recs)
    p = _payloads.profile_payload(series, health.Thresholds(), None)
    assert p["step"] == 3 and sum(x["rms"] is not None for x in p["layers"]) == len(names) - 1


@pytest.mark.parametrize("ref", [1e22, 1e30, 1e-30])
def test_profile_bands_never_cross(ref):
    # The reference (the layers nearest the loss) far beyond the absolute lines: the relative vanishing line would
    # sit above the absolute exploding one.
    names, _, recs = _stack(np.full(5, math.log10(ref)), steps=1)
    bands = health.profile(names, recs[0])["bands"]
    assert bands["vanishing_below"] is not None and bands["exploding_above"] is not None
    assert bands["vanishing_below"] < bands["exploding_above"]


def test_profile_bands_without_a_finite_reference():
    names, _, recs = _stack(np.full(3, -3.0), steps=1)
    recs[0, :] = record.compute(np.full(256, np.nan), hist_sample=None)
    bands = health.profile(names, recs[0])["bands"]
    t = health.Thresholds()
    assert (bands["vanishing_below"], bands["exploding_above"]) == (t.vanish_rms_below, t.explode_rms_above)


# --- no warning reaches the terminal -------------------------------------------------------------------------------


def test_concurrent_diagnoses_of_nan_runs_raise_no_warning(tmp_path):
    """The plugin's server answers requests on threads; Python's warning filters are process-wide, so nothing in
    the diagnosis may rely on silencing them. All-NaN steps and layers, served from 8 threads at once."""
    names, steps, recs = _stack(np.full(4, -3.0), steps=12)
    nan = record.compute(np.full(256, np.nan), hist_sample=None)
    recs[6:, :] = nan
    recs[:, 1] = nan
    series = _series(tmp_path, names, steps, recs)
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            for step in (None, 3, 8, 11):
                _payloads.health_payload(series, health.Thresholds(), step)
                _payloads.profile_payload(series, health.Thresholds(), step)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=serve) for _ in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert not errors, errors
    assert [str(w.message) for w in caught] == []
