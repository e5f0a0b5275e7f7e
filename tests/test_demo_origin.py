"""The demo's exploding run, trained for real (its own function, about 10 s): its NaN origin is stored and served
(the ``nan_origin`` route, ``tb-gradhealth report --json``), and the whole run tells one answer: the same layer in
the headline, the timeline, rank 1 and the drawer's notes, with fixes for its tanh layers."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
from tensorboard.plugins import base_plugin
from werkzeug.test import Client

from tb_gradhealth import cli, plugin, reader, record
from tb_gradhealth import testing as gl
from tests.test_health_answer import check_answer

pytestmark = pytest.mark.tf
DEMO = Path(__file__).resolve().parent.parent / "demo" / "demo.py"


@pytest.fixture(scope="module")
def exploding(tmp_path_factory, tensorflow) -> tuple[Path, reader.RunSeries]:
    from demo import demo

    logdir = tmp_path_factory.mktemp("demo_exploding")
    demo.run_exploding(str(logdir / "exploding"), 100)
    series = reader.read_logdir(str(logdir)).runs[0]
    return logdir, series


@pytest.fixture(scope="module")
def report(exploding) -> dict:
    """``tb-gradhealth report --json`` of the run."""
    logdir, _ = exploding
    out, err = io.StringIO(), io.StringIO()
    args = cli.build_parser().parse_args(["report", str(logdir), "--json", "--fail-on", "none"])
    assert cli.report(args, out, err) == 0, err.getvalue()
    return json.loads(out.getvalue())["runs"][0]


def _loss_line() -> int:
    """The demo's source line that squares the error: where float32 overflows (read from the file, not the code)."""
    lines = DEMO.read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if "tf.square(model(" in text)


def test_the_origin_names_the_op_its_place_direction_and_source_line(exploding, report):
    _, series = exploding
    d = record.derived(series.records)
    first_nan = int(series.steps[np.argmax((d["nan"] + d["inf"]).sum(axis=1) > 0)])  # from the counts alone
    o = report["nan_origin"]
    assert o is not None and o["found"], o
    assert o["step"] == first_nan and o["framework"] == "tensorflow"
    # The output grew to ~1e22 and its square overflowed float32 in the loss: no layer made it.
    assert (o["op"], o["direction"], o["layer"]) == ("Square", "forward", None)
    assert Path(o["file"]).resolve() == DEMO and o["line"] == _loss_line() and "tf.square" in o["code"]
    assert re.search(rf"NaN/Inf made at step {first_nan} in code outside any layer \(Square, forward\) - "
                     rf"demo\.py:{_loss_line()}", o["message"]), o["message"]


def test_the_nan_origin_route_serves_the_same_origin(exploding, report):
    logdir, series = exploding
    ingester = gl.data_server(str(logdir), {"gradhealth": 0}, last_steps={"exploding": int(series.steps[-1])})
    p = plugin.GradHealthPlugin(base_plugin.TBContext(data_provider=ingester.data_provider,
                                                      sampling_hints={"gradhealth": 0}))
    r = Client(p.get_plugin_apps()["/nan_origin"]).get("/nan_origin?run=exploding")
    assert r.status_code == 200
    assert json.loads(r.get_data(as_text=True))["origin"] == report["nan_origin"]


def test_one_answer_across_headline_timeline_ranking_and_notes(report):
    check_answer(report)
    sm, top = report["summary"], report["layers"][0]
    a = sm["answer"]
    assert a["now"] == "nonfinite" and a["status"] == "exploding" and a["step"] < a["now_since"]
    nonfinite = next(e for e in sm["timeline"] if e["status"] == "nonfinite")
    assert nonfinite["layer"] == a["layer"] and nonfinite["step"] == a["now_since"]
    for x in report["layers"][1:]:
        for r in x["reasons"]:
            m = re.search(r"first layer to reach nonfinite was (\S+),", r)
            assert m is None or m.group(1) == a["layer"], r
    # The NaN layer's values before the NaN are there, where its own are null.
    assert top["rms"] is None and top["last_finite"]["step"] == a["now_since"] - 1
    # A tanh stack: no rectifier advice anywhere.
    assert top["kind"] == "Dense" and top["activation"] == "tanh"
    assert not any("LeakyReLU" in f or "ReLUs" in f for x in report["layers"] for f in x["fixes"])
