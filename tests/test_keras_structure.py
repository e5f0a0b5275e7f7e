"""The Keras callback's parts, read from their source: every attribute is born in ``__init__``, and the capture path
is decided in one function that nothing else second-guesses.

Runs without TensorFlow (the source is parsed, not imported); ``test_keras.py`` checks the same on live objects
after a ``fit``.
"""

from __future__ import annotations

import ast

import pytest

from tests.attributes import ROOT, born_outside_init, classes_of

pytestmark = pytest.mark.unit

#: The callback and the objects it holds for a fit (the NaN-origin search's base class is in origin.py).
PARTS = ("keras.py", "_tf/capture.py", "_stepbook.py", "_tf/fit_origin.py", "origin.py", "live.py")


def _classes() -> dict:
    out = {}
    for part in PARTS:
        out.update(classes_of(ROOT / part))
    return out


def test_every_attribute_of_the_callback_s_parts_is_born_in_init():
    classes = _classes()
    assert {"GradientHealthCallback", "Capture", "InStep", "AfterStep", "Ring", "Statistics", "StepBook", "LossBook",
            "_RecordSink", "StopCheck", "LiveRun", "_Probe", "FitOrigin"} <= set(classes)
    assert born_outside_init(classes) == {}


def test_an_attribute_first_set_by_a_later_method_is_found(tmp_path):
    """The check itself: a class that sets an attribute in a method, and one whose subclass sets its base's."""
    source = tmp_path / "late.py"
    source.write_text(
        "class Base:\n    def __init__(self):\n        self.kept = 0\n\n"
        "class Late(Base):\n    def __init__(self):\n        super().__init__()\n\n"
        "    def start(self):\n        self.kept, (self.late, x) = 1, (2, 3)\n\n"
        "        def nested():\n            self.deeper = 4\n        self.kept += 1\n")
    assert born_outside_init(classes_of(source)) == {"Late": {"late": "start", "deeper": "start"}}


def _calls_of(tree: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func).endswith(name)]


def test_the_capture_path_is_chosen_by_one_function_and_never_branched_on():
    """Only ``_choose_capture`` makes a path (``AfterStep``/``InStep``) and only it asks whether the record may be
    taken after the step; the callback never reads which path it holds (``after_step``, ``isinstance``)."""
    tree = ast.parse((ROOT / "keras.py").read_text())
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    for made in ("AfterStep", "InStep", "_records_after_step"):
        callers = {name for name, fn in functions.items() if _calls_of(fn, made)}
        assert callers == {"_choose_capture"}, (made, callers)
    callers = {name for name, fn in functions.items() if _calls_of(fn, "_choose_capture")}
    assert callers == {"_start_capture", "_choose_again"}
    reads = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "after_step"]
    assert reads == []
    assert not [ast.unparse(n) for n in _calls_of(tree, "isinstance") if "Capture" in ast.unparse(n)
                or "AfterStep" in ast.unparse(n) or "InStep" in ast.unparse(n)]
