"""What the NaN-origin fault cases share, framework-free (tests/nan_cases_tf.py, nan_cases_torch.py, nan_cases_jax.py).

The fault fires only on samples of batch ``FAULT_BATCH`` (0-based), so the first steps train normally and the
non-finite gradient appears at step ``FAULT_STEP``. A case's source line is the line ending in its
``# fault: <case>`` marker.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tb_gradhealth import origin

BATCH = 8
STEPS = 4
FAULT_BATCH = 2
FAULT_STEP = FAULT_BATCH + 1
FAULT_ROWS = slice(FAULT_BATCH * BATCH, FAULT_BATCH * BATCH + 2)  # two samples of that batch
NAN_SAMPLE = 1  # the sample (within the faulty batch) that holds a NaN in the input-data case


def fault_line(case: str, path: str) -> int:
    """The line number of ``path`` that carries the ``# fault: <case>`` marker."""
    for i, text in enumerate(Path(path).read_text().splitlines(), 1):
        if text.rstrip().endswith(f"# fault: {case}"):
            return i
    raise LookupError(case)


@dataclass
class Case:
    """One training set-up and where its fault is: op, layer (None: the loss), direction."""

    name: str
    op: str
    layer: str | None
    direction: str
    model: Any
    loss: Callable[[Any, Any], Any]
    x: np.ndarray
    y: np.ndarray
    input_nan: bool = False


def data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets in [0.5, 1.5): no fault fires on them."""
    rng = np.random.default_rng(seed)
    return (rng.uniform(0.5, 1.5, (BATCH * STEPS, 4)).astype("float32"),
            rng.uniform(0.5, 1.5, (BATCH * STEPS, 1)).astype("float32"))


def mse(y: Any, p: Any) -> Any:
    """The mean squared error of PyTorch tensors or JAX arrays (their operators and ``.mean()``)."""
    return ((p - y) ** 2).mean()


def with_nan_sample(x: np.ndarray) -> np.ndarray:
    x[FAULT_BATCH * BATCH + NAN_SAMPLE, 2] = np.nan
    return x


def assert_names_the_fault(found: origin.NanOrigin | None, case: Case, file: str, line: int) -> None:
    """``found`` names the case's op, layer, direction, the line ``file:line``, and the faulty step."""
    assert found is not None and found.found, found
    assert found.step == FAULT_STEP, found
    assert (found.op, found.layer, found.direction) == (case.op, case.layer, case.direction), found
    assert (os.path.basename(found.file), found.line) == (os.path.basename(file), line), found
    if case.input_nan:
        assert len(found.input_nonfinite) == 1 and f"(sample {NAN_SAMPLE})" in found.input_nonfinite[0], found
    else:
        assert found.input_nonfinite == (), found


def stored(run_dir: Path) -> list[origin.NanOrigin]:
    """The origins stored in a run directory's event files."""
    return origin.read_event_files(sorted(str(p) for p in run_dir.glob("events.out.tfevents.*")))


def assert_case_found(cases: Any, name: str, train: Callable[[Case, str], Any], run_dir: Path) -> Case:
    """Case ``name`` of the module ``cases`` (``CASES``, ``fault_line``), trained by ``train`` (which returns its
    origin finder) into ``run_dir``: the finder names the fault marked in the module's source
    (:func:`assert_names_the_fault`) and the run stores exactly that answer. Returns the case."""
    case = cases.CASES[name]()
    found = train(case, str(run_dir)).origin
    assert_names_the_fault(found, case, cases.__file__, cases.fault_line(name))
    assert [o.to_json() for o in stored(run_dir)] == [found.to_json()]
    return case
