"""The held-out half of the diagnosis zoo: cases written before the rules they score were changed, never tuned on.

Every label comes from an intervention on the training, not from a threshold: a factor injected into the backward
pass at a known layer and step (a layer-sized identity whose gradient is multiplied by ``c``: ``c = 0`` cuts the
path, a tiny ``c`` starves everything below it, NaN poisons it), a mutation of a healthy original (DeepCrime's
operators: learning rate x100, zero init) trained beside that original, or a change that cannot alter the
training's health (target units, a constant loss factor, a parameter initialised near zero on purpose) beside the
ordinary run. What each variable's gradient *is* at each step (NaN/Inf, exactly zero, or a real number) is measured
in the loop in plain TF; which variables an injection reaches follows from the graph (every variable at or before
the injected layer). No label uses a constant of the diagnosis.

Three mutations labelled against a healthy twin's gradient on the same batch were added after the rules were
changed, and are not tuned on either. A twin label reads the median over every batch of the data, before and after
training: on sequences whose recurrence runs for a different number of steps per batch, one batch can sit decades
nearer the twin than the typical one. The cases at the end were added before the rules for them were changed:
growth from near zero that is learning (healthy, from twins whose loss it matches), a loop that never zeroes its
gradients and ReLU recurrences under adaptive optimizers whose loss swings by decades (exploding, from the step
each variable leaves its twins' range), and healthy runs that must have no episode at any step. The first such
recurrence (``rnn_relu_adam_swings``) is registered in the design half: its onset miss was studied to change the
rule that dates it; three more of its class were written before that change. For a cause acting on every layer
at once, a variable's onset is its departure from the twins' range (seeds of the healthy twin: the band is their
own spread, no constant of the diagnosis), and the loss's own departure is the latest acceptable onset
(``latest_onset``). Label format: that of ``benchmarks/diagnosis_zoo.py``.
``python benchmarks/diagnosis_zoo.py --half heldout``.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from benchmarks import zoo_cases
from benchmarks.zoo_cases import CLASSES, FEATURES, Case, _chain, ce, image_data, teacher_data

CASES: dict[str, Case] = {}


def case(name: str, rule: str) -> Callable:
    def register(fn: Callable[[str], dict[str, Any]]) -> Callable[[str], dict[str, Any]]:
        CASES[name] = Case(name, rule, fn)
        return fn

    return register


def _design_case(name: str, rule: str) -> Callable:
    """Register a case in the design half: one first written here whose misses were studied to change a rule."""
    def register(fn: Callable[[str], dict[str, Any]]) -> Callable[[str], dict[str, Any]]:
        zoo_cases.CASES[name] = Case(name, rule, fn)
        return fn

    return register


# --- the loop: records every step (or every ``log_every``), measures what each gradient is ------------------------


def grad_scale_layer() -> Any:
    """A Keras layer that is the identity forward and multiplies the gradient by its ``factor`` variable backward
    (NaN poisons it, 0 cuts the path)."""
    import keras
    import tensorflow as tf

    class GradScale(keras.layers.Layer):
        def build(self, input_shape: Any) -> None:
            self.factor = tf.Variable(1.0, trainable=False, name="factor")

        def call(self, x: Any) -> Any:
            factor = self.factor

            @tf.custom_gradient
            def scaled(h: Any) -> Any:
                def grad(dy: Any) -> Any:
                    return dy * factor

                return tf.identity(h), grad

            return scaled(x)

    return GradScale


def train_loop(log_dir: str, model: Any, opt: Any, x: np.ndarray, y: np.ndarray, *, steps: int, batch: int,
               loss: Any = None, log_every: int = 1, before_step: Callable[[int], None] | None = None,
               accumulate: bool = False) -> dict[str, Any]:
    """A custom training loop that logs ``summary.gradients`` (with the weights and the applied update) every
    ``log_every`` steps and the raw loss every step; returns per step the measured state of each variable's
    gradient ("nonfinite", "dead" for exactly zero, "live") and the loss. ``accumulate``: the loop never zeroes its
    gradient buffers (a forgotten ``optimizer.zero_grad()``): each step applies, and logs, the sum of every gradient
    so far, as ``param.grad`` holds it in such a PyTorch loop."""
    import tensorflow as tf

    from tb_gradhealth import summary

    loss_fn = loss or ce()
    variables = model.trainable_variables
    writer = tf.summary.create_file_writer(log_dir)
    buffers = [tf.Variable(tf.zeros_like(v), trainable=False) for v in variables] if accumulate else None

    def make(log: bool) -> Any:
        @tf.function
        def step_fn(xb: Any, yb: Any, step: Any) -> Any:
            with tf.GradientTape() as tape:
                value = loss_fn(yb, model(xb, training=True))
            grads = tape.gradient(value, variables)
            if buffers is not None:
                grads = [tf.identity(b.assign_add(g)) for b, g in zip(buffers, grads, strict=True)]
            before = [tf.identity(v) for v in variables]
            opt.apply(grads, variables)
            if log:
                updates = [v - b for b, v in zip(before, variables, strict=True)]
                with writer.as_default(step=step):
                    summary.gradients(zip(grads, variables, strict=True), weights=before, updates=updates)
            with writer.as_default(step=step):
                tf.summary.scalar("loss", value)
            return (value, [tf.reduce_all(tf.math.is_finite(g)) for g in grads],
                    [tf.reduce_all(tf.equal(g, 0.0)) for g in grads])

        return step_fn

    logged, quiet = make(True), make(False)
    states, losses, logged_steps = [], [], []
    for s in range(1, steps + 1):
        if before_step is not None:
            before_step(s)
        fn = logged if s % log_every == 0 else quiet
        xb, yb = x[((s - 1) * batch) % len(x):][:batch], y[((s - 1) * batch) % len(y):][:batch]
        value, finite, zero = fn(xb, yb, tf.constant(s, tf.int64))
        states.append(["nonfinite" if not bool(f) else "dead" if bool(z) else "live"
                       for f, z in zip(finite, zero, strict=True)])
        losses.append(float(value))
        if s % log_every == 0:
            logged_steps.append(s)
    writer.close()
    return {"names": summary.variable_names(variables), "states": states, "loss": losses, "logged": logged_steps}


def _measured_chain(steps: Sequence[int], states: Sequence[str], live_as: Callable[[int], str]) -> dict[str, Any]:
    """A label from the measured state per step; ``live_as(step)`` names what a live gradient is at that step."""
    return _chain(steps, [live_as(s) if st == "live" else st for s, st in zip(steps, states, strict=True)])


def injection_labels(run: dict[str, Any], reached: Sequence[str], status: str, from_step: int, culprit_layer: str,
                     rule: str, **extra: Any) -> dict[str, Any]:
    """Variables in ``reached`` have ``status`` from ``from_step`` (while their gradient is live); NaN/Inf and exact
    zeros as measured; culprits are the variables of ``culprit_layer``."""
    names, steps = run["names"], list(range(1, len(run["states"]) + 1))
    layers = {}
    for i, n in enumerate(names):
        hit = n in reached
        layers[n] = _measured_chain(steps, [st[i] for st in run["states"]],
                                    lambda s, hit=hit: status if hit and s >= from_step else "healthy")
    sick = [n for n, e in layers.items() if e["status"] != "healthy"]
    nan = [ep["from"] for e in layers.values() for ep in e.get("episodes", []) if ep["status"] == "nonfinite"]
    return {"sick": bool(sick), "layers": layers, "culprits": [n for n in names if n.split("/")[-2] == culprit_layer],
            "onset": min((e["onset"] for e in layers.values() if e["status"] != "healthy"), default=None),
            "first_nan": min(nan) if nan else None, "diverges": False, "rule": rule,
            "evidence": {"loss_first": run["loss"][0], "loss_last": run["loss"][-1]}, **extra}


def healthy_labels(run: dict[str, Any], rule: str, zero_until: int = 0) -> dict[str, Any]:
    """Every variable healthy; raises when the run does not learn (mean loss of the last tenth of the steps not
    below that of the first tenth) or any gradient was NaN/Inf or exactly zero (after step ``zero_until``, for a
    parameter that starts at zero by design): then the label would be a guess."""
    loss = np.array(run["loss"])
    k = max(1, loss.size // 10)
    bad = {st for row in run["states"][zero_until:] for st in row} - {"live"}
    if not (np.isfinite(loss).all() and loss[-k:].mean() < loss[:k].mean()) or bad:
        raise RuntimeError(f"a run labelled healthy did not learn or had {bad} gradients: loss {loss[:k].mean():.3g}"
                           f" -> {loss[-k:].mean():.3g}")
    return {"sick": False, "layers": {n: {"status": "healthy", "onset": None} for n in run["names"]}, "culprits": [],
            "onset": None, "first_nan": None, "diverges": False, "rule": rule,
            "evidence": {"loss_first_tenth": float(loss[:k].mean()), "loss_last_tenth": float(loss[-k:].mean())}}


def relu_mlp(depth: int, *, width: int = 32, out: int = CLASSES, inject_after: str | None = None,
             kernel_initializer: Any = "he_normal", bias_initializer: Any = "zeros") -> tuple[Any, Any]:
    """A He/ReLU MLP (the healthy recipe) with an optional gradient-scaling identity after one layer."""
    import keras

    L = keras.layers
    inj = None
    layers: list[Any] = [keras.Input((FEATURES,))]
    for i in range(depth):
        layers.append(L.Dense(width, activation="relu", kernel_initializer=kernel_initializer,
                              bias_initializer=bias_initializer, name=f"relu_{i}"))
        if inject_after == f"relu_{i}":
            inj = grad_scale_layer()(name="inject")
            layers.append(inj)
    layers.append(L.Dense(out, kernel_initializer=kernel_initializer if kernel_initializer == "zeros" else
                          "glorot_uniform", name="logits"))
    return keras.Sequential(layers, name="mlp"), inj


def _reached(names: Sequence[str], layer: str) -> list[str]:
    """The variables at or before ``layer`` (network order): those a backward-pass injection after it reaches."""
    idx = max(i for i, n in enumerate(names) if n.split("/")[-2] == layer)
    return list(names[:idx + 1])


def _switch(inj: Any, at: int, factor: float) -> Callable[[int], None]:
    def before(step: int) -> None:
        inj.factor.assign(factor if step >= at else 1.0)

    return before


# --- healthy runs whose gradient scale is anything -----------------------------------------------------------------

SCALE_RULE = ("healthy: a He/ReLU MLP regression with Adam (lr matched to the units); target units are a constant "
              "(the twin with unit targets is the same training up to that constant); the loss falls (checked)")


def _regression(units: float, lr: float, *, seed: int = 41, depth: int = 3, optimizer: str = "Adam",
                rule: str = SCALE_RULE) -> Callable[[str], dict[str, Any]]:
    def run(log_dir: str) -> dict[str, Any]:
        import keras

        rng = np.random.default_rng(seed)
        x = rng.standard_normal((100 * 32, FEATURES)).astype(np.float32)
        y = (units * (x @ rng.standard_normal((FEATURES, 1)) / math.sqrt(FEATURES))).astype(np.float32)
        model, _ = relu_mlp(depth, out=1)
        r = train_loop(log_dir, model, getattr(keras.optimizers, optimizer)(lr), x, y, steps=100, batch=32,
                       loss=keras.losses.MeanSquaredError())
        return healthy_labels(r, rule)

    return run


case("regression_units_1", SCALE_RULE)(_regression(1.0, 1e-3))
case("regression_units_300", SCALE_RULE)(_regression(300.0, 3e-2))
# Targets in the tens of thousands, where the last hidden activations grow to fit them: written before the rule that
# reads the output layer's weight against its bias; studied for it (its gap opened mid-run), so it moved to the
# design half; the two after it were written before that rule's present form. The largest (3e4) was then studied
# for the loss window's evidence (four minibatch losses read as a rise): the design half too.
_design_case("regression_units_1e4", SCALE_RULE)(_regression(1e4, 0.3))
case("regression_units_3e3", SCALE_RULE)(_regression(3e3, 0.1))
_design_case("regression_units_3e4", SCALE_RULE)(_regression(3e4, 0.5))
# Written before the trend rule weighed a whole network's growth against the loss: regressions whose gradients
# grow by decades over their first steps while the fit scales up to targets in the tens of thousands (every
# optimizer's steps are of the learning rate's size, so the weights must grow for the output to reach the targets).
# All three were still flagged after the loss window's change, and were studied for that rule: the design half.
_BIG_TARGETS = SCALE_RULE.replace("with Adam (lr matched to the units)", "with an adaptive optimizer at a high lr")
_design_case("regression_units_1e5", _BIG_TARGETS)(_regression(1e5, 1.0, seed=43, rule=_BIG_TARGETS))
_design_case("regression_units_3e4_deep", _BIG_TARGETS)(_regression(3e4, 0.3, seed=47, depth=5, rule=_BIG_TARGETS))
_design_case("regression_units_1e4_rmsprop", _BIG_TARGETS)(_regression(1e4, 0.2, seed=53, optimizer="RMSprop",
                                                                        rule=_BIG_TARGETS))
# Three more, written after the loss window's change and before those three were studied for the next rule.
case("regression_units_3e5", _BIG_TARGETS)(_regression(3e5, 2.0, seed=59, rule=_BIG_TARGETS))
# Flagged late (its output kernel 3 decades above the reference once the bias had fitted the targets' mean) and
# studied for the relative rule's reach (it leaves the output layer to the rule that reads its weight against its
# bias): the design half.
_design_case("regression_units_1e4_deep", _BIG_TARGETS)(_regression(1e4, 0.2, seed=61, depth=4,
                                                                     rule=_BIG_TARGETS))
case("regression_units_3e4_adamax", _BIG_TARGETS)(_regression(3e4, 0.5, seed=67, optimizer="Adamax",
                                                               rule=_BIG_TARGETS))
# Three more, written before the one of those flagged late (its output kernel, at step 71) was studied.
case("regression_units_1e4_deep5", _BIG_TARGETS)(_regression(1e4, 0.2, seed=71, depth=5, rule=_BIG_TARGETS))
case("regression_units_3e3_deep", _BIG_TARGETS)(_regression(3e3, 0.1, seed=73, depth=4, rule=_BIG_TARGETS))
case("regression_units_1e5_nadam", _BIG_TARGETS)(_regression(1e5, 1.0, seed=79, optimizer="Nadam",
                                                              rule=_BIG_TARGETS))

LOSS_FACTOR_RULE = ("healthy: the same He/ReLU classifier with its loss multiplied by a constant and SGD's learning "
                    "rate divided by it (the same weights at every step); the loss falls (checked)")


def _loss_factor(factor: float) -> Callable[[str], dict[str, Any]]:
    def run(log_dir: str) -> dict[str, Any]:
        import keras

        keras.utils.set_random_seed(43)
        base = ce()
        x, y = teacher_data(50 * 64, 43)
        model, _ = relu_mlp(4)
        r = train_loop(log_dir, model, keras.optimizers.SGD(0.05 / factor), x, y, steps=50, batch=64,
                       loss=lambda yt, yp: factor * base(yt, yp))
        return healthy_labels(r, LOSS_FACTOR_RULE)

    return run


case("loss_factor_1e-3", LOSS_FACTOR_RULE)(_loss_factor(1e-3))
case("loss_factor_1e3", LOSS_FACTOR_RULE)(_loss_factor(1e3))

# --- growth by design ----------------------------------------------------------------------------------------------

DESIGN_RULE = ("healthy: residual MLP blocks whose branch is scaled by a LayerScale vector initialised at 1e-6 "
               "or a ReZero scalar initialised at 0 (they are meant to grow by decades), Adam; the loss falls "
               "(checked)")


@case("layerscale_rezero", DESIGN_RULE)
def layerscale_rezero(log_dir: str) -> dict[str, Any]:
    import keras

    L = keras.layers

    class Scale(L.Layer):
        def __init__(self, init: float, per_channel: bool, **kw: Any) -> None:
            super().__init__(**kw)
            self.init, self.per_channel = init, per_channel

        def build(self, input_shape: Any) -> None:
            shape = (input_shape[-1],) if self.per_channel else ()
            self.gamma = self.add_weight(shape=shape, initializer=keras.initializers.Constant(self.init),
                                         name="gamma")

        def call(self, x: Any) -> Any:
            return x * self.gamma

    inp = keras.Input((FEATURES,))
    h = L.Dense(64, name="stem")(inp)
    for b in range(4):
        r = L.Dense(64, name=f"block{b}_out")(L.Dense(128, activation="gelu", name=f"block{b}_in")(
            L.LayerNormalization(name=f"block{b}_ln")(h)))
        scale = Scale(1e-6, True, name=f"block{b}_layer_scale") if b % 2 == 0 else Scale(0.0, False,
                                                                                          name=f"block{b}_rezero")
        h = L.Add(name=f"block{b}_add")([h, scale(r)])
    model = keras.Model(inp, L.Dense(CLASSES, name="logits")(L.LayerNormalization(name="ln_f")(h)), name="lsmlp")
    x, y = teacher_data(80 * 32, 47)
    r = train_loop(log_dir, model, keras.optimizers.Adam(1e-3), x, y, steps=80, batch=32)
    return healthy_labels(r, DESIGN_RULE, zero_until=1)  # ReZero's branch gets exact zeros until gamma moves


# --- round-off at convergence ----------------------------------------------------------------------------------------

CONVERGED_RULE = ("healthy: a two-layer linear network fitting exactly realisable targets with SGD until the loss "
                  "is at float32 round-off; the loss falls (checked)")


@case("converged_linear", CONVERGED_RULE)
def converged_linear(log_dir: str) -> dict[str, Any]:
    import keras

    rng = np.random.default_rng(53)
    x = rng.standard_normal((256, 8)).astype(np.float32)
    y = (x @ rng.standard_normal((8, 1))).astype(np.float32)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="hidden"),
                              keras.layers.Dense(1, name="out")], name="linear")
    r = train_loop(log_dir, model, keras.optimizers.SGD(0.05), np.tile(x, (40, 1)), np.tile(y, (40, 1)),
                   steps=600, batch=256, loss=keras.losses.MeanSquaredError(), log_every=10)
    labels = healthy_labels(r, CONVERGED_RULE)
    labels["evidence"]["loss_min"] = float(np.min(r["loss"]))
    return labels


# --- injected faults at a known layer and step -----------------------------------------------------------------------

STARVE_RULE = ("injected: from step {at} the gradient after {layer} is multiplied by {factor:g}; every variable at "
               "or before it is vanishing from then (measured NaN/zero states kept); culprit {layer}")


def _inject(layer: str, at: int, factor: float, status: str, *, depth: int = 6, steps: int = 40,
            log_every: int = 1, rule: str = STARVE_RULE) -> Callable[[str], dict[str, Any]]:
    def run(log_dir: str) -> dict[str, Any]:
        import keras

        model, inj = relu_mlp(depth, inject_after=layer)
        x, y = teacher_data(steps * 64, 59)
        r = train_loop(log_dir, model, keras.optimizers.SGD(0.05), x, y, steps=steps, batch=64,
                       log_every=log_every, before_step=_switch(inj, at, factor))
        return injection_labels(r, _reached(r["names"], layer), status, at, layer,
                                rule.format(at=at, layer=layer, factor=factor))

    return run


case("starved_mid_run", STARVE_RULE)(_inject("relu_3", 20, 1e-6, "vanishing"))
case("starved_from_start", STARVE_RULE)(_inject("relu_1", 1, 1e-7, "vanishing", depth=4))
CUT_RULE = ("injected: from step {at} the gradient after {layer} is multiplied by 0; every variable at or before it "
            "gets exact zeros (dead) from then; culprit {layer}")
case("cut_mid_run", CUT_RULE)(_inject("relu_2", 15, 0.0, "dead", rule=CUT_RULE))
NAN_RULE = ("injected: at step {at} the gradient after {layer} is NaN; measured per step (NaN/Inf, exact zero), "
            "culprit {layer}")
case("nan_at_step_12", NAN_RULE)(_inject("relu_2", 12, math.nan, "nonfinite", depth=4, steps=20, rule=NAN_RULE))

SHORT_RULE = ("injected: the gradient after {layer} is multiplied by {factor:g} from the start; every variable at or "
              "before it is vanishing; {n} logged steps")


def _short(n: int) -> Callable[[str], dict[str, Any]]:
    rule = SHORT_RULE.replace("{n}", str(n))
    return _inject("relu_1", 1, 1e-6, "vanishing", depth=3, steps=10 * n, log_every=10, rule=rule)


for _n in (1, 2, 3, 4):
    case(f"short_starved_{_n}", SHORT_RULE.replace("{n}", str(_n)))(_short(_n))

TWO_LAYER_RULE = ("injected: a two-layer model whose hidden layer's gradient is multiplied by {factor:g} from the "
                  "start: it is vanishing, the output layer healthy")
case("two_layer_starved", TWO_LAYER_RULE)(_inject("relu_0", 1, 1e-6, "vanishing", depth=1, steps=30,
                                                  rule=TWO_LAYER_RULE))

# --- mutations beside their healthy originals ----------------------------------------------------------------------

ORIGINAL_RULE = "healthy original of the mutations: He/ReLU MLP, SGD(0.02); the loss falls (checked)"


def _original_run(log_dir: str, lr: float, kernel_initializer: str = "he_normal", optimizer: Any = None,
                  depth: int = 5, seed: int = 61) -> dict[str, Any]:
    import keras

    keras.utils.set_random_seed(seed)
    model, _ = relu_mlp(depth, kernel_initializer=kernel_initializer)
    x, y = teacher_data(40 * 64, 61)
    return train_loop(log_dir, model, optimizer or keras.optimizers.SGD(lr), x, y, steps=40, batch=64)


@case("original_relu_sgd", ORIGINAL_RULE)
def original_relu_sgd(log_dir: str) -> dict[str, Any]:
    return healthy_labels(_original_run(log_dir, 0.02), ORIGINAL_RULE)


LR_RULE = ("mutation lr x100 of original_relu_sgd: every variable exploding from the first step its gradient norm "
           "or update/weight leaves the range of the original over 3 seeds (its own among them) while live, at the "
           "latest from the loss label (the first step whose loss is above 4x the original's at that step and "
           "stays so); NaN/Inf and exact zeros as measured; culprits: any variable (a global cause)")


def _lr_mutant(clipnorm: float | None) -> Callable[[str], dict[str, Any]]:
    def run(log_dir: str) -> dict[str, Any]:
        import keras

        return _lr_mutant_run(log_dir, keras.optimizers.SGD(2.0, clipnorm=clipnorm))

    return run


case("mutant_lr_x100", LR_RULE)(_lr_mutant(None))


def _lr_mutant_run(log_dir: str, optimizer: Any) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as keep:  # the original, trained again beside it over 3 seeds
        twins = _twin_runs(lambda d, seed: _original_run(d, 0.02, seed=seed), (61, *TWIN_SEEDS[:2]), keep)
        r = _original_run(log_dir, 2.0, optimizer=optimizer)
        loss, ref = np.array(r["loss"]), np.array(twins[0]["loss"])
        worse = ~(loss <= 4.0 * ref)  # NaN counts as worse
        onset = next((s + 1 for s in range(loss.size) if worse[s:].all()), None)
        if onset is None:
            raise RuntimeError("the lr x100 mutant did not diverge from its original")
        labels = global_cause_labels(r, log_dir, twins, "exploding", LR_RULE, loss_label=onset)
    labels["diverges"] = True
    labels["evidence"]["twin_loss"] = [float(v) for v in ref]
    return labels


GLOBAL_CLIP_RULE = ORIGINAL_RULE + " (SGD(0.02) with global_clipnorm=0.05)"


@case("original_global_clip", GLOBAL_CLIP_RULE)
def original_global_clip(log_dir: str) -> dict[str, Any]:
    import keras

    return healthy_labels(_original_run(log_dir, 0.02, optimizer=keras.optimizers.SGD(0.02, global_clipnorm=0.05)),
                          GLOBAL_CLIP_RULE)


LAMB_RULE = ORIGINAL_RULE.replace("SGD(0.02)", "LAMB(1e-3), a layer-wise adaptive optimizer")


@case("original_lamb", LAMB_RULE)
def original_lamb(log_dir: str) -> dict[str, Any]:
    import keras

    return healthy_labels(_original_run(log_dir, 0.02, optimizer=keras.optimizers.Lamb(1e-3)), LAMB_RULE)


ONE_LAYER_RULE = "healthy: a one-layer softmax regression (one Dense layer), SGD(0.1); the loss falls (checked)"


@case("one_layer", ONE_LAYER_RULE)
def one_layer(log_dir: str) -> dict[str, Any]:

    return healthy_labels(_original_run(log_dir, 0.1, depth=0), ONE_LAYER_RULE)


ZERO_RULE = ("mutation zero init of original_relu_sgd: every gradient is measured per step; exact zeros are dead "
             "(all kernels and the hidden biases), the output bias live and healthy")


@case("mutant_zero_init", ZERO_RULE)
def mutant_zero_init(log_dir: str) -> dict[str, Any]:
    r = _original_run(log_dir, 0.02, kernel_initializer="zeros")
    labels = injection_labels(r, [], "healthy", 1, "", ZERO_RULE)
    dead = [n for n, e in labels["layers"].items() if e["status"] == "dead"]
    labels["culprits"] = dead
    return labels


# --- a healthy SGD convnet without normalisation -------------------------------------------------------------------

CONV_RULE = "healthy: a He/ReLU convnet without BatchNormalization, SGD(0.05); the loss falls (checked)"


@case("convnet_sgd_no_bn", CONV_RULE)
def convnet_sgd_no_bn(log_dir: str) -> dict[str, Any]:
    import keras

    L = keras.layers
    model = keras.Sequential([keras.Input((16, 16, 3))]
                             + [L.Conv2D(16, 3, padding="same", activation="relu", kernel_initializer="he_normal",
                                         name=f"conv_{i}") for i in range(3)]
                             + [L.GlobalAveragePooling2D(name="pool"), L.Dense(CLASSES, name="logits")],
                             name="convnet")
    x, y = image_data(40 * 32, 67, 16)
    r = train_loop(log_dir, model, keras.optimizers.SGD(0.05), x, y, steps=40, batch=32)
    return healthy_labels(r, CONV_RULE)


def train(name: str, case_dir: Any) -> dict[str, Any]:
    """Train one held-out case (same bookkeeping as the design half)."""
    saved = dict(zoo_cases.CASES)
    zoo_cases.CASES[name] = CASES[name]
    try:
        return zoo_cases.train(name, case_dir)
    finally:
        zoo_cases.CASES.clear()
        zoo_cases.CASES.update(saved)


os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


# --- mutations labelled against a healthy twin (added after the rules were changed; never tuned on) -----------------

TWIN_RULE = ("mutation beside its healthy twin ({twin}), same data: {status} where the variable's gradient norm is at "
             "least 4 decades {side} the twin's at the median over every batch of the data (each batch's norm against "
             "the twin's on that batch), at the start and at the end; healthy within 2 decades; doubtful between")


def _grad_norms(model: Any, x: np.ndarray, y: np.ndarray, loss: Any) -> np.ndarray:
    """Each variable's gradient norm on ``(x, y)``, in float64 (a float32 norm of values below about 1e-19 squares
    them to 0: a vanishing gradient would read as no gradient at all)."""
    import tensorflow as tf

    with tf.GradientTape() as tape:
        value = loss(y, model(x, training=True))
    return np.array([float(np.linalg.norm(np.asarray(tf.convert_to_tensor(g), np.float64)))
                     for g in tape.gradient(value, model.trainable_variables)])


def _norms_per_batch(model: Any, x: np.ndarray, y: np.ndarray, batch: int, loss: Any) -> np.ndarray:
    """``[batches, variables]`` the gradient norm of each variable on each batch of the data."""
    return np.array([_grad_norms(model, x[b * batch:(b + 1) * batch], y[b * batch:(b + 1) * batch], loss)
                     for b in range(len(x) // batch)])


def _decades(norms: np.ndarray, twin: np.ndarray, sign: float) -> np.ndarray:
    """Per batch (rows) and variable (columns), the decades ``norms`` sit above (``sign`` 1) or below (-1) the
    twin's on the same batch. Data whose recurrence runs for a different number of steps on every batch puts each
    batch at a different distance, so a label reads them all, not one."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return sign * np.log10(norms / twin)


def _spread(d: np.ndarray) -> list[list[float]]:
    """``[min, median, max]`` over the batches, per variable (evidence beside the label)."""
    with np.errstate(invalid="ignore"):
        return [[round(float(v), 2) for v in np.nanpercentile(d[:, i], [0, 50, 100])] for i in range(d.shape[1])]


def _median_decades(d: np.ndarray) -> np.ndarray:
    """The median over the batches whose norms are finite, per variable (NaN where none is)."""
    out = np.full(d.shape[1], np.nan)
    for i in range(d.shape[1]):
        finite = d[np.isfinite(d[:, i]), i]
        if finite.size:
            out[i] = float(np.median(finite))
    return out


def _twin_case(build: Callable[[bool], Any], status: str, twin: str, *, steps: int, x: np.ndarray, y: np.ndarray,
               batch: int, optimizer: Callable[[], Any], loss: Any = None) -> Callable[[str], dict[str, Any]]:
    rule = TWIN_RULE.format(twin=twin, status=status, side="above" if status == "exploding" else "below")
    sign = 1.0 if status == "exploding" else -1.0

    def run(log_dir: str) -> dict[str, Any]:
        loss_fn = loss or ce()
        mutant, healthy = build(True), build(False)
        twin_norms = _norms_per_batch(healthy, x, y, batch, loss_fn)
        before = _decades(_norms_per_batch(mutant, x, y, batch, loss_fn), twin_norms, sign)
        r = train_loop(log_dir, mutant, optimizer(), x, y, steps=steps, batch=batch, loss=loss_fn)
        after = _decades(_norms_per_batch(mutant, x, y, batch, loss_fn), twin_norms, sign)
        at_start, at_end = _median_decades(before), _median_decades(after)
        # a gradient that is NaN/Inf on every batch by the end is judged at the start alone (its NaN is measured per
        # step below)
        dec = np.where(np.isfinite(at_end), np.minimum(at_start, at_end), at_start)
        steps_all = list(range(1, len(r["states"]) + 1))
        layers, sick = {}, []
        for i, n in enumerate(r["names"]):
            d = float(dec[i])
            bad = d >= 4.0
            label = _measured_chain(steps_all, [st[i] for st in r["states"]],
                                    lambda _s, bad=bad: status if bad else "healthy")
            layers[n] = {**label, "decades_from_twin": round(d, 2), **({"doubtful": True} if 2.0 < d < 4.0 else {})}
            if bad:
                sick.append(n)
        names = r["names"]
        order = {n: i for i, n in enumerate(names)}
        nan = [ep["from"] for e in layers.values() for ep in e.get("episodes", []) if ep["status"] == "nonfinite"]
        return {"sick": any(e["status"] != "healthy" for e in layers.values()), "layers": layers,
                "culprits": sorted(sick, key=lambda n: -order[n]), "onset": 1 if sick else (min(nan) if nan else None),
                "first_nan": min(nan) if nan else None, "diverges": bool(nan), "rule": rule,
                "evidence": {"loss_first": r["loss"][0], "loss_last": r["loss"][-1],
                             "decades_per_batch_at_start": dict(zip(names, _spread(before), strict=True)),
                             "decades_per_batch_at_end": dict(zip(names, _spread(after), strict=True)),
                             "first_batch_decades_at_start": dict(zip(names, np.round(before[0], 2).tolist(),
                                                                      strict=True))}}

    return run


def _sigmoid_swap(mutant: bool) -> Any:
    import keras

    keras.utils.set_random_seed(71)
    act, init = ("sigmoid", "glorot_uniform") if mutant else ("relu", "he_normal")
    return keras.Sequential([keras.Input((FEATURES,))]
                            + [keras.layers.Dense(32, activation=act, kernel_initializer=init, name=f"dense_{i}")
                               for i in range(10)] + [keras.layers.Dense(CLASSES, name="logits")], name="swap")


def _tanh_gain(mutant: bool) -> Any:
    import keras

    keras.utils.set_random_seed(73)
    gain = 4.0 if mutant else 1.0  # weight variance gain^2/fan_in: chaotic above 1, critical at 1
    init = keras.initializers.VarianceScaling(gain**2, "fan_in", "normal", seed=73)
    return keras.Sequential([keras.Input((FEATURES,))]
                            + [keras.layers.Dense(64, activation="tanh", kernel_initializer=init, name=f"tanh_{i}")
                               for i in range(12)] + [keras.layers.Dense(CLASSES, name="logits")], name="tanh_gain")


def _relu_rnn(seed: int, name: str) -> Callable[[bool], Any]:
    """A builder of a ReLU SimpleRNN classifier over 40 steps whose recurrent kernel is orthogonal at gain 3 (the
    mutant) or 1 (its twin)."""

    def build(mutant: bool) -> Any:
        import keras

        keras.utils.set_random_seed(seed)
        init = keras.initializers.Orthogonal(gain=3.0 if mutant else 1.0, seed=seed)
        return keras.Sequential([keras.Input((40, 8)), keras.layers.SimpleRNN(32, activation="relu",
                                                                              recurrent_initializer=init, name="rnn"),
                                 keras.layers.Dense(CLASSES, name="logits")], name=name)

    return build


_rnn_gain = _relu_rnn(79, "rnn_gain")


_X, _Y = teacher_data(40 * 64, 71)
case("mutant_sigmoid_swap", TWIN_RULE.format(twin="He/ReLU", status="vanishing", side="below"))(
    _twin_case(_sigmoid_swap, "vanishing", "He/ReLU", steps=40, x=_X, y=_Y, batch=64,
               optimizer=lambda: __import__("keras").optimizers.SGD(0.1)))
case("mutant_tanh_chaotic", TWIN_RULE.format(twin="critical init", status="exploding", side="above"))(
    _twin_case(_tanh_gain, "exploding", "critical init", steps=40, x=_X, y=_Y, batch=64,
               optimizer=lambda: __import__("keras").optimizers.SGD(0.01)))
_RX = np.random.default_rng(79).standard_normal((30 * 32, 40, 8)).astype(np.float32)
_RY = (np.argmax(_RX[:, :5, :CLASSES].sum(axis=1), axis=1)).astype(np.int32)
case("mutant_rnn_gain_3", TWIN_RULE.format(twin="orthogonal gain 1", status="exploding", side="above"))(
    _twin_case(_rnn_gain, "exploding", "orthogonal gain 1", steps=30, x=_RX, y=_RY, batch=32,
               optimizer=lambda: __import__("keras").optimizers.SGD(1e-4)))


# --- growth from near zero, accumulating gradients, an RNN under Adam whose loss swings; healthy runs that must
# have no episode at any step (written before the rules for them were changed; labels from twins, never tuned on) ---

TWIN_SEEDS = (101, 102, 103)


def _twin_runs(train_one: Callable[[str, int], dict[str, Any]], seeds: Sequence[int], keep: str) -> list[dict]:
    """Train the healthy twin once per seed into ``keep``/twin_<seed> (a temporary directory: the labels keep what
    was measured on them); returns their loop results with their ``dir``."""
    out = []
    for seed in seeds:
        twin_dir = os.path.join(keep, f"twin_{seed}")
        out.append({**train_one(twin_dir, seed), "dir": twin_dir})
    return out


def _attention_model(seed: int, qk_scale: float | None) -> Any:
    """Embedding, a LayerNormalization (beta initialised at zero), one self-attention whose query and key kernels
    start at ``qk_scale`` (normal std; None: Glorot, the standard init) and a classifier over the pooled tokens."""
    import keras

    keras.utils.set_random_seed(seed)
    L = keras.layers
    init = "glorot_uniform" if qk_scale is None else keras.initializers.RandomNormal(stddev=qk_scale, seed=seed)
    inp = keras.Input((ATT_TOKENS, FEATURES))
    h = L.LayerNormalization(name="ln")(L.Dense(32, name="embed")(inp))
    q = L.Dense(32, use_bias=False, kernel_initializer=init, name="query")(h)
    k = L.Dense(32, use_bias=False, kernel_initializer=init, name="key")(h)
    v = L.Dense(32, name="value")(h)
    a = L.Add(name="residual")([h, L.Attention(name="attend")([q, v, k])])
    out = L.Dense(CLASSES, name="logits")(L.GlobalAveragePooling1D(name="pool")(a))
    return keras.Model(inp, out, name="attention")


ATT_TOKENS = 8


def _attention_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Token sets whose class is a linear teacher's on the token with the largest first feature: the attention
    has to find that token."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, ATT_TOKENS, FEATURES)).astype(np.float32)
    pick = x[np.arange(n), np.argmax(x[:, :, 0], axis=1)]
    y = np.argmax(pick @ rng.standard_normal((FEATURES, CLASSES)), axis=1).astype(np.int32)
    return x, y


GROW_RULE = ("healthy: a LayerNormalization whose beta starts at zero and a self-attention whose query and key "
             "kernels start at std 1e-5 (their gradients start 3-4 decades below the rest and rise to them as they "
             "learn), Adam(1e-2); twins with Glorot query/key, 3 seeds: the loss falls and ends at or below the "
             "worst twin's (mean of the last tenth of the steps): it learns at least as well as the standard init, "
             "nothing blew up (checked)")


@case("attention_grows_from_zero", GROW_RULE)
def attention_grows_from_zero(log_dir: str) -> dict[str, Any]:
    import keras

    x, y = _attention_data(120 * 32, 107)

    def one(d: str, seed: int, scale: float | None = None) -> dict[str, Any]:
        return train_loop(d, _attention_model(seed, scale), keras.optimizers.Adam(1e-2), x, y, steps=120, batch=32)

    with tempfile.TemporaryDirectory() as keep:
        twins = _twin_runs(one, TWIN_SEEDS, keep)
        peaks = np.stack([np.nanmax(zoo_cases.logged_evidence(t["dir"])[2], axis=0) for t in twins])
    r = one(log_dir, 107, 1e-5)
    labels = healthy_labels(r, GROW_RULE)
    k = max(1, len(r["loss"]) // 10)
    ends = [float(np.mean(t["loss"][-k:])) for t in twins]
    if not float(np.mean(r["loss"][-k:])) <= max(ends):
        raise RuntimeError(f"a run labelled healthy ends above its twins' loss: {np.mean(r['loss'][-k:])} > {ends}")
    _, _, grad, _ = zoo_cases.logged_evidence(log_dir)
    labels["evidence"]["grad_norm_log10_first_peak_last"] = {
        n: [round(float(grad[0, i]), 2), round(float(np.nanmax(grad[:, i])), 2), round(float(grad[-1, i]), 2)]
        for i, n in enumerate(r["names"])}
    labels["evidence"]["twin_grad_norm_log10_peak_range"] = {
        n: [round(float(peaks[:, i].min()), 2), round(float(peaks[:, i].max()), 2)] for i, n in enumerate(r["names"])}
    labels["evidence"]["twin_loss_last_tenth"] = ends
    return labels


ACCUMULATE_RULE = ("mutation: the loop never zeroes its gradients (each step applies the sum of all gradients so "
                   "far), He/ReLU MLP, SGD(0.3); twins: the same loop zeroing them, 3 seeds. Every variable is "
                   "exploding from the first logged step its gradient norm or update/weight leaves the twins' range "
                   "at that step (onset), at the latest from the step the loss stays above every twin's (the loss "
                   "label); NaN/Inf and exact zeros as measured; culprits: every variable (a global cause)")


def _mlp_run(d: str, seed: int, *, accumulate: bool, lr: float, x: np.ndarray, y: np.ndarray, steps: int) -> Any:
    import keras

    keras.utils.set_random_seed(seed)
    model, _ = relu_mlp(4)
    return train_loop(d, model, keras.optimizers.SGD(lr), x, y, steps=steps, batch=64, accumulate=accumulate)


def global_cause_labels(run: dict[str, Any], log_dir: str, twins: Sequence[dict[str, Any]], status: str,
                        rule: str, loss_label: int | None = None) -> dict[str, Any]:
    """Labels of a cause acting on every layer at once, from its twins: each variable ``status`` from its own
    departure from the twins' range (:func:`zoo_cases.twin_departures`), with the loss label (default: the loss's
    own departure from its twins, :func:`zoo_cases.loss_departure`) as the latest acceptable onset
    (``latest_onset``); measured NaN/Inf and exact zeros kept."""
    dep = zoo_cases.twin_departures(log_dir, [t["dir"] for t in twins])
    if loss_label is None:
        loss_label = zoo_cases.loss_departure(run["loss"], [t["loss"] for t in twins])
    if loss_label is None or all(v is None for v in dep.values()):
        raise RuntimeError(f"the mutant did not leave its twins' range: departures {dep}, loss {loss_label}")
    steps = list(range(1, len(run["states"]) + 1))
    layers = {}
    for i, n in enumerate(run["names"]):
        start = dep[n] if dep[n] is not None else loss_label
        entry = _measured_chain(steps, [st[i] for st in run["states"]],
                                lambda s, start=start: status if s >= start else "healthy")
        if entry["status"] != "healthy":
            entry["latest_onset"] = max(loss_label, start)
        layers[n] = entry
    nan = [ep["from"] for e in layers.values() for ep in e.get("episodes", []) if ep["status"] == "nonfinite"]
    loss = np.asarray(run["loss"])
    k = max(1, loss.size // 10)
    return {"sick": True, "layers": layers, "culprits": list(run["names"]),
            "onset": min(e["onset"] for e in layers.values() if e["onset"] is not None),
            "latest_onset": loss_label, "first_nan": min(nan) if nan else None, "diverges": bool(nan), "rule": rule,
            "evidence": {"departures": dep, "loss_departure": loss_label,
                         "loss_first_last_tenth": [float(loss[:k].mean()), float(loss[-k:].mean())],
                         "twin_loss_last_tenth": [float(np.mean(t["loss"][-k:])) for t in twins]}}


@case("forgot_zero_grad", ACCUMULATE_RULE)
def forgot_zero_grad(log_dir: str) -> dict[str, Any]:
    x, y = teacher_data(60 * 64, 109)
    kw = {"lr": 0.3, "x": x, "y": y, "steps": 60}
    with tempfile.TemporaryDirectory() as keep:
        twins = _twin_runs(lambda d, seed: _mlp_run(d, seed, accumulate=False, **kw), TWIN_SEEDS, keep)
        r = _mlp_run(log_dir, TWIN_SEEDS[0], accumulate=True, **kw)
        return global_cause_labels(r, log_dir, twins, "exploding", ACCUMULATE_RULE)


def _span_data(n_batches: int, batch: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sequences whose signal starts after a run of zeros whose length is drawn per batch (0-30 of 40 steps); the
    class is read from the first 5 steps of signal. The recurrence runs for a different number of steps on every
    batch, so a gain above 1 makes each batch's scale different."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_batches * batch, 40, 8)).astype(np.float32)
    y = np.zeros(n_batches * batch, np.int32)
    for b, lead in enumerate(rng.integers(0, 31, n_batches)):
        part = slice(b * batch, (b + 1) * batch)
        x[part, :lead] = 0.0
        y[part] = np.argmax(x[part, lead:lead + 5, :CLASSES].sum(axis=1), axis=1)
    return x, y


_SX, _SY = _span_data(60, 32, 131)
_design_case("rnn_relu_adam_swings", TWIN_RULE.format(twin="orthogonal gain 1", status="exploding", side="above")
             + "; ReLU recurrence at orthogonal gain 3, Adam(1e-3), sequences whose signal starts at a step drawn "
             "per batch")(
    _twin_case(_relu_rnn(113, "rnn_adam"), "exploding", "orthogonal gain 1", steps=60, x=_SX, y=_SY, batch=32,
               optimizer=lambda: __import__("keras").optimizers.Adam(1e-3)))


def _relu_rnn_stack(seed: int, name: str, *, units: Sequence[int], gain: float) -> Callable[[bool], Any]:
    """A builder of a classifier over 40 steps by stacked ReLU SimpleRNNs whose recurrent kernels are orthogonal at
    ``gain`` (the mutant) or 1 (its twin)."""

    def build(mutant: bool) -> Any:
        import keras

        keras.utils.set_random_seed(seed)
        layers = [keras.Input((40, 8))]
        for i, u in enumerate(units):
            init = keras.initializers.Orthogonal(gain=gain if mutant else 1.0, seed=seed + i)
            layers.append(keras.layers.SimpleRNN(u, activation="relu", recurrent_initializer=init,
                                                 return_sequences=i < len(units) - 1, name=f"rnn_{i}"))
        return keras.Sequential([*layers, keras.layers.Dense(CLASSES, name="logits")], name=name)

    return build


def _rnn_swing_case(register: Callable, name: str, what: str, *, model: str, seed: int, data_seed: int,
                    units: tuple[int, ...], gain: float, optimizer: str, lr: float) -> None:
    """Register (``register``: :func:`case` or :func:`_design_case`) a twin case of stacked ReLU recurrences
    (``units``) at orthogonal ``gain`` under ``keras.optimizers.<optimizer>(lr)``, 60 steps of 32 sequences of
    :func:`_span_data` from ``data_seed``."""
    x, y = _span_data(60, 32, data_seed)
    rule = TWIN_RULE.format(twin="orthogonal gain 1", status="exploding", side="above")
    register(name, f"{rule}; {what}, {optimizer}({lr:g}), signal starting at a step drawn per batch")(
        _twin_case(_relu_rnn_stack(seed, model, units=units, gain=gain), "exploding",
                   "orthogonal gain 1", steps=60, x=x, y=y, batch=32,
                   optimizer=lambda: getattr(__import__("keras").optimizers, optimizer)(lr)))


# More of the class above, written before the rule that dates their onset was changed. The first two (a blow-up
# alike in every layer, dated late) were then studied for the rule that reads such a blow-up: the design half.
_rnn_swing_case(_design_case, "rnn_relu_rmsprop_swings", "ReLU recurrence (48 units) at orthogonal gain 3",
                model="rnn_rmsprop", seed=149, data_seed=151, units=(48,), gain=3.0, optimizer="RMSprop", lr=1e-3)
_rnn_swing_case(_design_case, "rnn_stacked_relu_adam_swings",
                "two stacked ReLU recurrences (24 units) at orthogonal gain 2.5", model="rnn_stack", seed=157,
                data_seed=163, units=(24, 24), gain=2.5, optimizer="Adam", lr=1e-3)
# Studied for the adaptive optimizer read over time and the output kernel beside a calm bias: the design half.
_rnn_swing_case(_design_case, "rnn_relu_adam_gain2_swings", "ReLU recurrence (32 units) at orthogonal gain 2",
                model="rnn_gain2", seed=167, data_seed=173, units=(32,), gain=2.0, optimizer="Adam", lr=1e-3)
# Written before the rule for a blow-up alike in every layer under an adaptive optimizer. The wide one's onset, dated
# where its loss first swings, was then studied for the rule that reads the output layer's weight gradient against
# its bias's (the design half); the others were not.
_rnn_swing_case(_design_case, "rnn_relu_adam_wide_swings", "ReLU recurrence (64 units) at orthogonal gain 3",
                model="rnn_wide", seed=181, data_seed=191, units=(64,), gain=3.0, optimizer="Adam", lr=3e-4)
_rnn_swing_case(case, "rnn_relu_nadam_swings", "ReLU recurrence (40 units) at orthogonal gain 2.5",
                model="rnn_nadam", seed=193, data_seed=197, units=(40,), gain=2.5, optimizer="Nadam", lr=1e-3)
_rnn_swing_case(case, "rnn_relu_adamw_swings", "ReLU recurrence (56 units) at orthogonal gain 3",
                model="rnn_adamw", seed=223, data_seed=227, units=(56,), gain=3.0, optimizer="AdamW", lr=5e-4)
_rnn_swing_case(case, "rnn_relu_adam_lowlr_swings", "ReLU recurrence (48 units) at orthogonal gain 2.8",
                model="rnn_lowlr", seed=229, data_seed=233, units=(48,), gain=2.8, optimizer="Adam", lr=1e-4)
def _rnn_healthy_case(name: str, *, model: str, seed: int, data_seed: int, optimizer: str, lr: float) -> None:
    """Register a healthy case: a ReLU recurrence (32 units) at orthogonal gain 1 under
    ``keras.optimizers.<optimizer>(lr)``, 60 steps of 32 sequences of :func:`_span_data` from ``data_seed``."""
    rule = (f"healthy: a ReLU recurrence (32 units) at orthogonal gain 1 under {optimizer}({lr:g}) on sequences whose "
            "signal starts at a step drawn per batch; the loss falls (checked); it must have no episode at any step")

    def run(log_dir: str) -> dict[str, Any]:
        import keras

        x, y = _span_data(60, 32, data_seed)
        net = _relu_rnn_stack(seed, model, units=(32,), gain=1.0)(True)
        r = train_loop(log_dir, net, getattr(keras.optimizers, optimizer)(lr), x, y, steps=60, batch=32)
        return healthy_labels(r, rule)

    case(name, rule)(run)


_rnn_healthy_case("rnn_relu_rmsprop_healthy", model="rnn_ok", seed=211, data_seed=199, optimizer="RMSprop", lr=1e-3)


AE_RULE = ("healthy: a Dense autoencoder (64-16-64) with Adam on low-rank data; the loss falls (checked); it must "
           "have no episode at any step")


@case("autoencoder_adam", AE_RULE)
def autoencoder_adam(log_dir: str) -> dict[str, Any]:
    import keras

    L = keras.layers
    rng = np.random.default_rng(127)
    x = (rng.standard_normal((80 * 32, 6)) @ rng.standard_normal((6, 64))).astype(np.float32)
    model = keras.Sequential([keras.Input((64,)), L.Dense(64, activation="relu", name="enc_0"),
                              L.Dense(16, name="code"), L.Dense(64, activation="relu", name="dec_0"),
                              L.Dense(64, name="recon")], name="autoencoder")
    r = train_loop(log_dir, model, keras.optimizers.Adam(1e-3), x, x, steps=80, batch=32,
                   loss=keras.losses.MeanSquaredError())
    return healthy_labels(r, AE_RULE)


GRU_RULE = ("healthy: a GRU classifier over 20-step sequences with Adam; the loss falls (checked); it must have no "
            "episode at any step")


@case("gru_adam", GRU_RULE)
def gru_adam(log_dir: str) -> dict[str, Any]:
    import keras

    model = keras.Sequential([keras.Input((20, 8)), keras.layers.GRU(32, name="gru"),
                              keras.layers.Dense(CLASSES, name="logits")], name="gru")
    x, y = _RX[:, :20], _RY
    r = train_loop(log_dir, model, keras.optimizers.Adam(3e-3), np.tile(x, (2, 1, 1)), np.tile(y, 2), steps=60,
                   batch=32)
    return healthy_labels(r, GRU_RULE)


# Written before they were first scored, with the twin label read over every batch: more recurrences at gains from
# 1.5 to 2.5 under adaptive optimizers on the same kind of data (whether each is sick, and which variables, is what
# the twins measure), and a healthy one under Adam.
_rnn_swing_case(case, "rnn_relu_rmsprop_gain2", "ReLU recurrence (36 units) at orthogonal gain 2",
                model="rnn_rms2", seed=239, data_seed=241, units=(36,), gain=2.0, optimizer="RMSprop", lr=1e-3)
# Studied for the ranking of a blow-up on the way forward (its output kernel was named first): the design half.
_rnn_swing_case(_design_case, "rnn_relu_adam_gain2_5", "ReLU recurrence (28 units) at orthogonal gain 2.5",
                model="rnn_adam25", seed=251, data_seed=257, units=(28,), gain=2.5, optimizer="Adam", lr=1e-3)
_rnn_swing_case(case, "rnn_relu_adamax_gain2_2", "ReLU recurrence (44 units) at orthogonal gain 2.2",
                model="rnn_adamax", seed=263, data_seed=269, units=(44,), gain=2.2, optimizer="Adamax", lr=2e-3)
_rnn_swing_case(case, "rnn_relu_adam_gain1_5", "ReLU recurrence (32 units) at orthogonal gain 1.5",
                model="rnn_adam15", seed=281, data_seed=283, units=(32,), gain=1.5, optimizer="Adam", lr=1e-3)
_rnn_healthy_case("rnn_relu_adam_healthy", model="rnn_adam_ok", seed=277, data_seed=271, optimizer="Adam", lr=1e-3)
# Written before the ranking named where a blow-up on the way forward began: more recurrences at gains above 2
# under adaptive optimizers (which variables are sick is what the twins measure), and a ReLU MLP whose every layer
# multiplies its activations by about 5 at init, beside its He-initialised twin, under Adam.
_rnn_swing_case(case, "rnn_relu_adam_gain2_3", "ReLU recurrence (30 units) at orthogonal gain 2.3",
                model="rnn_adam23", seed=293, data_seed=307, units=(30,), gain=2.3, optimizer="Adam", lr=1e-3)
_rnn_swing_case(case, "rnn_relu_rmsprop_gain2_6", "ReLU recurrence (40 units) at orthogonal gain 2.6",
                model="rnn_rms26", seed=311, data_seed=313, units=(40,), gain=2.6, optimizer="RMSprop", lr=1e-3)


def _relu_gain(mutant: bool) -> Any:
    import keras

    keras.utils.set_random_seed(317)
    # weight variance scale/fan_in: 2 is He (activations keep their scale), 50 multiplies them by 5 per layer
    init = keras.initializers.VarianceScaling(50.0 if mutant else 2.0, "fan_in", "normal", seed=317)
    return keras.Sequential([keras.Input((FEATURES,))]
                            + [keras.layers.Dense(32, activation="relu", kernel_initializer=init, name=f"relu_{i}")
                               for i in range(6)] + [keras.layers.Dense(CLASSES, name="logits")], name="relu_gain")


_GX, _GY = teacher_data(40 * 64, 331)
case("mutant_relu_gain5_adam", TWIN_RULE.format(twin="He init", status="exploding", side="above"))(
    _twin_case(_relu_gain, "exploding", "He init", steps=40, x=_GX, y=_GY, batch=64,
               optimizer=lambda: __import__("keras").optimizers.Adam(1e-3)))
