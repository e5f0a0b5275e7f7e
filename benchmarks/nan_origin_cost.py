"""What finding where the first NaN/Inf was made costs: before the NaN (per training step) and after it (the time
to the answer), beside TensorBoard's Debugger V2 and ``torch.autograd.detect_anomaly`` on the same training.

    nice -n 10 python benchmarks/nan_origin_cost.py [--steps 60] [--rounds 3] [--part tf|torch|all]

The model: Dense(256, no bias) -> a hand-written layer that appends each sample's Euclidean norm ->
Dense(256, relu) -> Dense(10), batch 64, SGD, on the CPU; the same in PyTorch. The fault: an all-zero input sample at
step ``--fault-step``: its norm is 0, finite forward, infinite backward (so every gradient is NaN).

Per-step cost (no NaN; ``--rounds`` rounds of ``--steps`` timed steps each after a warm-up, configurations
interleaved and reversed every other round so machine load hits every one alike; the table gives the median step's
ms over all rounds (robust to load from other processes; with ``update_freq=100`` it is an unlogged step), its
ratio to the callback or recorder without the feature, and the mean step's):

* Keras ``fit``: no callback; ``GradientHealthCallback(update_freq=1 | 100)`` with ``nan_origin=False`` and ``True``;
  Debugger V2 (``tf.debugging.experimental.enable_dump_debug_info``) with ``NO_TENSOR`` and ``FULL_HEALTH``;
* a custom TF loop (``tf.function``, and ``jit_compile=True``) that returns its record and reads it on the host each
  step, without and with ``apply_if_finite`` and ``OriginFinder.check``;
* PyTorch: a plain step; ``StepRecorder`` (every step) without and with ``origin=``; the plain step under
  ``torch.autograd.detect_anomaly()``.

Time to the answer: from the end of the faulty step to the origin being known: the callback's or recorder's replay
(``NanOrigin.seconds``); Debugger V2's reading of its dump for the first NaN/Inf tensor (``DebugDataReader``, as its
plugin does); ``detect_anomaly`` raises inside the faulty step itself (its time is the step's extra cost).
PyTorch and TensorFlow run in separate processes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

WIDTH, IN, OUT, BATCH = 256, 128, 10, 64
#: Steps of each timed run left out of the timing (tracing, compiling, the first captured call).
WARM = 10


def _data(steps: int, fault_step: int | None) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((steps * BATCH, IN)).astype("float32")
    y = rng.integers(0, OUT, steps * BATCH)
    if fault_step is not None:
        x[(fault_step - 1) * BATCH] = 0.0
    return x, y


# --- TensorFlow ---------------------------------------------------------------------------------------------------


def _keras_model():
    import keras
    import tensorflow as tf

    class NormFeature(keras.layers.Layer):
        def call(self, h):
            return tf.concat([h, tf.sqrt(tf.reduce_sum(tf.square(h), axis=-1, keepdims=True))], axis=-1)

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((IN,)), keras.layers.Dense(WIDTH, use_bias=False), NormFeature(name="norm_feature"),
        keras.layers.Dense(WIDTH, activation="relu"), keras.layers.Dense(OUT),
    ])
    model.compile(optimizer=keras.optimizers.SGD(1e-3), jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _tf_configs(tmp: str) -> dict:
    from tb_gradhealth.keras import GradientHealthCallback

    def cb(freq: int, on: bool):
        return lambda d: [GradientHealthCallback(d, update_freq=freq, nan_origin=on, stop_on="nonfinite")]

    return {
        "no callback": (None, lambda d: []),
        "callback, every step": (None, cb(1, False)),
        "callback, every step + nan_origin": (None, cb(1, True)),
        "callback, every 100": (None, cb(100, False)),
        "callback, every 100 + nan_origin": (None, cb(100, True)),
        "Debugger V2 NO_TENSOR": ("NO_TENSOR", lambda d: []),
        "Debugger V2 FULL_HEALTH": ("FULL_HEALTH", lambda d: []),
    }


def _step_seconds(model, x, y, callbacks, warm: int) -> np.ndarray:
    """Each step's seconds, from batch-end times inside one ``fit``, after ``warm`` steps (tracing, compiling)."""
    import keras

    ends: list[float] = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.perf_counter())

    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[*callbacks, Clock()])
    return np.diff(ends[warm - 1:])


def tf_part(args: argparse.Namespace) -> dict:
    import tensorflow as tf

    out: dict = {"per_step": {}, "answer": {}}
    with tempfile.TemporaryDirectory() as tmp:
        configs = _tf_configs(tmp)
        x, y = _data(args.steps + WARM, None)
        times: dict[str, list[np.ndarray]] = {k: [] for k in configs}
        for r in range(args.rounds):
            for name in _order(list(configs), r):
                debug_mode, make_cbs = configs[name]
                log_dir = os.path.join(tmp, f"{r}-{len(times[name])}-{abs(hash(name))}")
                if debug_mode:
                    tf.debugging.experimental.enable_dump_debug_info(log_dir, tensor_debug_mode=debug_mode,
                                                                     circular_buffer_size=1000)
                try:
                    times[name].append(_step_seconds(_keras_model(), x, y, make_cbs(log_dir), WARM))
                finally:
                    if debug_mode:
                        tf.debugging.experimental.disable_dump_debug_info()
        out["per_step"] = _summary(times)
        out["answer"] = _tf_answers(args, tmp)
        out["loop"] = _tf_loop(args, tmp)
    return out


def _tf_loop(args: argparse.Namespace, tmp: str) -> dict:
    """A custom loop that returns its record and reads it on the host every step (as writing it does), with and
    without ``apply_if_finite`` + ``OriginFinder.check``; with and without XLA."""
    import keras
    import tensorflow as tf

    from tb_gradhealth import summary
    from tb_gradhealth.tf_origin import OriginFinder, apply_if_finite

    x, y = _data(args.steps + WARM, None)
    batches = [(tf.constant(x[i * BATCH:(i + 1) * BATCH]), tf.constant(y[i * BATCH:(i + 1) * BATCH]))
               for i in range(args.steps + WARM)]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def make(jit: bool, origin: bool):
        model = _keras_model()
        variables = model.trainable_variables
        opt = keras.optimizers.SGD(1e-3)
        opt.build(variables)

        def loss_fn(a, b):
            return loss(b, model(a, training=True))

        @tf.function(jit_compile=jit)
        def step(a, b):
            with tf.GradientTape() as tape:
                value = loss_fn(a, b)
            grads = tape.gradient(value, variables)
            pairs = list(zip(grads, variables, strict=True))
            rec = summary.compute(pairs)
            if origin:
                apply_if_finite(opt, pairs, rec)
            else:
                opt.apply_gradients(pairs)
            return rec

        finder = OriginFinder(loss_fn, variables, None, root=model) if origin else None

        def run() -> np.ndarray:
            ends = [time.perf_counter()]
            for i, (a, b) in enumerate(batches, 1):
                rec = step(a, b)
                rec.counts.numpy(), rec.values.numpy()  # the host read that writing the record does
                if finder is not None:
                    finder.check(i, rec, a, b)
                ends.append(time.perf_counter())
            return np.diff(ends[WARM:])

        return run

    configs = {f"custom loop{' (XLA)' if jit else ''}{' + origin' if on else ''}": (jit, on)
               for jit in (False, True) for on in (False, True)}
    times: dict[str, list[np.ndarray]] = {k: [] for k in configs}
    for r in range(args.rounds):
        for name in _order(list(configs), r):
            times[name].append(make(*configs[name])())
    return _summary(times)


def _tf_answers(args: argparse.Namespace, tmp: str) -> dict:
    import tensorflow as tf
    from tensorflow.python.debug.lib import debug_events_reader

    from tb_gradhealth.keras import GradientHealthCallback

    x, y = _data(args.fault_step + 2, args.fault_step)
    model = _keras_model()
    cb = GradientHealthCallback(os.path.join(tmp, "answer"), update_freq=1, stop_on="nonfinite")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    answers = {"GradientHealthCallback": (cb.origin.seconds if cb.origin else float("nan"),
                                          cb.origin.message() if cb.origin else "no NaN seen")}
    dump = os.path.join(tmp, "dbg")
    tf.debugging.experimental.enable_dump_debug_info(dump, tensor_debug_mode="FULL_HEALTH", circular_buffer_size=-1)
    try:
        model = _keras_model()
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    finally:
        tf.debugging.experimental.disable_dump_debug_info()
    t = time.perf_counter()
    found = "no NaN/Inf found"
    with debug_events_reader.DebugDataReader(dump) as reader:
        reader.update()
        for trace in reader.graph_execution_traces():
            health = trace.debug_tensor_value  # FULL_HEALTH: [id, device, dtype, rank, size, -inf, +inf, nan, ...]
            if health is not None and len(health) > 7 and sum(health[5:8]) > 0:
                found = f"{trace.op_type} {trace.op_name} (graph {trace.graph_id[:8]})"
                break
    answers["Debugger V2 FULL_HEALTH (read the dump)"] = (time.perf_counter() - t, found)
    return answers


# --- PyTorch ------------------------------------------------------------------------------------------------------


def _torch_model():
    import torch

    class NormFeature(torch.nn.Module):
        def forward(self, h):
            return torch.cat([h, torch.sqrt(torch.sum(torch.square(h), dim=-1, keepdim=True))], dim=-1)

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, WIDTH, bias=False), NormFeature(), torch.nn.Linear(WIDTH + 1, WIDTH),
                               torch.nn.ReLU(), torch.nn.Linear(WIDTH, OUT))


def torch_part(args: argparse.Namespace) -> dict:
    import torch

    from tb_gradhealth.torch import StepRecorder
    from tb_gradhealth.torch_origin import OriginFinder
    from tb_gradhealth.writer import Writer

    torch.set_num_threads(1)
    loss_of = torch.nn.functional.cross_entropy

    def run(name: str, log_dir: str, x, y, steps: int):
        model = _torch_model()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        writer = Writer(log_dir) if "StepRecorder" in name else None
        finder = OriginFinder(model, lambda a, b: loss_of(model(a), b)) if "origin" in name else None
        rec = StepRecorder(writer, model, opt, origin=finder, every=1) if writer is not None else None
        t = time.perf_counter()
        ends = [t]
        try:
            for i in range(1, steps + 1):
                xb, yb = x[(i - 1) * BATCH: i * BATCH], y[(i - 1) * BATCH: i * BATCH]
                opt.zero_grad()
                if "detect_anomaly" in name:
                    with torch.autograd.detect_anomaly(check_nan=True):
                        loss_of(model(xb), yb).backward()
                else:
                    loss_of(model(xb), yb).backward()
                if rec is not None:
                    rec.step(i, batch=(xb, yb))
                    if finder is not None and finder.origin is not None:
                        return time.perf_counter() - t, finder.origin
                else:
                    opt.step()
                ends.append(time.perf_counter())
        except RuntimeError as e:  # detect_anomaly raises at the NaN
            return time.perf_counter() - t, str(e).splitlines()[0]
        finally:
            if writer is not None:
                writer.close()
        return np.diff(ends), None

    names = ["plain step", "StepRecorder", "StepRecorder + origin", "plain step + detect_anomaly"]
    out: dict = {"per_step": {}, "answer": {}}
    with tempfile.TemporaryDirectory() as tmp:
        x, y = (torch.from_numpy(a) for a in _data(args.steps + 5, None))
        times: dict[str, list[np.ndarray]] = {n: [] for n in names}
        for r in range(args.rounds):
            for n in _order(names, r):
                run(n, os.path.join(tmp, f"w{r}{len(times[n])}"), x, y, 5)  # warm-up
                times[n].append(run(n, os.path.join(tmp, f"{r}{len(times[n])}"), x[5 * BATCH:], y[5 * BATCH:],
                                    args.steps)[0])
        out["per_step"] = _summary(times)
        x, y = (torch.from_numpy(a) for a in _data(args.fault_step + 2, args.fault_step))
        _, found = run("StepRecorder + origin", os.path.join(tmp, "answer"), x, y, args.fault_step + 2)
        out["answer"]["StepRecorder + origin"] = (found.seconds, found.message()) if found else (float("nan"), "-")
        t_plain = out["per_step"]["plain step"][0] * 1e-3
        secs, err = run("plain step + detect_anomaly", os.path.join(tmp, "anom"), x, y, args.fault_step + 2)
        out["answer"]["detect_anomaly (raises in the step)"] = (secs - (args.fault_step - 1) * t_plain, str(err))
    return out


def _order(names: list[str], r: int) -> list[str]:
    """Configurations in order on even rounds, reversed on odd ones: where a run sits in a round (the machine
    warming up, other processes' load) weighs on every configuration alike."""
    return names if r % 2 == 0 else names[::-1]


def _summary(times: dict[str, list[np.ndarray]]) -> dict[str, tuple[float, float]]:
    """``{configuration: (median step ms, mean step ms)}`` over every timed step of every round."""
    return {k: (float(np.median(np.concatenate(v))) * 1e3, float(np.mean(np.concatenate(v))) * 1e3)
            for k, v in times.items()}


# --- table --------------------------------------------------------------------------------------------------------


def _print(framework: str, result: dict, base: str) -> None:
    per_step = result["per_step"]
    print(f"\n{framework}: ms per training step (median step, its ratio to '{base}'; mean step)")
    width = max(map(len, per_step)) + 2
    for name, (median, mean) in per_step.items():
        print(f"  {name:<{width}} {median:8.3f} ms   {median / per_step[base][0]:5.2f}x   mean {mean:8.3f} ms")
    if not result["answer"]:
        return
    print(f"{framework}: time from the NaN to the answer")
    for name, (secs, what) in result["answer"].items():
        print(f"  {name:<{width}} {secs * 1e3:8.1f} ms   {what}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--fault-step", type=int, default=8)
    parser.add_argument("--part", choices=("tf", "torch", "all"), default="all")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part == "all":  # each framework in its own process
        for part, base in (("tf", "callback, every step"), ("torch", "StepRecorder")):
            cmd = [sys.executable, __file__, "--part", part, "--json", "--steps", str(args.steps), "--rounds",
                   str(args.rounds), "--fault-step", str(args.fault_step)]
            env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
            result = json.loads(proc.stdout.splitlines()[-1])
            _print("TensorFlow / Keras fit" if part == "tf" else "PyTorch", result, base)
            if "loop" in result:
                _print("TensorFlow custom loop", {"per_step": result["loop"], "answer": {}}, "custom loop")
        return
    result = tf_part(args) if args.part == "tf" else torch_part(args)
    if args.json:
        print(json.dumps(result, default=str))
    else:
        _print(args.part, result, "callback, every step" if args.part == "tf" else "StepRecorder")
        if "loop" in result:
            _print("custom loop", {"per_step": result["loop"], "answer": {}}, "custom loop")


if __name__ == "__main__":
    main()
