"""Frozen parameters and stale gradients in real PyTorch loops recorded by ``StepRecorder`` (no TensorFlow here).

A parameter frozen by the user (``requires_grad=False``, or in none of the optimizer's ``param_groups``) is recorded
frozen, its weights measured unchanged and its leftover ``.grad`` never read; a ``.grad`` that backward did not
produce since the last optimizer step is recorded missing; every other row equals the float64 reference of the
gradient, weight and update seen beside the recorder."""

from __future__ import annotations

import numpy as np
import pytest

from tb_gradhealth import cli, reader, record
from tb_gradhealth.writer import Writer
from tests.record_close import assert_records_close

torch = pytest.importorskip("torch")
tgh = pytest.importorskip("tb_gradhealth.torch")

pytestmark = pytest.mark.torch

nn = torch.nn
MISSING = record.INDEX["missing"]


def _frozen_row(p: torch.Tensor) -> np.ndarray:
    return record.frozen(p.numel())


class Probe:
    """What the recorder should have recorded: each parameter's gradient, weight and applied update, read beside it
    (``None`` gradient where the row must read as missing, a frozen row where it must be frozen)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.refs: dict[int, np.ndarray] = {}

    def step(self, rec, step: int, *, frozen: set[str] = frozenset(), missing: set[str] = frozenset(),
             loss=None) -> None:
        named = list(self.model.named_parameters())
        grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in named}
        before = {n: p.detach().clone() for n, p in named}
        rec.step(step, loss=loss)
        if not rec.logs(step):
            return
        self.refs[step] = np.stack([
            _frozen_row(p) if n in frozen else
            record.compute(None if n in missing else grads[n].numpy(), before[n].numpy(),
                           (before[n] - p.detach()).numpy(), size=p.numel(), hist_sample=None)
            for n, p in named])

    def check(self, logdir: str) -> reader.RunSeries:
        run = reader.read_logdir(logdir).runs[0]
        assert not run.problems
        assert list(run.steps) == sorted(self.refs)
        for step, rows in zip(run.steps, run.records, strict=True):
            assert_records_close(self.refs[int(step)], rows, list(run.layers))
        return run


def _finetune_model() -> nn.Module:
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh())
    return nn.Sequential(backbone, nn.Linear(16, 1))


def test_fine_tuning_with_a_frozen_backbone_records_it_frozen_and_reports_ok(tmp_path, capsys):
    model = _finetune_model()
    backbone = model[0]
    rng = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 8, generator=rng), torch.randn(64, 1, generator=rng)
    model(x).square().mean().backward()  # an earlier loop left a .grad on every backbone parameter
    backbone.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    probe = Probe(model)
    with Writer(str(tmp_path), hist_sample=0) as w:
        rec = tgh.StepRecorder(w, model, opt, every=5)
        for step in range(31):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            probe.step(rec, step, frozen=frozen, loss=loss)
    assert frozen == {"0.0.weight", "0.0.bias", "0.2.weight", "0.2.bias"}
    for n, p in model.named_parameters():  # measured: the frozen weights never moved, the head's did
        assert torch.equal(p.detach(), weights[n]) is (n in frozen), n
    assert all(p.grad is not None for p in backbone.parameters())  # the leftover gradient was there all along
    run = probe.check(str(tmp_path))
    assert list(run.steps) == [*range(10), 10, 15, 20, 25, 30]
    for rows in run.records:
        assert {n for n, r in zip(run.layers, rows, strict=True) if r[MISSING] == record.FROZEN} == frozen
    assert cli.main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ok, 0 of 6 layers flagged (4 frozen)" in out, out


def test_a_parameter_outside_the_optimizer_is_frozen_though_backward_reaches_it(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model[2].parameters(), lr=1e-2)  # model[0] requires a gradient, outside the optimizer
    first = {n: p.detach().clone() for n, p in model[0].named_parameters()}
    probe = Probe(model)
    x = torch.randn(16, 6)
    with Writer(str(tmp_path), hist_sample=0) as w:
        rec = tgh.StepRecorder(w, model, opt, every=1)
        for step in range(3):
            opt.zero_grad()
            model(x).square().mean().backward()
            assert model[0].weight.grad is not None
            probe.step(rec, step, frozen={"0.weight", "0.bias"})
    for n, p in model[0].named_parameters():
        assert torch.equal(p.detach(), first[n])
    probe.check(str(tmp_path))


class _Branches(nn.Module):
    """A trunk and two heads; ``forward(x, heads)`` takes only the heads named (a branch not taken)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 1), nn.Linear(8, 1)

    def forward(self, x, heads):
        h = torch.tanh(self.trunk(x))
        return sum(getattr(self, k)(h).square().mean() for k in heads)


B = {"b.weight", "b.bias"}


def test_a_stale_grad_is_recorded_missing_not_with_its_old_values(tmp_path):
    """``zero_grad(set_to_none=False)`` after each step: a head whose branch is not taken keeps its ``.grad``
    (a leftover by hand first, zeros later); that is no gradient of this step."""
    model = _Branches()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 4)
    for p in model.b.parameters():  # left by an earlier loop
        p.grad = torch.full_like(p, 7.0)
    probe = Probe(model)
    with Writer(str(tmp_path), hist_sample=0) as w:
        rec = tgh.StepRecorder(w, model, opt, every=1)
        plan = [("a", B), ("a", B), ("ab", ()), ("a", B)]  # heads taken, rows that must read missing
        for step, (heads, missing) in enumerate(plan):
            model(x, heads).backward()
            probe.step(rec, step, missing=missing)
            opt.zero_grad(set_to_none=False)
        # a gradient assigned by hand before the step is the step's own: the optimizer applies it
        model(x, "a").backward()
        model.b.weight.grad = torch.full_like(model.b.weight, 0.25)
        probe.step(rec, 4, missing={"b.bias"})
    run = probe.check(str(tmp_path))
    b = [run.layers.index(n) for n in ("b.bias", "b.weight")]
    np.testing.assert_array_equal(run.records[:, b, MISSING], [[1, 1], [1, 1], [0, 0], [1, 1], [1, 0]])
    assert not run.records[0, b, record.HIST_START:].any()  # none of the leftover 7s was binned


def test_stale_grads_are_told_at_a_sparse_cadence(tmp_path):
    """Logged every 3rd step: the watch is armed after the step before a logged step only, and still tells the
    head whose branch was last taken at an unlogged step."""
    model = _Branches()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 4)
    probe = Probe(model)
    with Writer(str(tmp_path), hist_sample=0) as w:
        rec = tgh.StepRecorder(w, model, opt, every=3, first=1)
        for step, heads in enumerate(["ab", "ab", "a", "a", "ab", "ab", "ab"]):
            opt.zero_grad(set_to_none=False)
            model(x, heads).backward()
            hooked = model.b.weight._post_accumulate_grad_hooks
            assert bool(hooked) is rec.logs(step), step  # hooks only around logged steps
            probe.step(rec, step, missing=B if heads == "a" else set())
    assert sorted(probe.refs) == [0, 3, 6]
    probe.check(str(tmp_path))


def test_gradual_unfreezing_switches_the_rows_from_frozen_to_live_at_its_step(tmp_path):
    model = _finetune_model()
    backbone = model[0]
    backbone.requires_grad_(False)
    opt = torch.optim.Adam(model[1].parameters(), lr=1e-2)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    names = {n for n, _ in model.named_parameters() if n.startswith("0.")}
    probe = Probe(model)
    with Writer(str(tmp_path), hist_sample=0) as w:
        rec = tgh.StepRecorder(w, model, opt, every=1)
        for step in range(8):
            if step == 5:  # unfreeze: the backbone joins the optimizer
                backbone.requires_grad_(True)
                opt.add_param_group({"params": list(backbone.parameters()), "lr": 1e-3})
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            probe.step(rec, step, frozen=names if step < 5 else set())
    run = probe.check(str(tmp_path))
    rows = [run.layers.index(n) for n in sorted(names)]
    assert (run.records[:5, rows, MISSING] == record.FROZEN).all()
    assert (run.records[5:, rows, MISSING] == 0).all()
    assert (run.records[5:, rows, record.INDEX["update_max_abs"]] > 0).all()


def test_add_gradients_and_compute_mark_frozen_rows_without_reading_their_grad(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 2))
    model(torch.randn(3, 5)).sum().backward()
    model[0].weight.requires_grad_(False)
    model[0].weight.grad.fill_(float("nan"))  # read, it would count NaNs
    opt = torch.optim.SGD([model[1].weight], lr=0.1)  # model[0].bias and model[1].bias: outside it
    named = list(model.named_parameters())
    with Writer(str(tmp_path), hist_sample=0) as w:
        rows = tgh.add_gradients(w, 0, model.named_parameters(), optimizer=opt)  # a generator, read once
    stacked = tgh.to_memory(tgh.compute(model, True, hist_sample=0))
    ref = np.stack([record.frozen(p.numel()) if n != "1.weight"
                    else record.compute(p.grad.numpy(), p.detach().numpy(), hist_sample=None) for n, p in named])
    assert_records_close(ref, rows, [n for n, _ in named])
    assert list(reader.read_logdir(str(tmp_path)).runs[0].layers) == [n for n, _ in named]
    # without the optimizer only requires_grad=False freezes
    assert stacked[:, MISSING].tolist() == [record.FROZEN, 0, 0, 0]
    assert_records_close(np.stack([record.compute(p.grad.numpy(), p.detach().numpy(), hist_sample=None)
                                   for n, p in named[1:]]), stacked[1:], [n for n, _ in named[1:]])
