"""Where the Keras callback's logged step spends its time: the capturing step taken apart, part by part.

Each configuration is ``GradientHealthCallback(update_freq=1)`` on its own copy of one model of
``real_architectures.py`` (same models, data, optimizer and driver), timed in the same interleaved rounds against
the plain step; the ratios are per round, the median and the spread printed:

  plain          Keras' own train step, no callback
  capture_only   the capturing step with the statistics replaced by one ``reduce_max`` per gradient: what the
                 capture itself costs (the optimizer hook, the weights kept from before the update, the ring
                 buffer store)
  gradient       the statistics of the gradient alone (no weight or update norms)
  no_updates     ``record_updates=False``: gradient and weight statistics, the weights read after the update
  weights_before the same work on the weights kept from before the update (as ``every`` has them), no update: the
                 statistics need nothing the optimizer writes, so they may run beside it
  every          the default logged step: gradient, weight and update statistics
  every_graph    the same as plain TensorFlow ops (``compile_statistics=False``)

``capture_only``, ``gradient`` and ``weights_before`` replace ``records.compute`` as the capture module sees it
(a measurement only: the records they write are not right). Run under ``flock /tmp/gradhealth-heavy.lock``; the
figures move with the machine's load (read the spread).

Usage: python benchmarks/capture_cost.py [--model mobilenetv2] [--rounds 5] [--steps 4] [--configs plain,...]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

CONFIGS = ("plain", "capture_only", "gradient", "no_updates", "weights_before", "every", "every_graph")
#: Configurations that cut the statistics down as the capture module calls them.
PARTS = ("capture_only", "gradient", "weights_before")


class PartialStatistics:
    """``records`` (:mod:`tb_gradhealth._tf.records`) as the capture module sees it, with ``compute`` cut down to
    ``part`` while a step is traced."""

    def __init__(self, records: Any) -> None:
        self._records = records
        self.part = "all"

    def __getattr__(self, name: str) -> Any:
        return self._compute if name == "compute" else getattr(self._records, name)

    def _compute(self, grads: Any, weights: Any, updates: Any, **kw: Any) -> Any:
        import tensorflow as tf

        from tb_gradhealth import record

        if self.part == "gradient":
            return self._records.compute(grads, None, None, **kw)
        if self.part == "weights_before":
            return self._records.compute(grads, weights, None, **kw)
        if self.part == "capture_only":
            n = len(grads)
            m = tf.stack([tf.reduce_max(g) if g is not None else tf.constant(0.0) for g in grads])
            values = tf.concat([m[:, None], tf.zeros([n, record.NUM_VALUES + record.HIST_BINS - 1])], 1)
            return self._records.DeviceRecord(tf.zeros([n, record.NUM_COUNTS], tf.int32), values)
        return self._records.compute(grads, weights, updates, **kw)


def make_runner(ra: Any, model: str, config: str, log_root: str, partial: PartialStatistics) -> Any:
    runner = ra.Runner(model, "plain", log_root)
    runner.config = config
    if config == "plain":
        return runner
    runner.callback = ra.start_callback(
        runner.model, os.path.join(log_root, config), update_freq=1, record_updates=config != "no_updates",
        compile_statistics=False if config == "every_graph" else None,
    )
    partial.part = config if config in PARTS else "all"
    runner.first_s = runner.first()  # traced now, with this configuration's statistics
    partial.part = "all"
    return runner


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mobilenetv2")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    import real_architectures as ra

    from tb_gradhealth._tf import capture, records

    configs = args.configs.split(",")
    if "plain" not in configs:
        configs.insert(0, "plain")
    partial = PartialStatistics(records)
    capture.records = partial
    log_root = tempfile.mkdtemp(prefix="gradhealth-capture-cost-")
    runners = [make_runner(ra, args.model, c, log_root, partial) for c in configs]
    for r in runners:
        if r.config == "plain":
            r.first_s = r.first()
        r.run(2)
    gc.collect()
    gc.freeze()
    times: dict[str, list[float]] = {c: [] for c in configs}
    for k in range(args.rounds):
        for r in runners[k % len(runners):] + runners[: k % len(runners)]:
            times[r.config].append(r.run(args.steps))
    plain = times["plain"]
    load = os.getloadavg()[0]
    print(f"{args.model}: {args.rounds} rounds x {args.steps} steps, load average {load:.1f}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"  {'config':14s} {'step ms':>8s} {'+ms':>7s} {'ratio (min-max)':>22s} {'first s':>8s}")
    for r in runners:
        t = times[r.config]
        ratios = [a / b for a, b in zip(t, plain, strict=True)]
        med = statistics.median(t)
        print(f"  {r.config:14s} {1e3 * med:8.1f} {1e3 * (med - statistics.median(plain)):7.1f} "
              f"{statistics.median(ratios):8.3f}x ({min(ratios):.2f}-{max(ratios):.2f}) {r.first_s:8.1f}")


if __name__ == "__main__":
    main()
