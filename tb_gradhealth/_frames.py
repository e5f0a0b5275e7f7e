"""Which Python frame of a stack is the user's code: the first one outside the frameworks and this package.

Used by the op-by-op replays (:mod:`tb_gradhealth.tf_origin`, :mod:`tb_gradhealth.torch_origin`) to name the line
that created the operation that made a NaN/Inf. A frame is the user's unless its file lies under the standard
library or one of the framework packages below (so a user's own installed package still counts as user code).
"""

from __future__ import annotations

import importlib.util
import linecache
import os
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from types import FrameType

#: Packages whose frames are never the user's code.
FRAMEWORK_PACKAGES = (
    "tb_gradhealth", "tensorflow", "keras", "tf_keras", "torch", "jax", "jaxlib", "numpy", "absl", "google",
    "tensorboard", "optree", "ml_dtypes", "lightning", "pytorch_lightning", "transformers", "_pytest", "pytest",
    "pluggy",
)


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str
    code: str


@lru_cache(maxsize=1)
def _library_dirs() -> tuple[str, ...]:
    dirs = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib")}
    for name in FRAMEWORK_PACKAGES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        for loc in (spec.submodule_search_locations or []) if spec else []:
            dirs.add(os.path.realpath(loc))
    return tuple(sorted(d + os.sep for d in dirs))


@lru_cache(maxsize=4096)
def is_user_file(filename: str) -> bool:
    if not filename or filename.startswith("<"):
        return False
    path = os.path.realpath(filename)
    return not any(path.startswith(d) for d in _library_dirs())


def user_frame(frame: FrameType | None) -> Frame | None:
    """The innermost frame of user code at or above ``frame``, or None."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if is_user_file(filename):
            line = frame.f_lineno
            return Frame(filename, line, frame.f_code.co_name, linecache.getline(filename, line).strip())
        frame = frame.f_back
    return None
