"""The TF-free Writer: event files that TensorBoard's own data provider reads back exactly, without TensorFlow."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from tensorboard.backend.event_processing import plugin_event_multiplexer
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.compat.proto import summary_pb2

from tb_gradhealth import metadata, progress, reader, record, testing
from tb_gradhealth.writer import Writer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def reference(g: np.ndarray | None, w: np.ndarray | None) -> dict[str, float]:
    """The exact fields of one layer, from numpy float64 directly (not from ``record.compute``)."""
    out = {"missing": float(g is None), "weight_max_abs": float(np.max(np.abs(w))) if w is not None else np.nan}
    if g is None:
        return {**out, "size": float(np.size(w))}
    x = np.asarray(g, np.float32).astype(np.float64).ravel()
    x = np.where(np.abs(x) < np.finfo(np.float32).tiny, 0.0, x)
    finite = x[np.isfinite(x)]
    return {**out, "size": x.size, "nan": np.isnan(x).sum(), "posinf": np.isposinf(x).sum(),
            "neginf": np.isneginf(x).sum(), "zero": np.count_nonzero(finite == 0), "min": finite.min(),
            "max": finite.max(), "mean": finite.mean(), "norm": np.sqrt(np.sum(finite**2))}


@pytest.mark.unit
def test_add_gradients_round_trip_through_data_provider(tmp_path):
    rng = np.random.default_rng(0)
    grads = {
        "dense/kernel": rng.normal(size=(20, 30)).astype(np.float32) * 1e-30,
        "dense/bias": np.array([1.0, np.nan, np.inf, 0.0, -3.0], np.float32),
        "emb/embeddings": None,
        "big/kernel": rng.normal(size=10_000).astype(np.float32) * 1e30,
    }
    weights = {"dense/kernel": np.ones((20, 30), np.float32), "emb/embeddings": np.full((4, 2), 2.0, np.float32)}
    with Writer(str(tmp_path), hist_sample=4096, seed=1) as w:
        for step in (3, 7):
            tag = w.add_gradients(step, grads, weights=weights)
    got = testing.read_back(str(tmp_path))
    assert list(got) == [tag]
    content, points = got[tag]
    c = metadata.decode_content(content)
    assert c.layers == tuple(grads) and c.kind == "gradients" and c.hist_sample == 4096
    assert [s for s, _ in points] == [3, 7]
    for _, t in points:
        rows = record.from_disk(t)
        norms = record.derived(rows)["norm"]
        for i, n in enumerate(grads):
            want = reference(grads[n], weights.get(n))
            for f in ("size", "nan", "posinf", "neginf", "zero", "min", "max", "weight_max_abs", "missing"):
                if f in want:
                    np.testing.assert_array_equal(rows[i, record.INDEX[f]], np.float32(want[f]), f"{n} {f}")
            if "mean" in want:
                np.testing.assert_allclose(rows[i, record.INDEX["mean"]], want["mean"], rtol=1e-6, err_msg=n)
                np.testing.assert_allclose(norms[i], want["norm"], rtol=1e-6, err_msg=n)
        # the sampled layer's histogram totals the finite nonzero count; the small ones are exact
        big = rows[3]
        assert big[record.INDEX["hist_sample"]] == 4096
        np.testing.assert_allclose(big[record.HIST_START:].sum(), 10_000, rtol=1e-5)
        bias_bins = np.bincount(record.hist_bin(np.array([1.0, 3.0])), minlength=record.HIST_BINS)
        np.testing.assert_array_equal(rows[1, record.HIST_START:], bias_bins)


@pytest.mark.unit
def test_metadata_only_on_first_event_per_tag_and_tensorboard_keeps_first(tmp_path):
    with Writer(str(tmp_path)) as w:
        for step in range(3):
            w.add_gradients(step, {"a": np.ones(3, np.float32)})
        w.add_gradients(0, {"a": np.ones(3, np.float32), "b": np.ones(2, np.float32)})
    (path,) = glob.glob(str(tmp_path / "events.out.tfevents.*"))
    values = [v for e in EventFileLoader(path).Load() for v in e.summary.value]
    with_md = [v.tag for v in values if v.HasField("metadata")]
    assert len(values) == 4 and len(with_md) == 2 and len(set(with_md)) == 2  # once per tag
    # TensorBoard attributes the first metadata to every later event of the tag
    got = testing.read_back(str(tmp_path))
    assert sorted(len(metadata.decode_content(c).layers) for c, _ in got.values()) == [1, 2]
    mux = plugin_event_multiplexer.EventMultiplexer(tensor_size_guidance={"gradhealth": 0})
    mux.AddRunsFromDirectory(str(tmp_path))
    mux.Reload()
    (run,) = mux.Runs()
    events_per_tag = {}
    for tag in with_md:
        assert mux.SummaryMetadata(run, tag).data_class == summary_pb2.DATA_CLASS_TENSOR
        layers = metadata.decode_content(mux.SummaryMetadata(run, tag).plugin_data.content).layers
        events_per_tag[layers] = len(mux.Tensors(run, tag))
    assert events_per_tag == {("a",): 3, ("a", "b"): 1}


@pytest.mark.unit
def test_add_scalars_are_standard_scalars(tmp_path):
    with Writer(str(tmp_path)) as w:
        for step in range(4):
            w.add_scalars(step, {"loss": 1.0 / (step + 1), "lr": 0.1})
    got = testing.read_back(str(tmp_path), plugin="scalars")
    assert set(got) == {"loss", "lr"}
    steps, values = zip(*got["loss"][1], strict=True)
    assert steps == (0, 1, 2, 3)
    np.testing.assert_allclose(values, [1.0, 0.5, 1 / 3, 0.25], rtol=1e-6)


@pytest.mark.unit
def test_add_loss_is_the_progress_scalar_read_as_training_progress(tmp_path, caplog):
    with Writer(str(tmp_path)) as w:
        w.add_loss(0, 2.0)
        w.add_loss(3, np.float64(0.5))
        w.add_loss(7, np.array(0.25, dtype=np.float32))  # a one-element array is read on the host
        for bad in ("0.1", None, [0.1, 0.2]):  # not a number: a warning, nothing written, nothing raised
            with caplog.at_level("WARNING", logger="tb_gradhealth"):
                caplog.clear()
                w.add_loss(9, bad)
            assert "not a number" in caplog.text, bad
        with pytest.raises(ValueError):
            w.add_loss(5, 1.0)  # a step that goes back
    got = testing.read_back(str(tmp_path), plugin="scalars")
    assert list(got) == [progress.LOSS_TAG]
    assert got[progress.LOSS_TAG][1] == [(0, 2.0), (3, 0.5), (7, 0.25)]  # nothing of the refused calls
    steps, loss = progress.read_loss(reader.find_runs(str(tmp_path))["."])
    assert steps.tolist() == [0, 3, 7] and loss.tolist() == [2.0, 0.5, 0.25]


@pytest.mark.unit
def test_add_records_validates_and_close_is_final(tmp_path):
    w = Writer(str(tmp_path))
    with pytest.raises(ValueError):
        w.add_records(0, ["a", "b"], record.empty((1,)))
    with pytest.raises(ValueError):
        w.add_records(0, ["a", "a"], record.empty((2,)))
    tag = w.add_records(5, ["x", "y"], np.stack([record.compute(np.arange(4.0)), record.missing()]), kind="merged")
    w.close()
    w.close()
    with pytest.raises(RuntimeError):
        w.add_scalars(0, {"a": 1.0})
    content, points = testing.read_back(str(tmp_path))[tag]
    assert metadata.decode_content(content).kind == "merged"
    assert points[0][0] == 5 and record.from_disk(points[0][1])[1, record.INDEX["missing"]] == 1


@pytest.mark.e2e
def test_works_with_tensorflow_absent(tmp_path):
    """A subprocess where ``import tensorflow`` fails: the writer still writes readable events."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["tensorflow"] = None  # any `import tensorflow` now raises ImportError
        import numpy as np
        import tb_gradhealth
        with tb_gradhealth.Writer({str(tmp_path)!r}) as w:
            w.add_gradients(1, {{"l/kernel": np.arange(6, dtype=np.float32), "l/bias": None}})
            w.add_scalars(1, {{"loss": 2.5}})
        assert sys.modules["tensorflow"] is None
        print("ok")
        """
    )
    res = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("ok")
    (content, points), = testing.read_back(str(tmp_path)).values()
    rows = record.from_disk(points[0][1])
    assert metadata.decode_content(content).layers == ("l/kernel", "l/bias")
    assert rows[0, record.INDEX["size"]] == 6 and rows[0, record.INDEX["zero"]] == 1
    assert rows[1, record.INDEX["missing"]] == 1


# --- a logdir that can never be written fails at construction; faults that may clear do not ----------------------


def _grads(step: int) -> dict[str, np.ndarray]:
    return {"dense/kernel": np.full((4, 4), 1e-3 * (step + 1))}


@pytest.mark.unit
def test_a_logdir_under_a_file_is_refused_at_construction(tmp_path):
    afile = tmp_path / "passwd"
    afile.write_text("root:x:0:0\n")
    for logdir in (afile / "gradlogs", afile / "deeper" / "still", afile):
        with pytest.raises(NotADirectoryError, match="not a directory") as e:
            Writer(str(logdir))
        assert repr(str(logdir)) in str(e.value)
    assert afile.read_text() == "root:x:0:0\n" and sorted(os.listdir(tmp_path)) == ["passwd"]


def _in_child_as(uid: int, fn) -> str:
    """``fn()`` in a forked child running as ``uid`` (this process stays root): ``repr`` of what it raised, or
    ``"ok"``. The interpreter is not started again: the child has every module of this one."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop root, run, report, exit without running pytest's handlers
        os.close(read)
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            fn()
            answer = "ok"
        except BaseException as e:  # noqa: BLE001 - the answer is the exception
            answer = f"{type(e).__name__}: {e}"
        os.write(write, answer.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        answer = f.read().decode()
    os.waitpid(pid, 0)
    return answer


@pytest.mark.unit
@pytest.mark.skipif(not hasattr(os, "fork") or os.geteuid() != 0, reason="switches to user nobody: needs root")
def test_permission_denied_is_refused_and_root_may_write_anywhere(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o755)  # root's directory: other users may read it, not write it
    os.chmod(tmp_path, 0o755)
    nobody = 65534
    answer = _in_child_as(nobody, lambda: Writer(str(locked / "run")))
    assert answer.startswith("PermissionError") and "permission denied" in answer, answer
    assert repr(str(locked / "run")) in answer and not (locked / "run").exists()
    # root bypasses the mode bits: a 0o500 directory is writable for it, so nothing is refused
    os.chmod(locked, 0o500)
    with Writer(str(locked / "run")) as w:
        w.add_gradients(0, _grads(0))
    assert reader.read_logdir(str(locked)).runs[0].steps.tolist() == [0]


@pytest.mark.unit
def test_permission_denied_is_refused_where_access_says_so(tmp_path, monkeypatch):
    """The same refusal without root: the file system answers "not writable" for the logdir's parent."""
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if os.fspath(path) == str(tmp_path)
                        else real_access(path, mode, **kw))
    with pytest.raises(PermissionError, match="permission denied") as e:
        Writer(str(tmp_path / "run"))
    assert repr(str(tmp_path / "run")) in str(e.value) and not (tmp_path / "run").exists()


@pytest.mark.unit
def test_strict_makes_a_failed_write_raise_and_default_keeps_it_queued(tmp_path):
    def broken(data: bytes) -> None:
        raise OSError(28, "No space left on device")

    calm = Writer(str(tmp_path / "calm"), max_queue=1)
    calm._writer._write = broken  # a full disk from now on
    calm.add_gradients(0, _grads(0))  # no exception: queued, a warning
    assert not calm.flush() and calm._writer.failing
    calm.close()
    assert calm.dropped_records == 1

    from tb_gradhealth._storage import StrictWriteError

    strict = Writer(str(tmp_path / "strict"), max_queue=1, strict=True)
    strict.add_gradients(0, _grads(0))
    strict._writer._write = broken
    with pytest.raises(StrictWriteError, match="No space left on device") as e:
        strict.add_gradients(1, _grads(1))
    assert str(tmp_path / "strict") in str(e.value)
    with pytest.raises(StrictWriteError):
        strict.close()
    assert reader.read_logdir(str(tmp_path)).runs[0].steps.tolist() == [0]  # what was written stays


@pytest.mark.unit
def test_strict_raises_for_a_write_of_the_background_flush_at_the_next_call(tmp_path):
    from tb_gradhealth._storage import StrictWriteError

    w = Writer(str(tmp_path / "run"), strict=True)
    w.add_gradients(0, _grads(0))  # queued

    def broken(data: bytes) -> None:
        raise OSError(5, "Input/output error")

    w._writer._write = broken
    w._writer._flush(now=True, raising=False)  # what the background flush does
    with pytest.raises(StrictWriteError, match="Input/output error"):
        w.add_gradients(1, _grads(1))


@pytest.mark.unit
def test_a_read_only_file_system_is_a_fault_that_may_clear(tmpfs):
    """A read-only mount is not refused at construction (it can be remounted); strict makes it raise."""
    from tb_gradhealth._storage import StrictWriteError

    tmpfs.remount("ro")
    Writer(str(tmpfs.path / "run")).close()
    with pytest.raises(StrictWriteError, match="Read-only file system"):
        Writer(str(tmpfs.path / "strict"), strict=True)
    tmpfs.remount("rw")


@pytest.mark.torch
@pytest.mark.parametrize("module, name", [("lightning", "GradHealth"), ("transformers", "GradHealthCallback")])
def test_training_loop_callbacks_refuse_a_log_dir_that_can_never_be_written(tmp_path, module, name):
    import importlib

    pytest.importorskip(module)
    callback = getattr(importlib.import_module(f"tb_gradhealth.{module}"), name)
    afile = tmp_path / "passwd"
    afile.write_text("x")
    with pytest.raises(NotADirectoryError, match="not a directory") as e:
        callback(str(afile / "gradlogs"))
    assert str(afile / "gradlogs") in str(e.value)
    assert callback(str(tmp_path / "run"), strict=True).strict  # a writable one is fine; strict kept for its Writer
    assert callback().log_dir is None  # no log_dir: the trainer's, checked when the writer is made
