"""What ``stop_on`` costs a training loop: the live run fed by the writer, and the diagnosis of each logged step.

One run of ``--layers`` x ``--steps`` logged steps (synthetic records of a healthy network, :func:`tb_gradhealth.
testing.synthetic_records`, with a falling loss) is written by the numpy ``Writer`` with a
:class:`tb_gradhealth.live.StopCheck` watching it, checked at every logged step as the writers check it: once with
every logged step diagnosed (``dense=None``), once with the default thinning (:data:`tb_gradhealth.live.DENSE_CHECKS`).
It prints the process time a logged step's write costs with and without the live run fed beside it, the time of
one check at several points of the run, and each mode's total over the run (all in CPU seconds of this process).

    flock /tmp/gradhealth-heavy.lock python benchmarks/live_cost.py [--layers 100 --steps 1000]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

from tb_gradhealth import live, testing
from tb_gradhealth.writer import Writer

MARKS = (10, 100, 250, 500, 1000, 2000, 5000)


def _rows(rng: np.random.Generator, n_layers: int, s: int, n_steps: int) -> np.ndarray:
    depth = 10.0 ** np.linspace(-4.0, -2.0, n_layers)
    return testing.synthetic_records(depth * np.exp(rng.normal(0.0, 0.05, n_layers)) * (1.0 + 0.2 * s / n_steps))


def measure(n_layers: int, n_steps: int, dense: int | None) -> dict:
    """Write the run with a StopCheck of ``dense`` watching; the costs of writing, feeding and checking."""
    rng = np.random.default_rng(0)
    names = [f"block_{i // 2:04d}/{'kernel' if i % 2 == 0 else 'bias'}" for i in range(n_layers)]
    check = live.StopCheck(("nonfinite", "exploding"), dense=dense)
    write, plain, at = 0.0, 0.0, {}
    with tempfile.TemporaryDirectory() as tmp, Writer(f"{tmp}/live") as w, Writer(f"{tmp}/plain") as p:
        check.watch(w)
        for s in range(n_steps):
            rows = _rows(rng, n_layers, s, n_steps)
            loss = 2.0 - s / n_steps + 0.05 * rng.random()
            t0 = time.process_time()
            p.add_records(s, names, rows)
            p.add_loss(s, loss)
            t1 = time.process_time()
            w.add_records(s, names, rows)
            w.add_loss(s, loss)
            t2 = time.process_time()
            plain, write = plain + t1 - t0, write + t2 - t1
            before = check.seconds
            if check.check(s) is not None:
                raise SystemExit(f"the synthetic run was stopped at step {s}: {check.event}")
            if s + 1 in MARKS and check.seconds > before:
                at[s + 1] = check.seconds - before
    return {"plain_write_ms": 1e3 * plain / n_steps, "fed_write_ms": 1e3 * write / n_steps, "checks": check.checks,
            "check_total_s": check.seconds, "check_at_s": at}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    print(f"{args.layers} layers x {args.steps} logged steps, every logged step handed to StopCheck.check")
    for dense in (None, live.DENSE_CHECKS):
        r = measure(args.layers, args.steps, dense)
        label = "every logged step" if dense is None else f"dense={dense}"
        print(f"{label}: {r['checks']} checks, {r['check_total_s']:.1f} s in all "
              f"({1e3 * r['check_total_s'] / args.steps:.1f} ms a logged step); one check at logged step "
              + ", ".join(f"{k}: {1e3 * v:.0f} ms" for k, v in r["check_at_s"].items()))
        print(f"  a logged step's write: {r['plain_write_ms']:.2f} ms, {r['fed_write_ms']:.2f} ms with the live run "
              "fed beside it")


if __name__ == "__main__":
    main()
