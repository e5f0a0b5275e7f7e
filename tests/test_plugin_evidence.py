"""The evidence beside the gradients reaches the tab: the ``health`` route of a run whose writer recorded its loss and
its layers' kinds carries each layer's kind and activation, the loss up to the diagnosed step and its trend, and the
fixes for that kind; the skipped steps and the training loop a writer recorded reach the diagnosis; through
TensorBoard's data server, through the plugin's own file reading, and in the CLI's JSON alike. The labels are what
the runs were written with (:func:`tb_gradhealth.testing.make_sigmoid_stack`, :func:`_write_skips`)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from tensorboard.plugins import base_plugin
from werkzeug.test import Client

from tb_gradhealth import cli, plugin, progress, record
from tb_gradhealth import testing as gl
from tb_gradhealth.writer import Writer
from tests.live_replay import spy_diagnose_run
from tests.test_plugin import PluginApp, get_json

pytestmark = pytest.mark.e2e
RUN = "sigmoid_stack"
SKIPS = "skips"
#: The run ``SKIPS``: its loop, and the steps its optimizer skipped.
SOURCE = {"loop": "torch", "optimizer": "SGD", "momentum": "0.9"}
SKIPPED = [0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def _write_skips(run_dir: str) -> None:
    rng = np.random.default_rng(0)
    names = ["dense/kernel", "dense/bias"]
    with Writer(run_dir, source=SOURCE) as w:
        for s, skipped in enumerate(SKIPPED):
            w.add_scalars(s, {progress.SKIPPED_TAG: skipped})  # before the record: loaded when it is
            w.add_records(s, names, np.stack([record.compute(rng.standard_normal(32), rng.standard_normal(32))
                                              for _ in names]))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("evidence")
    facts, loss = gl.make_sigmoid_stack(str(logdir), RUN)
    gl.make_vanishing(str(logdir))  # the same gradients, written without loss or kinds
    _write_skips(str(logdir / SKIPS))
    ingester = gl.data_server(str(logdir), {"gradhealth": 0},
                              last_steps={RUN: facts.steps[-1], SKIPS: len(SKIPPED) - 1})
    return logdir, facts, loss, ingester.data_provider


def _client(provider, logdir=None) -> Client:
    flags = argparse.Namespace(**({plugin.READ_FILES: True} if logdir else {}))
    ctx = base_plugin.TBContext(data_provider=provider, sampling_hints={"gradhealth": 0}, flags=flags,
                                logdir=str(logdir) if logdir else None)
    return Client(PluginApp(plugin.GradHealthPlugin(ctx).get_plugin_apps()))


@pytest.mark.parametrize("reading", ["data server", "event files"])
def test_health_carries_the_kinds_the_loss_and_the_fixes_for_the_kind(written, reading):
    logdir, facts, loss, provider = written
    client = _client(provider, logdir if reading == "event files" else None)
    body = get_json(client, f"/health?run={RUN}")
    by_layer = {lj["layer"]: lj for lj in body["layers"]}
    assert all((lj["kind"], lj["activation"]) == ("Dense", "sigmoid") for lj in body["layers"])
    for name in facts.vanishing:
        assert by_layer[name]["status"] == "vanishing"
        assert "sigmoid, which saturates" in by_layer[name]["fixes"][0]
    assert body["loss"]["steps"] == facts.steps
    np.testing.assert_allclose(body["loss"]["values"], loss, rtol=1e-6)  # float32 on disk
    trend = body["summary"]["loss_trend"]
    quarter = len(loss) // 4
    change = np.median(loss[-quarter:]) / np.median(loss[:quarter]) - 1
    assert trend["falls"] and not trend["flat"] and trend["change"] == pytest.approx(change, rel=1e-5)
    # at an earlier step, only the loss up to it
    early = get_json(client, f"/health?run={RUN}&step=9")
    assert early["loss"]["steps"] == list(range(10)) and early["summary"]["loss_trend"]["last_step"] == 9
    # a run written without them has none
    plain = get_json(client, "/health?run=vanishing")
    assert plain["loss"] is None and plain["summary"]["loss_trend"] is None
    assert not any("kind" in lj for lj in plain["layers"])


def test_the_cli_json_is_the_same_answer(written, capsys):
    logdir, _, _, provider = written
    assert cli.main(["report", str(logdir), "--json", "--run", RUN, "--fail-on", "none"]) == 0
    (body,) = json.loads(capsys.readouterr().out)["runs"]
    served = get_json(_client(provider), f"/health?run={RUN}")
    for key in ("problems", "notes", "nan_origin"):
        body.pop(key)
    assert body == served


@pytest.mark.parametrize("reading", ["data server", "event files"])
def test_the_skipped_steps_and_the_loop_reach_the_diagnosis(written, reading, monkeypatch):
    logdir, _, _, provider = written
    calls = spy_diagnose_run(monkeypatch)
    get_json(_client(provider, logdir if reading == "event files" else None), f"/health?run={SKIPS}&step=5")
    (kw,) = calls
    assert kw["source"] == SOURCE and kw["at_step"] == 5
    steps, flags = kw["skipped"]
    assert steps.tolist() == list(range(len(SKIPPED))) and flags.tolist() == SKIPPED
