"""Bytes crossing from device to host per step per layer: our host_call vs sampling 1,000 values per variable.

The sampling recipe sends, per variable, ``shuffle(flatten(g))[:1000]`` as a ``[1, 1000]`` float32 tensor plus
scalars: 4,016 B per variable (1000 samples + 4 scalars). Ours sends one packed record per layer
(``counts`` int32 [1, L, 5] + ``values`` float32 [1, L, 89]) plus the step and the extra scalars once per step.
Both payloads are measured from the actual tensors each recipe builds (shape x dtype size), per shard.

The second half shows what the bytes buy: a 1M-element gradient with one 1e8 spike, 3 NaN and 2 Inf. The recipe's
1000-element sample sees the spike with probability 1e-3 and the NaN/Inf almost never; the record's max|g| and
NaN/Inf counts are exact. No timing here, so no lock is needed.

Run: ``python benchmarks/host_payload.py [--layers 10] [--trials 200]``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tb_gradhealth import record, tpu  # noqa: E402

SAMPLED_VALUES = 1000


def _nbytes(tensors: list[tf.Tensor]) -> int:
    return int(sum(t.shape.num_elements() * t.dtype.size for t in tensors))


def sampled_tensors(grads: list[tf.Tensor], step: tf.Tensor, loss: tf.Tensor, lr: tf.Tensor) -> list[tf.Tensor]:
    """The sampling recipe: ``[gs, loss, lr] + [reshape(shuffle(flatten(g))[:1000], [1, -1])]``."""
    sampled = [tf.reshape(tf.random.shuffle(tf.reshape(g, [-1]))[:SAMPLED_VALUES], [1, -1]) for g in grads]
    return [tf.reshape(step, [1]), tf.reshape(loss, [1]), tf.reshape(lr, [1])] + sampled


def payload(n_layers: int, size: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    variables = [tf.Variable(rng.normal(size=(size,)).astype(np.float32), name=f"dense_{i}/kernel")
                 for i in range(n_layers)]
    grads = [tf.constant(rng.normal(scale=1e-3, size=(size,)).astype(np.float32)) for _ in range(n_layers)]
    step = tf.constant(7, tf.int64)
    loss, lr = tf.constant(0.5), tf.constant(0.1)
    with tempfile.TemporaryDirectory() as d:
        _, ours = tpu.host_call(list(zip(grads, variables, strict=True)), step, d, {"loss": loss, "learning_rate": lr})
    sampled = sampled_tensors(grads, step, loss, lr)
    ours_record = _nbytes(ours[:2])
    ours_shared = _nbytes(ours[2:])
    sampled_per_var = _nbytes(sampled[3:]) / n_layers
    return {
        "layers": n_layers,
        "ours_bytes_per_layer": ours_record / n_layers,
        "ours_shared_bytes_per_step": ours_shared,
        "ours_total_bytes_per_step": ours_record + ours_shared,
        "sampled_bytes_per_variable": sampled_per_var + 4 * 4,  # 1000 samples + 4 scalars
        "sampled_total_bytes_per_step": _nbytes(sampled),
        "ratio_sampled_over_ours_per_layer": (sampled_per_var + 16) / (ours_record / n_layers),
    }


def fidelity(trials: int, size: int = 1_000_000) -> dict[str, object]:
    rng = np.random.default_rng(1)
    g = rng.normal(scale=1e-3, size=size).astype(np.float32)
    spike = int(rng.integers(size))
    g[spike] = 1e8
    bad = rng.choice(np.setdiff1d(np.arange(size), [spike]), size=5, replace=False)
    g[bad[:3]] = np.nan
    g[bad[3:]] = np.inf
    gt = tf.constant(g)
    seen_spike = seen_nan = seen_inf = 0
    for t in range(trials):
        tf.random.set_seed(t)
        sample = tf.random.shuffle(gt)[:SAMPLED_VALUES].numpy()
        seen_spike += bool(np.any(sample == np.float32(1e8)))
        seen_nan += bool(np.isnan(sample).any())
        seen_inf += bool(np.isinf(sample).any())
    with tempfile.TemporaryDirectory() as d:
        _, tensors = tpu.host_call([(gt, tf.Variable(tf.zeros_like(gt), name="big/kernel"))], tf.constant(0), d)
    rows = record.from_device(tensors[0][0].numpy(), tensors[1][0].numpy())
    der = record.derived(rows[0])
    return {
        "elements": size,
        "trials": trials,
        "sampled_sample_saw_1e8_spike": f"{seen_spike}/{trials}",
        "sampled_sample_saw_nan": f"{seen_nan}/{trials}",
        "sampled_sample_saw_inf": f"{seen_inf}/{trials}",
        "ours_max_abs": float(der["max_abs"]),
        "ours_nan": int(der["nan"]),
        "ours_inf": int(der["inf"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--size", type=int, default=100_000, help="elements per variable for the payload part")
    parser.add_argument("--trials", type=int, default=200)
    args = parser.parse_args()
    out = {"payload": payload(args.layers, args.size), "fidelity": fidelity(args.trials)}
    print(json.dumps(out, indent=2))
    assert out["payload"]["ours_bytes_per_layer"] <= 400, "goal: <= 400 B per layer"


if __name__ == "__main__":
    main()
