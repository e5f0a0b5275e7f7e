"""Each layer's output recorded by ``StepRecorder(activations=True)`` in real PyTorch loops (no TensorFlow here):
every forward record equals the float64 reference of the outputs seen by hooks of the test's own, on logged steps
only, with no hook of the recorder in an unlogged step's forward; micro-batches are parts of one batch."""

from __future__ import annotations

import numpy as np
import pytest

from tb_gradhealth import reader, record
from tb_gradhealth.writer import Writer
from tests.forward_reference import check_against, edge_outputs, reference

torch = pytest.importorskip("torch")
tgh = pytest.importorskip("tb_gradhealth.torch")

pytestmark = pytest.mark.torch

nn = torch.nn


class Seen:
    """The outputs of the watched modules in each forward, copied by hooks of the test's own, and how many hooks
    each module had while it ran."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        self.outputs: list[dict[str, list[np.ndarray]]] = []
        self.hooks: list[int] = []
        modules = dict(model.named_modules())
        model.register_forward_pre_hook(lambda m, a: self.outputs.append({}))
        for name in names:
            modules[name].register_forward_hook(self._keep(name))

    def _keep(self, name: str):
        def hook(module, args, output):
            self.outputs[-1].setdefault(name, []).append(output.detach().clone().numpy())
            self.hooks.append(len(module._forward_hooks))
        return hook


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 3))
    with torch.no_grad():
        model[0].bias[:10] = -50.0  # ten units dead for every input
        model[2].weight.mul_(8.0)  # tanh driven towards its bounds
    return model


def _cnn() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.Sigmoid(),
                         nn.Flatten(), nn.Linear(4 * 4 * 4, 2))


CASES = {
    "mlp": (_mlp, (24, 6), {"0": (-1, None), "1": (-1, None), "2": (-1, None), "3": (-1, (-1.0, 1.0)),
                            "4": (-1, None)}),
    "cnn": (_cnn, (10, 3, 8, 8), {"0": (1, None), "1": (1, None), "2": (1, None), "3": (1, None),
                                  "4": (1, (0.0, 1.0)), "6": (-1, None)}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logged_steps_record_every_layers_output_as_the_float64_reference(tmp_path, case):
    build, shape, expect = CASES[case]
    model = build()
    seen = Seen(model, list(expect))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(2)
    with Writer(str(tmp_path)) as w:
        rec = tgh.StepRecorder(w, model, opt, every=3, first=2, activations=True)
        for step in range(8):
            x = torch.randn(shape, generator=gen)
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            rec.step(step)
    (series,) = reader.read_logdir(str(tmp_path)).runs
    act = series.activations
    logged = [s for s in range(8) if s < 2 or s % 3 == 0]
    assert act.steps.tolist() == logged == series.steps.tolist()
    assert act.layers == tuple(expect)
    kinds = dict(act.layer_info)
    assert kinds["1" if case == "mlp" else "2"] == ("ReLU", "relu")
    assert kinds["0"] == (("Dense", "") if case == "mlp" else ("Conv2D", ""))
    for k, step in enumerate(logged):
        for j, (name, (axis, bounds)) in enumerate(expect.items()):
            (out,) = seen.outputs[step][name]
            check_against(act.records[k, j], reference(out, axis, bounds), rtol=2e-6)
    # the recorder's hooks ran in logged steps' forwards only: unlogged ones had the test's own hook alone
    per_forward = np.array(seen.hooks).reshape(8, len(expect))
    assert [int(per_forward[s].max()) for s in range(8)] == [2 if s in logged else 1 for s in range(8)]
    if case == "mlp":
        assert act.records[0, 1, record.ACT_INDEX["dead"]] >= 10  # the ten units of the bias at -50
        assert act.records[0, 3, record.ACT_INDEX["saturated"]] > 0


def test_micro_batches_are_parts_of_one_batch_and_a_reused_module_gets_a_row_per_call(tmp_path):
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 12), nn.Linear(12, 5)
            self.act = nn.ReLU()

        def forward(self, x):
            return self.act(self.b(self.act(self.a(x))))

    torch.manual_seed(3)
    model = Net()
    seen = Seen(model, ["a", "act"])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = [torch.randn(5, 4), torch.randn(7, 4)]
    xs[0][:, :] = xs[0].abs()
    with Writer(str(tmp_path)) as w:
        rec = tgh.StepRecorder(w, model, opt, activations=True)
        opt.zero_grad()
        for x in xs:  # two micro-batches, one optimizer step
            model(x).sum().backward()
        rec.step(0)
    act = reader.read_logdir(str(tmp_path)).runs[0].activations
    assert act.layers == ("a", "act", "b", "act#1")
    for j, (name, call) in enumerate([("a", 0), ("act", 0), ("act", 1)]):
        whole = np.concatenate([seen.outputs[f][name][call] for f in range(2)])
        ref = reference(whole)
        check_against(act.records[0, [0, 1, 3][j]], ref, rtol=2e-6)
        parts = [reference(seen.outputs[f][name][call])["dead"] for f in range(2)]
        assert ref["dead"] <= min(parts)  # a unit alive in either part is alive


def test_activations_need_a_module_and_cost_nothing_off(tmp_path):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(ValueError, match="torch.nn.Module"):
        tgh.StepRecorder(None, list(model.named_parameters()), opt, activations=True)
    with Writer(str(tmp_path)) as w:
        rec = tgh.StepRecorder(w, model, opt)
        model(torch.randn(3, 6)).sum().backward()
        rec.step(0)
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert reader.read_logdir(str(tmp_path)).runs[0].activations is None


class Outputs:
    """Every training forward's outputs of ``net.0`` (Linear) and ``net.1`` (Tanh) of the integrations' network, in
    order, copied by hooks of the test's own; evaluation forwards (``module.training`` False) apart."""

    def __init__(self, net: nn.Module) -> None:
        self.train: list[dict[str, np.ndarray]] = []
        self.evaluated = 0
        net.register_forward_pre_hook(self._begin)
        for name in ("0", "1"):
            net[int(name)].register_forward_hook(self._keep(name))

    def _begin(self, module, args):
        if module.training:
            self.train.append({})
        else:
            self.evaluated += 1

    def _keep(self, name: str):
        def hook(module, args, output):
            if module.training:
                self.train[-1][name] = output.detach().clone().numpy()
        return hook

    def check(self, act, logged: list[int], per_step: int) -> None:
        """The forward records at ``logged`` steps are those of the ``per_step`` training forwards of each step."""
        assert act.layers == ("net.0", "net.1", "net.2") and act.steps.tolist() == logged
        assert act.layer_info["net.1"] == ("Tanh", "tanh")
        for k, step in enumerate(logged):
            batch = self.train[step * per_step:(step + 1) * per_step]
            for j, (name, bounds) in enumerate((("0", None), ("1", (-1.0, 1.0)))):
                check_against(act.records[k, j], reference(np.concatenate([b[name] for b in batch]), -1, bounds),
                              rtol=2e-6)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def test_lightning_records_the_training_batches_of_logged_steps_accumulated_batches_as_one(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from tb_gradhealth.lightning import GradHealth

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()
            self.seen = Outputs(self.net)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8) * 3, torch.randn(32, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    module = Module()
    trainer = pl.Trainer(max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accumulate_grad_batches=2, num_sanity_val_steps=0,
                         callbacks=[GradHealth(str(tmp_path), every=2, first=1, activations=True)])
    trainer.fit(module, loader, loader)
    run = reader.read_logdir(str(tmp_path)).runs[0]
    assert module.seen.evaluated > 0 and len(module.seen.train) == 12 and not run.problems
    module.seen.check(run.activations, [0, 2, 4], per_step=2)


def test_trainer_callback_records_the_batches_of_logged_steps(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from tb_gradhealth.transformers import GradHealthCallback

    class Regressor(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _net()
            self.seen = Outputs(self.net)

        def forward(self, x, labels=None):
            out = self.net(x)
            return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

    torch.manual_seed(2)
    data = [{"x": torch.randn(8) * 3, "labels": torch.randn(1)} for _ in range(64)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=4,
                                          gradient_accumulation_steps=2, report_to=[], save_strategy="no",
                                          use_cpu=True, disable_tqdm=True, learning_rate=1e-3, logging_steps=1)
    model = Regressor()
    callback = GradHealthCallback(str(tmp_path / "logs"), every=3, first=1, activations=True)
    transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    run = reader.read_logdir(str(tmp_path / "logs")).runs[0]
    assert len(model.seen.train) == 8 and not run.problems
    model.seen.check(run.activations, [0, 3], per_step=2)


def _dead_relu_mlp(dead_units: int) -> nn.Module:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    with torch.no_grad():
        model[2].bias[:dead_units] = -50.0  # these units of the second layer output 0 for every input
    return model


@pytest.mark.parametrize("dead_units", [40, 0])
def test_the_diagnosis_reads_dead_relu_units_through_the_relu_module_after_a_linear(tmp_path, dead_units):
    """The ``nn.ReLU`` row speaks for the ``Linear`` before it: its dead units make ``2.weight`` and ``2.bias``
    dead while their gradient is not zero; the twin without the shift stays healthy."""
    from tb_gradhealth import _payloads, health

    model = _dead_relu_mlp(dead_units)
    seen = Seen(model, ["3"])
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(4)
    grads_live = []
    with Writer(str(tmp_path)) as w:
        rec = tgh.StepRecorder(w, model, opt, activations=True)
        for step in range(10):
            x = torch.randn((32, 8), generator=gen)
            loss = (model(x) - x[:, :1]).square().mean()
            opt.zero_grad()
            loss.backward()
            grads_live.append(bool(model[2].weight.grad.abs().max() > 0))
            rec.step(step, loss=loss)
            opt.step()
    (series,) = reader.read_logdir(str(tmp_path)).runs
    by = {x["layer"]: x for x in _payloads.health_payload(series, health.Thresholds(), None)["layers"]}
    (last,) = seen.outputs[-1]["3"]
    measured = float(np.mean(~np.any(last != 0, axis=0)))
    assert all(grads_live)
    if dead_units:
        assert measured >= 0.5
        for name in ("2.weight", "2.bias"):
            assert by[name]["status"] == "dead", by[name]["reasons"]
            assert f"{measured:.0%} of its relu units output 0 for every input of the batch" in by[name]["reasons"][0]
            assert by[name]["forward"]["output"] == "3"
        assert by["0.weight"]["status"] == "healthy"
    else:
        assert measured < 0.5
        assert all(x["status"] == "healthy" for x in by.values())


@pytest.mark.parametrize("name", sorted(edge_outputs()))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_each_outputs_statistics_on_the_host_match_the_float64_reference(name, dtype):
    """The statistics a forward hook takes on the host, whichever path the output takes, equal the float64
    reference (a float16 output as float32 holds it)."""
    from tb_gradhealth import _forwardstats
    from tb_gradhealth._torchforward import output_stats

    a, axis, bounds = edge_outputs()[name]
    t = torch.from_numpy(a).to(getattr(torch, dtype))
    stats = output_stats(t, axis, bounds)
    rec = _forwardstats.row(stats.counts.numpy(), stats.values.double().numpy(), stats.alive.numpy(), bounds)
    check_against(rec, reference(t.float().numpy(), axis, bounds), rtol=2e-6)
