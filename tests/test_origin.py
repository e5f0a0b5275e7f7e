"""The stored NaN origin: versioned JSON under its own plugin name, read back by the CLI (event files) and by the
plugin's ``nan_origin`` route (TensorBoard's data server); logs without one read as before."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from tensorboard.plugins import base_plugin
from werkzeug.test import Client

from tb_gradhealth import cli, origin, plugin, reader
from tb_gradhealth import testing as gl

FOUND = origin.NanOrigin(
    step=12, found=True, framework="tensorflow", op="Exp", layer="attention/softmax", direction="forward",
    input_shapes=((8, 3),), output_shapes=((8, 3),), file="/home/me/model.py", line=88, function="call",
    code="e = tf.exp(x)", nonfinite="Inf in its output", seconds=0.05,
)


@pytest.mark.unit
def test_round_trip_and_message():
    back = origin.decode(origin.encode(FOUND))
    assert back.to_json() == FOUND.to_json()
    assert FOUND.message() == ("NaN/Inf made at step 12 in layer 'attention/softmax' (Exp, forward) - model.py:88 "
                               "`e = tf.exp(x)`")
    missing = origin.NanOrigin(step=3, found=False, reason="the batch of step 3 was not kept")
    assert missing.message() == "non-finite gradient at step 3: origin not found (the batch of step 3 was not kept)"


@pytest.mark.unit
def test_a_newer_format_is_refused_and_damage_is_a_problem(tmp_path):
    newer = json.dumps({**json.loads(origin.encode(FOUND)), "v": origin.FORMAT_VERSION + 1})
    with pytest.raises(origin.UnsupportedVersion):
        origin.decode(newer)
    with pytest.raises(ValueError):
        origin.decode(b"{not json")


@pytest.mark.unit
def test_report_prints_the_origin_and_old_logs_read_as_before(tmp_path, capsys):
    gl.make_demo_logdir(str(tmp_path))
    origin.write(str(tmp_path / "exploding"), FOUND)
    assert [o.to_json() for o in origin.read_event_files(reader.find_runs(str(tmp_path))["exploding"])] == \
        [FOUND.to_json()]
    cli.main(["report", str(tmp_path)])
    text = capsys.readouterr().out
    block = text[text.index("run exploding"):]
    assert FOUND.message() in block.split("\n\n")[0]
    assert text.count("NaN/Inf made at") == 1
    cli.main(["report", str(tmp_path), "--json"])
    runs = {r["run"]: r for r in json.loads(capsys.readouterr().out)["runs"]}
    assert runs["exploding"]["nan_origin"]["op"] == "Exp" and runs["exploding"]["nan_origin"]["line"] == 88
    assert {r["nan_origin"] is None for name, r in runs.items() if name != "exploding"} == {True}


@pytest.mark.e2e
def test_route_answers_the_origin_through_the_data_server(tmp_path):
    facts = gl.make_demo_logdir(str(tmp_path))
    origin.write(str(tmp_path / "exploding"), FOUND)
    ingester = gl.data_server(str(tmp_path), {"gradhealth": 0}, last_steps=gl.last_steps(facts))
    p = plugin.GradHealthPlugin(base_plugin.TBContext(data_provider=ingester.data_provider,
                                                      sampling_hints={"gradhealth": 0}))
    app = p.get_plugin_apps()["/nan_origin"]
    client = Client(app)
    deadline = time.monotonic() + 30
    while True:
        body = json.loads(client.get("/nan_origin?run=exploding").get_data(as_text=True))
        if body["origin"] is not None or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert body["origin"] == FOUND.to_json() and body["problems"] == []
    other = json.loads(client.get("/nan_origin?run=healthy").get_data(as_text=True))
    assert other == {"run": "healthy", "origin": None, "problems": []}
    assert client.get("/nan_origin").status_code == 400


@pytest.mark.unit
def test_the_documented_answer_has_the_fields_of_the_stored_form():
    text = (Path(__file__).resolve().parent.parent / "docs" / "API.md").read_text()
    section = text[text.index("## GET nan_origin"):]
    start = section.index("```json") + len("```json")
    body = json.loads(section[start:section.index("```", start)])
    assert set(body) == {"run", "origin", "problems"}
    assert set(body["origin"]) == set(FOUND.to_json())
    assert origin.decode(json.dumps({"v": origin.FORMAT_VERSION, **body["origin"]})).message() == \
        body["origin"]["message"]


class _Counting(origin.OriginSearch):
    """A finder whose replay says which inputs it got: the protocol without a framework."""

    def __init__(self, log_dir=None):
        super().__init__(log_dir)
        self.replays, self.finite_steps = [], []

    def replay(self, step, *, batch):
        self.replays.append((step, batch))
        return origin.NanOrigin(step=step, found=False, framework="none", reason="replayed")

    def finite(self, step):
        self.finite_steps.append(step)


@pytest.mark.unit
def test_the_origin_protocol_replays_the_first_nonfinite_record_once(tmp_path):
    import numpy as np

    from tb_gradhealth import record

    finite = np.stack([record.compute(np.ones(4)), record.compute(np.zeros(3))])
    bad = np.stack([record.compute(np.ones(4)), record.compute(np.array([1.0, np.inf, 2.0]))])
    finder = _Counting()
    assert finder.find(0, finite, batch="b0") is None and finder.finite_steps == [0] and not finder.replays
    found = finder.find(1, bad[:, : record.NUM_COUNTS].astype(np.int32), log_dir=str(tmp_path), batch="b1")
    assert found is finder.origin and found.step == 1 and finder.replays == [(1, "b1")]
    assert finder.find(2, bad, batch="b2") is None and finder.replays == [(1, "b1")]  # the first one only
    assert {run: o.step for run, o in origin.read_logdir(str(tmp_path)).items()} == {".": 1}  # stored where asked
