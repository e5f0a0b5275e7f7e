"""The trainings of the diagnosis zoo (``benchmarks/diagnosis_zoo.py``) and how each one is labelled.

Every case trains a small real TF/Keras network on CPU, writes gradient-health records with the project's writers
(``GradientHealthCallback`` for ``fit``, ``summary.gradients`` in custom loops) and the raw training loss of every
step as the scalar ``loss`` in the same run directory, and returns its labels. Labels never come from the diagnosis:
they come from what each layer does, measured with plain TF/numpy, by the shared rules below (each case names the
ones it uses and why they apply):

* **learning rule** (vanishing): a layer learns if its weights move. ``r = ||w_end - w_start|| / ||w_start||`` of
  the layer's main parameter (its first variable with a nonzero initial norm: kernel, embeddings, gamma); the
  reference is the median ``r`` of the ``HEAD`` layers nearest the loss. A layer whose ``r`` is at least
  ``VANISH_DECADES`` decades below the reference does not learn: ``vanishing`` from the first logged step (these
  networks are sick from their initialisation). A layer's other variables (its bias) share its status: the bias
  gradient is the same backpropagated signal summed over the batch. Within ``DOUBT`` decades of the threshold a
  layer is ``doubtful`` (left out of the scores).
* **inert rule**: a bias (or a BatchNormalization beta) is ``inert`` when every path from it reaches a
  BatchNormalization in training mode through operations that keep a per-channel constant a per-channel constant
  (additions, 1x1 or unpadded convolutions, dense layers, pooling, reshapes): BatchNormalization subtracts the
  batch mean per channel, so the constant cancels and the exact gradient is zero; only round-off is recorded.
* **dead rule**: with plain SGD (no momentum, no weight decay) a variable changes at a step iff its gradient is
  nonzero; a variable bitwise unchanged at >= 90% of the steps gets exactly-zero gradients: ``dead`` from the first
  logged step.
* **divergence rule**: the raw loss ``L_s`` (and each layer's main-parameter weight norm, taken before step s's
  update) diverges from the first logged step ``s`` at which it grows by at least ``GROWTH``x per logged step
  for ``GROWTH_STEPS`` consecutive logged steps, or (a weight norm) jumps >= 10x in one step (a non-finite value
  counts as growth), and never again comes down to its value at ``s-1`` (a spike that recovers, a catapult, is
  not a divergence); the run's onset is the earliest over the loss and the weight norms. A layer whose main
  weight norm grew >= 10x from just before the onset to its last finite value is ``exploding`` from the onset
  (the culprits); every layer is ``nonfinite`` from the first step its gradient was NaN/Inf (measured from the
  weights SGD wrote, or the loss), the run's ``first_nan``. A run where neither happens is labelled healthy.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.diagnosis_zoo import layer_of

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

FEATURES = 32
CLASSES = 4
VANISH_DECADES = 3.0
DOUBT = 0.5
HEAD = 2
GROWTH = 1.5
GROWTH_STEPS = 3
EXPLODE_WEIGHT_GROWTH = 10.0


@dataclass(frozen=True)
class Case:
    name: str
    rule: str
    fn: Callable[[str], dict[str, Any]]
    #: a keras.applications model: minutes of CPU each (tracing, and the callback's first-call compilation)
    heavy: bool = False
    #: trains the case in place of :func:`train`'s Keras set-up, ``(name, case_dir) -> labels``: a framework that
    #: cannot share this process with TensorFlow trains in a child process (``benchmarks/zoo_child.py``)
    runner: Callable[[str, Path], dict[str, Any]] | None = None


CASES: dict[str, Case] = {}


def case(name: str, rule: str, heavy: bool = False) -> Callable:
    def register(fn: Callable[[str], dict[str, Any]]) -> Callable[[str], dict[str, Any]]:
        CASES[name] = Case(name, rule, fn, heavy)
        return fn

    return register


def train(name: str, case_dir: Path) -> dict[str, Any]:
    """Train one case into ``case_dir`` (emptied first) and save its ``labels.json``; returns the labels. A case with
    a ``runner`` trains through it; the others here, seeded by their name."""
    if CASES[name].runner is not None:
        return CASES[name].runner(name, case_dir)
    import keras

    keras.utils.set_random_seed(sum(map(ord, name)))
    return record_case(CASES[name], case_dir)


def record_case(c: Case, case_dir: Path) -> dict[str, Any]:
    """Run ``c``'s training into ``case_dir`` (emptied first) and save its ``labels.json`` with what every case
    records beside its labels: wall and CPU seconds, a label for every recorded layer (healthy unless given), the
    logged steps. Imports no framework: a child process without TensorFlow calls it too."""
    from tb_gradhealth import reader

    name = c.name
    shutil.rmtree(case_dir, ignore_errors=True)
    case_dir.mkdir(parents=True)
    t0, c0 = time.perf_counter(), _cpu_s()
    labels = c.fn(str(case_dir))
    labels["train_s"] = round(time.perf_counter() - t0, 2)
    labels["train_cpu_s"] = round(_cpu_s() - c0, 2)
    labels["case"] = name
    labels.setdefault("rule", c.rule)
    runs = [r for r in reader.read_logdir(str(case_dir)).runs if r.num_steps]
    if len(runs) != 1:
        raise RuntimeError(f"{name}: expected one gradient-health run, got {[r.run for r in runs]}")
    recorded = list(runs[0].layers)
    extra = sorted(set(labels["layers"]) - set(recorded))
    if extra:
        raise RuntimeError(f"{name}: labels for layers that are not recorded: {extra}")
    for n in recorded:  # every recorded layer has a label
        labels["layers"].setdefault(n, {"status": "healthy", "onset": None})
    labels["layers"] = {n: labels["layers"][n] for n in recorded}
    labels["logged_steps"] = [int(s) for s in runs[0].steps]
    (case_dir / "labels.json").write_text(json.dumps(labels, indent=1, default=_json_default))
    return labels


def _cpu_s() -> float:
    """CPU seconds of this process, all threads (the machine is shared: wall time depends on the others' load)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _json_default(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(type(x))


# --- data -----------------------------------------------------------------------------------------------------


def teacher_data(n: int, seed: int, features: int = FEATURES) -> tuple[np.ndarray, np.ndarray]:
    """Labels of a random linear teacher on Gaussian inputs: a learnable classification task."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features)).astype(np.float32)
    y = np.argmax(x @ rng.standard_normal((features, CLASSES)), axis=1).astype(np.int32)
    return x, y


def image_data(n: int, seed: int, size: int, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Noise images whose class is the brightest quadrant (learnable by a small convnet)."""
    rng = np.random.default_rng(seed)
    x = rng.random((n, size, size, 3)).astype(np.float32)
    y = rng.integers(0, 4, n).astype(np.int32)
    h = size // 2
    for i, c in enumerate(y):
        x[i, (c // 2) * h:(c // 2 + 1) * h, (c % 2) * h:(c % 2 + 1) * h] += 0.5
    return x * scale, y


def ce() -> Any:
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


# --- recording ----------------------------------------------------------------------------------------------------


def _trace_callback() -> Any:
    import keras

    from tb_gradhealth import summary
    from tb_gradhealth.writer import Writer

    class Trace(keras.callbacks.Callback):
        """Raw loss per step, weight norms / finiteness / change before each step, written and kept for labels.

        Keras reports the running mean of the loss over the epoch; with equal batches the raw loss of the k-th
        batch is ``k*m_k - (k-1)*m_(k-1)``. Step s is the optimizer's s-th step, as the gradient-health callback
        numbers it; ``wnorm[s]`` is the norm of the weights the step's gradient was taken at (before its update).
        """

        def __init__(self, log_dir: str, stop_after_nan: int | None) -> None:
            super().__init__()
            self.log_dir = log_dir
            self.stop_after_nan = stop_after_nan
            self.steps: list[int] = []
            self.loss: list[float] = []
            self.wnorm: list[np.ndarray] = []
            self.finite: list[np.ndarray] = []
            self.unchanged: list[np.ndarray] = []
            self._prev: list[np.ndarray] | None = None
            self._mean = 0.0
            self._k = 0
            self._step = 0
            self._nan_at: int | None = None

        def on_train_begin(self, logs: Any = None) -> None:
            self.names = summary.variable_names(self.model.trainable_variables)
            self.w_start = self._weights()
            self.writer = Writer(os.path.join(self.log_dir, "train"))

        def _weights(self) -> list[np.ndarray]:
            return [np.array(v.numpy(), dtype=np.float64) for v in self.model.trainable_variables]

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self._mean, self._k = 0.0, 0

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            w = self._weights()
            self.wnorm.append(np.array([np.linalg.norm(a) for a in w]))
            self.finite.append(np.array([bool(np.all(np.isfinite(a))) for a in w]))
            if self._prev is not None:
                self.unchanged.append(np.array([np.array_equal(a, b) for a, b in zip(w, self._prev, strict=True)]))
            self._prev = w

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self._k += 1
            self._step += 1
            m = float((logs or {}).get("loss", math.nan))
            raw = self._k * m - (self._k - 1) * self._mean if self._k > 1 else m
            self._mean = m
            self.steps.append(self._step)
            self.loss.append(raw)
            self.writer.add_scalars(self._step, {"loss": raw})
            if not math.isfinite(raw) and self._nan_at is None:
                self._nan_at = self._step
            if self.stop_after_nan is not None and self._nan_at is not None:
                if self._step - self._nan_at >= self.stop_after_nan:
                    self.model.stop_training = True

        def on_train_end(self, logs: Any = None) -> None:
            self.w_end = self._weights()
            w = self.w_end
            self.unchanged.append(np.array([np.array_equal(a, b) for a, b in zip(w, self._prev, strict=True)]))
            self.end_finite = np.array([bool(np.all(np.isfinite(a))) for a in w])
            self.writer.close()

    return Trace


def fit_logged(model: Any, x: Any, y: Any, log_dir: str, *, batch: int, update_freq: int = 1,
               stop_after_nan: int | None = None, epochs: int = 1, callbacks: Sequence[Any] = ()) -> Any:
    """``model.fit`` with the gradient-health callback and the loss/weight trace (then ``callbacks``, the user's own,
    e.g. ``TerminateOnNaN``); returns the trace."""
    from tb_gradhealth.keras import GradientHealthCallback

    trace = _trace_callback()(log_dir, stop_after_nan)
    model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, shuffle=False,
              callbacks=[GradientHealthCallback(log_dir, update_freq=update_freq), trace, *callbacks])
    return trace


# --- twins: the healthy run beside a mutant, and where the mutant leaves its range ----------------------------------


def logged_evidence(log_dir: str) -> tuple[list[str], list[int], np.ndarray, np.ndarray]:
    """``(names, steps, log10 gradient norm, log10 ||update|| / ||weight||)`` ``[S, L]`` of the one gradient-health
    run under ``log_dir``, read back from what the writer logged (NaN where not finite or not recorded)."""
    from tb_gradhealth import reader, record

    runs = [r for r in reader.read_logdir(log_dir).runs if r.num_steps]
    if len(runs) != 1:
        raise RuntimeError(f"{log_dir}: expected one gradient-health run, got {[r.run for r in runs]}")
    d = record.derived(runs[0].records)
    with np.errstate(divide="ignore", invalid="ignore"):
        grad, upd = np.log10(d["norm"]), np.log10(d["update_to_weight"])
    return (list(runs[0].layers), [int(s) for s in runs[0].steps],
            np.where(np.isfinite(grad), grad, np.nan), np.where(np.isfinite(upd), upd, np.nan))


def twin_departures(run_dir: str, twin_dirs: Sequence[str]) -> dict[str, int | None]:
    """Per variable, the first logged step at which its gradient norm or its update/weight ratio lies outside the
    healthy twins' range at that step (``[min, max]`` over the twins, which differ only by their seed): where the
    run stops being one of its healthy twins. A value that is not finite counts as outside; a step a twin did not
    log is left out. None: the run never left the range."""
    names, steps, grad, upd = logged_evidence(run_dir)
    twins = [logged_evidence(d) for d in twin_dirs]
    out: dict[str, int | None] = dict.fromkeys(names)
    for i, n in enumerate(names):
        for k, s in enumerate(steps):
            rows = [(g[tw_steps.index(s), tw_names.index(n)], u[tw_steps.index(s), tw_names.index(n)])
                    for tw_names, tw_steps, g, u in twins if s in tw_steps and n in tw_names]
            if not rows:
                continue
            band = np.array(rows)
            if any(_outside(x, band[:, j]) for j, x in enumerate((grad[k, i], upd[k, i]))):
                out[n] = s
                break
    return out


def _outside(x: float, twin: np.ndarray) -> bool:
    """``x`` outside the twins' ``[min, max]`` (a NaN ``x`` where the twins are finite counts as outside)."""
    known = twin[np.isfinite(twin)]
    if not known.size:
        return False
    return not (known.min() <= x <= known.max())


def loss_departure(loss: Sequence[float], twin_losses: Sequence[Sequence[float]]) -> int | None:
    """The first step (1-based) from which the loss stays above every healthy twin's loss at the same step to the
    end of the run (NaN counts as above): the loss running away from its twins. None: it never does."""
    loss = np.asarray(loss, dtype=np.float64)
    top = np.max(np.array([np.asarray(t, dtype=np.float64)[:loss.size] for t in twin_losses]), axis=0)
    above = ~(loss <= top)
    return next((s + 1 for s in range(loss.size) if above[s:].all()), None)


# --- labelling rules ------------------------------------------------------------------------------------------


def groups(names: Sequence[str]) -> dict[str, list[int]]:
    """Variables of each layer (name prefix), in network order."""
    out: dict[str, list[int]] = {}
    for i, n in enumerate(names):
        out.setdefault(layer_of(n), []).append(i)
    return out


def rel_change(w0: np.ndarray, w1: np.ndarray) -> float:
    n0 = float(np.linalg.norm(w0))
    return float(np.linalg.norm(w1 - w0)) / n0 if n0 > 0 else math.nan


def learning_labels(names: Sequence[str], w_start: Sequence[np.ndarray], w_end: Sequence[np.ndarray],
                    first_step: int, skip: Sequence[str] = ()) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """The learning rule (module docstring): per-variable labels and the evidence (decades below the head)."""
    grp = {g: [i for i in idx if names[i] not in skip] for g, idx in groups(names).items()}
    grp = {g: idx for g, idx in grp.items() if idx}
    r: dict[str, float] = {}
    for g, idx in grp.items():
        main = next((i for i in idx if np.linalg.norm(w_start[i]) > 0), None)
        if main is not None:
            r[g] = rel_change(w_start[main], w_end[main])
    head = [r[g] for g in list(r)[-HEAD:]]
    ref = float(np.median(head))
    labels, evidence = {}, {"reference_rel_change": ref, "rel_change": r}
    for g, idx in grp.items():
        if g not in r:
            continue
        dec = math.log10(r[g] / ref) if r[g] > 0 else -math.inf
        vanishing = dec <= -VANISH_DECADES
        doubtful = abs(dec + VANISH_DECADES) < DOUBT
        for i in idx:
            labels[names[i]] = {"status": "vanishing" if vanishing else "healthy",
                                "onset": first_step if vanishing else None, "decades_below_head": round(-dec, 2),
                                **({"doubtful": True} if doubtful else {})}
    return labels, evidence


def label_run(names: Sequence[str], trace: Any, *, inert: Sequence[str] = (), rule: str, **extra: Any
              ) -> dict[str, Any]:
    """Labels of a fit() case by the inert and learning rules (healthy unless the rules say otherwise)."""
    first = trace.steps[0]
    layers, evidence = learning_labels(names, trace.w_start, trace.w_end, first, skip=inert)
    for n in inert:
        layers[n] = {"status": "inert", "onset": None}
    sick = [n for n, e in layers.items() if e["status"] in ("vanishing", "exploding", "dead", "nonfinite")
            and not e.get("doubtful")]
    return {"sick": bool(sick), "layers": layers, "culprits": _deepest_first(names, sick),
            "onset": first if sick else None, "first_nan": None, "diverges": False, "rule": rule,
            "evidence": {**evidence, "loss_first": trace.loss[0], "loss_last": trace.loss[-1]}, **extra}


def _deepest_first(names: Sequence[str], sick: Sequence[str]) -> list[str]:
    order = {n: i for i, n in enumerate(names)}
    return sorted(sick, key=lambda n: -order[n])


def growth_onset(steps: Sequence[int], values: Sequence[float], jump: bool = False) -> int | None:
    """The divergence rule's onset of one series: the first step of ``GROWTH_STEPS`` consecutive >= ``GROWTH``x
    rises, or (``jump``, for weight norms) of a single >= ``EXPLODE_WEIGHT_GROWTH``x jump, after which the series
    never comes back down. Not ``jump`` for the loss: a noisy loss jumps 10x out of a dip without diverging."""
    v = list(values)

    def rises(j: int, factor: float) -> bool:
        return not math.isfinite(v[j]) or (math.isfinite(v[j - 1]) and v[j] >= factor * v[j - 1])

    for i in range(1, len(v)):
        if not (math.isfinite(v[i - 1]) and v[i - 1] > 0):
            continue
        steady = i + GROWTH_STEPS <= len(v) and all(rises(j, GROWTH) for j in range(i, i + GROWTH_STEPS))
        # ... and never comes back to where it started (a transient spike that recovers is not a divergence)
        kept = all(not math.isfinite(x) or x > v[i - 1] for x in v[i:])
        if kept and (steady or (jump and rises(i, EXPLODE_WEIGHT_GROWTH))):
            return int(steps[i])
    return None


def divergence_labels(names: Sequence[str], steps: Sequence[int], loss: Sequence[float], wnorm: np.ndarray,
                      nonfinite_from: dict[str, int | None], *, inert: Sequence[str] = (), rule: str
                      ) -> dict[str, Any]:
    """The divergence rule (module docstring). ``wnorm``: [S, L] weight norms before each step's update;
    ``nonfinite_from``: per variable, the first step whose gradient was NaN/Inf (None: never).

    Weight norms are judged on each layer's main parameter (first variable with a nonzero initial norm: a
    zero-initialised bias or beta "grows" by any factor from nothing); the layer's other variables share its status.
    """
    wnorm = np.asarray(wnorm, dtype=np.float64)
    main = {}
    for idx in groups(names).values():
        live = [i for i in idx if names[i] not in inert]
        m = next((i for i in live if wnorm[0, i] > 0), None)
        if m is not None:
            main.update(dict.fromkeys(live, m))
    onsets = [growth_onset(steps, loss)]
    onsets += [growth_onset(steps, list(wnorm[:, m]), jump=True) for m in set(main.values())]
    found = [o for o in onsets if o is not None]
    onset = min(found) if found else None
    nan_steps = [s for s in nonfinite_from.values() if s is not None]
    first_nan = min(nan_steps) if nan_steps else None
    layers: dict[str, dict[str, Any]] = {}
    culprits = []
    for i, n in enumerate(names):
        chain = []
        if onset is not None and i in main:
            col = wnorm[max(list(steps).index(onset) - 1, 0):, main[i]]  # from the value before the rise
            fin = col[np.isfinite(col)]
            grew = float(fin[-1] / col[0]) if fin.size and col[0] > 0 else math.nan
            if grew >= EXPLODE_WEIGHT_GROWTH and (nonfinite_from.get(n) is None or nonfinite_from[n] > onset):
                chain.append({"status": "exploding", "from": onset})
                culprits.append(n)
        if nonfinite_from.get(n) is not None:
            chain.append({"status": "nonfinite", "from": nonfinite_from[n]})
        if chain:
            layers[n] = {"status": chain[0]["status"], "onset": chain[0]["from"], "episodes": chain}
        elif n in inert:
            layers[n] = {"status": "inert", "onset": None}
    if not culprits and first_nan is not None:
        culprits = [n for n in names if nonfinite_from.get(n) == first_nan]
    sick = any(e["status"] != "inert" for e in layers.values())
    return {"sick": sick, "layers": layers, "culprits": _deepest_first(names, culprits),
            "onset": onset if onset is not None else first_nan, "first_nan": first_nan, "diverges": sick,
            "rule": rule, "evidence": {"loss": [float(x) for x in loss],
                                       "main_weight_norms": {names[m]: [float(x) for x in wnorm[:, m]]
                                                             for m in sorted(set(main.values()))}}}


def nonfinite_from_trace(names: Sequence[str], trace: Any) -> dict[str, int | None]:
    """First step whose gradient was non-finite, per variable, from a fit() trace: the first non-finite loss
    (backprop of a NaN loss is NaN everywhere), or the first step after which SGD wrote non-finite weights."""
    loss_bad = next((s for s, v in zip(trace.steps, trace.loss, strict=True) if not math.isfinite(v)), None)
    finite = np.array(trace.finite[1:] + [trace.end_finite])  # after step s's update
    out = {}
    for i, n in enumerate(names):
        bad = np.flatnonzero(~finite[:, i])
        w_bad = int(trace.steps[bad[0]]) if bad.size else None
        cands = [s for s in (loss_bad, w_bad) if s is not None]
        out[n] = min(cands) if cands else None
    return out


# --- structure: parameters whose exact gradient is zero -----------------------------------------------------------


def _as_list(t: Any) -> list[Any]:
    return list(t) if isinstance(t, list | tuple) else [t]


def inert_parameters(model: Any) -> list[str]:
    """The inert rule (module docstring) on a functional Keras model: record names of the inert variables."""
    import keras

    from tb_gradhealth import summary

    consumers: dict[int, list[Any]] = {}
    for layer in model.layers:
        try:
            inputs = _as_list(layer.input)
        except (AttributeError, ValueError):
            continue
        for t in inputs:
            consumers.setdefault(id(t), []).append(layer)
    outputs = {id(t) for t in _as_list(model.outputs)}
    L = keras.layers
    passing = (L.Add, L.Concatenate, L.Dense, L.GlobalAveragePooling2D, L.GlobalMaxPooling2D, L.MaxPooling2D,
               L.AveragePooling2D, L.Flatten, L.Reshape, L.GlobalAveragePooling1D)
    memo: dict[int, bool] = {}

    def killed(t: Any) -> bool:
        key = id(t)
        if key in memo:
            return memo[key]
        memo[key] = False  # cycles cannot occur; a default for safety
        users = consumers.get(key, [])
        ok = bool(users) and key not in outputs
        for layer in users:
            if not ok:
                break
            if isinstance(layer, L.BatchNormalization):
                continue
            if isinstance(layer, L.Conv2D | L.DepthwiseConv2D | L.Conv1D):
                k = tuple(layer.kernel_size)
                if not (all(d == 1 for d in k) or layer.padding == "valid"):
                    ok = False
                    break
            elif isinstance(layer, L.Dropout):
                ok = ok and layer.rate == 0
            elif not isinstance(layer, passing):
                ok = False
                break
            ok = ok and killed(layer.output)
        memo[key] = ok
        return ok

    inert = []
    var_names = dict(zip(map(id, model.trainable_variables), summary.variable_names(model.trainable_variables),
                         strict=True))
    for layer in model.layers:
        if isinstance(layer, L.BatchNormalization):
            param = layer.beta if layer.center else None
        else:
            param = getattr(layer, "bias", None) if getattr(layer, "use_bias", False) else None
        if param is None or id(param) not in var_names:
            continue
        if killed(layer.output):
            inert.append(var_names[id(param)])
    return inert


# --- the cases ------------------------------------------------------------------------------------------------------


def dense_stack(depth: int, activation: str, *, width: int = 32, name: str, **kw: Any) -> Any:
    import keras

    return keras.Sequential(
        [keras.Input((FEATURES,))]
        + [keras.layers.Dense(width, activation=activation, name=f"{activation}_{i:02d}", **kw) for i in range(depth)]
        + [keras.layers.Dense(CLASSES, name="logits")],
        name=name,
    )


def _mlp_case(log_dir: str, model: Any, optimizer: Any, *, steps: int, batch: int = 64, loss: Any = None,
              seed: int = 0, update_freq: int = 1, rule: str, inert: Sequence[str] = ()) -> dict[str, Any]:
    from tb_gradhealth import summary

    x, y = teacher_data(steps * batch, seed)
    model.compile(optimizer=optimizer, loss=loss or ce())
    trace = fit_logged(model, x, y, log_dir, batch=batch, update_freq=update_freq)
    names = summary.variable_names(model.trainable_variables)
    return label_run(names, trace, inert=inert, rule=rule)


LEARN = "learning rule: vanishing where ||dw||/||w0|| >= 3 decades below the 2 layers nearest the loss"


def _sigmoid_case(depth: int, optimizer: str) -> Callable[[str], dict[str, Any]]:
    def run(log_dir: str) -> dict[str, Any]:
        import keras

        opt = keras.optimizers.SGD(0.5) if optimizer == "sgd" else keras.optimizers.Adam(1e-3)
        return _mlp_case(log_dir, dense_stack(depth, "sigmoid", name=f"sigmoid{depth}"), opt, steps=60, rule=LEARN)

    return run


# Deep sigmoid MLPs with SGD: sigmoid' <= 1/4, so backprop shrinks the signal at every layer and the layers near the
# input stop learning. Labelled by the learning rule (measured weight change); justification: with plain SGD the
# weight change is the sum of the gradients times the learning rate, so a layer that moves 3 decades less than the
# head receives 3 decades less gradient.
case("sigmoid_mlp_10", LEARN + " (10 sigmoid layers, SGD)")(_sigmoid_case(10, "sgd"))
case("sigmoid_mlp_14", LEARN + " (14 sigmoid layers, SGD)")(_sigmoid_case(14, "sgd"))
# The same 14-layer network with Adam: Adam divides by the gradient's running RMS, so small-gradient layers move at
# the rate of the others (until the gradient nears Adam's epsilon): by the learning rule they are not vanishing.
case("sigmoid_mlp_14_adam", LEARN + " (14 sigmoid layers, Adam: the sick network of sigmoid_mlp_14)")(
    _sigmoid_case(14, "adam"))


def _tanh_case(depth: int) -> Callable[[str], dict[str, Any]]:
    def run(log_dir: str) -> dict[str, Any]:
        import keras

        # A bias of 2 saturates tanh (tanh'(2) = 0.07): every layer multiplies the backpropagated signal by ~0.1-0.3,
        # the tanh form of the sigmoid network's disease.
        model = dense_stack(depth, "tanh", name=f"tanh{depth}", bias_initializer=keras.initializers.Constant(2.0))
        return _mlp_case(log_dir, model, keras.optimizers.SGD(0.5), steps=60, rule=LEARN)

    return run


case("tanh_mlp_8", LEARN + " (8 tanh layers saturated by a bias of 2, SGD)")(_tanh_case(8))
case("tanh_mlp_14", LEARN + " (14 tanh layers saturated by a bias of 2, SGD)")(_tanh_case(14))


# Too-large init: a ReLU stack whose every kernel is drawn 6x wider than He's (gain 6 per layer). ReLU networks are
# homogeneous, so every gradient is ~6^(depth-1) times its He-initialised value. Rule: a variable is `exploding`
# from the first logged step when its gradient norm on the first batch is >= 3 decades above the gradient norm of
# the same network with He's init on the same batch (plain tf.GradientTape), and still >= 3 decades above it at the
# end; doubtful within half a decade. Adam at lr 1e-4 keeps training finite (its step is bounded by the lr).
RELU_INIT_RULE = ("exploding where the gradient norm is >= 3 decades above that of the same network with He init, "
                  "on the same batch, at the start and the end")


@case("relu_big_init", RELU_INIT_RULE)
def relu_big_init(log_dir: str) -> dict[str, Any]:
    import keras
    import tensorflow as tf

    from tb_gradhealth import summary

    depth, gain, batch, steps = 6, 6.0, 64, 30

    def build(scale: float) -> Any:
        init = keras.initializers.VarianceScaling(2.0 * scale**2, "fan_in", "truncated_normal", seed=7)
        return keras.Sequential(
            [keras.Input((FEATURES,))]
            + [keras.layers.Dense(64, activation="relu", kernel_initializer=init, name=f"relu_{i}")
               for i in range(depth)]
            + [keras.layers.Dense(CLASSES, kernel_initializer=init, name="logits")], name="relu_big")

    x, y = teacher_data(steps * batch, 11)
    model, ref = build(gain), build(1.0)

    def grad_norms(m: Any) -> np.ndarray:
        with tf.GradientTape() as tape:
            loss = ce()(y[:batch], m(x[:batch], training=True))
        return np.array([float(tf.norm(g)) for g in tape.gradient(loss, m.trainable_variables)])

    ref_norms, start = grad_norms(ref), grad_norms(model)
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss=ce())
    trace = fit_logged(model, x, y, log_dir, batch=batch)
    end = grad_norms(model)
    names = summary.variable_names(model.trainable_variables)
    layers, sick = {}, []
    for i, n in enumerate(names):
        dec = min(math.log10(start[i] / ref_norms[i]), math.log10(end[i] / ref_norms[i]))
        exploding = dec >= 3.0
        layers[n] = {"status": "exploding" if exploding else "healthy", "onset": trace.steps[0] if exploding else None,
                     "decades_above_he": round(dec, 2), **({"doubtful": True} if abs(dec - 3.0) < DOUBT else {})}
        if exploding and not layers[n].get("doubtful"):
            sick.append(n)
    return {"sick": bool(sick), "layers": layers, "culprits": _deepest_first(names, sick),
            "onset": trace.steps[0] if sick else None, "first_nan": None, "diverges": False, "rule": RELU_INIT_RULE,
            "evidence": {"loss_first": trace.loss[0], "loss_last": trace.loss[-1]}}


INERT_LEARN = "inert rule (conv bias feeding only BatchNormalization) + learning rule; healthy otherwise"


# A healthy Conv/BN/ReLU ResNet that keeps use_bias=True before every BatchNormalization: those biases are inert
# (BN subtracts the per-channel batch mean, so the bias cancels and its exact gradient is zero; the records hold
# round-off). Everything else learns (learning rule), Adam, the loss falls.
@case("resnet_bn_bias", INERT_LEARN)
def resnet_bn_bias(log_dir: str) -> dict[str, Any]:
    import keras

    from tb_gradhealth import summary

    L = keras.layers
    inp = keras.Input((16, 16, 3))
    h = L.ReLU(name="stem_relu")(L.BatchNormalization(name="stem_bn")(L.Conv2D(16, 3, padding="same",
                                                                               name="stem_conv")(inp)))
    for b in range(2):
        r = L.Conv2D(16, 3, padding="same", name=f"block{b}_conv1")(h)
        r = L.ReLU(name=f"block{b}_relu1")(L.BatchNormalization(name=f"block{b}_bn1")(r))
        r = L.BatchNormalization(name=f"block{b}_bn2")(L.Conv2D(16, 3, padding="same", name=f"block{b}_conv2")(r))
        h = L.ReLU(name=f"block{b}_out")(L.Add(name=f"block{b}_add")([h, r]))
    out = L.Dense(CLASSES, name="logits")(L.GlobalAveragePooling2D(name="pool")(h))
    model = keras.Model(inp, out, name="resnet")
    x, y = image_data(40 * 32, 5, 16)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=ce())
    trace = fit_logged(model, x, y, log_dir, batch=32)
    names = summary.variable_names(model.trainable_variables)
    return label_run(names, trace, inert=inert_parameters(model), rule=INERT_LEARN)


TRANSFORMER_RULE = ("attention key bias inert (softmax is shift-invariant over keys) + learning rule; sparse "
                    "embedding rows are not a disease; healthy otherwise")


# A healthy transformer block: token embedding over a 2,000-word vocabulary of which a batch uses a few dozen rows
# (Zipf-distributed tokens), learned positions, pre-LN attention and MLP, mean pooling, Adam. The key projection's
# bias adds q.b_k to every logit of a query, the same for all keys, which softmax cancels: it is inert (exact
# gradient zero). The embedding's rows outside the batch get exact zeros, as they should: the layer learns.
@case("transformer_block", TRANSFORMER_RULE)
def transformer_block(log_dir: str) -> dict[str, Any]:
    import keras

    from tb_gradhealth import summary

    L = keras.layers
    vocab, seq, dim, batch, steps = 2000, 16, 32, 32, 40

    class Positions(L.Layer):
        def build(self, input_shape: Any) -> None:
            self.embeddings = self.add_weight(shape=(seq, dim), initializer="random_normal", name="embeddings")

        def call(self, x: Any) -> Any:
            return x + self.embeddings

    inp = keras.Input((seq,), dtype="int32")
    h = Positions(name="pos_emb")(L.Embedding(vocab, dim, name="tok_emb")(inp))
    a = L.LayerNormalization(name="ln_1")(h)
    h = L.Add(name="res_1")([h, L.MultiHeadAttention(2, dim // 2, name="mha")(a, a)])
    m = L.Dense(dim, name="mlp_2")(L.Dense(64, activation="gelu", name="mlp_1")(L.LayerNormalization(name="ln_2")(h)))
    h = L.Add(name="res_2")([h, m])
    out = L.Dense(CLASSES, name="logits")(L.GlobalAveragePooling1D(name="pool")(L.LayerNormalization(name="ln_f")(h)))
    model = keras.Model(inp, out, name="transformer")
    rng = np.random.default_rng(9)
    tokens = np.minimum(rng.zipf(1.6, (steps * batch, seq)), vocab - 1).astype(np.int32)
    y = (tokens[:, 0] % CLASSES).astype(np.int32)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=ce())
    trace = fit_logged(model, tokens, y, log_dir, batch=batch)
    names = summary.variable_names(model.trainable_variables)
    inert = [n for n in names if n.endswith("key/bias")]
    labels = label_run(names, trace, inert=inert, rule=TRANSFORMER_RULE)
    labels["evidence"]["embedding_rows_used"] = int(np.unique(tokens).size)
    return labels


# Two stacked LSTMs on 100-step sequences whose class is set by the first 5 steps: the loss signal has to travel back
# through ~100 steps of recurrence. Keras records one variable per gate matrix (not per time step), so what can be
# labelled per variable is whether it learns: the learning rule (SGD, where weight change = lr x summed gradient).
@case("lstm_long", LEARN + " (2 LSTMs over 100 steps, SGD)")
def lstm_long(log_dir: str) -> dict[str, Any]:
    import keras

    from tb_gradhealth import summary

    steps, batch, t = 30, 32, 100
    rng = np.random.default_rng(4)
    x = rng.standard_normal((steps * batch, t, 8)).astype(np.float32)
    y = (np.argmax(x[:, :5, :CLASSES].sum(axis=1), axis=1)).astype(np.int32)
    model = keras.Sequential([keras.Input((t, 8)), keras.layers.LSTM(32, return_sequences=True, name="lstm_0"),
                              keras.layers.LSTM(32, name="lstm_1"), keras.layers.Dense(CLASSES, name="logits")],
                             name="lstm")
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=ce())
    trace = fit_logged(model, x, y, log_dir, batch=batch)
    return label_run(summary.variable_names(model.trainable_variables), trace, rule=LEARN)


DEAD_RULE = "dead rule: bitwise-unchanged weights at >= 90% of SGD steps (exact-zero gradients) + learning rule"


# A two-branch MLP whose second branch has its ReLU bias initialised at -20: every pre-activation is negative, every
# unit of the branch is dead, its kernel and bias get exactly-zero gradients (dead rule, measured: SGD leaves them
# bitwise unchanged). The other branch and the head learn.
@case("dead_relu_branch", DEAD_RULE)
def dead_relu_branch(log_dir: str) -> dict[str, Any]:
    import keras

    from tb_gradhealth import summary

    L = keras.layers
    inp = keras.Input((FEATURES,))
    a = L.Dense(32, activation="relu", kernel_initializer="he_normal", name="live_1")(inp)
    a = L.Dense(32, activation="relu", kernel_initializer="he_normal", name="live_2")(a)
    b = L.Dense(32, activation="relu", bias_initializer=keras.initializers.Constant(-20.0), name="dead_1")(inp)
    out = L.Dense(CLASSES, name="logits")(L.Concatenate(name="concat")([a, b]))
    model = keras.Model(inp, out, name="two_branch")
    x, y = teacher_data(60 * 64, 13)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=ce())
    trace = fit_logged(model, x, y, log_dir, batch=64)
    names = summary.variable_names(model.trainable_variables)
    unchanged = np.array(trace.unchanged).mean(axis=0)
    dead = [n for i, n in enumerate(names) if unchanged[i] >= 0.9]
    labels = label_run(names, trace, inert=dead, rule=DEAD_RULE)
    for n in dead:
        labels["layers"][n] = {"status": "dead", "onset": trace.steps[0]}
    labels["sick"] = True
    labels["culprits"] = _deepest_first(names, [n for n, e in labels["layers"].items()
                                                if e["status"] in ("dead", "vanishing") and not e.get("doubtful")])
    labels["onset"] = trace.steps[0]
    labels["evidence"]["unchanged_fraction"] = dict(zip(names, map(float, unchanged), strict=True))
    return labels


NAN_RULE = ("per step, measured in the loop: nonfinite where a variable's gradient has NaN/Inf, dead where it is "
            "exactly zero; culprit = the layer whose backward pass the NaN was injected into")
NAN_LAYER, NAN_STEP = "relu_02", 15


# NaN injected into the backward pass at a known layer and step: a tf.custom_gradient identity after relu_02's output
# returns NaN as the gradient at step 15. Backprop carries it into relu_02's own kernel/bias gradients and every
# shallower layer's at step 15 (deeper layers are finite: backprop reached them first); SGD writes NaN weights.
# From step 16, TF's ReLU maps the NaN activations to 0, so what each variable's gradient is afterwards (NaN, or
# exactly zero because the path is cut) is measured at every step in the loop, in plain TF: the labels are that
# measured chain (nonfinite where the gradient has a NaN/Inf, dead where it is exactly zero, healthy otherwise).
# The culprit is relu_02 (kernel and bias). A custom loop logging with summary.gradients.
@case("nan_injection", NAN_RULE)
def nan_injection(log_dir: str) -> dict[str, Any]:
    import keras
    import tensorflow as tf

    from tb_gradhealth import summary

    model = dense_stack(5, "relu", width=32, name="nan", kernel_initializer="he_normal")
    names = summary.variable_names(model.trainable_variables)
    opt = keras.optimizers.SGD(0.05)
    batch, steps = 64, NAN_STEP + 10
    x, y = teacher_data(steps * batch, 17)
    writer = tf.summary.create_file_writer(log_dir)

    @tf.custom_gradient
    def poison(h: Any, flag: Any) -> Any:
        def grad(dy: Any) -> Any:
            return tf.where(flag, tf.fill(tf.shape(dy), float("nan")), dy), tf.zeros_like(flag, tf.float32)

        return tf.identity(h), grad

    @tf.function
    def step_fn(xb: Any, yb: Any, step: Any) -> Any:
        with tf.GradientTape() as tape:
            h = xb
            for layer in model.layers:
                h = layer(h, training=True)
                if layer.name == NAN_LAYER:
                    h = poison(h, tf.equal(step, NAN_STEP))
            loss = ce()(yb, h)
        grads = tape.gradient(loss, model.trainable_variables)
        with writer.as_default(step=step):
            summary.gradients(zip(grads, model.trainable_variables, strict=True))
            tf.summary.scalar("loss", loss)
        opt.apply(grads, model.trainable_variables)
        return ([tf.reduce_all(tf.math.is_finite(g)) for g in grads], [tf.reduce_all(tf.equal(g, 0.0)) for g in grads])

    states: list[list[str]] = []
    for s in range(1, steps + 1):
        finite, zero = step_fn(x[(s - 1) * batch:s * batch], y[(s - 1) * batch:s * batch], tf.constant(s, tf.int64))
        states.append(["nonfinite" if not bool(f) else "dead" if bool(z) else "healthy"
                       for f, z in zip(finite, zero, strict=True)])
    writer.close()
    step_list = list(range(1, steps + 1))
    layers = {n: _chain(step_list, [st[i] for st in states]) for i, n in enumerate(names)}
    first = min(e["onset"] for e in layers.values() if e["status"] != "healthy")
    culprits = [n for n in names if n.split("/")[-2] == NAN_LAYER]
    evidence = {"states": {n: [st[i] for st in states] for i, n in enumerate(names)}}
    return {"sick": True, "layers": layers, "culprits": culprits, "onset": first, "first_nan": first,
            "diverges": False, "rule": NAN_RULE, "evidence": evidence}


def _chain(steps: Sequence[int], states: Sequence[str]) -> dict[str, Any]:
    """A label from a measured status per step: its episodes (healthy before the first change)."""
    eps = []
    for s, st in zip(steps, states, strict=True):
        if (eps[-1]["status"] if eps else "healthy") != st:
            eps.append({"status": st, "from": int(s)})
    if not eps:
        return {"status": "healthy", "onset": None}
    return {"status": eps[0]["status"], "onset": eps[0]["from"], "episodes": eps}


DIVERGE_RULE = ("divergence rule: onset = first of 3 logged steps each >= 1.5x the previous (loss or a main weight "
                "norm), or a weight norm's >= 10x jump, never undone; exploding = main weight norm grew >= 10x from "
                "just before the onset; nonfinite from the first NaN gradient")


def _diverging_fit(log_dir: str, model: Any, optimizer: Any, x: Any, y: Any, *, batch: int, loss: Any = None,
                   inert: Sequence[str] = ()) -> dict[str, Any]:
    from tb_gradhealth import summary

    model.compile(optimizer=optimizer, loss=loss or ce())
    trace = fit_logged(model, x, y, log_dir, batch=batch, stop_after_nan=3)
    names = summary.variable_names(model.trainable_variables)
    return divergence_labels(names, trace.steps, trace.loss, np.array(trace.wnorm),
                             nonfinite_from_trace(names, trace), inert=inert, rule=DIVERGE_RULE)


# A learning-rate divergence: a He-initialised ReLU MLP on a regression task, plain SGD whose learning rate grows 15% a
# step (a warm-up gone wrong). The loss falls first, then rises exponentially until float32 overflows. Labelled by
# the divergence rule from the raw loss and the weight norms measured before every step (SGD: a non-finite
# gradient writes non-finite weights, which the trace sees at the next step).
def _diverge_model() -> Any:
    import keras

    return keras.Sequential([keras.Input((FEATURES,))]
                            + [keras.layers.Dense(32, activation="relu", kernel_initializer="he_normal",
                                                  name=f"relu_{i}") for i in range(4)]
                            + [keras.layers.Dense(1, name="out")], name="diverge")


#: Seeds of the constant-learning-rate twins of ``lr_divergence_sgd`` beside the run's own (its case name's).
DIVERGE_TWIN_SEEDS = (101, 102)


@case("lr_divergence_sgd", DIVERGE_RULE + "; a variable's exploding episode starts where its gradient norm or "
      "update/weight leaves the range of twins at the schedule's first learning rate (3 seeds, its own among them), "
      "at the latest at the divergence rule's onset")
def lr_divergence_sgd(log_dir: str) -> dict[str, Any]:
    import tempfile

    import keras

    rng = np.random.default_rng(21)
    x = rng.standard_normal((120 * 32, FEATURES)).astype(np.float32)
    y = (x @ rng.standard_normal((FEATURES, 1)) / math.sqrt(FEATURES)).astype(np.float32)
    lr = keras.optimizers.schedules.ExponentialDecay(2e-3, decay_steps=1, decay_rate=1.15)
    labels = _diverging_fit(log_dir, _diverge_model(), keras.optimizers.SGD(lr), x, y, batch=32,
                            loss=keras.losses.MeanSquaredError())
    with tempfile.TemporaryDirectory() as keep:
        twins = []
        for seed in (sum(map(ord, "lr_divergence_sgd")), *DIVERGE_TWIN_SEEDS):  # train() seeds the run by its name
            keras.utils.set_random_seed(seed)
            model = _diverge_model()
            model.compile(optimizer=keras.optimizers.SGD(2e-3), loss=keras.losses.MeanSquaredError())
            twins.append(os.path.join(keep, str(seed)))
            fit_logged(model, x, y, twins[-1], batch=32)
        return with_twin_departures(labels, twin_departures(log_dir, twins))


def with_twin_departures(labels: dict[str, Any], dep: dict[str, int | None]) -> dict[str, Any]:
    """A global cause's labels with each exploding episode starting at the variable's departure from its twins
    (when earlier), the divergence rule's onset kept as the latest acceptable one (``latest_onset``)."""
    for n, entry in labels["layers"].items():
        eps = entry.get("episodes") or []
        if eps and eps[0]["status"] == "exploding" and dep.get(n) is not None and dep[n] < eps[0]["from"]:
            entry["latest_onset"] = eps[0]["from"]
            eps[0]["from"] = entry["onset"] = dep[n]
    labels["evidence"]["departures"] = dep
    if any("latest_onset" in e for e in labels["layers"].values()):
        labels["latest_onset"] = labels["onset"]
        labels["onset"] = min(e["onset"] for e in labels["layers"].values() if e.get("onset") is not None)
    return labels


MIXED_RULE = ("healthy: overflowed steps are skipped by the loss-scale optimizer (measured: weights unchanged, "
              "scale halved), every other step learns (learning rule)")


# Mixed precision with dynamic loss scaling: float16 compute, a LossScaleOptimizer starting at scale 2^22, so the
# first few scaled gradients overflow float16; the optimizer skips those steps (weights unchanged) and halves the
# scale until it fits. The record (custom loop, summary.gradients) holds the unscaled gradient, Inf on the skipped
# steps, with the pre-step weights and the applied update (zero on a skipped step). Skipping an overflowed step is
# the optimizer working as designed, not a disease: every layer is labelled healthy; the learning rule (applied on
# the whole run) confirms that every layer learns. Measured evidence: the skipped steps.
@case("mixed_precision", MIXED_RULE)
def mixed_precision(log_dir: str) -> dict[str, Any]:
    import keras
    import tensorflow as tf

    from tb_gradhealth import summary

    L = keras.layers
    model = keras.Sequential([keras.Input((FEATURES,))]
                             + [L.Dense(64, activation="relu", kernel_initializer="he_normal", name=f"relu_{i}",
                                        dtype="mixed_float16") for i in range(3)]
                             + [L.Dense(CLASSES, name="logits", dtype="float32")], name="mixed")
    variables = model.trainable_variables
    names = summary.variable_names(variables)
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=2.0**22)
    opt.build(variables)
    batch, steps = 64, 40
    x, y = teacher_data(steps * batch, 23)
    writer = tf.summary.create_file_writer(log_dir)
    w_start = [v.numpy().astype(np.float64) for v in variables]

    @tf.function
    def step_fn(xb: Any, yb: Any, step: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = ce()(yb, model(xb, training=True))
            scaled = opt.scale_loss(loss)
        grads = tape.gradient(scaled, variables)
        scale = tf.identity(opt.dynamic_scale)
        before = [tf.identity(v) for v in variables]
        opt.apply(grads, variables)
        updates = [b - v for b, v in zip(before, variables, strict=True)]
        unscaled = [g / scale for g in grads]
        with writer.as_default(step=step):
            summary.gradients(zip(unscaled, variables, strict=True), weights=before, updates=updates)
            tf.summary.scalar("loss", loss)
            tf.summary.scalar("loss_scale", scale)
        return loss, tf.add_n([tf.reduce_sum(tf.abs(u)) for u in updates])

    skipped = []
    for s in range(1, steps + 1):
        _, moved = step_fn(x[(s - 1) * batch:s * batch], y[(s - 1) * batch:s * batch], tf.constant(s, tf.int64))
        if float(moved) == 0.0:
            skipped.append(s)
    writer.close()
    w_end = [v.numpy().astype(np.float64) for v in variables]
    layers, evidence = learning_labels(names, w_start, w_end, 1)
    sick = [n for n, e in layers.items() if e["status"] != "healthy" and not e.get("doubtful")]
    return {"sick": bool(sick), "layers": layers, "culprits": sick, "onset": 1 if sick else None, "first_nan": None,
            "diverges": False, "rule": MIXED_RULE, "evidence": {**evidence, "skipped_steps": skipped}}


SUM_MEAN_RULE = LEARN + " (10 sigmoid layers, SGD; sum- and mean-reduced loss, lr scaled by 1/batch: same training)"


def _reduction_case(reduction: str) -> Callable[[str], dict[str, Any]]:
    def run(log_dir: str) -> dict[str, Any]:
        import keras

        batch = 64
        lr = 0.5 if reduction == "sum_over_batch_size" else 0.5 / batch  # the same SGD trajectory
        keras.utils.set_random_seed(31)  # the same init for both runs
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
        return _mlp_case(log_dir, dense_stack(10, "sigmoid", name="sigmoid10"), keras.optimizers.SGD(lr),
                         steps=60, batch=batch, loss=loss, rule=SUM_MEAN_RULE)

    return run


# The same sick network and the same training with the loss mean-reduced and sum-reduced (lr divided by the batch
# size, so the weights follow the same path): gradients differ by the batch size (1.8 decades), labels are equal.
case("loss_mean", SUM_MEAN_RULE)(_reduction_case("sum_over_batch_size"))
case("loss_sum", SUM_MEAN_RULE)(_reduction_case("sum"))

CLIP_RULE = LEARN + " (He/ReLU MLP, SGD with clipnorm: healthy)"


# Gradient clipping on a healthy network: SGD(0.1, clipnorm=0.05) clips every variable's gradient to norm 0.05 at most
# (measured: the fraction of steps where the recorded norm sits at the clip); the record holds the applied, clipped
# gradient. Healthy by the learning rule: every layer learns at a comparable rate.
@case("clipnorm", CLIP_RULE)
def clipnorm(log_dir: str) -> dict[str, Any]:
    import keras

    model = keras.Sequential([keras.Input((FEATURES,))]
                             + [keras.layers.Dense(64, activation="relu", kernel_initializer="he_normal",
                                                   name=f"relu_{i}") for i in range(4)]
                             + [keras.layers.Dense(CLASSES, name="logits")], name="clip")
    return _mlp_case(log_dir, model, keras.optimizers.SGD(0.1, clipnorm=0.05), steps=60, rule=CLIP_RULE)


EVERY100_RULE = LEARN + " (BN/ReLU MLP, Adam, logged every 100 of 2,000 steps: healthy)"


# A run logged every 100 steps (update_freq=100, 2,000 steps, 20 logged steps): a healthy Dense/BN/ReLU MLP with Adam.
@case("every_100_steps", EVERY100_RULE)
def every_100_steps(log_dir: str) -> dict[str, Any]:
    import keras

    L = keras.layers
    layers = [keras.Input((FEATURES,))]
    for i in range(3):
        layers += [L.Dense(64, use_bias=False, kernel_initializer="he_normal", name=f"dense_{i}"),
                   L.BatchNormalization(name=f"bn_{i}"), L.ReLU(name=f"relu_{i}")]
    model = keras.Sequential(layers + [L.Dense(CLASSES, name="logits")], name="every100")
    return _mlp_case(log_dir, model, keras.optimizers.Adam(1e-3), steps=2000, batch=32, update_freq=100,
                     rule=EVERY100_RULE)


APP_RULE = ("inert rule on the model graph (biases/betas whose every path ends in BatchNormalization) + learning "
            "rule; healthy otherwise")
APP_STEPS = 8


def _application(name: str) -> Any:
    import keras

    return getattr(keras.applications, name)(weights=None, input_shape=(32, 32, 3), classes=CLASSES,
                                             classifier_activation=None)


def _app_case(name: str, scale: float) -> Callable[[str], dict[str, Any]]:
    def run(log_dir: str) -> dict[str, Any]:
        import keras

        from tb_gradhealth import summary

        model = _application(name)
        x, y = image_data(APP_STEPS * 8, 3, 32, scale)
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=ce())
        trace = fit_logged(model, x, y, log_dir, batch=8)
        names = summary.variable_names(model.trainable_variables)
        return label_run(names, trace, inert=inert_parameters(model), rule=APP_RULE)

    return run


# keras.applications models trained as a user would (weights=None, 32x32 inputs, 4 classes, batch 8, Adam): healthy.
# Their structural zeros are labelled by the inert rule on the model graph: ResNet50's conv biases (each feeds only
# a BatchNormalization), MobileNetV2's project_BN betas (reached only through a 1x1 conv into BatchNormalization),
# EfficientNetB0's project_bn betas of blocks without a residual (their stochastic-depth Dropout in the residual
# blocks scales each sample differently, so there the beta is not inert; the rule leaves it healthy).
case("app_resnet50", APP_RULE + " (ResNet50)", heavy=True)(_app_case("ResNet50", 1.0))
case("app_mobilenetv2", APP_RULE + " (MobileNetV2)", heavy=True)(_app_case("MobileNetV2", 1.0))
case("app_efficientnetb0", APP_RULE + " (EfficientNetB0: takes 0-255 inputs)", heavy=True)(
    _app_case("EfficientNetB0", 255.0))


# ResNet50 with SGD(0.1) on the same task diverges within a few steps: labelled by the divergence rule (raw loss and
# the weight norms before every step), conv biases inert as above. At most 16 steps, 3 after the first NaN loss.
@case("app_resnet50_diverge", DIVERGE_RULE + " (ResNet50, SGD 0.1)", heavy=True)
def app_resnet50_diverge(log_dir: str) -> dict[str, Any]:
    import keras

    model = _application("ResNet50")
    x, y = image_data(16 * 8, 3, 32)
    return _diverging_fit(log_dir, model, keras.optimizers.SGD(0.1), x, y, batch=8, inert=inert_parameters(model))
