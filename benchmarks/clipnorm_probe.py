"""What per-variable clipping leaves in the Keras callback's records, and what the diagnosis reads from them.

Under ``clipnorm`` Keras clips each gradient before the optimizer's update step, which is where the callback records
it: the record holds the clipped gradient (its norm pinned at the clip), not the one backprop produced. This trains,
with ``fit`` and ``GradientHealthCallback``, the held-out zoo's He/ReLU MLP at its healthy learning rate and at x100
and x1000 of it, and its recurrent net at orthogonal gain 1 and 3 (the zoo's ``mutant_rnn_gain_3``), all under
``clipnorm=1``, and prints per run the raw loss against the healthy twin's, how many variables are pinned at the
clip, the largest step relative to the layer's weights (update RMS over the largest weight RMS
of the layer's variables, as the rules read it), and the diagnosis (its cause's story).

    flock /tmp/gradhealth-heavy.lock nice -n 5 python benchmarks/clipnorm_probe.py [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # ``python benchmarks/clipnorm_probe.py`` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CLIP = 1.0


def _runs() -> list[tuple[str, str, Any, float, Any, Any, int]]:
    """(name, twin name, model builder, SGD learning rate, x, y, batch)."""
    from benchmarks import zoo_heldout as H
    from benchmarks.zoo_cases import teacher_data

    def mlp() -> Any:
        import keras

        keras.utils.set_random_seed(61)
        return H.relu_mlp(5)[0]

    x, y = teacher_data(40 * 64, 61)
    return [("mlp lr 0.02 (healthy)", "", mlp, 0.02, x, y, 64),
            ("mlp lr 2 (x100)", "mlp lr 0.02 (healthy)", mlp, 2.0, x, y, 64),
            ("mlp lr 20 (x1000)", "mlp lr 0.02 (healthy)", mlp, 20.0, x, y, 64),
            ("rnn gain 1 (healthy)", "", lambda: H._rnn_gain(False), 1e-4, H._RX, H._RY, 32),
            ("rnn gain 3", "rnn gain 1 (healthy)", lambda: H._rnn_gain(True), 1e-4, H._RX, H._RY, 32)]


def probe(out: Path) -> list[list[Any]]:
    import keras

    from benchmarks.zoo_cases import ce, fit_logged
    from tb_gradhealth import health, reader
    from tb_gradhealth.health import rules

    rows, losses = [], {}
    for name, twin, build, lr, x, y, batch in _runs():
        model = build()
        model.compile(optimizer=keras.optimizers.SGD(lr, clipnorm=CLIP), loss=ce())
        log_dir = out / name.split(" (")[0].replace(" ", "_")
        trace = fit_logged(model, x, y, str(log_dir), batch=batch)
        loss = np.array(trace.loss)
        losses[name] = loss
        run = next(r for r in reader.read_logdir(str(log_dir)).runs if r.num_steps)
        ev = rules.evaluate(run.records, run.layers, health.Thresholds())
        h = health.diagnose_run(run.layers, run.steps, run.records)
        vs_twin = float(np.nanmedian(loss[-10:] / losses[twin][-10:])) if twin else None
        rows.append([name, f"{loss[0]:.3g}", f"{np.nanmax(loss):.3g}", f"{loss[-1]:.3g}",
                     "-" if vs_twin is None else f"{vs_twin:.2g}x",
                     f"{int(ev.clipped.any(axis=0).sum())} of {len(run.layers)}",
                     f"{10.0 ** np.nanmax(ev.log_upd):.2g}", h.cause["story"] if h.cause else "healthy"])
    return rows


def main(argv: list[str] | None = None) -> int:
    from benchmarks.diagnosis_zoo import table

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="keep the logdirs here (default: a temporary folder)")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = probe(args.out or Path(tmp))
    print(table(["run (SGD, clipnorm=1)", "loss first", "loss max", "loss last", "last 10 vs twin",
                 "variables pinned at the clip", "max update RMS / layer weight RMS", "diagnosis (cause)"],
                rows, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
