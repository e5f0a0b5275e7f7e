"""tb_gradhealth.torch: records computed with torch ops equal the float64 reference field by field; they reach
the event file through the Writer; torch.compile and the optimizer/GradScaler helper record what is applied."""

from __future__ import annotations

import numpy as np
import pytest

from tb_gradhealth import reader, record
from tb_gradhealth.writer import Writer
from tests.record_close import assert_records_close, extreme_cases

torch = pytest.importorskip("torch")
tgh = pytest.importorskip("tb_gradhealth.torch")

pytestmark = pytest.mark.torch

CASES = extreme_cases(np.random.default_rng(0))


def with_histogram_of(exact: np.ndarray, sampled: np.ndarray) -> np.ndarray:
    """``exact`` with the sampled record's histogram and ``hist_sample`` (to compare every other field)."""
    out = np.array(exact, dtype=np.float64)
    out[..., record.INDEX["hist_sample"]:] = sampled[..., record.INDEX["hist_sample"]:]
    return out


def _one(grad, **kw) -> np.ndarray:
    return tgh.to_memory(tgh.compute({"g": grad}, hist_sample=0, **kw))[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_float32_cases_match_reference(case):
    g = CASES[case]
    assert_records_close(record.compute(g, hist_sample=None), _one(torch.from_numpy(g)))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_other_dtypes_match_reference(dtype):
    rng = np.random.default_rng(1)
    if dtype == "float64":  # float64 keeps its range beyond float32 (min/max then round to +-inf)
        values = np.concatenate([rng.normal(size=500) * 1e100, rng.normal(size=500) * 1e-300, [np.nan, 0.0]])
        t = torch.from_numpy(values)
    else:
        t = torch.from_numpy(np.concatenate([rng.normal(size=700) * 1e-3, [np.inf, 0.0, 6e-8]]).astype(np.float32))
        t = t.to(getattr(torch, dtype))
        values = t.float().numpy()
    assert_records_close(record.compute(values, hist_sample=None), _one(t))


def test_sparse_gradient_with_duplicate_indices_is_its_dense_gradient():
    idx = torch.tensor([[0, 5, 5, 2, 9]])
    vals = torch.tensor([[1.0, -2.0], [3.0, 1e-40], [4.0, np.nan], [0.0, 0.0], [-1e30, 7.0]])
    sp = torch.sparse_coo_tensor(idx, vals, (12, 2))
    assert_records_close(record.compute(sp.to_dense().numpy(), hist_sample=None), _one(sp))


def test_module_missing_gradients_weights_and_updates():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.ReLU(), torch.nn.Linear(30, 2), torch.nn.Linear(2, 2))
    model(torch.randn(8, 40))[:, :1].sum().backward()
    model[3].bias.grad = None  # no gradient reached it: a missing record with the parameter's size
    params = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    after = {n: p.detach() - 0.1 * (p.grad if p.grad is not None else 0) for n, p in params.items()}
    updates = {n: tgh.Delta(before[n], after[n]) for n in params}
    got = tgh.to_memory(tgh.compute(model, True, updates, hist_sample=0))
    names = tgh.layer_names(model)
    assert names == list(params)
    ref = np.stack([
        record.compute(None if p.grad is None else p.grad.numpy(), p.detach().numpy(),
                       (before[n] - after[n]).numpy(), size=p.numel(), hist_sample=None)
        for n, p in params.items()
    ])
    assert_records_close(ref, got, names)
    assert got[names.index("3.bias"), record.INDEX["missing"]] == 1


def test_sampled_histogram_follows_the_sampling_rule():
    rng = np.random.default_rng(2)
    g = rng.normal(size=20_000).astype(np.float32)
    g[::7] = 0.0
    g[::11] = np.nan
    exact = record.compute(g, hist_sample=None)
    a, b, c = (tgh.to_memory(tgh.compute({"g": torch.from_numpy(g)}, hist_sample=512, seed=s))[0] for s in (5, 5, 6))
    np.testing.assert_array_equal(a, b)  # same seed, same draws
    assert not np.array_equal(a, c)
    assert_records_close(with_histogram_of(exact, a), a)  # every other field stays exact
    finite_nonzero = exact[record.HIST_START:].sum()
    kept = a[record.INDEX["hist_sample"]]
    # 512 draws, the finite nonzero ones kept; the bins are scaled to the exact finite nonzero count
    assert 0 < kept < 512
    np.testing.assert_allclose(a[record.HIST_START:].sum(), finite_nonzero, rtol=1e-5)
    assert set(np.flatnonzero(a[record.HIST_START:])) <= set(np.flatnonzero(exact[record.HIST_START:]))


def test_add_gradients_writes_one_event_the_reader_reads_back(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 1))
    with Writer(str(tmp_path), hist_sample=0) as w:
        for step in range(3):
            model.zero_grad()
            model(torch.randn(4, 16)).sum().backward()
            rows = tgh.add_gradients(w, step, model)
    run = reader.read_logdir(str(tmp_path)).runs[0]
    assert list(run.layers) == tgh.layer_names(model) and run.num_steps == 3
    ref = np.stack([record.compute(p.grad.numpy(), p.detach().numpy(), hist_sample=None)
                    for p in model.parameters()])
    assert_records_close(ref, run.records[-1])
    np.testing.assert_array_equal(run.records[-1], record.from_disk(record.to_disk(rows)))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_traced_whole_by_torch_compile(backend):
    """``fullgraph=True``: the record traces without a graph break (no ``.item()``, no data-dependent branch)."""
    torch.manual_seed(0)
    model = torch.compile(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)),
                          backend=backend)
    model(torch.randn(32, 64)).square().mean().backward()
    named = {n: p.grad for n, p in model.named_parameters()}
    named["unused"] = None
    named["inf"] = torch.tensor([1.0, float("inf"), float("nan"), 0.0])

    @torch.compile(backend=backend, fullgraph=True)
    def log_step(named):
        return tgh.compute(named, hist_sample=1024)

    packed = log_step(named)
    ref = tgh.to_memory(tgh.compute(named, hist_sample=1024))
    assert_records_close(ref, tgh.to_memory(packed))
    exact = np.stack([record.compute(None if g is None else g.numpy(), size=0, hist_sample=None)
                      for g in named.values()])
    assert_records_close(with_histogram_of(exact, ref), ref)


@pytest.mark.slow
def test_compile_true_matches_eager():
    """``compile=True`` (inductor: a C++ compiler generates the loops) gives the eager numbers."""
    torch.manual_seed(0)
    grads = {"w": torch.randn(3000) * 1e-20, "b": torch.tensor([1.0, float("nan"), 0.0, -float("inf")])}
    eager = tgh.to_memory(tgh.compute(grads, seed=3, hist_sample=256))
    compiled = tgh.to_memory(tgh.compute(grads, seed=3, hist_sample=256, compile=True))
    assert_records_close(eager, compiled)


def _scaler_run(tmp_path, inject_inf: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    seen = {}
    with Writer(str(tmp_path), hist_sample=0) as w:
        rec = tgh.StepRecorder(w, model, opt, scaler=scaler)
        x = torch.randn(16, 8)
        if inject_inf:
            x[0, 0] = float("inf")
        opt.zero_grad()
        scaler.scale(model(x).square().mean()).backward()
        scaler.unscale_(opt)  # the user unscales (e.g. to clip): the recorder sees the same gradients
        seen["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        seen["before"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        seen["applied"] = rec.step(0)
        seen["after"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        seen["scale_after"] = scaler.get_scale()
    return model, seen


@pytest.mark.parametrize("inject_inf", [False, True], ids=["applied", "skipped"])
def test_step_recorder_with_grad_scaler(tmp_path, inject_inf):
    from tb_gradhealth.testing import read_back

    model, seen = _scaler_run(tmp_path, inject_inf)
    assert seen["applied"] is (not inject_inf)
    run = reader.read_logdir(str(tmp_path)).runs[0]
    ref = np.stack([
        record.compute(seen["grads"][n].numpy(), seen["before"][n].numpy(),
                       (seen["before"][n] - seen["after"][n]).numpy(), hist_sample=None)
        for n in run.layers
    ])
    assert_records_close(ref, run.records[0], list(run.layers))
    upd = run.records[0][:, record.INDEX["update_max_abs"]]
    nonfinite = run.records[0][:, record.INDEX["nan"]: record.INDEX["neginf"] + 1].sum()
    assert bool(nonfinite > 0) is inject_inf and bool(np.all(upd == 0) if inject_inf else np.all(upd > 0))
    scalars = {tag: points for tag, (_, points) in read_back(str(tmp_path), "scalars").items()}
    assert scalars["amp/loss_scale"] == [(0, 1024.0)]
    assert scalars["amp/step_skipped"] == [(0, float(inject_inf))]
    assert seen["scale_after"] == (512.0 if inject_inf else 1024.0)


def test_step_recorder_default_cadence_logs_the_first_steps_then_every_hundredth(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Writer(str(tmp_path), hist_sample=0) as w:
        rec = tgh.StepRecorder(w, model, opt)
        for step in range(205):
            opt.zero_grad()
            model(torch.randn(2, 3)).sum().backward()
            rec.step(step)
    assert list(reader.read_logdir(str(tmp_path)).runs[0].steps) == [*range(10), 100, 200]


@pytest.mark.parametrize("n", [0, 1, 2039, 2040, 2041, 3 * 2040 + 7, 100_003, 2 * (1 << 17) + 3])
def test_batched_count_of_normal_values_is_exact(n):
    """The eager passes count normal values eight flag bytes at a time: every length around the row block, and one
    over several of the CPU's pieces."""
    from tb_gradhealth import _torcheager

    rng = np.random.default_rng(n)
    x = rng.choice(np.array([0.0, -0.0, 1e-40, -1e-45, 1.2e-38, -1.0, 3e38, 2.5e-30], np.float32), size=n)
    expected = int(np.count_nonzero(np.abs(x.astype(np.float64)) >= np.finfo(np.float32).tiny))
    assert int(_torcheager.count_normal(torch.from_numpy(x))) == expected


def test_step_recorder_records_each_update_while_it_reuses_the_snapshot(tmp_path):
    """Logged step after logged step the weights' snapshot is copied into the same tensors: each step's record
    holds that step's own update (the float64 reference of ``before - after``)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    refs = []
    with Writer(str(tmp_path), hist_sample=0) as w:
        rec = tgh.StepRecorder(w, model, opt, every=1)
        for step in range(3):
            opt.zero_grad()
            model(torch.randn(4, 6)).square().mean().backward()
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            rec.step(step)
            refs.append(np.stack([record.compute(grads[n].numpy(), before[n].numpy(), (before[n] - p.detach()).numpy(),
                                                 hist_sample=None) for n, p in model.named_parameters()]))
    run = reader.read_logdir(str(tmp_path)).runs[0]
    for step, ref in enumerate(refs):
        assert_records_close(ref, run.records[step], list(run.layers))
