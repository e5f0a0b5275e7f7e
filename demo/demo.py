"""Train a few small, real networks on generated data and log their gradient health, then (optionally) serve it.

``python demo/demo.py --logdir /tmp/gradhealth-demo --serve`` (or ``python -m demo ...`` from the repository root)
writes one TensorBoard run per scenario, each through one of the project's own writers, so that the Gradient Health
tab shows the cases it exists to tell apart:

===================  ===================================================  ===========================================
run                  network                                              writer
===================  ===================================================  ===========================================
``healthy/train``    He-initialised Dense/BatchNorm/ReLU MLP, Adam        ``keras.GradientHealthCallback`` (and the
                                                                          layers' outputs: ``activations=True``)
``vanishing/train``  12-layer sigmoid MLP, SGD: the first layers vanish   ``keras.GradientHealthCallback`` (same)
``exploding``        deep tanh stack, too-large init, growing step size:  ``summary.compute``/``write`` in a custom
                     gradients grow for a dozen steps, then NaN; where    loop, ``tf_origin.OriginFinder``
                     the NaN was made is replayed and stored
``accumulation``     MLP trained with 4 micro-batches per step            ``accumulate.GradientAccumulator`` (noise)
``tpu_host_call``    MLP on 4 simulated TPU shards                        ``tpu.host_call`` (shards merged on host)
``numpy_writer``     two-layer numpy MLP with hand-written backprop       ``tb_gradhealth.Writer`` (no TensorFlow)
``pytorch``          PyTorch MLP, AdamW (only when torch is installed)    ``tb_gradhealth.torch.StepRecorder``
===================  ===================================================  ===========================================

The Keras runs are ``<name>/train`` because the callback writes where ``keras.callbacks.TensorBoard`` writes its
training scalars (the demo adds that callback too, so the loss shows in the same run).

Every run is small (at most ~13,000 parameters, 40 to 100 steps): the whole demo takes well under two minutes on two CPU
cores. ``--serve`` then starts TensorBoard on the log directory with ``--samples_per_plugin=gradhealth=0`` (keep
every logged step: by default TensorBoard keeps only a random 10 to 100 of them per tag) and blocks until Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before anything imports TensorFlow (TensorBoard may)

try:  # ``python demo/demo.py`` from a checkout that was not pip-installed: use the checkout's package.
    import tb_gradhealth  # noqa: F401
except ImportError:  # pragma: no cover - depends on how the demo is started
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

#: Run names in the order they are trained (and listed in TensorBoard).
TF_RUNS = ("healthy", "vanishing", "exploding", "accumulation", "tpu_host_call")
ALL_RUNS = (*TF_RUNS, "numpy_writer", "pytorch")

FEATURES = 32
CLASSES = 4
BATCH = 64


def make_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A generated classification task: labels of a random linear teacher on Gaussian inputs (learnable, not noise)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, FEATURES)).astype(np.float32)
    teacher = rng.standard_normal((FEATURES, CLASSES)).astype(np.float32)
    y = np.argmax(x @ teacher, axis=1).astype(np.int32)
    return x, y


def log(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


# --------------------------------------------------------------------------------------------------------- TF runs


def _tf():
    """Import TensorFlow (only the TF runs need it; the numpy run and --serve do not)."""
    import tensorflow as tf

    return tf


def run_healthy(logdir: str, steps: int) -> int:
    """He-initialised BN/ReLU MLP with Adam: every layer's gradient stays within a decade or two of the others."""
    _tf()
    import keras

    keras.utils.set_random_seed(1)
    x, y = make_data(steps * BATCH, seed=1)
    layers = [keras.Input((FEATURES,))]
    for i in range(3):
        layers += [
            keras.layers.Dense(64, kernel_initializer="he_normal", use_bias=False, name=f"dense_{i}"),
            keras.layers.BatchNormalization(name=f"bn_{i}"),
            keras.layers.ReLU(name=f"relu_{i}"),
        ]
    layers.append(keras.layers.Dense(CLASSES, name="logits"))
    model = keras.Sequential(layers, name="healthy")
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=_keras_callbacks(logdir))
    return steps


def _keras_callbacks(logdir: str) -> list:
    """Gradient health at every step, with each layer's output beside its gradients (the tab's forward profile),
    plus Keras' own TensorBoard callback for the loss: both write to ``logdir/train``, so they show as one run
    (``<name>/train``) in TensorBoard."""
    import keras

    from tb_gradhealth.keras import GradientHealthCallback

    return [
        GradientHealthCallback(logdir, update_freq=1, activations=True),
        keras.callbacks.TensorBoard(logdir, update_freq=1, write_graph=False),
    ]


def run_vanishing(logdir: str, steps: int) -> int:
    """12 sigmoid layers: backprop multiplies by sigmoid' <= 0.25 per layer, so the first layers' gradients vanish."""
    _tf()
    import keras

    keras.utils.set_random_seed(2)
    x, y = make_data(steps * BATCH, seed=2)
    model = keras.Sequential(
        [keras.Input((FEATURES,))]
        + [keras.layers.Dense(32, activation="sigmoid", name=f"sigmoid_{i:02d}") for i in range(12)]
        + [keras.layers.Dense(CLASSES, name="logits")],
        name="vanishing",
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=_keras_callbacks(logdir))
    return steps


def _mlp(keras, name: str, widths: tuple[int, ...] = (64, 64)):
    return keras.Sequential(
        [keras.Input((FEATURES,))]
        + [
            keras.layers.Dense(w, activation="relu", kernel_initializer="he_normal", name=f"hidden_{i}")
            for i, w in enumerate(widths)
        ]
        + [keras.layers.Dense(CLASSES, name="logits")],
        name=name,
    )


def run_exploding(logdir: str, steps: int) -> int:
    """A deep tanh stack with too large an init, trained by SGD whose learning rate grows 10% a step (a warm-up gone
    wrong): the loss improves for a while, then the steps overshoot, the weights and gradients grow by orders of
    magnitude over a dozen logged steps (the trend the diagnosis flags as exploding before anything overflows),
    the saturated tanh units pass exactly zero back, and finally the backward pass makes NaN.

    The loop is a custom ``tf.function`` step, written as docs/NAN_ORIGIN.md shows: it returns the step's record
    (``summary.compute``, written with ``summary.write`` and the layers' kinds), applies the update only when the
    record is finite (``tf_origin.apply_if_finite``), and ``OriginFinder.check`` replays the first step whose record
    holds a NaN/Inf, op by op, on the weights it started from: the op, layer, direction and source line go to the
    run's event files (the tab's headline, ``tb-gradhealth report``). It stops 5 steps after the first NaN/Inf, as a
    job with a NaN guard would.
    """
    tf = _tf()
    import keras

    import tb_gradhealth.summary as ghs
    from tb_gradhealth.layerinfo import model_layer_info
    from tb_gradhealth.tf_origin import OriginFinder, apply_if_finite

    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((BATCH, FEATURES)).astype(np.float32)
    target = (x @ rng.standard_normal((FEATURES, 1))).astype(np.float32)
    init = keras.initializers.RandomNormal(stddev=0.5)  # gain 0.5 * sqrt(32) = 2.8 per layer: too large
    model = keras.Sequential(
        [keras.Input((FEATURES,))]
        + [keras.layers.Dense(32, activation="tanh", kernel_initializer=init, name=f"tanh_{i}") for i in range(6)]
        + [keras.layers.Dense(1, kernel_initializer=init, name="out")],
        name="exploding",
    )
    lr = keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=1, decay_rate=1.1)  # rate > 1: grows
    opt = keras.optimizers.SGD(lr)
    variables = model.trainable_variables
    opt.build(variables)
    info = model_layer_info(model, variables)  # ("Dense", "tanh") per variable: the fixes are worded for it
    writer = tf.summary.create_file_writer(logdir)

    def loss_fn(xb):
        return tf.reduce_mean(tf.square(model(xb, training=True) - target))

    finder = OriginFinder(loss_fn, variables, logdir, root=model)

    @tf.function
    def train_step(xb, step):
        with tf.GradientTape() as tape:
            loss = loss_fn(xb)
        grads = tape.gradient(loss, variables)
        pairs = list(zip(grads, variables, strict=True))
        rec = ghs.compute(pairs, weights=True)
        with writer.as_default(step=step):
            ghs.write(rec, ghs.layer_names(pairs), layer_info=info)
            tf.summary.scalar("loss", loss)
            tf.summary.scalar("learning_rate", lr(opt.iterations))
        apply_if_finite(opt, zip(grads, variables, strict=True), rec)
        return rec

    nan_steps = 0
    step = 0
    for step in range(steps):
        rec = train_step(x, tf.constant(step, tf.int64))
        finder.check(step, rec, x)
        if finder.origin is not None:
            nan_steps += 1
            if nan_steps >= 5:
                break
    writer.close()
    return step + 1


def run_accumulation(logdir: str, steps: int) -> int:
    """Gradient accumulation over 4 micro-batches per optimizer step (``accumulate.GradientAccumulator``): records
    the applied (mean) gradient and, per layer, the gradient noise between the micro-batches."""
    tf = _tf()
    import keras

    import tb_gradhealth.summary as ghs
    from tb_gradhealth.accumulate import GradientAccumulator

    keras.utils.set_random_seed(4)
    micro = 4
    micro_batch = BATCH // micro
    x, y = make_data(steps * BATCH, seed=4)
    model = _mlp(keras, "accumulation")
    opt = keras.optimizers.SGD(0.05)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    acc = GradientAccumulator(model.trainable_variables, micro_batches=micro)
    writer = tf.summary.create_file_writer(logdir)

    @tf.function
    def train_step(xb, yb, step):
        total = 0.0
        for k in range(micro):  # unrolled at trace time: 4 forward/backward passes, one optimizer step
            xs, ys = xb[k * micro_batch : (k + 1) * micro_batch], yb[k * micro_batch : (k + 1) * micro_batch]
            with tf.GradientTape() as tape:
                loss = loss_fn(ys, model(xs, training=True))
            acc.add(tape.gradient(loss, model.trainable_variables))
            total += loss
        rec = acc.apply(opt)  # the record of the applied mean gradient, with micro_batches and noise filled
        with writer.as_default(step=step):
            ghs.write(rec, acc.layers)
            tf.summary.scalar("loss", total / micro)

    for step in range(steps):
        sl = slice(step * BATCH, (step + 1) * BATCH)
        train_step(x[sl], y[sl], tf.constant(step, tf.int64))
    writer.close()
    return steps


def run_tpu_host_call(logdir: str, steps: int, shards: int = 4) -> int:
    """``tpu.host_call`` on 4 simulated shards (``tpu.simulate_shards``): each shard computes its packed record
    (tensors of leading dimension 1), the shards' tensors are concatenated along axis 0 as TPUEstimator does, and
    the host function merges the shards' records with the record's merge rules before writing one per layer."""
    tf = _tf()
    import keras

    from tb_gradhealth import tpu

    keras.utils.set_random_seed(5)
    x, y = make_data(steps * BATCH, seed=5)
    model = _mlp(keras, "tpu_host_call")
    opt = keras.optimizers.SGD(0.05)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    per_shard = BATCH // shards

    @tf.function
    def shard_gradients(xs, ys):
        with tf.GradientTape() as tape:
            loss = loss_fn(ys, model(xs, training=True))
        return tape.gradient(loss, model.trainable_variables), loss

    for step in range(steps):
        pairs, scalars, grads = [], [], []
        for s in range(shards):
            lo = step * BATCH + s * per_shard
            g, loss = shard_gradients(x[lo : lo + per_shard], y[lo : lo + per_shard])
            pairs.append(list(zip(g, model.trainable_variables, strict=True)))
            scalars.append({"loss": float(loss)})
            grads.append(g)
        tpu.simulate_shards(pairs, step, logdir, scalars)
        # CrossShardOptimizer's all-reduce, simulated: every shard applies the mean gradient.
        mean = [tf.add_n(list(parts)) / shards for parts in zip(*grads, strict=True)]
        opt.apply_gradients(zip(mean, model.trainable_variables, strict=True))
    tpu.flush(logdir)
    return steps


# ------------------------------------------------------------------------------------------------------ numpy run


def run_numpy_writer(logdir: str, steps: int) -> int:
    """A two-layer numpy MLP with hand-written backprop, logged by the TensorFlow-free ``tb_gradhealth.Writer``."""
    from tb_gradhealth import Writer

    rng = np.random.default_rng(6)
    x, y = make_data(steps * BATCH, seed=6)
    params = {
        "hidden/kernel": rng.standard_normal((FEATURES, 64)) * np.sqrt(2.0 / FEATURES),
        "hidden/bias": np.zeros(64),
        "out/kernel": rng.standard_normal((64, CLASSES)) * np.sqrt(1.0 / 64),
        "out/bias": np.zeros(CLASSES),
    }
    lr = 0.1
    with Writer(logdir) as writer:
        for step in range(steps):
            xb, yb = x[step * BATCH : (step + 1) * BATCH], y[step * BATCH : (step + 1) * BATCH]
            h_pre = xb @ params["hidden/kernel"] + params["hidden/bias"]
            h = np.maximum(h_pre, 0.0)
            logits = h @ params["out/kernel"] + params["out/bias"]
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            loss = float(-np.mean(np.log(p[np.arange(len(yb)), yb] + 1e-12)))
            d_logits = p.copy()
            d_logits[np.arange(len(yb)), yb] -= 1.0
            d_logits /= len(yb)
            d_h = (d_logits @ params["out/kernel"].T) * (h_pre > 0)
            grads = {
                "hidden/kernel": xb.T @ d_h,
                "hidden/bias": d_h.sum(axis=0),
                "out/kernel": h.T @ d_logits,
                "out/bias": d_logits.sum(axis=0),
            }
            writer.add_gradients(step, grads, weights=params)
            writer.add_scalars(step, {"loss": loss})
            for name, g in grads.items():
                params[name] = params[name] - lr * g
    return steps


def run_pytorch(logdir: str, steps: int) -> int:
    """A PyTorch MLP; records computed on the device by ``tb_gradhealth.torch`` (skipped without PyTorch:
    :func:`unavailable`).

    It trains in a child process (a fresh interpreter): TensorFlow and PyTorch in one process can crash
    (``import tensorflow`` then ``import torch._dynamo`` segfaults with some releases), and a PyTorch user's
    process has no TensorFlow in it anyway."""
    import multiprocessing

    child = multiprocessing.get_context("spawn").Process(target=_train_pytorch, args=(logdir, steps))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"the PyTorch run's process exited with {child.exitcode}")
    return steps


def _train_pytorch(logdir: str, steps: int) -> None:
    import torch

    import tb_gradhealth.torch
    from tb_gradhealth import Writer

    torch.manual_seed(7)
    x, y = (torch.from_numpy(a) for a in make_data(steps * BATCH, seed=7))
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, CLASSES))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with Writer(logdir) as writer:
        recorder = tb_gradhealth.torch.StepRecorder(writer, model, opt, every=1)  # a short run: every step
        for step in range(steps):
            xb, yb = x[step * BATCH : (step + 1) * BATCH].float(), y[step * BATCH : (step + 1) * BATCH].long()
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            recorder.step(step)
            writer.add_scalars(step, {"loss": loss.item()})


RUNNERS: dict[str, tuple[Callable[[str, int], int], int]] = {
    # name: (function, steps)
    "healthy": (run_healthy, 100),
    "vanishing": (run_vanishing, 100),
    "exploding": (run_exploding, 150),
    "accumulation": (run_accumulation, 80),
    "tpu_host_call": (run_tpu_host_call, 40),
    "numpy_writer": (run_numpy_writer, 100),
    "pytorch": (run_pytorch, 60),
}


# ----------------------------------------------------------------------------------------------------------- serve


def tensorboard_plugins() -> list:
    """TensorBoard's plugins plus ours: through the installed entry point, or passed explicitly from a checkout."""
    from importlib import metadata

    from tensorboard import default

    installed = any(ep.name == "gradhealth" for ep in metadata.entry_points().select(group="tensorboard_plugins"))
    if installed:
        try:
            return default.get_plugins()
        except Exception as e:  # a broken third-party entry point must not stop the demo
            log(f"loading TensorBoard's dynamic plugins failed ({e}); passing the gradhealth plugin explicitly")
    from tb_gradhealth import plugin

    ours = getattr(plugin, "GradHealthLoader", None) or plugin.GradHealthPlugin
    return default.get_static_plugins() + [ours]


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def serve(logdir: str, host: str, port: int) -> None:
    """Serve ``logdir`` in TensorBoard with every gradhealth sample kept; block until Ctrl-C."""
    from tensorboard import program

    tb = program.TensorBoard(plugins=tensorboard_plugins())
    tb.configure(
        argv=[
            "tensorboard",
            "--logdir",
            logdir,
            "--host",
            host,
            "--port",
            str(port),
            "--samples_per_plugin",
            "gradhealth=0",
        ]
    )
    try:
        url = tb.launch()
    except program.TensorBoardServerException as e:  # taken between the check at start-up and now
        raise SystemExit(f"demo: TensorBoard could not start: {e.msg}") from None
    log(f"TensorBoard is serving {logdir} at {url}#gradhealth  (Ctrl-C to stop)")
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops it as cleanly as Ctrl-C
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        log("stopped")


# ------------------------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="demo")
    p.add_argument("--logdir", default="/tmp/gradhealth-demo", help="where to write the runs (default: %(default)s)")
    p.add_argument("--serve", action="store_true", help="then serve the logdir in TensorBoard until Ctrl-C")
    p.add_argument("--host", default="localhost", help="TensorBoard host (default: %(default)s)")
    p.add_argument("--port", type=int, default=6006, help="TensorBoard port; 0 picks a free one (default: %(default)s)")
    p.add_argument(
        "--runs",
        default=",".join(ALL_RUNS),
        help="comma-separated runs to train (default: all: %(default)s); empty with --serve: only serve",
    )
    p.add_argument("--steps", type=float, default=1.0, help="scale every run's step count (default: %(default)s)")
    args = p.parse_args(argv)
    args.runs = [r for r in args.runs.split(",") if r]
    unknown = [r for r in args.runs if r not in RUNNERS]
    if unknown:
        p.error(f"unknown run(s) {', '.join(unknown)}; choose from {', '.join(ALL_RUNS)}")
    if not args.runs and not args.serve:
        p.error("--runs is empty: nothing to train (name runs, or add --serve to only serve the logdir)")
    if not (args.steps > 0 and np.isfinite(args.steps)):
        p.error(f"--steps must be a positive scale factor, got {args.steps}")
    if args.serve:
        busy = port_in_use(args.host, args.port)
        if busy:
            p.error(f"--port {args.port}: {busy}; stop what uses it or pick another port (--port 0 picks a free one)")
    return args


def port_in_use(host: str, port: int) -> str | None:
    """Why TensorBoard could not listen on ``host:port`` (checked before training), or None when it can."""
    import errno
    import socket

    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        return f"cannot resolve host {host!r} ({e})"
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will: TIME_WAIT is no conflict
            try:
                sock.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return f"{address[0]} port {port} is in use"
    return None


def unavailable(name: str) -> str | None:
    """Why run ``name`` cannot be trained here (``"torch not installed"``: ``pip install ".[torch]"`` adds it),
    or None."""
    import importlib.util

    if name == "pytorch" and importlib.util.find_spec("torch") is None:
        return "torch not installed"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logdir = Path(args.logdir).expanduser().resolve()
    logdir.mkdir(parents=True, exist_ok=True)
    if any(r in TF_RUNS for r in args.runs):
        t0 = time.perf_counter()
        log("importing TensorFlow ...")
        _tf()
        log(f"TensorFlow ready in {time.perf_counter() - t0:.1f} s")
    start = time.perf_counter()
    for name in args.runs:
        fn, steps = RUNNERS[name]
        steps = max(4, int(round(steps * args.steps)))
        run_dir = logdir / name
        if run_dir.exists():  # a re-run replaces the run instead of appending a second history to it
            shutil.rmtree(run_dir)
        why = unavailable(name)
        if why:  # its framework is not installed: no folder is made, and the line says so
            log(f"{name}: skipped ({why})")
            continue
        log(f"{name}: training ...")
        t0, c0 = time.perf_counter(), time.process_time()
        done = fn(str(run_dir), steps)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        log(f"{name}: {done} steps in {wall:.1f} s ({cpu:.1f} s CPU) -> {run_dir}")
    if args.runs:
        log(f"all runs written in {time.perf_counter() - start:.1f} s to {logdir}")
    if args.serve:
        serve(str(logdir), args.host, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
