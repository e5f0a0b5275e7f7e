"""Held-out cases for the diagnosis that reads each layer's output: four classes of networks, each trained by Keras
``fit`` with ``GradientHealthCallback(update_freq=1, activations=True)`` beside a healthy twin that differs by one
intervention, labelled from measurements of the networks themselves, never from the diagnosis or its constants.

Written before any rule that reads the outputs was tuned on them; the rules are not to be tuned on them either.

* ``dead_relu_bias``: a ReLU MLP whose second layer starts with 44 of its 64 biases at -40 (its twin: zeros). Label:
  that layer ``dead`` where the units that output 0 for every example of the whole data set, measured at the start
  and at the end of training by running the network, are at least two thirds of its units (the twin's fraction is
  printed beside it).
* ``tanh_saturated``: an 8-layer tanh MLP (Glorot) whose biases start at 4 (its twin: 0), under SGD.
  ``sigmoid_deep_adam``: a 12-layer sigmoid MLP (Glorot) whose biases start at 7 (its twin: He/ReLU; a sigmoid
  twin that deep does not learn either), under Adam: units pinned near a bound pass almost no signal either way.
  ``relu_forward_blowup``: an 8-layer ReLU MLP whose weights multiply the activations by about 5 per layer
  (variance 50/fan_in; its twin: He), under Adam.
  Label of each variable: the gradient-norm distance to the twin on every batch of the data at the start and at the
  end (``zoo_heldout.TWIN_RULE``: 4 decades or more beyond it is sick, within 2 healthy, doubtful between), the
  norms taken in float64 (a float32 norm of values below 1e-19 underflows to 0) and a zero norm against a nonzero
  one infinitely far. A twin is healthy where its measured training accuracy ends 0.1 or more above chance. Beside
  it, measured on the whole data set: the fraction of saturating outputs within 1e-3 of a bound, the output RMS of
  every layer in forward order, and the training accuracy against chance.

Goals: no flag and no episode at any logged step of a healthy twin; every labelled variable flagged with its label's
status at the end, its first flag within the first 10 logged steps (every defect here is there from the first
step); no variable labelled healthy in a sick run flagged at the end; the evidence named where it was measured
(dead units in the dead layer's reason; a saturated fraction in a vanishing saturating layer's reason; a forward
blow-up in an exploding layer's reason where the output RMS grew 1e4x or more through depth); a sick run whose
accuracy ends at chance (within 0.05) flagged at the end.

Usage: python benchmarks/activation_heldout.py [--out DIR] [--only NAME,...]   (about 3 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.zoo_cases import CLASSES, FEATURES, ce, teacher_data  # noqa: E402

STEPS, BATCH = 120, 64
#: a defect present from the first step is flagged within this many logged steps
EARLY = 10


def _mlp(name: str, depth: int, width: int, act: str, init: Any, bias: Any = "zeros", at: int | None = None) -> Any:
    """``depth`` hidden ``Dense`` layers and a linear classifier; ``bias`` initialises the hidden layer ``at`` (every
    hidden layer where ``at`` is None)."""
    import keras

    layers = [keras.Input((FEATURES,))]
    bias = keras.initializers.Constant(bias) if isinstance(bias, float) else bias
    for i in range(depth):
        layers.append(keras.layers.Dense(width, activation=act, kernel_initializer=init, name=f"{act}_{i}",
                                         bias_initializer=bias if at is None or i == at else "zeros"))
    return keras.Sequential(layers + [keras.layers.Dense(CLASSES, name="logits")], name=name)


def _dead_relu_bias(mutant: bool) -> Any:
    import keras

    keras.utils.set_random_seed(401)
    shift = np.zeros(64, np.float32)
    if mutant:
        shift[np.random.default_rng(401).permutation(64)[:44]] = -40.0
    return _mlp("dead_bias", 4, 64, "relu", keras.initializers.HeNormal(401),
                bias=keras.initializers.Constant(shift), at=1)


def _tanh_saturated(mutant: bool) -> Any:
    import keras

    keras.utils.set_random_seed(409)
    return _mlp("tanh_sat", 8, 64, "tanh", keras.initializers.GlorotUniform(409), bias=4.0 if mutant else 0.0)


def _sigmoid_deep(mutant: bool) -> Any:
    import keras

    keras.utils.set_random_seed(419)
    if mutant:
        return _mlp("sigmoid_deep", 12, 32, "sigmoid", keras.initializers.GlorotUniform(419), bias=7.0)
    return _mlp("sigmoid_deep", 12, 32, "relu", keras.initializers.HeNormal(419))


def _relu_blowup(mutant: bool) -> Any:
    import keras

    keras.utils.set_random_seed(421)
    return _mlp("relu_blowup", 8, 48, "relu",
                keras.initializers.VarianceScaling(50.0 if mutant else 2.0, "fan_in", "normal", seed=421))


#: name -> (builder, optimizer, data seed)
CASES: dict[str, tuple[Callable[[bool], Any], Callable[[], Any], int]] = {
    "dead_relu_bias": (_dead_relu_bias, lambda: __import__("keras").optimizers.SGD(0.05), 431),
    "tanh_saturated": (_tanh_saturated, lambda: __import__("keras").optimizers.SGD(0.05), 433),
    "sigmoid_deep_adam": (_sigmoid_deep, lambda: __import__("keras").optimizers.Adam(1e-3), 439),
    "relu_forward_blowup": (_relu_blowup, lambda: __import__("keras").optimizers.Adam(3e-4), 443),
}


# --- measurements (the network itself, run on the whole data set) ---------------------------------------------------


def _outputs(model: Any, x: np.ndarray) -> dict[str, np.ndarray]:
    """Every hidden layer's output (after its activation) on ``x``."""
    import keras

    hidden = [layer for layer in model.layers if layer.name != "logits"]
    probe = keras.Model(model.inputs, [layer.output for layer in hidden])
    return {layer.name: np.asarray(o, np.float64) for layer, o in zip(hidden, probe([x]), strict=True)}


def _forward(model: Any, x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    outs = _outputs(model, x)
    sat = {}
    for name, a in outs.items():
        if name.startswith("tanh"):
            sat[name] = float(np.mean(np.abs(a) >= 1 - 1e-3))
        elif name.startswith("sigmoid"):
            sat[name] = float(np.mean((a <= 1e-3) | (a >= 1 - 1e-3)))
    logits = np.asarray(model(x))
    return {"dead_units": {n: float(np.mean(np.all(a == 0, axis=0))) for n, a in outs.items()},
            "saturated": sat, "rms": {n: float(np.sqrt(np.mean(a * a))) for n, a in outs.items()},
            "accuracy": float(np.mean(np.argmax(logits, axis=1) == y))}


def _norms_per_batch(model: Any, x: np.ndarray, y: np.ndarray, loss: Any) -> np.ndarray:
    """``[batches, variables]`` each variable's gradient norm on each batch of the data, in float64."""
    import tensorflow as tf

    out = []
    for b in range(len(x) // BATCH):
        with tf.GradientTape() as tape:
            value = loss(y[b * BATCH:(b + 1) * BATCH], model(x[b * BATCH:(b + 1) * BATCH], training=True))
        grads = tape.gradient(value, model.trainable_variables)
        out.append([float(np.linalg.norm(np.asarray(g, np.float64))) for g in grads])
    return np.array(out)


def _decades(norms: np.ndarray, twin: np.ndarray, sign: float) -> np.ndarray:
    """Per batch and variable, the decades ``norms`` sit above (``sign`` 1) or below (-1) the twin's on that batch
    (+inf where the one is 0 and the other is not, in the direction of ``sign``)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return sign * (np.log10(norms) - np.log10(twin))


def _median(d: np.ndarray) -> np.ndarray:
    """Per variable, the median over the batches where the distance is defined (NaN where none is)."""
    out = np.full(d.shape[1], np.nan)
    for i in range(d.shape[1]):
        v = d[~np.isnan(d[:, i]), i]
        if v.size:
            out[i] = float(np.median(v))
    return out


def _train(model: Any, opt: Any, x: np.ndarray, y: np.ndarray, log_dir: str) -> None:
    from tb_gradhealth.keras import GradientHealthCallback

    model.compile(optimizer=opt, loss=ce())
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False,
              callbacks=[GradientHealthCallback(log_dir, update_freq=1, activations=True)])


def measure(name: str, root: Path) -> dict[str, Any]:
    """Train ``name`` and its twin into ``root/name`` and ``root/name_twin``; return the labels and what they were
    measured from."""
    build, opt, seed = CASES[name]
    x, y = teacher_data(STEPS * BATCH, seed)
    sick, twin = build(True), build(False)
    names = [v.path for v in sick.trainable_variables]
    loss = ce()
    twin_start = _norms_per_batch(twin, x, y, loss)
    start = {"sick": _forward(sick, x, y), "twin": _forward(twin, x, y)}
    sign = -1.0 if name in ("tanh_saturated", "sigmoid_deep_adam") else 1.0
    before = _decades(_norms_per_batch(sick, x, y, loss), twin_start, sign)
    _train(sick, opt(), x, y, str(root / name))
    _train(twin, opt(), x, y, str(root / f"{name}_twin"))
    after = _decades(_norms_per_batch(sick, x, y, loss), _norms_per_batch(twin, x, y, loss), sign)
    end = {"sick": _forward(sick, x, y), "twin": _forward(twin, x, y)}
    at_start, at_end = _median(before), _median(after)
    dec = np.where(np.isnan(at_end), at_start, np.minimum(at_start, at_end))
    status = "vanishing" if sign < 0 else "exploding"
    labels: dict[str, str] = {}
    if name == "dead_relu_bias":
        frac = min(start["sick"]["dead_units"]["relu_1"], end["sick"]["dead_units"]["relu_1"])
        if frac >= 2 / 3:
            labels = {n: "dead" for n in names if n.split("/")[-2] == "relu_1"}
    else:
        for n, d in zip(names, dec, strict=True):
            if d >= 4.0:
                labels[n] = status
            elif d > 2.0:
                labels[n] = "doubtful"
    rms = list(start["sick"]["rms"].values())
    return {"labels": labels, "start": start, "end": end, "decades": dict(zip(names, np.round(dec, 2).tolist(),
                                                                             strict=True)),
            "growth": rms[-1] / rms[0] if rms[0] > 0 else float("nan"), "names": names}


# --- diagnosis at every logged step ------------------------------------------------------------------------------


def diagnose_dir(case_dir: Path) -> tuple[Any, Any]:
    """``(Diagnosed at every logged step, the diagnosis at the last)`` of the one run in ``case_dir``, with the
    report's evidence."""
    from benchmarks.diagnosis_zoo import diagnose_steps, evidence
    from tb_gradhealth import _payloads, health, reader

    (series,) = [r for r in reader.read_logdir(str(case_dir)).runs if r.num_steps]
    ev = evidence(case_dir, series)
    steps = diagnose_steps(series, progress=ev.progress)
    last = _payloads.diagnose(series, health.Thresholds(), None, ev.progress)
    return steps, last


def _flags(d: Any) -> dict[str, int]:
    """Per layer, its first logged step flagged in the diagnosis at that step."""
    from benchmarks.diagnosis_zoo import is_flag

    first: dict[str, int] = {}
    for s, st in zip(d.steps, d.status, strict=True):
        for n, v in st.items():
            if is_flag(v):
                first.setdefault(n, s)
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    root = Path(a.out or tempfile.mkdtemp(prefix="gradhealth-activation-heldout-"))
    names = [n for n in CASES if not a.only or n in a.only.split(",")]
    goals: dict[str, list[str]] = {"twins": [], "status": [], "precision": [], "early": [], "evidence": [],
                                   "chance": []}
    totals = dict.fromkeys(goals, 0)
    for name in names:
        m = measure(name, root)
        twin_steps, _ = diagnose_dir(root / f"{name}_twin")
        sick_steps, last = diagnose_dir(root / name)
        twin_flags = _flags(twin_steps)
        learned = m["end"]["twin"]["accuracy"] >= 1 / CLASSES + 0.1
        totals["twins"] += learned
        if learned and (twin_flags or twin_steps.episode_layers):
            goals["twins"].append(f"{name}_twin: {sorted(twin_flags) or twin_steps.episode_layers}")
        by = last.by_layer()
        first = _flags(sick_steps)
        s0 = sick_steps.steps[0]
        print(f"\n{name}: {len(sick_steps.steps)} logged steps; accuracy {m['start']['sick']['accuracy']:.2f} -> "
              f"{m['end']['sick']['accuracy']:.2f} (twin {m['end']['twin']['accuracy']:.2f}, chance "
              f"{1 / CLASSES:.2f}); output RMS first -> last hidden layer at the start x{m['growth']:.3g}")
        for part in ("dead_units", "saturated"):
            vals = {k: round(v, 3) for k, v in m["start"]["sick"][part].items() if v}
            if vals:
                print(f"  measured {part} at the start: {vals}; twin "
                      f"{ {k: round(v, 3) for k, v in m['start']['twin'][part].items() if v} }")
        print(f"  {'variable':22s} {'label':10s} {'decades':>8s} {'verdict':10s} {'first flag':>10s}  reason")
        for n in m["names"]:
            lab = m["labels"].get(n, "healthy")
            lh = by[n]
            reason = lh.reasons[0][:90] if lh.reasons else ""
            print(f"  {n:22s} {lab:10s} {m['decades'][n]:8.2f} {lh.status:10s} {str(first.get(n, '-')):>10s}  "
                  f"{reason}")
            if lab == "healthy" and m["labels"]:
                totals["precision"] += 1
                if lh.status in ("vanishing", "exploding", "dead", "nonfinite"):
                    goals["precision"].append(f"{name} {n}: {lh.status}")
            if lab in ("healthy", "doubtful"):
                continue
            totals["status"] += 1
            totals["early"] += 1
            totals["evidence"] += 1
            if lh.status != lab:
                goals["status"].append(f"{name} {n}: {lh.status}, labelled {lab}")
            if first.get(n) is None or sick_steps.steps.index(first[n]) >= EARLY:
                goals["early"].append(f"{name} {n}: first flag at {first.get(n)} (first logged step {s0})")
            text = " ".join(lh.reasons).lower()
            wanted = {"dead": "output 0 for every input", "vanishing": "within 1% of their range" if
                      m["start"]["sick"]["saturated"] else "", "exploding": "blow up on their way forward" if
                      m["growth"] >= 1e4 else ""}[lab]
            if wanted and wanted not in text:
                goals["evidence"].append(f"{name} {n}: no '{wanted}'")
        if m["labels"] and m["end"]["sick"]["accuracy"] <= 1 / CLASSES + 0.05:
            totals["chance"] += 1
            if not any(lh.status in ("vanishing", "exploding", "dead", "nonfinite") for lh in last.layers):
                goals["chance"].append(f"{name}: ends {last.status if hasattr(last, 'status') else 'ok'}")
    print(f"\nlogdirs under {root}")
    rows = [("healthy twins: no flag, no episode at any logged step", "twins"),
            ("labelled variables read their label's status at the end", "status"),
            ("variables labelled healthy in a sick run are not flagged at the end", "precision"),
            (f"labelled variables flagged within the first {EARLY} logged steps", "early"),
            ("the measured evidence named in the labelled variable's reason", "evidence"),
            ("a sick run whose accuracy ends at chance is flagged", "chance")]
    for text, key in rows:
        bad = goals[key]
        print(f"{text:70s} {'PASS' if not bad else 'FAIL'}  {totals[key] - len(bad)}/{totals[key]}"
              + (f"  ({'; '.join(bad)})" if bad else ""))


if __name__ == "__main__":
    main()
