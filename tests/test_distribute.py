"""tf.distribute: MirroredStrategy over 2 logical CPU devices, per-replica and all-reduced (applied) records.

The strategy part runs in a subprocess, because logical devices must be configured before TensorFlow initialises
its runtime (and another test in this process may already have). The subprocess trains nothing: it takes two
steps of one linear layer, records inside ``strategy.run`` and writes on the host with ``distribute.merge_and_write``;
it also writes the single-device run of the same global batch with ``summary.gradients``. This process compares
the event files.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.util import tensor_util

from tb_gradhealth import metadata, record

pytestmark = [pytest.mark.tf, pytest.mark.e2e]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    from tb_gradhealth import distribute, summary, tpu

    out = sys.argv[1]
    GB, D, K = 8, 6, 3
    rng = np.random.default_rng(0)
    x_all = rng.normal(size=(2, GB, D)).astype(np.float32)
    y_all = rng.normal(size=(2, GB, K)).astype(np.float32)
    w0 = rng.normal(size=(D, K)).astype(np.float32)
    x_all[1, 5, 0] = np.nan  # step 1: a NaN in replica 1's half of the batch

    def loss_fn(w, b, x, y):
        per_example = tf.reduce_sum(tf.square(tf.matmul(x, w) + b - y), axis=1)
        return tf.nn.compute_average_loss(per_example, global_batch_size=GB)

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert strategy.num_replicas_in_sync == 2
    with strategy.scope():
        w = tf.Variable(w0, name="dense/kernel")
        b = tf.Variable(tf.zeros([K]), name="dense/bias")
    layers = ["dense/kernel", "dense/bias"]
    default_writer = tf.summary.create_file_writer(os.path.join(out, "default_writer"))

    @tf.function
    def step(x, y, i):
        def replica_fn(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(w, b, x, y)
            gv = list(zip(tape.gradient(loss, [w, b]), [w, b]))
            return (distribute.replica_record(gv, hist_sample=None), distribute.applied_record(gv, hist_sample=None),
                    [g for g, _ in gv])
        per_replica, applied, grads = strategy.run(replica_fn, args=(x, y))
        distribute.merge_and_write(strategy, per_replica, layers, i, os.path.join(out, "replicas"))
        distribute.merge_and_write(strategy, applied, layers, i, os.path.join(out, "applied"), all_reduced=True)
        with default_writer.as_default():
            distribute.merge_and_write(strategy, applied, layers, i, all_reduced=True)
        return grads

    half = GB // 2
    for i in range(2):
        xs = strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(x_all[i, ctx.replica_id_in_sync_group * half:][:half]))
        ys = strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(y_all[i, ctx.replica_id_in_sync_group * half:][:half]))
        grads = step(xs, ys, tf.constant(i, tf.int64))
        per_rep = [[g.numpy() for g in strategy.experimental_local_results(gr)] for gr in grads]
        np.savez(os.path.join(out, f"replica_grads_{i}.npz"), **{f"{l}_{r}": a for l, rs in enumerate(per_rep)
                                                                   for r, a in enumerate(rs)})
    tpu.flush()  # the shards module's writers, through the tpu re-export
    with default_writer.as_default():
        default_writer.flush()

    # The single-device run of the same global batches (the same starting weights: nothing was applied).
    w1, b1 = tf.Variable(w0, name="dense/kernel"), tf.Variable(tf.zeros([K]), name="dense/bias")
    single = tf.summary.create_file_writer(os.path.join(out, "single"))
    with single.as_default():
        for i in range(2):
            with tf.GradientTape() as tape:
                loss = loss_fn(w1, b1, tf.constant(x_all[i]), tf.constant(y_all[i]))
            gv = list(zip(tape.gradient(loss, [w1, b1]), [w1, b1]))
            summary.gradients(gv, step=i, hist_sample=0)
    single.flush()
    print("OK")
    """
)


def read_records(log_dir: str) -> tuple[tuple[str, ...], dict[int, np.ndarray]]:
    layers, rows = (), {}
    for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
        for event in EventFileLoader(path).Load():
            for v in event.summary.value:
                if v.tag.startswith(metadata.TAG_PREFIX):
                    if v.metadata.plugin_data.content:
                        layers = metadata.decode_content(v.metadata.plugin_data.content).layers
                    rows[event.step] = record.from_disk(tensor_util.make_ndarray(v.tensor))
    return layers, rows


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("needs TensorFlow")
    out = tmp_path_factory.mktemp("mirrored")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-4000:]
    return str(out)


def assert_close_records(got: np.ndarray, want: np.ndarray, rtol: float = 1e-5) -> None:
    for f in ("size", "nan", "posinf", "neginf", "zero", "missing"):
        np.testing.assert_array_equal(got[:, record.INDEX[f]], want[:, record.INDEX[f]], err_msg=f)
    dg, dw = record.derived(got), record.derived(want)
    for f in ("min", "max", "norm", "rms", "max_abs", "mean", "weight_norm"):
        np.testing.assert_allclose(dg[f], dw[f], rtol=rtol, atol=1e-7, err_msg=f)
    # Histograms: the same elements land in the same decades (summation order may move a value across an edge
    # only if it sits within float rounding of a power of ten: allow one element).
    np.testing.assert_allclose(got[:, record.HIST_START:], want[:, record.HIST_START:], atol=1)


def test_mirrored_applied_record_equals_single_device_run(run_dir):
    layers_a, applied = read_records(os.path.join(run_dir, "applied"))
    layers_s, single = read_records(os.path.join(run_dir, "single"))
    assert layers_a == layers_s == ("dense/kernel", "dense/bias")
    assert sorted(applied) == sorted(single) == [0, 1]
    assert_close_records(applied[0], single[0])
    # step 1 has a NaN in one replica's data: the applied (summed) gradient carries it, as the single-device one
    np.testing.assert_array_equal(applied[1][:, :record.NUM_COUNTS], single[1][:, :record.NUM_COUNTS])
    assert applied[1][0, record.INDEX["nan"]] > 0
    _, default = read_records(os.path.join(run_dir, "default_writer"))
    np.testing.assert_array_equal(default[0], applied[0])


def test_mirrored_per_replica_records_merge_to_the_union(run_dir):
    layers, merged = read_records(os.path.join(run_dir, "replicas"))
    assert layers == ("dense/kernel", "dense/bias")
    for i in (0, 1):
        grads = np.load(os.path.join(run_dir, f"replica_grads_{i}.npz"))
        want = np.stack([
            record.compute(np.concatenate([grads[f"{layer}_{r}"].ravel() for r in (0, 1)]), hist_sample=None)
            for layer in (0, 1)
        ])
        for f in ("size", "nan", "posinf", "neginf", "zero", "hist_sample"):
            np.testing.assert_array_equal(merged[i][:, record.INDEX[f]], want[:, record.INDEX[f]], err_msg=f)
        np.testing.assert_array_equal(merged[i][:, record.HIST_START:], want[:, record.HIST_START:])
        dm, dw = record.derived(merged[i]), record.derived(want)
        for f in ("min", "max", "norm", "rms", "mean"):
            np.testing.assert_allclose(dm[f], dw[f], rtol=1e-5, err_msg=f)
        assert np.all(merged[i][:, record.INDEX["size"]] == [36, 6])  # 2 replicas x (18, 3)
    # Replica 1's NaN at step 1 shows in the merged record; replica 0's half is clean.
    grads = np.load(os.path.join(run_dir, "replica_grads_1.npz"))
    assert np.isnan(grads["0_1"]).any() and not np.isnan(grads["0_0"]).any()
    assert merged[1][0, record.INDEX["nan"]] == np.isnan(grads["0_1"]).sum()
