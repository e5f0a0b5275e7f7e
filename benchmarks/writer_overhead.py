"""Per-step cost of gradient-health logging on the reference model, as ratios to a plain train step, in one run.

A 4x1024 ReLU MLP (3.96M parameters, 10 variables, batch 128, SGD), logging
**every step**. Variants, timed side by side in interleaved rounds (the minimum over rounds is kept: it is the
least disturbed by other processes on a shared machine):

  base / base_xla    plain train step, no logging (without / with jit_compile=True)
  stats              mean/std/max/min scalars per variable
  sampled            shuffle(flatten)[:1000] + tf.summary.histogram per variable
  fullhist           tf.summary.histogram on each full gradient (Keras-style histograms)
  probe              extra forward/backward on a fixed batch + scalars + full histograms
  ours               tb_gradhealth.summary.gradients(...) inside the plain tf.function step (its default: the
                     statistics as plain graph ops, no XLA compile)
  ours_xla           jit_compile=True step returning summary.compute(...); summary.write(...) outside (ratio to
                     base_xla)
  floor / floor_xla  ONE plain reduce_sum(g * g) over every gradient (the least an exact norm needs), returned from
                     the step (nothing written)
  floor_max / floor_max_xla
                     the cheapest exact statistic there is: ONE reduce_max(g) straight on each gradient buffer (a
                     single library reduction, no elementwise op; reduce_sum(g) would not do: under XLA the sum of
                     a matmul's output is folded into the matmul's inputs, so it reads nothing)
  floor_minmax / floor_minmax_xla
                     reduce_max(g) and reduce_min(g) of each gradient: two of the record's exact fields, nothing else

  --alternatives     our other designs, for docs/PERFORMANCE.md: ours_ops (plain TF ops, layer by layer),
                     ours_cluster (jit=True: all layers in one XLA function compiled of its own, the former
                     default), ours_noweights (no weight norms), ours_every10 (logging every 10th step via
                     tf.summary.record_if)

Also prints bytes on disk per layer-step for ours, and the Keras callback rows (with their
own baseline). Wall time and process CPU time are both shown; CPU time is steadier when other jobs share the CPU.
Run under ``flock /tmp/gradhealth-bench.lock``.
Usage: python benchmarks/writer_overhead.py [--steps 40] [--rounds 3] [--no-baselines] [--alternatives] [--only a,b]
       [--no-keras]
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tensorflow as tf  # noqa: E402

from tb_gradhealth import summary  # noqa: E402

BASELINE_VARIANTS = ("stats", "sampled", "fullhist", "probe")
#: Our variants without XLA: the default, and the alternatives measured for docs/FORMAT.md (use --only NAME).
OURS_OPTIONS = {
    "ours": {},
    "ours_ops": {"jit": False},  # plain TF ops, layer by layer
    "ours_cluster": {"jit": True},  # every layer in one XLA function of its own
    "ours_noweights": {"weights": False},
    "ours_every10": {},  # logging every 10th step through tf.summary.record_if
}


def make_model(width: int, depth: int) -> tf.keras.Model:
    layers = [tf.keras.Input((784,))]
    for _ in range(depth):
        layers.append(tf.keras.layers.Dense(width, activation="relu"))
    layers.append(tf.keras.layers.Dense(10))
    return tf.keras.Sequential(layers)


FLOOR_VARIANTS = ("floor", "floor_max", "floor_minmax")


def floor_stats(variant: str, grads: list) -> tf.Tensor:
    """The floor rows' statistics of every gradient, summed into one scalar the step returns (never pruned)."""
    kind = variant.removesuffix("_xla")
    if kind == "floor":
        return tf.add_n([tf.reduce_sum(g * g) for g in grads])
    if kind == "floor_max":
        return tf.add_n([tf.reduce_max(g) for g in grads])
    return tf.add_n([tf.reduce_max(g) - tf.reduce_min(g) for g in grads])


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.x = tf.random.normal((128, 784), seed=1)
        self.y = tf.random.uniform((128,), 0, 10, tf.int32, seed=2)
        self.loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.bytes_per_layer_step: float | None = None
        self.cpu: dict[str, list[float]] = {}  # process CPU seconds per step: steadier than wall time under load
        self.first: dict[str, list[float]] = {}  # seconds of each variant's first call: tracing and compiling

    def make_step(self, variant: str):
        """Returns ``(step_fn, writer, logdir)`` for one variant; step_fn() runs one logged train step."""
        args = self.args
        model = make_model(args.width, args.depth)
        opt = tf.keras.optimizers.SGD(0.01)
        step = tf.Variable(0, dtype=tf.int64)
        logdir = tempfile.mkdtemp(prefix=f"gh-bench-{variant}-")
        writer = tf.summary.create_file_writer(logdir)
        tvars = model.trainable_variables
        names = [v.path if hasattr(v, "path") else v.name for v in tvars]
        x, y, loss_fn = self.x, self.y, self.loss_fn

        def forward_backward(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            return loss, tape.gradient(loss, tvars)

        if variant in ("ours_xla", "base_xla") or variant.startswith("floor") and variant.endswith("_xla"):

            @tf.function(jit_compile=True)
            def compiled():
                loss, grads = forward_backward(x, y)
                opt.apply_gradients(zip(grads, tvars, strict=False))
                if variant == "base_xla":
                    return loss, None
                if variant.startswith("floor"):
                    return loss + 0 * floor_stats(variant, grads), None
                return loss, summary.compute(list(zip(grads, tvars, strict=False)), weights=True)

            @tf.function
            def train():
                loss, rec = compiled()
                if rec is not None:
                    with writer.as_default(step=step):
                        summary.write(rec, names)
                step.assign_add(1)
                return loss

            return train, writer, logdir

        @tf.function
        def train():
            loss, grads = forward_backward(x, y)
            opt.apply_gradients(zip(grads, tvars, strict=False))
            if variant == "probe":
                _, grads = forward_backward(x[:32], y[:32])
            if variant.startswith("floor"):  # returned, so it cannot be pruned
                loss = loss + 0 * floor_stats(variant, grads)
            if variant != "base" and not variant.startswith("floor"):
                with writer.as_default(step=step):
                    if variant == "ours_every10":  # tf.summary.record_if: nothing is computed on other steps
                        with tf.summary.record_if(step % 10 == 0):
                            summary.gradients(zip(grads, tvars, strict=False))
                    elif variant.startswith("ours"):
                        summary.gradients(zip(grads, tvars, strict=False), **OURS_OPTIONS[variant])
                    for n, g in zip(names, grads, strict=False):
                        if variant in ("stats", "probe"):
                            tf.summary.scalar(n + "/mean", tf.reduce_mean(g))
                            tf.summary.scalar(n + "/std", tf.math.reduce_std(g))
                            tf.summary.scalar(n + "/max", tf.reduce_max(g))
                            tf.summary.scalar(n + "/min", tf.reduce_min(g))
                        if variant == "sampled":
                            tf.summary.histogram(n, tf.random.shuffle(tf.reshape(g, [-1]))[:1000])
                        if variant in ("fullhist", "probe"):
                            tf.summary.histogram(n, g)
            step.assign_add(1)
            return loss

        return train, writer, logdir

    def time_variant(self, variant: str, steps: int) -> float:
        train, writer, logdir = self.make_step(variant)
        t = time.perf_counter()
        train().numpy()  # the first call traces the step (and compiles what XLA compiles)
        self.first.setdefault(variant, []).append(time.perf_counter() - t)
        for _ in range(4):
            train()
        t, c = time.perf_counter(), time.process_time()
        for _ in range(steps):
            loss = train()
        loss.numpy()
        writer.flush()
        dt = (time.perf_counter() - t) / steps
        self.cpu.setdefault(variant, []).append((time.process_time() - c) / steps)
        if variant == "ours":
            total = sum(os.path.getsize(f) for f in glob.glob(os.path.join(logdir, "events.out.tfevents.*")))
            nvars = 2 * (self.args.depth + 1)
            self.bytes_per_layer_step = total / ((steps + 5) * nvars)
        return dt


# --- Keras callback rows (function `keras_variants`) -----------------------------------------------------------
def keras_variants(bench: Bench) -> dict[str, float]:
    """``model.fit`` step time with ``GradientHealthCallback`` at ``update_freq=1`` and at its default, as ratios to
    the same ``fit`` without it (goals: <= 1.10x and <= 1.02x), with and without ``jit_compile``.

    A fit's step includes Keras' own per-batch work, so these rows have their own baseline (``keras_fit`` /
    ``keras_fit_xla``, a fit without the callback) and print their own ratio table; returns seconds per step by
    row. Steps are timed after 5 warm-up calls, and at a frequency above 1 after the first logged step too, so the
    rows measure the steady state (this is how a 2.2 s first logged step, a compile in the wrong place, was found).
    The default-frequency rows time ``2 x update_freq`` steps so logged and unlogged steps count in their true
    proportion. Skipped when ``--only`` names no ``keras*`` variant.
    """
    args = bench.args
    if args.only and not any(v.startswith("keras") for v in args.only.split(",")):
        return {}
    import inspect

    import keras
    import numpy as np

    from tb_gradhealth.keras import GradientHealthCallback

    default_freq = inspect.signature(GradientHealthCallback).parameters["update_freq"].default
    long_steps = max(args.steps, 2 * default_freq)
    rng = np.random.default_rng(0)
    n = 128 * (long_steps + default_freq + 5)
    x = rng.standard_normal((n, 784)).astype("float32")
    y = rng.integers(0, 10, n).astype("int32")

    class Clock(keras.callbacks.Callback):
        """Seconds per step after the warm-up batches (the first one traces and compiles)."""

        def __init__(self, warmup: int) -> None:
            super().__init__()
            self.warmup = warmup

        def on_train_batch_end(self, batch, logs=None):
            if batch == self.warmup - 1:
                self.t0 = time.perf_counter()
                self.batch0 = batch

        def on_train_end(self, logs=None):
            self.per_step = (time.perf_counter() - self.t0) / (self.last - 1 - self.batch0)

        def on_train_batch_begin(self, batch, logs=None):
            self.last = batch + 1

    class FloorSGD(keras.optimizers.SGD):
        """SGD that also takes ``max(g) - min(g)`` of every gradient it applies (kept: assigned to a variable).

        The ``keras_floor`` rows: two exact statistics of the applied gradients, read straight from their buffers
        inside ``fit``'s own step - less than any exact record needs (it also needs the sum of squares, the zero
        count, and the weights' two statistics).
        """

        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self._floor = tf.Variable(0.0, trainable=False)

        def apply(self, grads, trainable_variables=None):
            self._floor.assign(tf.add_n([tf.reduce_max(g) - tf.reduce_min(g) for g in grads]))
            return super().apply(grads, trainable_variables)

    def run(jit: bool, freq: int | None, steps: int, floor: bool = False, **options) -> float:
        keras.utils.set_random_seed(0)
        model = make_model(args.width, args.depth)
        opt = (FloorSGD if floor else keras.optimizers.SGD)(0.01)
        model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=jit)
        warmup = 5 if freq in (None, 1) else freq + 5
        clock = Clock(warmup)
        callbacks = [clock]
        if freq is not None:
            logdir = tempfile.mkdtemp(prefix="gh-bench-keras-")
            callbacks.insert(0, GradientHealthCallback(logdir, update_freq=freq, **options))
        model.fit(x[: 128 * (steps + warmup)], y[: 128 * (steps + warmup)], batch_size=128, epochs=1,
                  shuffle=False, verbose=0, callbacks=callbacks)
        return clock.per_step

    noupd = {"record_updates": False}
    rows = {  # name: (jit, update_freq, steps timed, callback options)
        "keras_fit": (False, None, long_steps, {}),
        "keras_floor": (False, None, args.steps, {"floor": True}),
        "keras_every": (False, 1, args.steps, {}),
        "keras_every_noupd": (False, 1, args.steps, noupd),
        "keras_default": (False, default_freq, long_steps, {}),
        "keras_fit_xla": (True, None, long_steps, {}),
        "keras_floor_xla": (True, None, args.steps, {"floor": True}),
        "keras_every_xla": (True, 1, args.steps, {}),
        "keras_every_noupd_xla": (True, 1, args.steps, noupd),
        "keras_default_xla": (True, default_freq, long_steps, {}),
    }
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, (jit, freq, steps, options) in rows.items():
            times.setdefault(name, []).append(run(jit, freq, steps, **options))
    best = {name: min(ts) for name, ts in times.items()}
    print(f"Keras model.fit with GradientHealthCallback (default update_freq={default_freq}), "
          f"min over {args.rounds} rounds; ratio to fit without the callback:")
    for name, t in best.items():
        ref = "keras_fit_xla" if name.endswith("_xla") else "keras_fit"
        print(f"  {name:22s} {t * 1e3:8.2f} ms/step  ratio {t / best[ref]:6.3f}")
    return best


# -------------------------------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--only", default="", help="comma-separated variants (base and base_xla always run)")
    p.add_argument("--no-baselines", action="store_true", help="skip the other logging recipes")
    p.add_argument("--alternatives", action="store_true", help="also time our alternative designs (OURS_OPTIONS)")
    p.add_argument("--no-keras", action="store_true", help="skip the Keras callback rows")
    args = p.parse_args()
    variants = ["base", *FLOOR_VARIANTS, "ours", "base_xla", *(f + "_xla" for f in FLOOR_VARIANTS), "ours_xla"]
    if not args.no_baselines:
        variants[1:1] = list(BASELINE_VARIANTS)
    if args.alternatives or args.only:
        variants += [v for v in OURS_OPTIONS if v != "ours"]
    if args.only:
        keep = set(args.only.split(",")) | {"base", "base_xla"}
        variants = [v for v in variants if v in keep]
    bench = Bench(args)
    res: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for v in variants:
            steps = args.steps if v not in ("fullhist", "probe") else max(5, args.steps // 4)
            res.setdefault(v, []).append(bench.time_variant(v, steps))
    if not args.no_keras:
        keras_variants(bench)  # prints its own table (its own baseline)
    best = {v: min(ts) for v, ts in res.items()}
    cpu = {v: min(ts) for v, ts in bench.cpu.items()}
    first = {v: min(ts) for v, ts in bench.first.items()}
    print(f"{'variant':15s} {'wall ms':>8s} {'steps/s':>8s} {'ratio':>6s} {'cpu ms':>8s} {'ratio':>6s} {'first s':>8s}"
          f"  (min over {args.rounds} rounds of {args.steps} steps; *_xla vs base_xla; first s: the first call, "
          f"tracing and any XLA compile)")
    for v, t in best.items():
        ref = "base_xla" if v.endswith("_xla") else "base"
        c = f"{cpu[v] * 1e3:8.2f} {cpu[v] / cpu[ref]:6.3f}" if v in cpu else f"{'':8s} {'':6s}"
        print(f"{v:15s} {t * 1e3:8.2f} {1 / t:8.1f} {t / best[ref]:6.3f} {c} {first.get(v, float('nan')):8.2f}")
    if bench.bytes_per_layer_step is not None:
        print(f"ours: {bench.bytes_per_layer_step:.1f} bytes on disk per layer-step")


if __name__ == "__main__":
    main()
