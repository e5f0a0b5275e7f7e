"""The layers' outputs as evidence of the diagnosis: a ReLU layer most of whose units are dead is ``dead`` while its
gradient is not zero, a saturating layer's vanishing reason quotes its saturated fraction, a forward blow-up is named
as the cause of the exploding layers after it; the CLI's text and JSON and the tab's health route carry each layer's
output fields. Every network is a numpy MLP trained by hand (:mod:`tests.mlp_numpy`) and written with the numpy
``Writer``; what it was built with (a bias shift that kills units, one that saturates tanh, an init scale that grows
the activations) is measured on its outputs with numpy, and a healthy twin built without it must stay clean and read
exactly as it reads without output records."""

from __future__ import annotations

import contextlib
import io
import json
import re

import numpy as np
import pytest

from tb_gradhealth import _payloads, cli, health, progress, reader, record
from tb_gradhealth.health.forward import Forward, blowup_at
from tb_gradhealth.health.thresholds import Thresholds
from tests.mlp_numpy import train

pytestmark = pytest.mark.unit
STEPS = 12
RELU = {"widths": [16, 32, 32, 32], "act": "relu"}
#: dense_2's first 22 of 32 biases shifted far below its inputs' range: those units are 0 for every input.
DEAD = {**RELU, "shift": {2: (22, -100.0)}}
#: Every tanh layer's biases shifted to +3: most outputs sit near +1, where tanh' is near 0.
SATURATED = {"widths": [16] + [32] * 6, "act": "tanh", "shift": {k: (32, 3.0) for k in range(1, 7)}}
#: Each ReLU layer's weights at 10x He scale: every layer multiplies the activations' RMS by about 10.
BLOWUP = {"widths": [16] + [32] * 6, "act": "relu", "scale": 10.0, "lr": 0.0}
#: Under Adam, which keeps every layer's update at pace whatever its gradient: the tanh stack saturated as above, and
#: a 10-layer sigmoid stack with every bias at +5, beside twins without the shift.
ADAM = {"adam": True, "lr": 1e-3}
SIGMOID = {"widths": [16] + [32] * 10, "act": "sigmoid", **ADAM}
ADAM_RUNS = {"saturated_adam": {**SATURATED, **ADAM}, "tanh_adam_twin": {**SATURATED, "shift": None, **ADAM},
             "sigmoid_adam": {**SIGMOID, "shift": {k: (32, 5.0) for k in range(1, 11)}}, "sigmoid_adam_twin": SIGMOID}
#: A variable whose gradient is this many decades or more below its healthy twin's is vanishing (the zoo's twin
#: rule): the label, measured on the twins, never from the diagnosis' own lines.
TWIN_DECADES = 4.0


def _report(logdir, *flags) -> dict:
    """The run's body in ``tb-gradhealth report --json``."""
    out = _capture(logdir, "--json", *flags)
    (body,) = json.loads(out)["runs"]
    return body


def _capture(logdir, *flags) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        cli.main(["report", str(logdir), *flags])
    return buf.getvalue()


def _layers(body: dict) -> dict[str, dict]:
    return {x["layer"]: x for x in body["layers"]}


def _dead_fraction(h: np.ndarray) -> float:
    """Units (columns) exactly zero for every input (row) of the batch: the label, measured."""
    return float(np.mean(~np.any(h.astype(np.float32) != 0, axis=0)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("outputs")
    made = {}
    for name, kw in (("dead", DEAD), ("twin", RELU), ("saturated", SATURATED), ("blowup", BLOWUP),
                     ("blowup_twin", {**BLOWUP, "scale": 1.0}), *ADAM_RUNS.items()):
        made[name] = (root / name, train(str(root / name), steps=STEPS, **kw))
        train(str(root / f"{name}_plain"), steps=STEPS, record_outputs=False, **kw)
    return made


def test_dead_relu_units_make_a_layer_dead_while_its_gradient_flows(runs):
    logdir, run = runs["dead"]
    fractions = [_dead_fraction(out["dense_2"]) for out in run.outputs]
    assert min(fractions) >= 0.5  # the construction did what it says
    assert all(np.any(g["dense_2/kernel"] != 0) for g in run.grads)  # the units left pass a gradient
    by = _layers(_report(logdir))
    for name in ("dense_2/kernel", "dense_2/bias"):
        x = by[name]
        assert x["status"] == "dead" and x["first_step"] == 0
        assert (f"{fractions[-1]:.0%} of its relu units output 0 for every input of the batch for the last {STEPS} "
                f"logged steps (dead since step 0)") in x["reasons"][0]
        assert "LeakyReLU" in x["fixes"][0]
        assert x["forward"]["output"] == "dense_2" and x["forward"]["dead_fraction"] == pytest.approx(fractions[-1])
    # the other layers' units live: they are not dead
    assert all(x["status"] != "dead" for n, x in by.items() if not n.startswith("dense_2/"))


def test_dead_units_need_their_line_and_sustain_steps(runs):
    logdir, run = runs["dead"]
    fraction = _dead_fraction(run.outputs[-1]["dense_2"])
    above = _layers(_report(logdir, "--dead-units", f"{min(1.0, fraction + 0.05):.2f}"))
    assert above["dense_2/kernel"]["status"] == "healthy"
    longer = _layers(_report(logdir, "--sustain-steps", str(STEPS + 1)))
    x = longer["dense_2/kernel"]
    assert x["status"] == "healthy"
    assert any(f"{fraction:.0%} of its units dead for every input of the batch at the last {STEPS} logged step(s)"
               in r for r in x["reasons"])


@pytest.mark.parametrize("twin", ["twin", "blowup_twin", "tanh_adam_twin", "sigmoid_adam_twin"])
def test_a_healthy_twin_reads_as_without_its_outputs(runs, twin):
    logdir, run = runs[twin]
    assert max(_dead_fraction(h) for out in run.outputs for h in out.values()) < 0.5
    with_outputs, without = _report(logdir), _report(logdir.parent / f"{twin}_plain")
    assert with_outputs["summary"]["counts"]["healthy"] == len(with_outputs["layers"])
    for body in (with_outputs, without):
        for x in body["layers"]:
            x.pop("forward", None)
        body.pop("forward_profile", None)
        body.pop("run")
    assert with_outputs == without


def test_a_saturating_layer_vanishing_quotes_its_saturated_fraction(runs):
    logdir, run = runs["saturated"]
    by = _layers(_report(logdir))
    vanishing = [n for n, x in by.items() if x["status"] == "vanishing"]
    assert vanishing
    lo, hi = record.saturation_edges((-1.0, 1.0))
    for name in vanishing:
        layer = name.split("/")[0]
        h = run.outputs[-1][layer].astype(np.float32)
        measured = float(np.mean((h <= lo) | (h >= hi)))
        assert measured >= 0.5
        assert any(f"forward: {measured:.0%} of its tanh outputs ({layer}) within 1% of their range from a bound at "
                   f"step {STEPS - 1}" in r for r in by[name]["reasons"]), by[name]["reasons"]
        assert by[name]["forward"]["saturated_fraction"] == pytest.approx(measured)


@pytest.mark.parametrize("sick, twin, act", [("saturated_adam", "tanh_adam_twin", "tanh"),
                                             ("sigmoid_adam", "sigmoid_adam_twin", "sigmoid")])
def test_saturated_units_make_a_layer_vanishing_under_adam(runs, sick, twin, act):
    """Adam keeps a saturated layer's updates at pace, so its records alone read healthy; its outputs show why its
    gradient is decades below its twin's, and make it vanishing."""
    (logdir, run), (_, healthy) = runs[sick], runs[twin]
    by, plain = _layers(_report(logdir)), _layers(_report(logdir.parent / f"{sick}_plain"))
    far = [v for v in run.grads[-1] if v.startswith("dense_") and np.log10(
        np.sqrt(np.mean(healthy.grads[-1][v] ** 2)) / np.sqrt(np.mean(run.grads[-1][v] ** 2))) >= TWIN_DECADES]
    assert len(far) >= 4
    assert [v for v in far if plain[v]["status"] == "healthy"]  # what only the outputs tell
    for v in far:
        assert by[v]["status"] == "vanishing", (v, by[v]["reasons"])
        assert any(f"of its {act} outputs ({v.split('/')[0]}) within 1% of their range" in r
                   for r in by[v]["reasons"]), by[v]["reasons"]


def test_a_forward_blowup_is_the_cause_of_the_exploding_layers_after_it(runs):
    logdir, run = runs["blowup"]

    def output_rms(step: int) -> dict[str, float]:
        return {k: float(np.sqrt(np.mean(v.astype(np.float32).astype(np.float64) ** 2)))
                for k, v in run.outputs[step].items()}

    rms = output_rms(0)
    assert rms["dense_6"] / rms["dense_1"] >= 100 and list(rms.values())[:6] == sorted(list(rms.values())[:6])
    by = _layers(_report(logdir))
    exploding = [n for n, x in by.items() if x["status"] == "exploding"]
    after = [n for n in exploding if not n.startswith("dense_1/")]
    assert after
    for name in after:
        found = [r for r in by[name]["reasons"] if r.startswith("cause: the activations blow up")]
        assert len(found) == 1, by[name]["reasons"]
        m = re.search(r"output RMS (\S+) at dense_1 -> (\S+) at (\S+) \(([\d,]+)x over (\d+) layers\) at step (\d+)",
                      found[0])
        assert m and m.group(3) == "dense_6" and int(m.group(5)) == 6
        at = int(m.group(6))  # quoted where the layer's trouble began
        assert at == by[name]["first_step"]
        rms = output_rms(at)
        assert float(m.group(4).replace(",", "")) == pytest.approx(rms["dense_6"] / rms["dense_1"], rel=1e-3)
        assert by[name]["fixes"][0].startswith("the activations grow on their way forward")
    # Where the climb starts the inputs are the data, yet the gradient is as far above the twin's as the layers'
    # after it (measured): the backward pass crosses the same too-large weights.
    healthy = runs["blowup_twin"][1]

    def above_twin(v: str) -> float:
        return float(np.log10(np.sqrt(np.mean(run.grads[0][v] ** 2)) / np.sqrt(np.mean(healthy.grads[0][v] ** 2))))

    assert above_twin("dense_1/kernel") >= min(above_twin(f"dense_{k}/kernel") for k in range(2, 7)) - 0.5
    first = [n for n in exploding if n.startswith("dense_1/")]
    assert first
    for name in first:
        found = [r for r in by[name]["reasons"] if r.startswith("cause: the activations blow up")]
        assert len(found) == 1 and found[0].endswith("the layers after it multiply its gradient on the way back as "
                                                     "they multiply the activations on the way forward"), found
    twin = _report(runs["blowup_twin"][0])
    assert not any("blow up on their way forward" in r for x in twin["layers"] for r in x["reasons"])


def test_a_climb_must_not_fall_a_decade_below_its_height():
    def forward(scales):
        rng = np.random.default_rng(1)
        recs = np.stack([record.compute_activations(rng.standard_normal((32, 8)) * s) for s in scales])[None]
        return Forward(tuple(f"l{k}" for k in range(len(scales))), np.array([0]), recs)

    rows = [0, 1, 2, 3]
    climb = blowup_at(forward([1.0, 8.0, 3.0, 300.0]), 0, rows, 100.0)
    assert climb is not None and (climb.first, climb.peak, climb.layers) == (0, 3, 4)
    assert blowup_at(forward([1.0, 0.05, 3.0, 300.0]), 0, rows, 100.0) is None  # two unrelated scales
    assert blowup_at(forward([1.0, 3.0, 9.0, 27.0]), 0, rows, 100.0) is None  # x27: below the line


def test_the_text_report_prints_a_forward_depth_line_for_flagged_layers(runs):
    logdir, run = runs["dead"]
    text = _capture(logdir)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("forward RMS at step")]
    fraction = _dead_fraction(run.outputs[-1]["dense_2"])
    assert len(lines) == 2  # dense_2's two variables, the only flagged ones
    assert "> [dense_2 " in lines[0] and f"({fraction:.0%} dead)]" in lines[0]
    assert lines[0].startswith(f"forward RMS at step {STEPS - 1}: dense_1 ")
    assert "forward RMS" not in _capture(runs["twin"][0])


def test_the_health_json_carries_each_layers_latest_output_fields(runs):
    logdir, run = runs["dead"]
    data = reader.read_logdir(str(logdir))
    (series,) = data.runs
    body = _payloads.health_payload(series, Thresholds(), None)
    last = run.outputs[-1]
    profile = body["forward_profile"]
    assert profile["step"] == STEPS - 1 and [o["output"] for o in profile["outputs"]] == list(last)
    for o in profile["outputs"]:
        h = last[o["output"]].astype(np.float32).astype(np.float64)
        assert o["rms"] == pytest.approx(float(np.sqrt(np.mean(h ** 2))), rel=1e-6)
        assert o["dead_fraction"] == pytest.approx(_dead_fraction(last[o["output"]]))
        assert o["saturated_fraction"] is None  # relu and linear are unbounded
    for x in body["layers"]:
        assert x["forward"]["output"] == x["layer"].split("/")[0] and x["forward"]["step"] == STEPS - 1
    # the same at an earlier step: the fields of that step
    early = _payloads.health_payload(series, Thresholds(), 4)
    assert early["forward_profile"]["step"] == 4
    assert early["forward_profile"]["outputs"][1]["dead_fraction"] == pytest.approx(
        _dead_fraction(run.outputs[4]["dense_2"]))
    # a run written without outputs has none of it
    plain = _payloads.health_payload(reader.read_logdir(str(logdir.parent / "dead_plain")).runs[0], Thresholds(),
                                     None)
    assert "forward_profile" not in plain and not any("forward" in x for x in plain["layers"])


def test_diagnose_run_takes_the_outputs_as_a_tuple(runs):
    logdir, _ = runs["dead"]
    (series,) = reader.read_logdir(str(logdir)).runs
    a = series.activations
    by_tuple = health.diagnose_run(series.layers, series.steps, series.records,
                                   activations=(a.layers, a.steps, a.records, a.layer_info))
    by_series = health.diagnose_run(series.layers, series.steps, series.records, activations=a)
    assert by_tuple.to_json() == by_series.to_json()
    assert by_tuple.by_layer()["dense_2/kernel"].status == "dead"
    with pytest.raises(ValueError, match="activations"):
        health.diagnose_run(series.layers, series.steps, series.records,
                            activations=(a.layers, a.steps, a.records[:, :1]))


def test_a_live_run_reads_the_outputs_as_the_report_does(tmp_path):
    """``stop_on``'s live diagnosis, fed the writer's events as they are written, answers as the report does."""
    from tb_gradhealth.live import LiveRun

    live = LiveRun()
    train(str(tmp_path / "dead"), steps=STEPS, watch=live.watch, **DEAD)
    logdir = str(tmp_path / "dead")
    (series,) = reader.read_logdir(logdir).runs
    loss = progress.read_progress(progress.run_paths(reader.find_runs(logdir), series.run))
    written = _payloads.diagnose(series, Thresholds(), None, loss)
    assert written.loss_trend is not None
    assert live.diagnose(Thresholds()).to_json() == written.to_json()
    assert written.by_layer()["dense_2/kernel"].status == "dead"


def test_the_series_route_gives_the_output_that_shows_a_variables_units_at_every_logged_step(tmp_path):
    """The drawer's output history: for a kernel, its layer's output (after its relu) at every logged step, with
    the fraction of its units that output 0 for every input, measured here on the outputs the loop made; a run
    written without its outputs has none."""
    net = {"widths": [16, 32, 32, 32], "act": "relu", "shift": {2: (22, -100.0)}, "steps": 9}
    run = train(str(tmp_path / "with"), **net)
    train(str(tmp_path / "without"), record_outputs=False, **net)
    (series,) = reader.read_logdir(str(tmp_path / "with")).runs
    out = _payloads.series_payload(series, "dense_2/kernel", Thresholds())["outputs"]
    assert out["output"] == "dense_2" and out["steps"] == list(range(net["steps"])) == [int(s) for s in series.steps]
    for k, seen in enumerate(run.outputs):
        a = seen["dense_2"].astype(np.float32).astype(np.float64)
        assert out["dead_fraction"][k] == pytest.approx(np.mean(~np.any(a != 0, axis=0)))
        assert out["rms"][k] == pytest.approx(np.sqrt(np.mean(a * a)), rel=1e-5)
    assert out["saturated_fraction"] == [None] * net["steps"] and out["total_steps"] == net["steps"]
    assert _payloads.series_payload(series, "head/kernel", Thresholds())["outputs"]["output"] == "head"
    (plain,) = reader.read_logdir(str(tmp_path / "without")).runs
    assert _payloads.series_payload(plain, "dense_2/kernel", Thresholds())["outputs"] is None
