"""tb_gradhealth._cpustats: the compiled one-read statistics of float32 values equal float64 references (extremes
and counts exactly, sums within float32 accumulation), the same on any number of threads; the eager PyTorch record
takes them on a CPU and agrees with the record of the framework ops it replaces; a machine without a working
compiler (or ``TB_GRADHEALTH_CPU_STATS=0``) keeps the framework ops."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from tb_gradhealth import _cpustats, record
from tests.record_close import assert_records_close, extreme_cases

pytestmark = pytest.mark.torch

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                    reason="no C compiler on this machine")
TINY = np.finfo(np.float32).tiny


def _stats(values: list[np.ndarray], threads: int = 1, run: int | None = None) -> np.ndarray:
    """Per-array rows of :data:`_cpustats.FIELDS`, cut into runs of ``run`` values (combined as the record does)."""
    sizes = np.array([v.size for v in values], np.int64)
    if run is None:
        owner, offset, size = np.arange(len(values)), np.zeros(len(values), np.int64), sizes
    else:
        owner = np.repeat(np.arange(len(values)), -(-sizes // run))
        offset = np.concatenate([np.arange(0, n, run) for n in sizes])
        size = np.minimum(sizes[owner] - offset, run)
    pointers = np.array([v.ctypes.data for v in values], np.uint64)[owner] + (4 * offset).astype(np.uint64)
    out = _cpustats.stats(pointers, size, threads)
    first = np.flatnonzero(np.diff(owner, prepend=-1))
    return np.stack([np.minimum.reduceat(out[:, 0], first), np.maximum.reduceat(out[:, 1], first),
                     *(np.add.reduceat(out[:, j], first) for j in (2, 3, 4))], 1)


def _reference(v: np.ndarray) -> tuple[float, float, float, float, int]:
    d = v.astype(np.float64)
    return d.min(), d.max(), d.sum(), (d * d).sum(), int(np.count_nonzero(np.abs(d) >= TINY))


@needs_compiler
@pytest.mark.parametrize("n", [1, 31, 32, 255, 256, 257, 1000, 4097, (1 << 18) + 5])
def test_statistics_equal_float64_references(n):
    rng = np.random.default_rng(n)
    v = (rng.normal(size=n) * 10.0 ** rng.uniform(-12, 12, size=n)).astype(np.float32)
    v[rng.random(n) < 0.3] = 0.0
    v[rng.random(n) < 0.05] = 1e-40  # subnormals: neither normal nor zero's sign
    got = _stats([v])[0]
    mn, mx, total, squares, normal = _reference(v)
    assert (got[0], got[1], got[4]) == (mn, mx, normal)
    assert abs(got[2] - total) <= 2e-6 * np.abs(v.astype(np.float64)).sum()
    assert got[3] == pytest.approx(squares, rel=2e-6)


@needs_compiler
@pytest.mark.parametrize("values", [[-0.0, 0.0], [-1e-45, 1e-45], [-3e38, 3e38, 0.0], [-2.5], [7.0, 7.0]])
def test_extremes_are_exact_at_every_sign_and_edge(values):
    v = np.array(values * 300, np.float32)  # past one block, so the vector loop and the tail both see them
    got = _stats([v])[0]
    assert (got[0], got[1]) == (v.min(), v.max())


@needs_compiler
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, -np.nan])
@pytest.mark.parametrize("at", [0, 700, 1026])
def test_a_run_with_nan_or_inf_has_nan_extremes(bad, at):
    v = np.ones(1027, np.float32)
    v[at] = bad
    got = _stats([v])[0]
    assert np.isnan(got[0]) and np.isnan(got[1])


@needs_compiler
def test_threads_and_runs_give_the_same_statistics():
    rng = np.random.default_rng(7)
    values = [rng.normal(size=n).astype(np.float32) for n in (3, 1 << 20, 70_001, (1 << 19) + 9)]
    one = _stats(values)
    many = _stats(values, threads=3, run=1 << 16)
    np.testing.assert_array_equal(one[:, [0, 1, 4]], many[:, [0, 1, 4]])
    np.testing.assert_allclose(one[:, 2:4], many[:, 2:4], rtol=1e-6, atol=1e-6)


def test_runs_cut_each_tensor_into_pieces():
    owner, offset, size = _cpustats.runs(np.array([5, 0, 2 * _cpustats.RUN + 1]))
    assert owner.tolist() == [0, 2, 2, 2]
    assert offset.tolist() == [0, 0, _cpustats.RUN, 2 * _cpustats.RUN]
    assert size.tolist() == [5, _cpustats.RUN, _cpustats.RUN, 1]


def test_without_a_compiler_the_library_is_none(monkeypatch, tmp_path):
    monkeypatch.setattr(_cpustats, "_loaded", [])
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _cpustats.library() is None


def test_a_compiler_that_fails_leaves_no_library(monkeypatch, tmp_path):
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\necho broken >&2\nexit 1\n")
    cc.chmod(0o755)
    monkeypatch.setattr(_cpustats, "_loaded", [])
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _cpustats.library() is None
    assert not list((tmp_path / "tb_gradhealth").glob("*.so"))  # no half-written library left for the next


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(_cpustats.ENV, "0")
    assert _cpustats.library() is None


@needs_compiler
def test_built_once_then_taken_from_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(_cpustats, "_loaded", [])
    assert _cpustats.library() is not None
    built = list((tmp_path / "tb_gradhealth").glob("cpustats-*.so"))
    assert len(built) == 1
    monkeypatch.setattr(_cpustats, "_loaded", [])
    monkeypatch.setattr(_cpustats, "_compiler", lambda: shutil.which("cc") or shutil.which("gcc"))
    monkeypatch.setattr(_cpustats.subprocess, "run", _only_version(_cpustats.subprocess.run))
    assert _cpustats.library() is not None  # no second compile: only the compiler's version was asked


def _only_version(run):
    def guarded(cmd, *args, **kwargs):
        assert cmd[1:] == ["--version"], cmd
        return run(cmd, *args, **kwargs)

    return guarded


# --- the eager PyTorch record on a CPU ----------------------------------------------------------------------


@needs_compiler
@pytest.mark.parametrize("case", sorted(extreme_cases(np.random.default_rng(0))))
def test_eager_record_equals_the_framework_ops_record(case, monkeypatch):
    """The same gradient, weight and update through the compiled statistics and through the framework ops (each
    within the record's tolerance of the float64 reference, so of each other)."""
    torch = pytest.importorskip("torch")
    tgh = pytest.importorskip("tb_gradhealth.torch")
    g = extreme_cases(np.random.default_rng(0))[case]
    big = np.resize(g, 3 * 8192 + 11) if g.size else g  # past the small tensors' size too
    for values in (g, big):
        t = torch.from_numpy(np.ascontiguousarray(values))
        ref = record.compute(values, values, values, hist_sample=None)
        got = tgh.to_memory(tgh.compute({"g": t}, {"g": t}, {"g": t}, hist_sample=0))
        monkeypatch.setenv(_cpustats.ENV, "0")
        ops = tgh.to_memory(tgh.compute({"g": t}, {"g": t}, {"g": t}, hist_sample=0))
        monkeypatch.delenv(_cpustats.ENV)
        assert_records_close(ref, got)
        assert_records_close(ref, ops)


@needs_compiler
def test_eager_record_reads_strided_and_negated_views():
    torch = pytest.importorskip("torch")
    tgh = pytest.importorskip("tb_gradhealth.torch")
    base = torch.randn(300, 200)
    for t in (base.t(), base[:, ::3], torch._neg_view(base) if hasattr(torch, "_neg_view") else -base):
        values = t.contiguous().resolve_neg().numpy()
        got = tgh.to_memory(tgh.compute({"g": t}, hist_sample=0))
        assert_records_close(record.compute(values, hist_sample=None), got)


@needs_compiler
@pytest.mark.parametrize("buffers", [True, False])
def test_step_records_read_the_weights_as_the_snapshot_copies_them(buffers, monkeypatch):
    """:func:`before_step` / :func:`after_step` (the loop of ``StepRecorder`` and the callbacks) give the records of
    the framework ops, and the snapshot holds the weights before the step."""
    torch = pytest.importorskip("torch")
    tgh = pytest.importorskip("tb_gradhealth.torch")

    def step(env: str) -> tuple[np.ndarray, list]:
        monkeypatch.setenv(_cpustats.ENV, env)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(300, 100), torch.nn.ReLU(), torch.nn.Linear(100, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.randn(16, 300)).square().mean().backward()
        params = list(model.named_parameters())
        before = [p.detach().clone() for _, p in params]
        snap = [torch.empty_like(p) for _, p in params] if buffers else None
        if buffers:  # the path under test is taken where the statistics are on
            from tb_gradhealth import _torcheager

            assert _torcheager.copies_on_cpu([p.detach() for _, p in params], snap) == (env == "1")
        pending = tgh.before_step(params, 0, 256, True, snap)
        taken = [t.clone() for t in pending.before.values()]
        opt.step()
        for b, t in zip(before, taken, strict=True):
            assert torch.equal(b, t)
        return tgh.after_step(pending, params), before

    fused, before = step("1")
    ops, _ = step("0")
    assert_records_close(ops, fused)
    w = record.INDEX["weight_max_abs"]
    assert fused[0, w] == pytest.approx(float(before[0].abs().max()))


@needs_compiler
def test_a_forked_child_computes_on_threads_of_its_own():
    """A process forked after the threads started (a data loader's worker, a launcher) still gets its answer."""
    import multiprocessing

    values = [np.arange(1 << 20, dtype=np.float32)]
    expected = _stats(values, threads=2, run=1 << 16)
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        got = pool.apply_async(_stats, (values, 2, 1 << 16)).get(timeout=60)
    np.testing.assert_array_equal(expected, got)


@needs_compiler
def test_a_tensor_subclass_goes_through_torch_ops():
    """A subclass (a wrapper, a quantized or a traced tensor) may hold no memory of its own to read."""
    torch = pytest.importorskip("torch")
    tgh = pytest.importorskip("tb_gradhealth.torch")
    from tb_gradhealth import _torcheager

    class Wrapped(torch.Tensor):
        pass

    values = np.random.default_rng(3).normal(size=20_000).astype(np.float32)
    t = torch.from_numpy(values).as_subclass(Wrapped)
    assert not _torcheager._plain([t.reshape(-1)])
    got = tgh.to_memory(tgh.compute({"g": t}, {"g": t}, {"g": tgh.Delta(t, t * 0.5)}, hist_sample=0))
    assert_records_close(record.compute(values, values, values - values * np.float32(0.5), hist_sample=None), got)
