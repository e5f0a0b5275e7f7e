"""The training loss read beside the gradient records (:mod:`tb_gradhealth.progress`), and the CLI using it."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

from tb_gradhealth import cli, metadata, progress, reader, record
from tb_gradhealth.writer import Writer

pytestmark = pytest.mark.unit

NAMES = [f"dense_{i}/{k}" for i in range(3) for k in ("kernel", "bias")]


def _write(logdir, losses: dict[str, list[float]] | None, lr: float = 1e-6, steps: int = 16) -> None:
    """SGD records of healthy gradients at learning rate ``lr`` (lr 1e-6 moves no weight), and the given scalars."""
    rng = np.random.default_rng(0)
    with Writer(str(logdir / "train")) as w:
        for s in range(1, steps + 1):
            rows = []
            for _ in NAMES:
                g = rng.standard_normal(64) * 1e-2
                rows.append(record.compute(g, rng.standard_normal(64) * 0.1, lr * g, hist_sample=None))
            w.add_records(s, NAMES, np.stack(rows))
            if losses:
                w.add_scalars(s, {tag: v[s - 1] for tag, v in losses.items()})


def test_reads_the_versioned_tag_first_then_a_plain_loss(tmp_path):
    flat, falling = [0.7] * 16, list(np.linspace(2.0, 0.5, 16))
    _write(tmp_path, {"loss": falling, progress.LOSS_TAG: flat})
    paths = reader.find_runs(str(tmp_path))["train"]
    steps, loss = progress.read_loss(paths)
    assert steps.tolist() == list(range(1, 17))
    np.testing.assert_allclose(loss, flat, rtol=1e-6)
    other = tmp_path / "other"
    other.mkdir()
    _write(other, {"loss": falling})
    steps, loss = progress.read_loss(reader.find_runs(str(other))["train"])
    np.testing.assert_allclose(loss, falling, rtol=1e-6)


def test_a_log_without_a_loss_has_no_progress(tmp_path):
    _write(tmp_path, None)
    assert progress.read_loss(reader.find_runs(str(tmp_path))["train"]) is None


@pytest.mark.parametrize(("loss", "flagged"), [([0.7] * 16, True), (list(np.linspace(2.0, 0.5, 16)), False)])
def test_report_flags_a_run_that_does_not_learn(tmp_path, capsys, loss, flagged):
    # lr 1e-6: the weights do not move. With the loss flat the run is not learning (exit 1); with a falling loss
    # written beside it, the same records are not flagged.
    _write(tmp_path, {"loss": loss})
    rc = cli.main(["report", str(tmp_path), "--json", "--fail-on", "vanishing"])
    body = json.loads(capsys.readouterr().out)
    statuses = {lh["status"] for run in body["runs"] for lh in run["layers"]}
    assert rc == (1 if flagged else 0)
    assert statuses == ({"vanishing"} if flagged else {"healthy"})


def test_layer_info_round_trips_and_old_or_damaged_content_reads_without_it():
    layers = ("a/kernel", "a/bias")
    info = (("Dense", "tanh"), ("Dense", "tanh"))
    md = metadata.create_summary_metadata(layers, layer_info=info)
    assert metadata.decode_content(md.plugin_data.content).layer_info == info
    old = metadata.encode_content(metadata.Content(record.FORMAT_VERSION, layers))  # as written before
    assert metadata.decode_content(old) == metadata.Content(record.FORMAT_VERSION, layers)
    payload = json.loads(zlib.decompress(md.plugin_data.content))
    for bad in ({"v": 99, "rows": payload["info"]["rows"]}, {"v": 1, "rows": [["Dense", "tanh"]]}, "x"):
        damaged = zlib.compress(json.dumps({**payload, "info": bad}).encode())
        got = metadata.decode_content(damaged)
        assert got.layers == layers and got.layer_info == ()


def test_report_names_the_layer_kind_and_its_fix(tmp_path, capsys):
    # The first layer's gradient starved by 1e-6, its metadata saying it is a sigmoid Dense layer.
    rng = np.random.default_rng(0)
    info = [("Dense", "sigmoid")] * len(NAMES)
    with Writer(str(tmp_path / "train")) as w:
        for s in range(1, 11):
            rows = [record.compute(rng.standard_normal(64) * (1e-8 if i < 2 else 1e-2), rng.standard_normal(64) * 0.1,
                                   None, hist_sample=None) for i in range(len(NAMES))]
            w.add_records(s, NAMES, np.stack(rows), layer_info=info)
    cli.main(["report", str(tmp_path), "--json", "--fail-on", "none"])
    top = json.loads(capsys.readouterr().out)["runs"][0]["layers"][0]
    assert top["layer"].startswith("dense_0/") and top["status"] == "vanishing"
    assert "sigmoid" in top["fixes"][0] and "layer: Dense, activation sigmoid" in top["reasons"]


class FakeProvider:
    """A data provider holding one run's loss scalar; counts the reads of values."""

    def __init__(self, points: list[tuple[int, float]]) -> None:
        self.points, self.reads = points, 0

    def list_scalars(self, ctx, *, experiment_id, plugin_name, run_tag_filter):
        from tensorboard.data import provider

        last = self.points[-1]
        return {"train": {progress.LOSS_TAG: provider.ScalarTimeSeries(
            max_step=last[0], max_wall_time=float(last[0]), plugin_content=b"", description="", display_name="")}}

    def read_scalars(self, ctx, *, experiment_id, plugin_name, downsample, run_tag_filter):
        from tensorboard.data import provider

        self.reads += 1
        assert plugin_name == "scalars" and set(run_tag_filter.tags) == set(progress.TAGS)
        return {"train": {progress.LOSS_TAG: [provider.ScalarDatum(step=s, wall_time=float(s), value=v)
                                              for s, v in self.points]}}


def test_the_plugins_loss_is_read_again_only_when_the_provider_lists_new_data():
    fake = FakeProvider([(0, 2.0), (1, 1.5)])
    losses = progress.ProviderProgress(fake)
    for _ in range(3):
        steps, loss = losses.get(None, "", "train").loss
        assert steps.tolist() == [0, 1] and loss.tolist() == [2.0, 1.5]
    assert fake.reads == 1
    fake.points.append((2, 1.0))  # the run wrote another loss value
    steps, loss = losses.get(None, "", "train").loss
    assert steps.tolist() == [0, 1, 2] and loss.tolist() == [2.0, 1.5, 1.0] and fake.reads == 2
    assert losses.get(None, "", "other") == progress.Progress() and fake.reads == 2  # nothing listed: nothing read
