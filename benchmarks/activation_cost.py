"""What recording each layer's output adds to a logged step: a step logged with ``activations=True`` against one
logged without it, and the plain step, on a PyTorch CNN and transformer block and on the Keras models of
``real_architectures.py`` (MobileNetV2 and the small transformer the callback benchmarks use).

Every configuration has its own copy of the model; rounds are interleaved (machine load hits all alike) and the
medians printed, with the ratio of each logged step to the plain one. Every step is logged (``every=1`` /
``update_freq=1``): the figures are the cost of a logged step, not of a run at the default cadence. PyTorch and
TensorFlow run in separate child processes (they must not share one). Run under
``flock /tmp/gradhealth-heavy.lock``; the figures move with the machine's load.

Usage: python benchmarks/activation_cost.py [--rounds 5] [--steps 4] [--parts torch,keras]
       [--keras-models mobilenetv2,transformer]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

CONFIGS = ("plain", "gradients", "activations")


def _table(title: str, times: dict[str, list[float]]) -> list[str]:
    """Each configuration's median step against the plain step and, the goal's measure, against the step that logs
    gradients only (both as medians of the per-round ratios, with their range)."""
    plain, grads = times["plain"], times["gradients"]
    lines = [title, f"  {'config':12s} {'step ms':>8s} {'+ms':>7s} {'vs plain (min-max)':>24s} "
                    f"{'vs gradients (min-max)':>24s}"]
    for config, t in times.items():
        cells = []
        for base in (plain, grads):
            ratios = [a / b for a, b in zip(t, base, strict=True)]
            cells.append(f"{statistics.median(ratios):8.3f}x ({min(ratios):.2f}-{max(ratios):.2f})")
        med = statistics.median(t)
        lines.append(f"  {config:12s} {1e3 * med:8.1f} {1e3 * (med - statistics.median(plain)):7.1f} "
                     f"{cells[0]:>24s} {cells[1]:>24s}")
    return lines


def _interleaved(runners: dict[str, Any], rounds: int, steps: int) -> dict[str, list[float]]:
    names = list(runners)
    times: dict[str, list[float]] = {c: [] for c in names}
    for k in range(rounds):
        for c in names[k % len(names):] + names[: k % len(names)]:
            times[c].append(runners[c](steps))
    return times


def torch_part(rounds: int, steps: int) -> None:
    import torch

    from tb_gradhealth.torch import StepRecorder
    from tb_gradhealth.writer import Writer

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    nn = torch.nn

    def cnn() -> tuple[nn.Module, torch.Tensor]:
        layers: list[nn.Module] = []
        c = 3
        for w in (32, 64, 64, 128):
            layers += [nn.Conv2d(c, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU()]
            c = w
        return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10)), \
            torch.randn(32, 3, 32, 32)

    def block() -> tuple[nn.Module, torch.Tensor]:
        layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
        return nn.Sequential(layer, nn.Flatten(), nn.Linear(64 * 256, 10)), torch.randn(16, 64, 256)

    root = tempfile.mkdtemp(prefix="gradhealth-activation-cost-")
    for name, build in (("torch cnn", cnn), ("torch transformer block", block)):
        runners = {}
        writers = []
        for config in CONFIGS:
            torch.manual_seed(0)
            model, x = build()
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            rec = None
            if config != "plain":
                w = Writer(os.path.join(root, name.replace(" ", "_"), config))
                writers.append(w)
                rec = StepRecorder(w, model, opt, every=1, first=0, activations=config == "activations")
            counter = [0]

            def run(k: int, model: Any = model, x: Any = x, opt: Any = opt, rec: Any = rec,
                    counter: list = counter) -> float:
                t = time.perf_counter()
                for _ in range(k):
                    loss = model(x).square().mean()
                    opt.zero_grad()
                    loss.backward()
                    if rec is not None:
                        rec.step(counter[0])
                    opt.step()
                    counter[0] += 1
                return (time.perf_counter() - t) / k

            run(2)  # warm-up
            runners[config] = run
        print("\n".join(_table(f"{name}: {rounds} rounds x {steps} steps", _interleaved(runners, rounds, steps))))
        for w in writers:
            w.close()


def keras_part(rounds: int, steps: int, models: list[str]) -> None:
    import real_architectures as ra

    root = tempfile.mkdtemp(prefix="gradhealth-activation-cost-")
    for name in models:
        runners, made = {}, []
        for config in CONFIGS:
            r = ra.Runner(name, "plain", root)
            if config != "plain":
                r.callback = ra.start_callback(r.model, os.path.join(root, name, config), update_freq=1,
                                               activations=config == "activations")
            first = r.first()
            r.run(2)
            runners[config] = r.run
            made.append((config, r, first))
        print("\n".join(_table(f"keras {name}: {rounds} rounds x {steps} steps", _interleaved(runners, rounds, steps))))
        print("  first step s: " + ", ".join(f"{c} {f:.1f}" for c, _, f in made))
        for _, r, _ in made:
            r.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--parts", default="torch,keras")
    p.add_argument("--keras-models", default="mobilenetv2,transformer")
    p.add_argument("--child", choices=("torch", "keras"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child == "torch":
        return torch_part(args.rounds, args.steps)
    if args.child == "keras":
        return keras_part(args.rounds, args.steps, args.keras_models.split(","))
    print(f"load average {os.getloadavg()[0]:.1f}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for part in args.parts.split(","):
        subprocess.run([sys.executable, __file__, "--child", part, "--rounds", str(args.rounds), "--steps",
                        str(args.steps), "--keras-models", args.keras_models], check=True)


if __name__ == "__main__":
    main()
