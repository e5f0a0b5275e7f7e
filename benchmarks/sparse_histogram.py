"""What a sparse layer costs the TF statistics: the whole-model function with and without a layer whose sample
is not enough (so its histogram is binned whole), on a real model's variables.

Rows, for ``keras.applications`` ResNet50's 161 trainable variables with random dense gradients, then the same with
the largest kernel, (3, 3, 512, 512), made all zero but for 23 values (a ReLU network at a 2x2 feature map):

  first call       trace + compile of the whole-model statistics (``summary.compute``, eagerly)
  steady dense     the least of ``--repeats`` calls, every layer sampled or exact as usual
  first sparse     the first call with the sparse layer: the whole binning compiles then, on its own
  steady sparse    the least of ``--repeats`` calls with the sparse layer

Each row is measured in a fresh process per round (``--src DIR`` puts another checkout's ``tb_gradhealth`` first on
the path, to measure a version side by side); sources alternate over ``--rounds`` and each cell keeps its least
value, the one least disturbed by other processes. Run under ``flock /tmp/gradhealth-heavy.lock``.
Usage: python benchmarks/sparse_histogram.py [--repeats 10] [--rounds 3] [--src DIR ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(repeats: int) -> dict[str, float]:
    import keras
    import numpy as np
    import tensorflow as tf

    from tb_gradhealth import summary

    model = keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10)
    variables = model.trainable_variables
    rng = np.random.default_rng(0)
    dense = [tf.constant(rng.standard_normal(v.shape).astype("float32")) for v in variables]
    big = max(range(len(variables)), key=lambda i: int(np.prod(variables[i].shape)))
    g = np.zeros(variables[big].shape, np.float32)
    g.reshape(-1)[rng.choice(g.size, 23, replace=False)] = rng.standard_normal(23)
    sparse = [*dense[:big], tf.constant(g), *dense[big + 1:]]

    def once(grads: list) -> float:
        t = time.perf_counter()
        summary.compute(grads).counts.numpy()
        return time.perf_counter() - t

    out = {"first call": once(dense), "steady dense": min(once(dense) for _ in range(repeats))}
    out["first sparse"] = once(sparse)
    out["steady sparse"] = min(once(sparse) for _ in range(repeats))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--src", action="append", default=[], help="another checkout to measure beside this one")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.repeats)))
        return
    rows: dict[str, dict[str, float]] = {}
    for _ in range(args.rounds):
        for src in [ROOT, *args.src]:
            env = {**os.environ, "PYTHONPATH": src, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
            done = subprocess.run([sys.executable, __file__, "--child", "--repeats", str(args.repeats)], env=env,
                                  capture_output=True, text=True, check=True, cwd=src)
            got = json.loads(done.stdout.strip().splitlines()[-1])
            rows[src] = {k: min(v, rows.get(src, got)[k]) for k, v in got.items()}
    names = list(next(iter(rows.values())))
    print("| source | " + " | ".join(names) + " |")
    print("| --- " * (len(names) + 1) + "|")
    for src, row in rows.items():
        cells = [f"{row[n]:.2f} s" if row[n] >= 1 else f"{row[n] * 1e3:.1f} ms" for n in names]
        print(f"| {os.path.relpath(src, ROOT) if src != ROOT else 'this checkout'} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
