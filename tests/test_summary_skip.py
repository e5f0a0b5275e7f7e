"""``summary.gradients(..., updates=...)`` says whether the optimizer skipped each logged step.

A custom loop under a loss-scale optimizer whose first scaled gradients overflow float16: the optimizer leaves the
weights of those steps unchanged. The loop measures that itself (the weights bitwise before and after each step,
the gradients' NaN/Inf), and the flag the writer records (``amp/step_skipped``, at steps with NaN/Inf gradients)
must say the same; the diagnosis as of each skipped step, with no later record to look at, then forgives its
NaN/Inf. Its twin applies a NaN gradient (plain SGD): the flag says applied and the step stays nonfinite. Steps
with finite gradients write no flag (a healthy run's Scalars tab gets no tag of zeros).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.tf]

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tb_gradhealth import cli, progress, summary  # noqa: E402


def _loop(log_dir: str, optimizer, steps: int, poison_at: int | None = None, dtype: str = "mixed_float16"):
    """Train a small MLP ``steps`` steps, recording every step; returns per step ``(weights unchanged, gradients
    not finite)`` as the loop measured them."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu", dtype=dtype),
                              keras.layers.Dense(1, dtype="float32")])
    variables = model.trainable_variables
    optimizer.build(variables)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps, 32, 8)).astype("float32")
    y = rng.normal(size=(steps, 32, 1)).astype("float32")
    scaled_loss = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    writer = tf.summary.create_file_writer(log_dir)

    @tf.function
    def step_fn(xb, yb, poison, step):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
            scaled = optimizer.scale_loss(loss) if scaled_loss else loss
        grads = tape.gradient(scaled, variables)
        grads = [g + poison for g in grads]
        before = [tf.identity(v) for v in variables]
        optimizer.apply(grads, variables)
        updates = [v - b for b, v in zip(before, variables, strict=True)]
        with writer.as_default(step=step):
            summary.gradients(zip(grads, variables, strict=True), weights=before, updates=updates)
            tf.summary.scalar("loss", loss)
        return grads

    measured = []
    for s in range(1, steps + 1):
        before = [v.numpy().copy() for v in variables]
        poison = tf.constant(float("nan") if s == poison_at else 0.0)
        grads = step_fn(x[s - 1], y[s - 1], poison, tf.constant(s, tf.int64))
        unchanged = all(np.array_equal(b, v.numpy()) for b, v in zip(before, variables, strict=True))
        measured.append((unchanged, not all(np.isfinite(g.numpy()).all() for g in grads)))
    writer.close()
    return measured


def _flags(log_dir) -> dict[int, float]:
    files = [str(p) for p in sorted(Path(log_dir).glob("events.out.tfevents.*"))]
    skipped = progress.read_progress(files).skipped
    assert skipped is not None, "no amp/step_skipped scalar was written"
    return {int(s): float(v) for s, v in zip(*skipped, strict=True)}


def _nonfinite_layers(capsys, log_dir, step: int) -> int:
    cli.main(["report", str(log_dir), "--json", "--step", str(step)])
    body = json.loads(capsys.readouterr().out)
    return body["runs"][0]["summary"]["counts"]["nonfinite"]


def test_a_loss_scale_optimizer_s_skipped_steps_are_written_and_forgiven_as_of_each(tmp_path, capsys):
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=2.0**20)
    measured = _loop(str(tmp_path), opt, steps=12)
    skipped = [s for s, (unchanged, bad) in enumerate(measured, 1) if unchanged and bad]
    applied = [s for s, (unchanged, _) in enumerate(measured, 1) if not unchanged]
    assert skipped and applied, measured  # the scale overflowed float16 at first, then fitted
    flags = _flags(tmp_path)
    assert [s for s, v in flags.items() if v == 1.0] == skipped
    assert all(flags.get(s) is None for s in applied)  # finite gradients: nothing to forgive, nothing written
    for s in skipped:  # as of a skipped step: no later record yet, the flag is the evidence
        assert _nonfinite_layers(capsys, tmp_path, s) == 0, s


def test_an_applied_nan_step_is_written_as_applied_and_stays_nonfinite(tmp_path, capsys):
    measured = _loop(str(tmp_path), keras.optimizers.SGD(0.01), steps=6, poison_at=4, dtype="float32")
    assert measured[3] == (False, True)  # the NaN reached the weights
    bad = [s for s, (_, nonfinite) in enumerate(measured, 1) if nonfinite]
    assert bad == [4, 5, 6]  # the NaN weights make every later gradient NaN
    assert _flags(tmp_path) == {s: 0.0 for s in bad}  # each applied (NaN weights move: NaN != NaN)
    assert _nonfinite_layers(capsys, tmp_path, 4) > 0
