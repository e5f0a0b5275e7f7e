"""What gradient-health logging costs on real architectures: keras.applications models and a small transformer.

Models (weights=None, 32x32x3 inputs unless ``--size``, batch 16, 10 classes, Adam, random data made here):
ResNet50, MobileNetV2, EfficientNetB0, DenseNet121, and a 2-block transformer built from keras.layers (32 tokens,
width 64). They have hundreds of variables, most of them tiny (biases, batch-norm parameters), unlike the
10-variable MLP of ``writer_overhead.py``: per-variable costs show here.

Configurations, each on its own copy of the model, all in ONE process, timed in interleaved rounds (each round runs
``--steps`` steps of every configuration in turn, a different one leading each round; per-round ratios to the plain
step of the same round; the median and the min-max spread over rounds are printed). Every copy is built before any
of them runs (building one sets the random seed, and TensorFlow's ``set_seed`` empties the eager kernel cache: each
function that had run would be instantiated and optimised again at its next call, seconds charged to one round),
and the garbage collector's objects are frozen before the timed rounds (a full collection of the traced graphs'
Python objects takes ~0.5 s and slows the step after it):

  plain        Keras' own train function (what ``fit`` calls per step), no callback
  every        ``GradientHealthCallback(update_freq=1)``: the statistics of gradient, weight and update each step
               (one XLA program: the default below ``update_freq=10``)
  every_graph  the same with ``compile_statistics=False``: the statistics as plain TF ops in the step
  default      ``GradientHealthCallback()`` (update_freq=100, statistics as plain TF ops), from optimizer step 98:
               its first call (step 99) is the first-step figure, its warm-up holds the logged step 100, and the
               timed steps are the unlogged ones after it; after the rounds, the calls up to step 200 run untimed
               and the call of step 200 is timed alone (a logged step, warm); the average cost at that cadence is
               printed as (99 x unlogged + 1 x that logged step) / 100
  default_in_step
               ``default`` with the record computed in a second variant of the train step (what the callback
               does at every step, with several steps a call, a distribution strategy, ``jit_compile`` or
               ``LossScaleOptimizer``; otherwise it computes it after the step, from the gradients the step
               returns)
  default_no_updates
               ``default`` with ``record_updates=False``: no read of the weights kept across the update (so no
               copy of them, and nothing for the NaN-origin search to put back)
  default_norms, default_norms_chained
               ``default_no_updates`` plus each large variable's weight and update norms computed in the step,
               right after its update (a design measured and not taken: its peak RSS)
  default_traced
               ``default`` with each block's statistics after the step traced once per block layout (a
               ``tf.function`` called for every later logged step) instead of run eagerly: a design measured and
               not taken (the functions' first trace and the memory they keep)
  floor        the plain step plus ONE ``reduce_max`` per gradient, kept in a variable (an optimizer whose
               ``apply`` takes it): the least any exact per-layer statistic costs on that model
  loop         a custom ``tf.function`` train step (GradientTape + optimizer.apply)
  loop_gh      the same + ``tb_gradhealth.summary.gradients`` every step (under a ``tf.summary`` writer)
  loop_xla     the custom step with ``jit_compile=True``
  loop_xla_gh  the same returning ``summary.compute(...)``; ``summary.write`` outside

The callback configurations are driven the way ``fit`` drives them (``on_train_begin``, ``on_train_batch_begin``,
the model's train function, ``on_train_batch_end``, ... ``on_train_end``), so that rounds can interleave without
re-tracing. Each step is synchronised by reading its loss.

First step = the first train-function call (trace + compile + one step). Peak RSS and a second first-step figure
come from a fresh subprocess per configuration (``--fresh-rounds`` of them, alternated, the median printed; off with
``--no-rss``): peak RSS in one process only grows, and
a configuration compiled after another benefits from its warm caches, so both are measured where nothing else ran
before. The child runs the first step and three more and reports its peak RSS (``VmHWM``); the ``default`` child
starts at optimizer step 98, so that its second call logs step 100 (the first call runs the plain step: the callback
builds its statistics at the first logged step), and its peak RSS counts them.

Timing figures from a shared machine (here: 2 CPU cores shared with other jobs) move with the load: read the
spread. Run under ``flock /tmp/gradhealth-heavy.lock``.

Usage: python benchmarks/real_architectures.py [--models resnet50,transformer] [--rounds 3] [--steps 4]
       [--configs plain,every,...] [--fresh-rounds 2] [--no-rss]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

BATCH, CLASSES, SIZE = 16, 10, 32
MODELS = ("resnet50", "mobilenetv2", "efficientnetb0", "densenet121", "transformer")
CONFIGS = ("plain", "every", "every_graph", "default", "default_in_step", "default_no_updates",
           "default_norms", "default_norms_chained", "default_traced", "floor", "loop", "loop_gh", "loop_xla",
           "loop_xla_gh")
#: Variants of ``default``, by the suffix of their name; those without the update's record (no copy of the weights).
DEFAULT_VARIANTS = ("_in_step", "_no_updates", "_norms", "_norms_chained", "_traced")
NO_UPDATES = ("_no_updates", "_norms", "_norms_chained")
#: ``default`` and its variants.
DEFAULT_CONFIGS = ("default", *(f"default{v}" for v in DEFAULT_VARIANTS))
#: The callback's configurations, by name without ``_in_step``.
CALLBACK = ("every", "every_graph", "default")
CONV = {"resnet50", "mobilenetv2", "efficientnetb0", "densenet121"}
GOALS = {"first": 1.25, "every_conv": 1.12, "floor_gap": 0.05, "default": 1.02, "rss": 1.10}


def build_model(name: str) -> Any:
    import keras

    keras.utils.set_random_seed(0)
    apps = {
        "resnet50": keras.applications.ResNet50,
        "mobilenetv2": keras.applications.MobileNetV2,
        "efficientnetb0": keras.applications.EfficientNetB0,
        "densenet121": keras.applications.DenseNet121,
    }
    if name in apps:
        return apps[name](weights=None, input_shape=(SIZE, SIZE, 3), classes=CLASSES)
    if name != "transformer":
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    layers, width, tokens = keras.layers, 64, 32
    inp = keras.Input((tokens,), dtype="int32")
    x = layers.Embedding(1000, width)(inp)
    x = x + layers.Embedding(tokens, width)(keras.ops.arange(tokens))[None]
    for _ in range(2):
        h = layers.MultiHeadAttention(4, width // 4)(x, x)
        x = layers.LayerNormalization()(x + h)
        h = layers.Dense(width)(layers.Dense(4 * width, activation="gelu")(x))
        x = layers.LayerNormalization()(x + h)
    out = layers.Dense(CLASSES)(layers.GlobalAveragePooling1D()(x))
    return keras.Model(inp, out)


def make_data(name: str) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    if name == "transformer":
        x = rng.integers(0, 1000, size=(BATCH, 32)).astype(np.int32)
    else:
        x = rng.standard_normal((BATCH, SIZE, SIZE, 3)).astype(np.float32)
    return x, rng.integers(0, CLASSES, size=(BATCH,)).astype(np.int32)


def start_callback(model: Any, log_dir: str, in_step: bool = False, **options: Any) -> Any:
    """A ``GradientHealthCallback(log_dir, **options)`` on ``model``, started as ``fit`` starts it (train begin,
    epoch 0), so that its steps can be driven one by one; ``in_step``: the record computed in a second variant of
    the train step, as the callback does where it cannot compute it after the step."""
    import contextlib
    from unittest import mock

    from tb_gradhealth.keras import GradientHealthCallback

    cb = GradientHealthCallback(log_dir, **options)
    cb.set_model(model)
    cb.set_params({"epochs": 1, "steps": None, "verbose": 0})
    where = mock.patch("tb_gradhealth.keras._records_after_step", return_value=False) if in_step else None
    with where or contextlib.nullcontext():
        cb.on_train_begin()
    cb.on_epoch_begin(0)
    return cb


def base_config(config: str) -> str:
    """The configuration without the suffix of a ``default`` variant."""
    for suffix in sorted(DEFAULT_VARIANTS, key=len, reverse=True):
        if config.endswith(suffix):
            return config.removesuffix(suffix)
    return config


def _norms_in_step(callback: Any, model: Any, chained: bool) -> None:
    """A design measured and not taken: each large variable's weight and update norms computed in the step, right
    after its own update (its read from before the update taken in a conditional on the logged calls, the norms
    kept in a variable), so that no copy of all the weights outlives the update; ``chained``: each large
    variable's update also waits for the norms of the one before, so that one copy at a time is alive. The host
    copies no weights (``record_updates=False``); the record itself is not changed."""
    import tensorflow as tf

    opt, wanted = model.optimizer, callback._capture.wanted
    large = {id(v.value): j for j, v in enumerate(v for v in model.trainable_variables if np.prod(v.shape) >= 2**16)}
    norms = tf.Variable(tf.zeros([len(large), 4]), trainable=False)
    original, last = opt.update_step, []

    def update_step(grad: Any, var: Any, lr: Any) -> Any:
        j = large.get(id(var))
        if j is None:
            return original(grad, var, lr)
        on = wanted > 0
        with tf.control_dependencies(last if chained else []):
            before = tf.cond(on, lambda: tf.reshape(tf.identity(var), [-1]), lambda: tf.zeros([0]))
        out = original(grad, var, lr)

        def keep() -> Any:
            d = before - tf.reshape(tf.convert_to_tensor(var), [-1])
            s = tf.stack([tf.reduce_max(tf.abs(d)), tf.reduce_sum(d * d), tf.reduce_max(tf.abs(before)),
                          tf.reduce_sum(before * before)])
            norms.scatter_nd_update([[j]], s[None])
            return tf.constant(True)

        last[:] = [tf.cond(on, keep, lambda: tf.constant(False))]
        return out

    opt.update_step = update_step


def _traced_blocks(callback: Any) -> None:
    """A design measured and not taken: the record after the step with each block's statistics traced once per
    block layout and called at every later logged step, instead of run eagerly (``packed.compute`` swapped for a
    ``tf.function`` of itself for the duration of this callback's record only; the record itself is not changed)."""
    import tensorflow as tf

    from tb_gradhealth._tf import compat, packed

    eager = packed.compute
    traced = compat.quiet_retracing(tf.function(eager, autograph=False))  # one trace per block's signature
    cap = callback._capture
    record_after = cap.record_after

    def traced_record_after(parts: Any, before: Any) -> None:
        packed.compute = traced
        try:
            record_after(parts, before)
        finally:
            packed.compute = eager

    cap.record_after = traced_record_after


class Runner:
    """One configuration on its own copy of a model: ``first()`` once, then ``run(k)`` steps per round."""

    def __init__(self, model_name: str, config: str, log_root: str, start_step: int = 0) -> None:
        import keras
        import tensorflow as tf

        self.config = config
        self.model = model = build_model(model_name)
        x, y = make_data(model_name)
        self.x, self.y = tf.constant(x), tf.constant(y)
        self.iterator = iter(tf.data.Dataset.from_tensors((x, y)).repeat())
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=model_name == "transformer")
        opt = _floor_optimizer(len(model.trainable_variables)) if config == "floor" else keras.optimizers.Adam(1e-4)
        model.compile(optimizer=opt, loss=loss)
        opt.build(model.trainable_variables)
        opt.iterations.assign(start_step)
        self.batch = 0
        self.callback = None
        if config.startswith("loop"):
            self._step = self._make_loop(config, loss, os.path.join(log_root, config))
            return
        if base_config(config) in CALLBACK:
            self.callback = start_callback(
                model, os.path.join(log_root, config), in_step=config.endswith("_in_step"),
                update_freq=100 if base_config(config) == "default" else 1,
                compile_statistics=False if config == "every_graph" else None,
                record_updates=not config.endswith(NO_UPDATES),
            )
            if "_norms" in config:
                _norms_in_step(self.callback, model, chained=config.endswith("_chained"))
            if config.endswith("_traced"):
                _traced_blocks(self.callback)
        else:
            model.make_train_function(force=True)
        self._step = self._fit_step

    def _fit_step(self) -> None:
        cb = self.callback
        if cb is not None:
            cb.on_train_batch_begin(self.batch)
        logs = self.model.train_function(self.iterator)
        float(logs["loss"])
        if cb is not None:
            cb.on_train_batch_end(self.batch, {})
        self.batch += 1

    def _make_loop(self, config: str, loss_fn: Any, log_dir: str) -> Any:
        import tensorflow as tf

        from tb_gradhealth import summary

        model, opt = self.model, self.model.optimizer
        tvars = model.trainable_variables
        names = summary.variable_names(tvars)
        gh, xla = config.endswith("_gh"), "xla" in config
        writer = tf.summary.create_file_writer(log_dir)

        @tf.function(jit_compile=xla)
        def step(x: Any, y: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, tvars)
            out = (loss,)
            if gh and xla:
                out = (loss, summary.compute(list(zip(grads, tvars, strict=True))))
            elif gh:
                summary.gradients(zip(grads, tvars, strict=True), step=tf.cast(opt.iterations, tf.int64))
            opt.apply(grads, tvars)
            return out

        def run() -> None:
            with writer.as_default():
                out = step(self.x, self.y)
                if len(out) > 1:
                    summary.write(out[1], names, step=tf.cast(opt.iterations, tf.int64))
            float(out[0])

        return run

    def first(self) -> float:
        t = time.perf_counter()
        self._step()
        return time.perf_counter() - t

    def run(self, k: int) -> float:
        t = time.perf_counter()
        for _ in range(k):
            self._step()
        return (time.perf_counter() - t) / k

    def run_logged(self, step: int) -> float:
        """The calls up to optimizer step ``step``, untimed; then the time of the call that runs it."""
        while int(self.model.optimizer.iterations.numpy()) < step - 1:
            self._step()
        return self.run(1)

    def close(self) -> None:
        if self.callback is not None:
            self.callback.on_epoch_end(0)
            self.callback.on_train_end()


def _floor_optimizer(n: int) -> Any:
    """Adam whose ``apply`` also keeps ``reduce_max`` of each gradient in a variable (the floor row)."""
    import keras
    import tensorflow as tf

    class FloorAdam(keras.optimizers.Adam):
        def __init__(self) -> None:
            super().__init__(1e-4)
            self.floor_out = tf.Variable(tf.zeros([n]), trainable=False)

        def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
            grads = list(grads)
            self.floor_out.assign(tf.stack([tf.reduce_max(g) for g in grads]))
            return super().apply(grads, trainable_variables)

    return FloorAdam()


def child(model_name: str, config: str) -> None:
    """Fresh process: first step and three more, then ``{"first": s, "logged": s, "rss_mb": peak}`` on stdout.

    ``default`` starts at optimizer step 98, so that its second call holds its first logged step (step 100; the
    callback builds its statistics there): the peak RSS counts them, ``logged`` is that call's time."""
    with tempfile.TemporaryDirectory() as d:
        default = base_config(config) == "default"
        r = Runner(model_name, config, d, start_step=98 if default else 0)
        first = r.first()
        logged = r.run(1) if default else first
        r.run(2)
        r.close()
    print(json.dumps({"first": first, "logged": logged, "rss_mb": _peak_rss_mb()}))


def _peak_rss_mb() -> float:
    """This process's peak RSS: ``VmHWM`` (``ru_maxrss`` would report the parent's peak, kept across fork+exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_child(model_name: str, config: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", f"{model_name}:{config}", "--size", str(SIZE)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _ratio_cell(values: list[float]) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    return f"{med:.3f}x ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else f"{med:.3f}x"


def fresh_runs(model_name: str, configs: list[str], rounds: int) -> dict:
    """Each configuration's fresh process ``rounds`` times, alternated (plain, every, ..., plain, every, ...) so
    that every configuration sees the same load; the median of each figure."""
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    for _ in range(rounds):
        for c in configs:
            runs[c].append(run_child(model_name, c))
    return {c: {k: statistics.median(r[k] for r in rs) for k in rs[0]} | {"all": rs} for c, rs in runs.items()}


def bench_model(model_name: str, configs: list[str], rounds: int, steps: int, rss: bool,
                fresh_rounds: int = 1) -> dict:
    with tempfile.TemporaryDirectory() as d:
        # Every copy is built before any runs: building one sets the random seed, and TensorFlow's set_seed clears
        # the eager kernel cache, so each function that already ran would be instantiated and optimised again in
        # its next call (seconds, charged to whichever configuration's round came next).
        # `default` starts at step 98: its warm-up steps hold its first logged step (100), so its timed steps are
        # the unlogged steps that follow one (what 99 of every 100 steps cost once the capturing step is built)
        runners = {c: Runner(model_name, c, d, start_step=98 if base_config(c) == "default" else 0) for c in configs}
        first: dict[str, float] = {}
        for c in configs:
            first[c] = runners[c].first()
            print(f"  [{model_name} {c}: first step {first[c]:.1f} s]", file=sys.stderr, flush=True)
        for c in configs:
            runners[c].run(2)  # `default` traces its capturing variant here (step 100); others warm up
        # The traced graphs are hundreds of thousands of Python objects: a full collection in a timed step would
        # charge ~0.5 s to one configuration's round. Collected once, and kept out of later collections.
        gc.collect()
        gc.freeze()
        times: dict[str, list[float]] = {c: [] for c in configs}
        for i in range(rounds):
            for c in configs[i % len(configs):] + configs[: i % len(configs)]:  # each config leads a round in turn
                times[c].append(runners[c].run(steps))
        gc.unfreeze()
        # `default`: the next logged step (200), warm: its call alone, after the unlogged calls up to it
        logged_warm = {c: runners[c].run_logged(200) for c in configs if base_config(c) == "default"}
        n_vars = len(runners[configs[0]].model.trainable_variables)
        n_params = sum(int(np.prod(v.shape)) for v in runners[configs[0]].model.trainable_variables)
        for r in runners.values():
            r.close()
    fresh = fresh_runs(model_name, configs, fresh_rounds) if rss else {}
    return {"model": model_name, "variables": n_vars, "params": n_params, "first": first, "times": times,
            "fresh": fresh, "logged_warm": logged_warm}


def _per_round(res: dict, c: str, base: str) -> list[float]:
    t = res["times"]
    if c not in t or base not in t:
        return []
    return [a / b for a, b in zip(t[c], t[base], strict=True)]


def report(res: dict) -> list[str]:
    t, first, fresh = res["times"], res["first"], res["fresh"]
    lines = [f"\n{res['model']}: {res['variables']} variables, {res['params'] / 1e6:.2f}M parameters; "
             f"plain step {statistics.median(t['plain']) * 1e3:.0f} ms (median over rounds)"
             if "plain" in t else f"\n{res['model']}"]
    lines.append(f"  {'config':22s} {'step ms':>9s} {'step ratio (min-max)':>26s} {'first s':>8s} {'first ratio':>12s}"
                 f" {'fresh first':>12s} {'RSS MB':>8s} {'RSS ratio':>9s}")
    for c in t:
        base = "loop_xla" if c == "loop_xla_gh" else ("loop" if c.startswith("loop") else "plain")
        ratios = _per_round(res, c, base) if c != base else []
        fr = f"{first[c] / first[base]:.2f}x" if base in first and c != base else ""
        ff = fresh.get(c, {}).get("first")
        ffr = f"{ff:.1f}s" if ff else ""
        if ff and base in fresh and c != base:
            ffr = f"{ff / fresh[base]['first']:.2f}x"
        rss = fresh.get(c, {}).get("rss_mb")
        rr = f"{rss / fresh[base]['rss_mb']:.3f}x" if rss and base in fresh and c != base else ""
        lines.append(f"  {c:22s} {statistics.median(t[c]) * 1e3:9.1f} {_ratio_cell(ratios):>26s} {first[c]:8.1f}"
                     f" {fr:>12s} {ffr:>12s} {rss or 0:8.0f} {rr:>9s}")
    for c in DEFAULT_CONFIGS:
        logged = fresh.get(c, {}).get("logged")
        if logged and "plain" in fresh:
            lines.append(f"  {c}, fresh process: its first logged step (step 100, the second call) {logged:.1f} s ="
                         f" {logged / fresh['plain']['first']:.2f}x the plain first step")
    for c, s in res["logged_warm"].items():
        lines.append(f"  {c}: a later logged step (200), warm: {s:.2f} s = {s / statistics.median(t['plain']):.2f}x"
                     " the plain step")
    for c, avg in _default_cadence(res).items():
        lines.append(f"  {c} cadence average (99 unlogged + 1 logged step, warm)/100: {_ratio_cell(avg)}")
    return lines + goals(res)


def _default_cadence(res: dict) -> dict[str, list[float]]:
    """Per ``default`` configuration, per round: (99 of its unlogged steps + its warm logged step) / 100 plain."""
    out = {}
    plain = res["times"].get("plain")
    for c, logged in res["logged_warm"].items():
        if plain:
            out[c] = [(99 * d + logged) / 100 / p for d, p in zip(res["times"][c], plain, strict=True)]
    return out


def goals(res: dict) -> list[str]:
    """The goals, printed (not asserted): of each callback configuration that ran."""
    out = []
    floor = _per_round(res, "floor", "plain")
    first, fresh = res["first"], res["fresh"]

    def mark(ok: bool) -> str:
        return "met" if ok else "NOT met"

    for c in ("every", "every_graph"):
        every = _per_round(res, c, "plain")
        if not every:
            continue
        e = statistics.median(every)
        if res["model"] in CONV:
            out.append(f"  goal {c} step <= {GOALS['every_conv']}x: {e:.3f}x {mark(e <= GOALS['every_conv'])}")
        if floor:
            f = statistics.median(floor)
            out.append(f"  goal {c} within {GOALS['floor_gap']} of floor ({f:.3f}x): gap {e - f:+.3f} "
                       f"{mark(e - f <= GOALS['floor_gap'])}")
    for c, per_round in _default_cadence(res).items():
        avg = statistics.median(per_round)
        out.append(f"  goal {c} cadence <= {GOALS['default']}x: {avg:.3f}x {mark(avg <= GOALS['default'])}")
    for c in ("every", "every_graph", *DEFAULT_CONFIGS):
        src = fresh if c in fresh and "plain" in fresh else first
        if c in src and "plain" in src:
            v = src[c]["first"] / src["plain"]["first"] if src is fresh else src[c] / src["plain"]
            out.append(f"  goal {c} first step <= {GOALS['first']}x ({'fresh' if src is fresh else 'in process'}):"
                       f" {v:.2f}x {mark(v <= GOALS['first'])}")
        if c in fresh and "plain" in fresh:
            v = fresh[c]["rss_mb"] / fresh["plain"]["rss_mb"]
            out.append(f"  goal {c} peak RSS <= {GOALS['rss']}x: {v:.3f}x {mark(v <= GOALS['rss'])}")
    return out


def main() -> None:
    global SIZE
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="steps per configuration per round")
    p.add_argument("--no-rss", action="store_true", help="skip the fresh-process first step and peak RSS")
    p.add_argument("--fresh-rounds", type=int, default=1,
                   help="fresh processes per configuration, alternated (the median is printed)")
    p.add_argument("--size", type=int, default=SIZE,
                   help="image side of the keras.applications models (the transformer's input is fixed)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    SIZE = a.size
    if a.child:
        child(*a.child.split(":"))
        return
    import tensorflow as tf

    configs = [c for c in a.configs.split(",") if c]
    if "plain" not in configs:
        configs.insert(0, "plain")
    print(f"TensorFlow {tf.__version__}, {os.cpu_count()} CPUs (shared with other jobs: read the spread), "
          f"load average {os.getloadavg()[0]:.1f}; {a.rounds} rounds x {a.steps} steps; images {SIZE}x{SIZE}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    for m in a.models.split(","):
        t0 = time.perf_counter()
        res = bench_model(m, configs, a.rounds, a.steps, not a.no_rss, a.fresh_rounds)
        print("\n".join(report(res)), flush=True)
        print(f"  ({time.perf_counter() - t0:.0f} s, load average {os.getloadavg()[0]:.1f})", flush=True)


if __name__ == "__main__":
    main()
