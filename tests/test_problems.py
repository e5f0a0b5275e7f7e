"""Problems carry their kind as a value: damage made on purpose is reported with the kind of that damage, and a
problem still reads, serialises and pickles as the plain line users see."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest

from tb_gradhealth import Writer, reader
from tb_gradhealth.problems import Kind, Problem, any_of_kind

pytestmark = pytest.mark.unit


def _run(tmp_path) -> str:
    with Writer(str(tmp_path), seed=0) as w:
        for step in range(4):
            w.add_gradients(step, {"a": np.full(8, 1e-3 * (step + 1)), "b": np.ones(4)})
        return w._writer.path


def _kinds(path: str) -> list[Kind]:
    problems: list[str] = []
    reader.read_run_dir([path], problems)
    return [getattr(p, "kind", None) for p in problems]


def test_a_truncated_file_is_partial(tmp_path):
    path = _run(tmp_path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 7)
    assert _kinds(path) == [Kind.PARTIAL]


def test_a_flipped_byte_is_file_damage(tmp_path):
    path = _run(tmp_path)
    data = bytearray(open(path, "rb").read())
    data[-30] ^= 0xFF  # inside the last record's data: its checksum fails
    open(path, "wb").write(bytes(data))
    assert _kinds(path) == [Kind.FILE]


def test_a_problem_is_the_line_users_read():
    p = Problem(Kind.RECORDS, "tag x: 1 damaged record row(s) skipped")
    assert p == "tag x: 1 damaged record row(s) skipped" and json.dumps([p]) == json.dumps([str(p)])
    back = pickle.loads(pickle.dumps(p))
    assert back == p and back.kind is Kind.RECORDS
    assert any_of_kind(["tag x: looks like records", p], Kind.RECORDS)
    assert not any_of_kind(["tag x: a plain line is of no kind"], Kind.RECORDS)
