"""Zoo cases of everyday Keras/TensorFlow loops whose story runs over time, and how each one is labelled.

Six classes: ``keras.applications`` models trained from scratch by ``fit()`` under SGD with momentum (no blow-up),
a run that ``TerminateOnNaN`` stops on its first NaN (at its first steps, or after healthy ones), huge gradients
that a tiny learning rate keeps finite, a learning rate that jumps in the middle of a convnet's training (the loss
does or does not come back), a learning rate growing 1.3x a step in ``fit()`` until NaN, and fits under Adam that
reach their loss floor (healthy). Each class has one instance in the design half (``zoo_cases.CASES``: studied to
design the rules) and at least one in the held-out half (``zoo_heldout.CASES``: written before the rules for them
changed, never tuned on), which differs from it by seed, architecture or hyperparameters.

Labels are measurements of the training, never the diagnosis: a twin's range (:func:`zoo_cases.twin_departures`),
a clean twin bit-identical up to a step (``identical_until``: records and loss compared), the weights a plain
Keras step writes, the loss against its level before an episode (``recovered``), the known floor of the data's
loss, gradient norms against a twin on every batch. The rule of each class is written beside it.
``python benchmarks/diagnosis_zoo.py --half both --only <case>``.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from benchmarks import zoo_cases, zoo_heldout
from benchmarks.zoo_cases import CLASSES, FEATURES, Case, ce, image_data, teacher_data

#: The two halves a case is registered in.
DESIGN, HELDOUT = zoo_cases.CASES, zoo_heldout.CASES


def register(half: dict[str, Case], name: str, rule: str, *, heavy: bool = False) -> Callable:
    """Register a case function in ``half`` (:data:`DESIGN` or :data:`HELDOUT`)."""

    def add(fn: Callable[[str], dict[str, Any]]) -> Callable[[str], dict[str, Any]]:
        if name in DESIGN or name in HELDOUT:
            raise ValueError(f"zoo case {name!r} is registered twice")
        half[name] = Case(name, rule, fn, heavy)
        return fn

    return add


# --- what a run wrote, read back ---------------------------------------------------------------------------------


def logged_run(log_dir: str) -> tuple[list[str], np.ndarray, np.ndarray, dict[int, float]]:
    """``(layers, steps, records, {step: loss})`` of the one gradient-health run under ``log_dir``, as the zoo's
    scorer reads it (the loss: the writer's, or the loop's scalar ``loss``)."""
    from tb_gradhealth import progress, reader

    runs = [r for r in reader.read_logdir(log_dir).runs if r.num_steps]
    if len(runs) != 1:
        raise RuntimeError(f"{log_dir}: expected one gradient-health run, got {[r.run for r in runs]}")
    loss = progress.read_loss(progress.run_paths(reader.find_runs(log_dir), runs[0].run))
    losses = {} if loss is None else {int(s): float(v) for s, v in zip(*loss, strict=True)}
    return list(runs[0].layers), np.asarray(runs[0].steps), runs[0].records, losses


def identical_until(run_dir: str, twin_dir: str) -> int | None:
    """The last logged step up to which the run under ``run_dir`` is bit-identical to its clean twin under
    ``twin_dir``: the same variables, and at every logged step up to it the same records (NaN where NaN) and the
    same loss. None: they differ from the first logged step."""
    layers, steps, records, loss = logged_run(run_dir)
    t_layers, t_steps, t_records, t_loss = logged_run(twin_dir)
    if layers != t_layers:
        raise RuntimeError(f"the twin records other variables: {layers} != {t_layers}")
    last = None
    for i, s in enumerate(steps):
        j = np.flatnonzero(t_steps == s)
        same = (j.size == 1 and np.array_equal(records[i], t_records[j[0]], equal_nan=True)
                and (s not in loss or (s in t_loss and np.array_equal(loss[s], t_loss[s], equal_nan=True))))
        if not same:
            break
        last = int(s)
    return last


def _loss_tenths(loss: Sequence[float]) -> tuple[float, float]:
    """The mean loss over the first and the last tenth of the steps."""
    v = np.asarray(loss, dtype=np.float64)
    k = max(1, v.size // 10)
    return float(v[:k].mean()), float(v[-k:].mean())


def _raw_losses(history: Sequence[float]) -> list[float]:
    """Per-batch losses from Keras' running mean over an epoch (``k*m_k - (k-1)*m_(k-1)``, equal batches)."""
    m = [float(v) for v in history]
    return [m[0]] + [(k + 1) * m[k] - k * m[k - 1] for k in range(1, len(m))]


def _loss_recorder() -> Any:
    import keras

    class LossRecorder(keras.callbacks.Callback):
        """Keras' running mean of the loss after every batch (no writer: a continuation of a logged fit)."""

        def on_train_begin(self, logs: Any = None) -> None:
            self.means: list[float] = []

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.means.append(float((logs or {}).get("loss", math.nan)))

    return LossRecorder()


# --- 1. keras.applications from scratch under SGD with momentum: no blow-up ---------------------------------------

MOMENTUM_APP_RULE = ("no blow-up by measurement: fit() applies each step's fresh gradient (it cannot forget to zero "
                     "it); the loss is finite at every step and a continuation of the same training (60 more steps "
                     "on fresh batches) stays finite and ends below the run's first tenth (it does not run away) "
                     "(checked); per layer the inert rule on the model graph and the learning rule (vanishing where "
                     "a layer moves 3 decades less than the head; healthy otherwise); SGD(0.01, momentum=0.9), whose "
                     "velocity grows over its first steps by design, 60 steps logged at every step")
APP_MOMENTUM_STEPS = 60


def _app_momentum(app: str, *, scale: float, seed: int) -> Callable[[str], dict[str, Any]]:
    """A ``keras.applications`` model (weights=None, 32x32 inputs, 4 classes, batch 8) trained from scratch by
    ``fit()`` under SGD(0.01, momentum=0.9); ``scale``: the input range the model takes (255 where it rescales
    its inputs itself)."""

    def run(log_dir: str) -> dict[str, Any]:
        import keras

        from tb_gradhealth import summary

        model = getattr(keras.applications, app)(weights=None, input_shape=(32, 32, 3), classes=CLASSES,
                                                  classifier_activation=None)
        x, y = image_data(APP_MOMENTUM_STEPS * 8, seed, 32, scale)
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss=ce())
        trace = zoo_cases.fit_logged(model, x, y, log_dir, batch=8)
        names = summary.variable_names(model.trainable_variables)
        labels = zoo_cases.label_run(names, trace, inert=zoo_cases.inert_parameters(model), rule=MOMENTUM_APP_RULE)
        xc, yc = image_data(APP_MOMENTUM_STEPS * 8, seed + 1, 32, scale)
        rec = _loss_recorder()
        model.fit(xc, yc, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[rec])
        more = _raw_losses(rec.means)
        first, _ = _loss_tenths(trace.loss)
        _, cont_last = _loss_tenths(more)
        if not (np.isfinite(trace.loss).all() and np.isfinite(more).all() and cont_last < first):
            raise RuntimeError(f"{app}: the loss ran away: first tenth {first:.3g}, continuation's last tenth "
                               f"{cont_last:.3g}")
        labels["evidence"].update(loss_first_last_tenth=list(_loss_tenths(trace.loss)),
                                  continuation_loss_first_last_tenth=list(_loss_tenths(more)))
        return labels

    return run


register(DESIGN, "app_mobilenetv3small_momentum", MOMENTUM_APP_RULE + " (MobileNetV3Small: takes 0-255 inputs)",
         heavy=True)(_app_momentum("MobileNetV3Small", scale=255.0, seed=811))


# --- 2. a run that died on its first NaN (TerminateOnNaN) -----------------------------------------------------------

NAN_STOP_RULE = ("measured at the step TerminateOnNaN stopped on (its loss the first NaN/Inf one): from the "
                 "weights before that step, a variable whose gradient has NaN/Inf is nonfinite from that step, and "
                 "plain Keras train_on_batch from the same weights writes NaN into exactly those variables "
                 "(checked: nothing was skipped); every earlier step had a finite loss and finite weights "
                 "(healthy); culprit: the first layer whose forward output on that batch is not finite (where the "
                 "overflow was made); recovered: false (the run ended on a NaN loss)")
NAN_TWIN_RULE = (NAN_STOP_RULE + "; the clean twin trains on the same data without the corrupted batch: "
                 "identical_until is measured by comparing their records and losses, and the twin learns (checked)")


def exp_mlp(seed: int, *, depth: int, width: int, name: str) -> Any:
    """Dense layers with exponential activations (``exp_<i>``) and a linear classifier: overflows float32 as soon
    as a pre-activation passes ~88."""
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((FEATURES,))]
                            + [keras.layers.Dense(width, activation="exponential", name=f"exp_{i}")
                               for i in range(depth)]
                            + [keras.layers.Dense(CLASSES, name="logits")], name=name)


def _weights_before_step() -> Any:
    import keras

    class WeightsBeforeStep(keras.callbacks.Callback):
        """A copy of the trainable weights taken before every step (the last one kept)."""

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self.weights = [np.array(v.numpy()) for v in self.model.trainable_variables]

    return WeightsBeforeStep()


def nan_step_evidence(model: Any, weights: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray
                      ) -> dict[str, Any]:
    """From ``weights`` (before the step) on the batch ``(x, y)``: which variables' gradients are not finite, the
    first layer whose forward output is not finite, and which variables plain Keras ``train_on_batch`` (the
    model's compiled optimizer) leaves with NaN/Inf weights."""
    import tensorflow as tf

    variables = model.trainable_variables
    for v, w in zip(variables, weights, strict=True):
        v.assign(w)
    h, first_bad = tf.constant(x), None
    for layer in model.layers:
        h = layer(h, training=True)
        if first_bad is None and not bool(tf.reduce_all(tf.math.is_finite(h))):
            first_bad = layer.name
    with tf.GradientTape() as tape:
        value = model.loss(y, model(x, training=True))
    grads = tape.gradient(value, variables)
    grad_bad = [not bool(tf.reduce_all(tf.math.is_finite(g))) for g in grads]
    model.train_on_batch(x, y)
    weight_bad = [not bool(np.all(np.isfinite(v.numpy()))) for v in variables]
    return {"loss": float(value), "grad_nonfinite": grad_bad, "weights_nonfinite": weight_bad,
            "first_nonfinite_layer": first_bad}


def nan_stop_labels(log_dir: str, model: Any, x: np.ndarray, y: np.ndarray, *, batch: int, rule: str
                    ) -> dict[str, Any]:
    """``fit()`` with ``TerminateOnNaN`` on a compiled ``model`` (plain SGD), labelled by :data:`NAN_STOP_RULE`."""
    import keras

    from tb_gradhealth import summary

    keep = _weights_before_step()
    trace = zoo_cases.fit_logged(model, x, y, log_dir, batch=batch,
                                 callbacks=[keep, keras.callbacks.TerminateOnNaN()])
    names = summary.variable_names(model.trainable_variables)
    k = trace.steps[-1]
    if math.isfinite(trace.loss[-1]) or not all(math.isfinite(v) for v in trace.loss[:-1]) or not all(
            f.all() for f in trace.finite):
        raise RuntimeError(f"TerminateOnNaN did not stop on the first NaN loss: losses {trace.loss}")
    ev = nan_step_evidence(model, keep.weights, x[(k - 1) * batch:k * batch], y[(k - 1) * batch:k * batch])
    if ev["grad_nonfinite"] != ev["weights_nonfinite"] or ev["first_nonfinite_layer"] is None:
        raise RuntimeError(f"the NaN step is not what its gradients say: {ev}")
    layers = {n: ({"status": "nonfinite", "onset": k, "episodes": [{"status": "nonfinite", "from": k}]}
                  if bad else {"status": "healthy", "onset": None})
              for n, bad in zip(names, ev["grad_nonfinite"], strict=True)}
    by_id = dict(zip(map(id, model.trainable_variables), names, strict=True))
    culprits = [by_id[id(v)] for v in model.get_layer(ev["first_nonfinite_layer"]).trainable_variables]
    return {"sick": True, "layers": layers, "culprits": culprits, "onset": k, "first_nan": k, "diverges": False,
            "recovered": False, "rule": rule,
            "evidence": {"loss": [float(v) for v in trace.loss], "stopped_at": k,
                         "nan_step": {**ev, "grad_nonfinite": dict(zip(names, ev["grad_nonfinite"], strict=True)),
                                      "weights_nonfinite": dict(zip(names, ev["weights_nonfinite"], strict=True))}}}


def _exp_nan_case(*, seed: int, depth: int, width: int, lr: float, data_seed: int
                  ) -> Callable[[str], dict[str, Any]]:
    """An exponential-activation MLP whose loss overflows at its first step(s), SGD(``lr``), batch 32."""

    def run(log_dir: str) -> dict[str, Any]:
        import keras

        model = exp_mlp(seed, depth=depth, width=width, name="exp_mlp")
        model.compile(optimizer=keras.optimizers.SGD(lr), loss=ce())
        x, y = teacher_data(20 * 32, data_seed)
        return nan_stop_labels(log_dir, model, x, y, batch=32, rule=NAN_STOP_RULE)

    return run


def _corrupt_batch_case(build: Callable[[], Any], *, at: int, factor: float, lr: float, data_seed: int,
                        steps: int = 40, batch: int = 32) -> Callable[[str], dict[str, Any]]:
    """``build()`` trained by fit() under SGD(``lr``) on teacher data whose batch ``at`` arrives in other units
    (its inputs times ``factor``, e.g. a feature pipeline that skipped its normalisation once), beside the clean
    twin on the same data without that batch's change."""

    def run(log_dir: str) -> dict[str, Any]:
        import keras

        x, y = teacher_data(steps * batch, data_seed)
        bad = x.copy()
        bad[(at - 1) * batch:at * batch] *= factor
        with tempfile.TemporaryDirectory() as keep:
            twin = build()
            twin.compile(optimizer=keras.optimizers.SGD(lr), loss=ce())
            twin_trace = zoo_cases.fit_logged(twin, x, y, keep, batch=batch)
            model = build()
            model.compile(optimizer=keras.optimizers.SGD(lr), loss=ce())
            labels = nan_stop_labels(log_dir, model, bad, y, batch=batch, rule=NAN_TWIN_RULE)
            labels["identical_until"] = identical_until(log_dir, keep)
        first, last = _loss_tenths(twin_trace.loss)
        if labels["onset"] != at or labels["identical_until"] != at - 1 or not last < first:
            raise RuntimeError(f"the corrupted batch did not stop the run at step {at} after a clean prefix: "
                               f"stopped at {labels['onset']}, identical until {labels['identical_until']}, "
                               f"twin loss {first:.3g} -> {last:.3g}")
        labels["evidence"]["twin_loss_first_last_tenth"] = [first, last]
        return labels

    return run


def _relu_exp_head(seed: int, *, width: int, name: str) -> Callable[[], Any]:
    """A builder of a He/ReLU layer, a layer with exponential activations and a linear classifier."""

    def build() -> Any:
        import keras

        keras.utils.set_random_seed(seed)
        L = keras.layers
        return keras.Sequential([keras.Input((FEATURES,)),
                                 L.Dense(width, activation="relu", kernel_initializer="he_normal", name="relu_0"),
                                 L.Dense(width, activation="exponential", name="exp_1"),
                                 L.Dense(CLASSES, name="logits")], name=name)

    return build


register(DESIGN, "exp_mlp_nan_first_step", NAN_STOP_RULE + " (3 exponential layers of 32, SGD(0.01))")(
    _exp_nan_case(seed=821, depth=3, width=32, lr=0.01, data_seed=823))
register(DESIGN, "corrupt_batch_nan_after_healthy", NAN_TWIN_RULE + " (ReLU then exponential layer of 32; batch 15 "
         "times 30)")(_corrupt_batch_case(_relu_exp_head(827, width=32, name="relu_exp"), at=15, factor=30.0,
                                          lr=0.02, data_seed=829))


# --- 3. huge gradients under a tiny learning rate --------------------------------------------------------------------

TINY_LR_RULE = ("twin at {twin}, same data, gradients on every batch before and after training: exploding where the "
                "variable's gradient norm (and, where its weights are not zero, its gradient/weight ratio) is at "
                "least 2 decades above the twin's (median over the batches, the smaller of start and end); healthy "
                "within 1 decade; doubtful between. Never vanishing. Intervention (checked): at the twin's usual "
                "learning rate {usual:g} the mutant's loss goes NaN/Inf or ends above where it began while the twin's "
                "falls: the learning rate {lr:g} is far too small for gradients that blow up at any usual one; the "
                "run's own gradients stay finite (checked)")


def _tiny_lr_case(build: Callable[[bool], Any], *, twin: str, x: np.ndarray, y: np.ndarray, batch: int,
                  steps: int, lr: float, usual: float) -> tuple[str, Callable[[str], dict[str, Any]]]:
    """``(rule, case)``: ``build(True)`` (the mutant) trained by plain SGD(``lr``) in a custom loop, labelled
    against ``build(False)`` (the twin) by :data:`TINY_LR_RULE`."""
    rule = TINY_LR_RULE.format(twin=twin, usual=usual, lr=lr)

    def norms(model: Any) -> tuple[np.ndarray, np.ndarray]:
        return (zoo_heldout._norms_per_batch(model, x, y, batch, ce()),
                np.array([np.linalg.norm(v.numpy().astype(np.float64)) for v in model.trainable_variables]))

    def decades(grads: np.ndarray, weights: np.ndarray, t_grads: np.ndarray, t_weights: np.ndarray) -> np.ndarray:
        g = zoo_heldout._median_decades(zoo_heldout._decades(grads, t_grads, 1.0))
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = g - np.log10(weights / t_weights)
        return np.where((weights > 0) & (t_weights > 0), np.minimum(g, ratio), g)

    def run(log_dir: str) -> dict[str, Any]:
        import keras

        t_grads, t_weights = norms(build(False))
        mutant = build(True)
        before = decades(*norms(mutant), t_grads, t_weights)
        r = zoo_heldout.train_loop(log_dir, mutant, keras.optimizers.SGD(lr), x, y, steps=steps, batch=batch)
        dec = np.minimum(before, decades(*norms(mutant), t_grads, t_weights))
        usual_loss = {}
        with tempfile.TemporaryDirectory() as keep:
            for kind in ("mutant", "twin"):
                u = zoo_heldout.train_loop(os.path.join(keep, kind), build(kind == "mutant"),
                                           keras.optimizers.SGD(usual), x, y, steps=steps, batch=batch)
                usual_loss[kind] = u["loss"]
        m_first, m_last = _loss_tenths(usual_loss["mutant"])
        t_first, t_last = _loss_tenths(usual_loss["twin"])
        blew_up = not np.isfinite(usual_loss["mutant"]).all() or m_last > m_first
        live = all(st == "live" for row in r["states"] for st in row)
        if not (blew_up and t_last < t_first and live and np.isfinite(dec).all()):
            raise RuntimeError(f"no finding to label: mutant at lr {usual:g} {m_first:.3g} -> {m_last:.3g}, twin "
                               f"{t_first:.3g} -> {t_last:.3g}, own gradients all live {live}, decades {dec}")
        names = r["names"]
        layers, sick = {}, []
        for n, d in zip(names, dec, strict=True):
            bad = d >= 2.0
            layers[n] = {"status": "exploding" if bad else "healthy", "onset": 1 if bad else None,
                         "decades_above_twin": round(float(d), 2), **({"doubtful": True} if 1.0 < d < 2.0 else {})}
            if bad:
                sick.append(n)
        order = {n: i for i, n in enumerate(names)}
        return {"sick": bool(sick), "layers": layers, "culprits": sorted(sick, key=lambda n: -order[n]),
                "onset": 1 if sick else None, "first_nan": None, "diverges": False, "rule": rule,
                "evidence": {"loss_first_last_tenth": list(_loss_tenths(r["loss"])),
                             "usual_lr_mutant_loss": [float(v) for v in usual_loss["mutant"][:10]],
                             "usual_lr_twin_loss_first_last_tenth": [t_first, t_last]}}

    return rule, run


def _scaled_relu_mlp(seed: int, *, depth: int, width: int, scale: float, name: str) -> Callable[[bool], Any]:
    """A builder of a ReLU MLP whose hidden kernels are drawn at ``scale`` times He's standard deviation (the
    mutant) or at He's (its twin); the classifier is Glorot in both."""

    def build(mutant: bool) -> Any:
        import keras

        keras.utils.set_random_seed(seed)
        s = scale if mutant else 1.0
        init = keras.initializers.VarianceScaling(2.0 * s * s, "fan_in", "normal", seed=seed)
        return keras.Sequential([keras.Input((FEATURES,))]
                                + [keras.layers.Dense(width, activation="relu", kernel_initializer=init,
                                                      name=f"relu_{i}") for i in range(depth)]
                                + [keras.layers.Dense(CLASSES, name="logits")], name=name)

    return build


_MX, _MY = teacher_data(60 * 64, 841)
_rule, _run = _tiny_lr_case(_scaled_relu_mlp(843, depth=10, width=32, scale=1.8, name="relu_big"),
                            twin="He's scale", x=_MX, y=_MY, batch=64, steps=60, lr=1e-9, usual=0.01)
register(DESIGN, "relu_mlp_1_8x_he_tiny_lr", _rule + " (10 ReLU layers of 32 at 1.8x He's std, SGD(1e-9))")(_run)


# --- 4. a learning rate that jumps in the middle of a convnet's training ---------------------------------------------

JUMP_RULE = ("custom loop, SGD at {lo:g} until step {at}, then {what}; twins: the same convnet at {lo:g} throughout, "
             "3 seeds (its own among them: identical_until measured against it, records and loss). A variable is "
             "exploding from its departure from the twins' range (gradient norm or update/weight, "
             "zoo_cases.twin_departures), at the latest from the loss label (the first step from the jump on whose "
             "loss is above every twin's and above its own range over the 10 steps before the jump), exact zeros "
             "(dead) and NaN/Inf as measured per step. The run must have learned before the jump (that range below "
             "half its loss over its first 10 steps, checked). recovered: false when every loss from the loss "
             "label to the end stays above that range (the labels run to the end); true when the mean of the last "
             "10 losses is back inside it, and every variable is healthy again from the first step after the "
             "loss's peak whose loss is back inside it; a run that is neither is not labelled; culprits: every "
             "variable")
JUMP_WINDOW = 10


def _convnet(seed: int, *, widths: Sequence[int], dense: int, activation: str, name: str, outputs: int = CLASSES
             ) -> Any:
    """Conv (3x3, same) + 2x2 max-pool blocks of ``widths`` filters, a hidden dense layer and a linear head on
    16x16 images (``logits``, or ``out`` for a regression's single output), He-initialised, no normalisation and
    no clipping."""
    import keras

    keras.utils.set_random_seed(seed)
    L = keras.layers
    layers: list[Any] = [keras.Input((16, 16, 3))]
    for i, w in enumerate(widths):
        layers += [L.Conv2D(w, 3, padding="same", activation=activation, kernel_initializer="he_normal",
                            name=f"conv_{i}"), L.MaxPooling2D(name=f"pool_{i}")]
    layers += [L.Flatten(name="flat"),
               L.Dense(dense, activation=activation, kernel_initializer="he_normal", name="dense"),
               L.Dense(outputs, name="logits" if outputs == CLASSES else "out")]
    return keras.Sequential(layers, name=name)


class LossEpisode(NamedTuple):
    """What the loss did around a learning-rate jump (:data:`JUMP_RULE`), steps 1-based."""

    #: the highest loss over the ``JUMP_WINDOW`` steps before the jump: its range before the episode
    level: float
    #: the first step from the jump on whose loss is above every twin's and above ``level`` (the loss label)
    rise: int
    #: the step of the highest loss from ``rise`` on (the first NaN/Inf one, if any)
    peak: int
    #: the first step after ``peak`` whose loss is back at or below ``level`` (None: never)
    back: int | None
    recovered: bool


def loss_episode(loss: Sequence[float], twin_losses: Sequence[Sequence[float]], *, at: int) -> LossEpisode:
    """The loss around a jump at step ``at`` against its own level before it and its twins' losses; raises
    RuntimeError where :data:`JUMP_RULE` labels nothing (the run had not learned before the jump, the loss never
    rose, or it neither stayed up nor came back)."""
    loss = np.asarray(loss, dtype=np.float64)
    level = float(loss[at - 1 - JUMP_WINDOW:at - 1].max())
    start = float(loss[:JUMP_WINDOW].mean())
    if not level < 0.5 * start:
        raise RuntimeError(f"the run had not learned before the jump (its loss {level:.3g} against {start:.3g} at "
                           "its start): no level to come back to")
    top = np.max([np.asarray(t, dtype=np.float64)[:loss.size] for t in twin_losses], axis=0)
    above = ~((loss <= top) | (loss <= level))  # NaN counts as above
    rise = next((s for s in range(at, loss.size + 1) if above[s - 1]), None)
    if rise is None:
        raise RuntimeError("the loss never rose above its twins and its level before the jump")
    after = loss[rise - 1:]
    peak = rise + int(np.argmax(np.where(np.isfinite(after), after, np.inf)))
    stayed_up = not (after <= level).any()  # NaN counts as above
    back = next((s for s in range(peak + 1, loss.size + 1) if loss[s - 1] <= level), None)
    recovered = back is not None and float(loss[-JUMP_WINDOW:].mean()) <= level
    if stayed_up == recovered:
        raise RuntimeError(f"neither recovered nor unrecovered: level {level:.3g}, rise at {rise}, back at {back}, "
                           f"last {JUMP_WINDOW} mean {loss[-JUMP_WINDOW:].mean():.3g}")
    return LossEpisode(level, rise, peak, back, recovered)


def jump_labels(run: dict[str, Any], log_dir: str, twins: Sequence[dict[str, Any]], *, at: int, rule: str
                ) -> dict[str, Any]:
    """Labels of a learning-rate jump at step ``at`` by :data:`JUMP_RULE`; ``twins`` as ``zoo_heldout._twin_runs``
    returns them, the first one the run's own seed."""
    ep = loss_episode(run["loss"], [t["loss"] for t in twins], at=at)
    end = ep.back if ep.recovered else math.inf
    dep = zoo_cases.twin_departures(log_dir, [t["dir"] for t in twins])
    steps = list(range(1, len(run["loss"]) + 1))
    layers = {}
    for i, n in enumerate(run["names"]):
        start = dep[n] if dep[n] is not None else ep.rise
        entry = zoo_heldout._measured_chain(steps, [st[i] for st in run["states"]],
                                            lambda s, start=start: "exploding" if start <= s < end else "healthy")
        if entry["status"] != "healthy":
            entry["latest_onset"] = max(ep.rise, start)
        layers[n] = entry
    onsets = [e["onset"] for e in layers.values() if e["onset"] is not None]
    nan = [e["from"] for entry in layers.values() for e in entry.get("episodes", []) if e["status"] == "nonfinite"]
    last = float(np.mean(run["loss"][-JUMP_WINDOW:]))
    return {"sick": True, "layers": layers, "culprits": list(run["names"]), "onset": min(onsets),
            "latest_onset": ep.rise, "first_nan": min(nan) if nan else None, "diverges": not ep.recovered,
            "recovered": ep.recovered, "identical_until": identical_until(log_dir, twins[0]["dir"]), "rule": rule,
            "evidence": {"departures": dep, "loss_rise": ep.rise, "loss_peak_step": ep.peak, "loss_back_at": ep.back,
                         "level_before_jump": ep.level, "loss_last_mean": last,
                         "twin_loss_last_mean": [float(np.mean(t["loss"][-JUMP_WINDOW:])) for t in twins]}}


def _jump_case(build: Callable[[int], Any], *, seed: int, lo: float, hi: float, at: int, until: int | None,
               data_seed: int, steps: int = 80, batch: int = 32) -> tuple[str, Callable[[str], dict[str, Any]]]:
    """``(rule, case)``: the convnet ``build(seed)`` at SGD(``lo``) whose learning rate is ``hi`` from step ``at``
    (to the end, or before step ``until``), labelled by :data:`JUMP_RULE`."""
    what = f"{hi:g} to the end" if until is None else f"{hi:g} for steps {at}-{until - 1}, then {lo:g} again"
    rule = JUMP_RULE.format(lo=lo, at=at, what=what)

    def run(log_dir: str) -> dict[str, Any]:
        import keras

        x, y = image_data(steps * batch, data_seed, 16)

        def one(d: str, s: int, jump: bool = False) -> dict[str, Any]:
            opt = keras.optimizers.SGD(lo)

            def before(step: int) -> None:
                opt.learning_rate.assign(hi if jump and step >= at and (until is None or step < until) else lo)

            return zoo_heldout.train_loop(d, build(s), opt, x, y, steps=steps, batch=batch, before_step=before)

        with tempfile.TemporaryDirectory() as keep:
            twins = zoo_heldout._twin_runs(one, (seed, *zoo_heldout.TWIN_SEEDS[:2]), keep)
            return jump_labels(one(log_dir, seed, jump=True), log_dir, twins, at=at, rule=rule)

    return rule, run


def _jump_convnet(widths: Sequence[int], dense: int, activation: str, name: str) -> Callable[[int], Any]:
    return lambda seed: _convnet(seed, widths=widths, dense=dense, activation=activation, name=name)


_cnn_a = _jump_convnet((16, 32), 32, "relu", "cnn_a")
_rule, _run = _jump_case(_cnn_a, seed=851, lo=0.05, hi=1.0, at=40, until=None, data_seed=853)
register(DESIGN, "cnn_lr_jump_unrecovered", _rule)(_run)
_rule, _run = _jump_case(_cnn_a, seed=851, lo=0.05, hi=0.5, at=40, until=42, data_seed=853)
register(DESIGN, "cnn_lr_spike_recovered", _rule)(_run)


# --- 5. a learning rate growing 1.3x a step in fit() until NaN (what stop_on is for) ---------------------------------

GROWTH_RULE = ("divergence rule (zoo_cases.DIVERGE_RULE) on the raw loss and the weight norms before every step, "
               "except where a gradient is NaN/Inf: measured at every step with tf.GradientTape on that step's batch "
               "from the weights the step starts at (a float32 loss overflows to Inf steps before any gradient does, "
               "and the writer's NaN-origin search then undoes the steps whose gradient is not finite, so neither the "
               "loss nor the weights show it); fit() under SGD(momentum=0.9) whose learning rate grows 1.3x a step "
               "from {lr:g} (a convnet regressing its images' top-left brightness, MSE); a variable's exploding "
               "episode starts where it leaves the range of twins at the constant {lr:g} (3 seeds, its own among "
               "them: identical_until measured against it), at the latest at the divergence rule's onset; recovered: "
               "false (checked: the mean of its last 10 losses is NaN/Inf or above every loss before that onset)")
GROWTH_TWIN_SEEDS = (101, 102)


def _gradient_states(x: np.ndarray, y: np.ndarray, batch: int) -> Any:
    import keras
    import tensorflow as tf

    class GradientStates(keras.callbacks.Callback):
        """Before every step of a ``fit`` over ``(x, y)`` in order (``shuffle=False``): what each variable's gradient
        is on the step's batch from the weights the step starts at (plain ``tf.GradientTape``, the compiled loss):
        "nonfinite", "dead" (exactly zero) or "live". Non-trainable state (batch statistics) is put back."""

        def on_train_begin(self, logs: Any = None) -> None:
            self.states: list[list[str]] = []

        def on_train_batch_begin(self, b: int, logs: Any = None) -> None:
            k = len(self.states)
            xb, yb = x[k * batch:(k + 1) * batch], y[k * batch:(k + 1) * batch]
            model = self.model
            kept = [(v, tf.identity(v)) for v in model.non_trainable_variables]
            with tf.GradientTape() as tape:
                value = keras.losses.get(model.loss)(yb, model(xb, training=True))
            grads = tape.gradient(value, model.trainable_variables)
            for v, w in kept:
                v.assign(w)
            self.states.append(["nonfinite" if not bool(tf.reduce_all(tf.math.is_finite(g))) else
                                "dead" if not bool(tf.reduce_any(g != 0)) else "live" for g in grads])

    return GradientStates()


def _with_measured_states(entry: dict[str, Any] | None, steps: Sequence[int], states: Sequence[str]
                          ) -> dict[str, Any]:
    """A divergence label with the gradient measured at each step: exact zeros are dead and NaN/Inf nonfinite
    where they were measured; a finite gradient keeps the label's status then (its exploding episode, or healthy;
    never nonfinite)."""
    eps = [(e["status"], e["from"]) for e in (entry or {}).get("episodes") or ()]

    def live_as(step: int) -> str:
        now = [st for st, start in eps if start <= step and st != "nonfinite"]
        return now[-1] if now else "healthy"

    if entry is not None and not eps:  # a label without episodes (inert): kept as it is
        return entry
    out = zoo_heldout._measured_chain(steps, states, live_as)
    if entry is not None and "latest_onset" in entry and out["status"] != "healthy":
        out["latest_onset"] = entry["latest_onset"]
    return out


def _growth_case(build: Callable[[int], Any], *, seed: int, lr: float, data_seed: int, batches: int = 60,
                 batch: int = 32) -> tuple[str, Callable[[str], dict[str, Any]]]:
    """``(rule, case)``: the convnet ``build(seed)`` (one output) regressing the mean brightness of each image's
    top-left quadrant, trained by fit() under SGD(momentum=0.9) at ``lr * 1.3**i`` (``i`` the optimizer's step
    count) until 3 steps past its first non-finite loss (or the end of the data), labelled by
    :data:`GROWTH_RULE`."""
    rule = GROWTH_RULE.format(lr=lr)

    def run(log_dir: str) -> dict[str, Any]:
        import keras

        from tb_gradhealth import summary

        x, _ = image_data(batches * batch, data_seed, 16)
        y = x[:, :8, :8].mean(axis=(1, 2, 3))[:, None]
        mse = keras.losses.MeanSquaredError()
        model = build(seed)
        growing = keras.optimizers.schedules.ExponentialDecay(lr, decay_steps=1, decay_rate=1.3)
        model.compile(optimizer=keras.optimizers.SGD(growing, momentum=0.9), loss=mse)
        states = _gradient_states(x, y, batch)
        trace = zoo_cases.fit_logged(model, x, y, log_dir, batch=batch, stop_after_nan=3, callbacks=[states])
        names = summary.variable_names(model.trainable_variables)
        nonfinite = {n: next((s for s, row in zip(trace.steps, states.states, strict=True)
                              if row[i] == "nonfinite"), None) for i, n in enumerate(names)}
        labels = zoo_cases.divergence_labels(names, trace.steps, trace.loss, np.array(trace.wnorm), nonfinite,
                                             rule=rule)
        onset, loss = labels["onset"], np.asarray(trace.loss, dtype=np.float64)
        tail = float(loss[-10:].mean())
        if labels["first_nan"] is None or onset is None or tail <= float(loss[:onset - 1].max()):
            raise RuntimeError(f"no divergence to label: onset {onset}, first NaN/Inf gradient "
                               f"{labels['first_nan']}, loss {loss}")
        with tempfile.TemporaryDirectory() as keep:
            twins = []
            for s in (seed, *GROWTH_TWIN_SEEDS):
                twin = build(s)
                twin.compile(optimizer=keras.optimizers.SGD(lr, momentum=0.9), loss=mse)
                twins.append(os.path.join(keep, str(s)))
                zoo_cases.fit_logged(twin, x, y, twins[-1], batch=batch)
            labels = zoo_cases.with_twin_departures(labels, zoo_cases.twin_departures(log_dir, twins))
            labels["identical_until"] = identical_until(log_dir, twins[0])
        labels["layers"] = {n: _with_measured_states(labels["layers"].get(n), trace.steps,
                                                     [row[i] for row in states.states])
                            for i, n in enumerate(names)}
        labels["recovered"] = False
        labels["evidence"]["gradient_states"] = {n: [row[i] for row in states.states] for i, n in enumerate(names)}
        return labels

    return rule, run


_rule, _run = _growth_case(lambda seed: _convnet(seed, widths=(16, 32), dense=32, activation="relu", name="cnn_growth",
                                                 outputs=1), seed=861, lr=2e-3, data_seed=863)
register(DESIGN, "cnn_lr_growth_momentum_fit", _rule)(_run)


# --- 6. convergence under Adam: the loss at its floor, noisy there ---------------------------------------------------

FLOOR_RULE = ("healthy by measurement: fit() under Adam on fresh batches of data whose loss floor is known from how "
              "it was drawn ({floor}); the mean loss over the last fifth of the steps is within 25% of the floor "
              "and within 2 standard errors of the fifth before it (it sits at its floor, per-batch noise and all), "
              "every loss finite (checked); learning rule per layer (checked); logged every {every} steps")


def _floor_case(kind: str, *, seed: int, data_seed: int, widths: Sequence[int], lr: float, steps: int,
                every: int = 5, batch: int = 32, noise: float = 0.3) -> tuple[str, Callable[[str], dict[str, Any]]]:
    """``(rule, case)``: a ReLU MLP (``widths``) fitted by Adam(``lr``) to a ``kind`` task ("regression": a
    linear teacher plus Gaussian noise of std ``noise``, floor its variance; "classifier": labels drawn from a
    linear teacher's softmax, floor its mean entropy), labelled by :data:`FLOOR_RULE`."""
    floor_text = ("the noise variance" if kind == "regression" else "the mean entropy of the teacher's softmax")
    rule = FLOOR_RULE.format(floor=floor_text, every=every)

    def run(log_dir: str) -> dict[str, Any]:
        import keras

        from tb_gradhealth import summary

        rng = np.random.default_rng(data_seed)
        x = rng.standard_normal((steps * batch, FEATURES)).astype(np.float32)
        if kind == "regression":
            clean = x @ rng.standard_normal((FEATURES, 1)) / math.sqrt(FEATURES)
            y = (clean + noise * rng.standard_normal(clean.shape)).astype(np.float32)
            floor, loss, out = noise**2, keras.losses.MeanSquaredError(), 1
        else:
            logits = 3.0 * x @ rng.standard_normal((FEATURES, CLASSES)) / math.sqrt(FEATURES)
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            drawn = (rng.random((len(x), 1)) > np.cumsum(p, axis=1)).sum(axis=1)
            y = np.minimum(drawn, CLASSES - 1).astype(np.int32)
            floor, loss, out = float(np.mean(-np.sum(p * np.log(p), axis=1))), ce(), CLASSES
        keras.utils.set_random_seed(seed)
        L = keras.layers
        model = keras.Sequential([keras.Input((FEATURES,))]
                                 + [L.Dense(w, activation="relu", name=f"relu_{i}") for i, w in enumerate(widths)]
                                 + [L.Dense(out, name="out")], name=f"{kind}_floor")
        model.compile(optimizer=keras.optimizers.Adam(lr), loss=loss)
        trace = zoo_cases.fit_logged(model, x, y, log_dir, batch=batch, update_freq=every)
        raw = np.asarray(trace.loss, dtype=np.float64)
        q = raw.size // 5
        last, before = raw[-q:], raw[-2 * q:-q]
        stderr = float(np.hypot(last.std(), before.std()) / math.sqrt(q))
        at_floor = abs(last.mean() - floor) <= 0.25 * floor and abs(last.mean() - before.mean()) <= 2 * stderr
        labels = zoo_cases.label_run(summary.variable_names(model.trainable_variables), trace, rule=rule)
        if not (np.isfinite(raw).all() and at_floor) or labels["sick"]:
            raise RuntimeError(f"not at its floor {floor:.4g}: last fifth {last.mean():.4g}, the one before "
                               f"{before.mean():.4g} (2 standard errors {2 * stderr:.3g}), sick {labels['culprits']}")
        labels["evidence"].update(floor=floor, loss_fifths=[float(v.mean()) for v in np.array_split(raw, 5)],
                                  last_fifth_std=float(last.std()))
        return labels

    return rule, run


_rule, _run = _floor_case("regression", seed=871, data_seed=873, widths=(64, 64), lr=3e-3, steps=800)
register(DESIGN, "regression_floor_adam", _rule + " (ReLU MLP 64-64, Adam(3e-3), noise std 0.3)")(_run)


# --- the held-out instances: written before the rules for these classes changed, never tuned on ----------------------

register(HELDOUT, "app_densenet121_momentum", MOMENTUM_APP_RULE + " (DenseNet121)", heavy=True)(
    _app_momentum("DenseNet121", scale=1.0, seed=911))
register(HELDOUT, "app_efficientnetv2b0_momentum", MOMENTUM_APP_RULE + " (EfficientNetV2B0: takes 0-255 inputs)",
         heavy=True)(_app_momentum("EfficientNetV2B0", scale=255.0, seed=913))

register(HELDOUT, "exp_mlp_nan_early", NAN_STOP_RULE + " (2 exponential layers of 32, SGD(0.01))")(
    _exp_nan_case(seed=921, depth=2, width=32, lr=0.01, data_seed=923))
register(HELDOUT, "corrupt_batch_nan_after_healthy_b", NAN_TWIN_RULE + " (ReLU then exponential layer of 64; batch "
         "22 times 50)")(_corrupt_batch_case(_relu_exp_head(925, width=64, name="relu_exp_b"), at=22, factor=50.0,
                                             lr=0.01, data_seed=927))


def _linear_rnn(seed: int, *, gain: float, units: int, name: str) -> Callable[[bool], Any]:
    """A builder of a linear SimpleRNN classifier over 40 steps whose recurrent kernel is orthogonal at ``gain``
    (the mutant) or 1 (its twin)."""

    def build(mutant: bool) -> Any:
        import keras

        keras.utils.set_random_seed(seed)
        init = keras.initializers.Orthogonal(gain=gain if mutant else 1.0, seed=seed)
        return keras.Sequential([keras.Input((40, 8)),
                                 keras.layers.SimpleRNN(units, activation="linear", recurrent_initializer=init,
                                                        name="rnn"),
                                 keras.layers.Dense(CLASSES, name="logits")], name=name)

    return build


_LX = np.random.default_rng(931).standard_normal((60 * 32, 40, 8)).astype(np.float32)
_LY = np.argmax(_LX[:, :5, :CLASSES].sum(axis=1), axis=1).astype(np.int32)
_rule, _run = _tiny_lr_case(_linear_rnn(933, gain=1.2, units=32, name="linear_rnn"), twin="orthogonal gain 1",
                            x=_LX, y=_LY, batch=32, steps=60, lr=1e-7, usual=0.01)
register(HELDOUT, "linear_rnn_gain_1_2_tiny_lr", _rule + " (a linear SimpleRNN of 32 over 40 steps, recurrent "
         "kernel orthogonal at gain 1.2, SGD(1e-7))")(_run)
_WX, _WY = teacher_data(60 * 64, 935)
_rule, _run = _tiny_lr_case(_scaled_relu_mlp(937, depth=8, width=64, scale=2.2, name="relu_big_b"),
                            twin="He's scale", x=_WX, y=_WY, batch=64, steps=60, lr=1e-8, usual=0.01)
register(HELDOUT, "relu_mlp_2_2x_he_tiny_lr", _rule + " (8 ReLU layers of 64 at 2.2x He's std, SGD(1e-8))")(_run)

_cnn_b = _jump_convnet((8, 16, 32), 64, "relu", "cnn_b")
_rule, _run = _jump_case(_cnn_b, seed=941, lo=0.03, hi=0.9, at=50, until=None, data_seed=943)
register(HELDOUT, "cnn_lr_jump_unrecovered_b", _rule)(_run)
_rule, _run = _jump_case(_cnn_b, seed=941, lo=0.03, hi=0.6, at=50, until=53, data_seed=943)
register(HELDOUT, "cnn_lr_spike_unrecovered_b", _rule)(_run)
_rule, _run = _jump_case(_cnn_b, seed=941, lo=0.03, hi=0.4, at=50, until=52, data_seed=943)
register(HELDOUT, "cnn_lr_spike_recovered_b", _rule)(_run)
_rule, _run = _jump_case(_jump_convnet((16, 32), 32, "elu", "cnn_elu"), seed=945, lo=0.05, hi=1.0, at=35,
                         until=None, data_seed=947)
register(HELDOUT, "cnn_elu_lr_jump_unrecovered", _rule + " (ELU convnet)")(_run)

_rule, _run = _growth_case(lambda seed: _convnet(seed, widths=(8, 16, 16), dense=16, activation="relu",
                                                 name="cnn_growth_b", outputs=1), seed=961, lr=1e-3, data_seed=963)
register(HELDOUT, "cnn_lr_growth_momentum_fit_b", _rule)(_run)

_rule, _run = _floor_case("classifier", seed=971, data_seed=973, widths=(64, 64), lr=2e-3, steps=800)
register(HELDOUT, "classifier_floor_adam", _rule + " (ReLU MLP 64-64, Adam(2e-3), labels drawn from a softmax)")(
    _run)
_rule, _run = _floor_case("regression", seed=975, data_seed=977, widths=(128,), lr=2e-3, steps=1000, noise=0.5)
register(HELDOUT, "regression_floor_adam_wide", _rule + " (ReLU MLP 128, Adam(2e-3), noise std 0.5)")(_run)
