"""The live diagnosis (:mod:`tb_gradhealth.live`) without any framework: fed what the numpy ``Writer`` writes, at
every logged step it is ``tb-gradhealth report --step S`` on the finished logdir; the report at a step reads
nothing after it; ``StopCheck``'s event, its thinning schedule and its arguments; the loop's ``source`` and the
skipped steps written, read back and handed to the diagnosis by the CLI.

The runs are built here with known shapes (gradients growing from a known step, a NaN at a known step, a flat or
falling loss); the expected diagnosis is never taken from the live object itself but from the report.
"""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

from tb_gradhealth import cli, health, live, metadata, progress, reader, record
from tb_gradhealth.writer import Writer
from tests.live_replay import as_json, diagnosis_of, report, spy_diagnose_run

pytestmark = pytest.mark.unit

BODY = [f"dense_{i}/{k}" for i in range(4) for k in ("kernel", "bias")]
HEAD = ["head/kernel", "head/bias"]
SOURCE = {"loop": "numpy", "optimizer": "SGD", "momentum": "0.9"}


def _rows(rng: np.random.Generator, names: list[str], scale: float, nan: bool = False,
          updated: bool = True) -> np.ndarray:
    """Records of Gaussian gradients of RMS ``scale`` (deeper layers larger), weights, and an update of 1e-3 of the
    gradient (``updated=False``: none, a skipped step); ``nan``: a NaN in every gradient."""
    rows = []
    for i, _ in enumerate(names):
        g = rng.standard_normal(48) * scale * (1.0 + 0.2 * i)
        if nan:
            g[3] = np.nan
        rows.append(record.compute(g, rng.standard_normal(48), 1e-3 * np.nan_to_num(g) if updated else
                                   np.zeros_like(g), hist_sample=32, rng=rng))
    return np.stack(rows)


def _write(w: Writer, rng: np.random.Generator, s: int, shape: str) -> None:
    """Logged step ``s`` of a run of ``shape``: ``healthy`` (flat gradients, a falling loss) or ``diverging``
    (gradients x1.6 a step from step 14, NaN from step 30, the loss following them). Both runs have a second tag
    (the head, its own layer list), a record rewritten at step 7 (the second replaces the first), a damaged row at
    step 9 and a step the optimizer skipped (NaN gradient, no update) at step 11."""
    diverging = shape == "diverging"
    scale = 1e-2 * (1.6 ** max(0, s - 14) if diverging else 1.0)
    nan = diverging and s >= 30
    skipped = s == 11
    body = _rows(rng, BODY, scale, nan=nan or skipped, updated=not skipped)
    if s == 9:  # min > max: a row the readers report as damaged and skip
        body[2, record.INDEX["min"]], body[2, record.INDEX["max"]] = 1.0, -1.0
    info = [("Dense", "relu")] * len(BODY)
    if s == 7:
        w.add_records(s, BODY, _rows(rng, BODY, 5.0), layer_info=info, source=SOURCE)
    w.add_records(s, BODY, body, layer_info=info, source=SOURCE)
    w.add_records(s, HEAD, _rows(rng, HEAD, scale, nan=nan), layer_info=[("Dense", "")] * 2, source=SOURCE)
    loss = (2.0 - s / 40) * (1.0 + 0.1 * np.sin(s)) if not diverging else np.exp(0.7 * max(0, s - 14)) + 1 / 3
    w.add_loss(s, np.nan if nan else loss)
    w.add_scalars(s, {progress.SKIPPED_TAG: float(skipped)})


@pytest.mark.parametrize("shape", ["healthy", "diverging"])
def test_at_every_logged_step_the_live_diagnosis_is_the_report_there(tmp_path, shape):
    rng = np.random.default_rng(0)
    run = live.LiveRun()
    seen, t = {}, health.Thresholds()
    with Writer(str(tmp_path), hist_sample=32) as w:
        run.watch(w)
        for s in range(1, 36):
            _write(w, rng, s, shape)
            seen[s] = as_json(run.diagnose(t, s).to_json())
    # the runs are what they were built to be: flagged at the end only when they diverged
    assert (shape == "diverging") == (seen[35]["summary"]["answer"] is not None)
    assert run.series().source == SOURCE and run.series().layers == tuple(BODY + HEAD)
    for s, diagnosed in seen.items():
        assert diagnosis_of(report(str(tmp_path), s), diagnosed) == diagnosed, f"step {s}"


def test_the_report_at_a_step_reads_nothing_after_it(tmp_path):
    rng = np.random.default_rng(1)
    with Writer(str(tmp_path), hist_sample=32) as w:
        for s in range(1, 21):
            _write(w, rng, s, "healthy")
        w.flush()
        before = report(str(tmp_path), 20)
        for s in range(21, 41):  # a blow-up after step 20: records, loss, skipped steps
            _write(w, rng, s, "diverging")
    after = report(str(tmp_path), 20)
    assert report(str(tmp_path))["summary"]["answer"] is not None  # what came after is flagged
    for key in ("problems", "notes", "nan_origin"):
        before.pop(key), after.pop(key)
    assert after == before


def test_the_event_names_the_answer_when_its_status_is_watched_else_the_highest_ranked(tmp_path):
    rng = np.random.default_rng(2)
    run = live.LiveRun()
    with Writer(str(tmp_path), hist_sample=32) as w:
        run.watch(w)
        for s in range(1, 30):
            _write(w, rng, s, "diverging")
        w.add_records(30, BODY, _rows(rng, BODY, 1e-2 * 1.6 ** 16))  # the body still growing, finite
        w.add_records(30, HEAD, _rows(rng, HEAD, 1e-2 * 1.6 ** 16, nan=True))  # NaN in the head only
    h = run.diagnose(health.Thresholds())
    statuses = {lh.layer: lh.status for lh in h.layers}
    answer = h.answer
    assert answer is not None and answer["now"] == "nonfinite" and "exploding" in statuses.values()
    both = live.stop_event(h, ("nonfinite", "exploding"))
    assert both.layer == answer["layer"] and both.status == "nonfinite" and both.step == h.step == 30
    in_order = tuple(lh.layer for lh in sorted(h.layers, key=lambda lh: lh.index)
                     if lh.status in ("nonfinite", "exploding"))
    assert both.layers == in_order
    exploding = live.stop_event(h, ("exploding",))
    ranked = [lh.layer for lh in h.layers if lh.status == "exploding"]  # the ranking, worst first
    assert exploding.layer == ranked[0] != answer["layer"] and exploding.status == "exploding"
    assert exploding.layers == tuple(n for n in in_order if statuses[n] == "exploding")
    assert live.stop_event(h, ("dead",)) is None
    assert "tb_gradhealth: nonfinite gradient in layer" in both.message()


def test_checks_thin_out_after_the_dense_steps_but_a_first_nan_is_checked_at_once(tmp_path):
    rng = np.random.default_rng(3)
    check = live.StopCheck(("nonfinite",), dense=4)
    checked = []
    with Writer(str(tmp_path), hist_sample=32) as w:
        check.watch(w)
        for s in range(1, 41):
            w.add_records(s, BODY, _rows(rng, BODY, 1e-2, nan=s >= 37))
            before = check.checks
            event = check.check(s)
            if check.checks > before:
                checked.append(s)
            if event is not None:
                break
    # logged step k (0-based) is checked when due: k + max(1, k // 4) after the last check
    assert checked == [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 16, 19, 23, 28, 34, 37]
    assert check.event is not None and check.event.step == 37 and check.event.status == "nonfinite"
    # a check reads every step so far: the diagnosis at the NaN step is the report's
    assert diagnosis_of(report(str(tmp_path), 37), as_json(check.last.to_json())) == as_json(check.last.to_json())
    assert check.check(38) is None  # once stopped, nothing more is checked


def test_stop_check_refuses_what_it_cannot_watch():
    with pytest.raises(ValueError, match="stop_on accepts"):
        live.StopCheck(("exploding", "slow"))
    with pytest.raises(ValueError, match="no_such"):
        live.StopCheck("exploding", thresholds={"no_such": 1})
    with pytest.raises(ValueError, match="dense"):
        live.StopCheck("exploding", dense=0)
    assert live.check_stop_on("dead") == ("dead",)
    assert live.make_thresholds({"growth_decades": "3"}).growth_decades == 3.0


def test_a_step_without_a_record_is_not_checked(tmp_path):
    check = live.StopCheck("nonfinite")
    with Writer(str(tmp_path)) as w:
        check.watch(w)
        w.add_records(2, BODY, _rows(np.random.default_rng(4), BODY, 1e-2))
    assert check.check(1) is None and check.check(3) is None and check.checks == 0
    assert check.check(2) is None and check.checks == 1


def test_a_probe_stream_is_not_the_runs_records(tmp_path):
    run = live.LiveRun()
    rng = np.random.default_rng(5)
    with Writer(str(tmp_path)) as w:
        run.watch(w)
        w.add_records(1, BODY, _rows(rng, BODY, 1e-2))
        w.add_records(1, HEAD, _rows(rng, HEAD, 1e-2), name="probe_gradients")
    assert run.series().layers == tuple(BODY) and run.steps.tolist() == [1]


# --- the loop's source and the skipped steps, written and read ----------------------------------------------------


def test_source_is_a_versioned_entry_of_the_tag_metadata():
    content = metadata.Content(record.FORMAT_VERSION, ("a",), source={"loop": "torch", "optimizer": "SGD"})
    assert metadata.decode_content(metadata.encode_content(content)).source == {"loop": "torch", "optimizer": "SGD"}
    assert metadata.decode_content(metadata.encode_content(metadata.Content(1, ("a",)))).source == {}
    payload = json.loads(zlib.decompress(metadata.encode_content(content)))
    payload["source"]["v"] = metadata.SOURCE_VERSION + 1  # a newer entry: read as none, the records still read
    newer = metadata.decode_content(zlib.compress(json.dumps(payload).encode()))
    assert newer.source == {} and newer.layers == ("a",)
    with pytest.raises(ValueError, match="unknown key"):
        metadata.check_source({"loop": "torch", "lr": "0.1"})


def test_loop_source_names_the_optimizer_and_its_momentum():
    class SGD:  # Keras' optimizers keep the momentum as an attribute
        momentum = 0.9

    class Plain:  # PyTorch's keep it in their parameter groups
        def __init__(self, momentum):
            self.param_groups = [{"lr": 0.1, "momentum": momentum}]

    assert metadata.loop_source("keras.fit", SGD()) == {"loop": "keras.fit", "optimizer": "SGD", "momentum": "0.9"}
    assert metadata.loop_source("torch", Plain(0.0)) == {"loop": "torch", "optimizer": "Plain"}
    assert metadata.loop_source("torch", Plain(0.5))["momentum"] == "0.5"
    assert metadata.loop_source("jax") == {"loop": "jax"}

    class Clipped:  # Keras' optimizers keep the global clip as an attribute, None without one
        def __init__(self, clip):
            self.global_clipnorm = clip

    assert metadata.loop_source("keras.fit", Clipped(1.0))["clip_norm"] == "1"
    assert "clip_norm" not in metadata.loop_source("keras.fit", Clipped(None))
    assert "clip_norm" not in metadata.with_clip({"loop": "torch"}, 0.0)
    assert metadata.with_clip({"loop": "torch"}, "0.25") == {"loop": "torch", "clip_norm": "0.25"}
    with pytest.raises(ValueError, match="loop"):
        metadata.loop_source("mxnet")


def test_the_numpy_writer_states_its_loop_and_old_logs_read_without_one(tmp_path):
    rng = np.random.default_rng(6)
    with Writer(str(tmp_path / "plain")) as w:
        w.add_records(1, BODY, _rows(rng, BODY, 1e-2))
    with Writer(str(tmp_path / "told"), source={"optimizer": "Adam"}) as w:
        w.add_records(1, BODY, _rows(rng, BODY, 1e-2))
    runs = {s.run: s for s in reader.read_logdir(str(tmp_path)).runs}
    assert runs["plain"].source == {"loop": "numpy"} and runs["told"].source == {"loop": "numpy", "optimizer": "Adam"}
    old = tmp_path / "old"
    tag = metadata.tag_for(BODY, step=1)
    from tb_gradhealth import testing

    testing.write_events(testing.event_file_path(str(old)), [testing.record_event(1, tag, _rows(rng, BODY, 1e-2),
                                                                                    layers=BODY)])
    (series,) = reader.read_logdir(str(old)).runs
    assert series.source == {}


def test_the_cli_hands_the_skipped_steps_and_the_source_to_the_diagnosis(tmp_path, monkeypatch, capsys):
    rng = np.random.default_rng(7)
    with Writer(str(tmp_path), source=SOURCE) as w:
        for s in range(1, 9):
            w.add_records(s, BODY, _rows(rng, BODY, 1e-2))
            w.add_loss(s, 1.0 / s)
            w.add_scalars(s, {progress.SKIPPED_TAG: float(s in (3, 4))})
    found = progress.read_progress(reader.find_runs(str(tmp_path))["."])
    assert found.skipped[0].tolist() == list(range(1, 9)) and found.skipped[1].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    assert found.loss[1].tolist() == [float(np.float32(1.0 / s)) for s in range(1, 9)]
    calls = spy_diagnose_run(monkeypatch)
    assert cli.main(["report", str(tmp_path), "--json", "--step", "6"]) == 0
    capsys.readouterr()
    (kw,) = calls
    assert kw["source"] == SOURCE and kw["at_step"] == 6
    np.testing.assert_array_equal(kw["skipped"][1], found.skipped[1])
    np.testing.assert_array_equal(kw["progress"][0], found.loss[0])
