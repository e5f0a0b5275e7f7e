"""Zoo cases trained in a child process: PyTorch, Lightning, Hugging Face and JAX, which the zoo's TensorFlow
process cannot host (TensorFlow and ``torch._dynamo`` crash in one process).

A case registers with :func:`case` in one of the zoo's halves (``zoo_cases.CASES``, the design half, or
``zoo_heldout.CASES``, the held-out half) with :func:`run_in_child` as its runner; the zoo's ``train`` then starts

    python -m benchmarks.zoo_child CASE DIR

which imports no TensorFlow, seeds the frameworks by the case's name, trains the case with
:func:`benchmarks.zoo_cases.record_case` (the bookkeeping every case shares) and leaves ``DIR/labels.json`` as the
TensorFlow cases do. The child uses one CPU thread: the machine is shared, and two trainings of one case (a GAN's
two sides, a clipped twin) then give bit-identical results.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # ``python benchmarks/zoo_child.py`` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import zoo_cases
from benchmarks.zoo_cases import Case

#: The modules whose cases train in the child (each registers its cases when imported; none imports a framework
#: at import time).
MODULES = ("benchmarks.zoo_torch_cases", "benchmarks.zoo_trainer_cases", "benchmarks.zoo_jax_cases")
_ROOT = Path(__file__).resolve().parent.parent


def load_cases() -> None:
    """Import every module of :data:`MODULES`, registering their cases in the zoo's halves."""
    for name in MODULES:
        importlib.import_module(name)


def case(half: dict[str, Case], name: str, rule: str) -> Callable:
    """Register ``fn(log_dir) -> labels`` as case ``name`` of ``half`` (``zoo_cases.CASES`` or
    ``zoo_heldout.CASES``), trained in a child process."""
    def register(fn: Callable[[str], dict[str, Any]]) -> Callable[[str], dict[str, Any]]:
        half[name] = Case(name, rule, fn, runner=run_in_child)
        return fn

    return register


def run_in_child(name: str, case_dir: Path) -> dict[str, Any]:
    """Train case ``name`` into ``case_dir`` in a child process; returns its labels."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-m", "benchmarks.zoo_child", name, str(case_dir)], check=True, cwd=_ROOT,
                   env=env)
    return json.loads((Path(case_dir) / "labels.json").read_text())


def _seed(name: str) -> None:
    import random

    import numpy as np

    seed = sum(map(ord, name))
    random.seed(seed)
    np.random.seed(seed)
    try:
        import torch
    except ImportError:
        return
    torch.manual_seed(seed)
    torch.set_num_threads(1)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m benchmarks.zoo_child CASE DIR", file=sys.stderr)
        return 2
    from benchmarks import zoo_heldout

    load_cases()
    name, case_dir = argv
    cases = {**zoo_cases.CASES, **zoo_heldout.CASES}
    if name not in cases or cases[name].runner is None:
        print(f"{name} is not a case trained in a child process", file=sys.stderr)
        return 2
    _seed(name)
    zoo_cases.record_case(cases[name], Path(case_dir))
    if "tensorflow" in sys.modules:
        raise RuntimeError(f"{name} imported TensorFlow in the child process")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
