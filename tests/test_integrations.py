"""The Lightning callback and the Hugging Face ``Trainer`` callback record, at the default-style cadence, the
gradient the optimizer applies (Trainer: after clipping) with the applied update, equal to the float64
reference of the gradients a probe callback sees at the same hook."""

from __future__ import annotations

import numpy as np
import pytest

from tb_gradhealth import layerinfo, progress, reader, record
from tests.record_close import assert_records_close

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _reference(seen: dict) -> np.ndarray:
    """The float64 reference of what a probe saw; a parameter it saw frozen (no gradient by ``requires_grad``)
    is the frozen record."""
    return np.stack([record.frozen(w.size) if g is None else record.compute(g, w, u, hist_sample=None)
                     for g, w, u in seen.values()])


def _grad(p: torch.Tensor) -> np.ndarray | None:
    """What a probe reads of a parameter's gradient: ``None`` where it is frozen."""
    return p.grad.numpy().copy() if p.requires_grad else None


def _kinds_and_loss(logdir: str) -> tuple[dict[str, tuple[str, str]], tuple[np.ndarray, np.ndarray] | None]:
    paths = next(iter(reader.find_runs(logdir).values()))
    return layerinfo.read_layer_info(paths), progress.read_loss(paths)


#: _net()'s parameters as the module tree says them: Linear then Tanh, then the output Linear.
NET_KINDS = {"0": ("Dense", "tanh"), "2": ("Dense", "")}


def test_lightning_callback_records_the_applied_gradient_and_update(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from tb_gradhealth.lightning import GradHealth

    seen: dict[int, dict] = {}
    losses: dict[int, float] = {}

    class Probe(pl.Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            self.before = {n: (p.grad.numpy().copy(), p.detach().numpy().copy())
                           for n, p in module.named_parameters()}

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            after = [p.detach().numpy() for p in module.parameters()]
            seen[trainer.global_step - 1] = {n: (g, w, w - a) for (n, (g, w)), a in zip(self.before.items(), after,
                                                                                          strict=True)}

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            losses[self.trainer.global_step] = loss.item()
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    trainer = pl.Trainer(max_steps=9, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[GradHealth(str(tmp_path), every=4, first=2), Probe()])
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=8))
    run = reader.read_logdir(str(tmp_path)).runs[0]
    assert list(run.steps) == [0, 1, 4, 8] and not run.problems
    for step, rows in zip(run.steps, run.records, strict=True):
        assert_records_close(_reference(seen[int(step)]), rows, list(run.layers))
    info, (loss_steps, loss) = _kinds_and_loss(str(tmp_path))
    assert info == {n: NET_KINDS[n.split(".")[1]] for n in run.layers}  # net.0.weight: ("Dense", "tanh")
    assert loss_steps.tolist() == [0, 1, 4, 8]
    np.testing.assert_allclose(loss, [losses[s] for s in (0, 1, 4, 8)], rtol=1e-6)


def test_lightning_callback_records_a_frozen_layer_frozen_until_it_is_unfrozen(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from tb_gradhealth.lightning import GradHealth

    seen: dict[int, dict] = {}

    class Probe(pl.Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            self.before = {n: (_grad(p), p.detach().numpy().copy()) for n, p in module.named_parameters()}

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            after = [p.detach().numpy() for p in module.parameters()]
            seen[trainer.global_step - 1] = {n: (g, w, w - a) for (n, (g, w)), a in zip(self.before.items(), after,
                                                                                          strict=True)}

    class Unfreeze(pl.Callback):  # gradual unfreezing: the first layer joins the optimizer at step 3
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if trainer.global_step == 3:
                module.net[0].requires_grad_(True)
                trainer.optimizers[0].add_param_group({"params": list(module.net[0].parameters())})

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()
            self.net[0].requires_grad_(False)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    trainer = pl.Trainer(max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         callbacks=[GradHealth(str(tmp_path), every=1), Unfreeze(), Probe()])
    module = Module()
    first = module.net[0].weight.detach().clone()
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    run = reader.read_logdir(str(tmp_path)).runs[0]
    assert list(run.steps) == list(range(6)) and not run.problems
    for step, rows in zip(run.steps, run.records, strict=True):
        assert_records_close(_reference(seen[int(step)]), rows, list(run.layers))
    rows = [list(run.layers).index(n) for n in ("net.0.weight", "net.0.bias")]
    assert run.records[:, rows, record.INDEX["missing"]].tolist() == [[record.FROZEN] * 2] * 3 + [[0, 0]] * 3
    assert not torch.equal(module.net[0].weight.detach(), first)  # it trained once unfrozen


@pytest.mark.parametrize(("clip", "algorithm", "stated"),
                         [(0.5, None, "0.5"), (0.5, "value", None), (None, None, None)], ids=["norm", "value", "none"])
def test_lightning_callback_states_the_global_norm_the_trainer_clips_to(tmp_path, clip, algorithm, stated):
    """``gradient_clip_val`` under the norm algorithm is the global norm each step is clipped to (``clip_norm`` in
    the tags' metadata, evidence the diagnosis weighs); clipping by value clips no norm, and no clip states none."""
    pl = pytest.importorskip("lightning.pytorch")
    from tb_gradhealth.lightning import GradHealth

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randn(16, 1))
    trainer = pl.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, gradient_clip_val=clip, gradient_clip_algorithm=algorithm,
                         callbacks=[GradHealth(str(tmp_path), every=1)])
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=8))
    (run,) = reader.read_logdir(str(tmp_path)).runs
    assert run.source.get("clip_norm") == stated and run.source["loop"] == "lightning"


@pytest.mark.parametrize("frozen", [False, True], ids=["all_trained", "first_layer_frozen"])
def test_trainer_callback_records_the_gradient_after_clipping(tmp_path, frozen):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from tb_gradhealth.transformers import GradHealthCallback

    seen: dict[int, dict] = {}
    losses: list[float] = []  # the loss of each batch, in order (Trainer logs it every step here)

    class Probe(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            self.before = {n: (_grad(p), p.detach().numpy().copy()) for n, p in model.named_parameters()}

        def on_optimizer_step(self, args, state, control, model=None, **kw):
            seen[state.global_step] = {n: (g, w, w - p.detach().numpy())
                                       for (n, (g, w)), p in zip(self.before.items(), model.parameters(), strict=True)}

    class Regressor(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _net()
            self.net[0].requires_grad_(not frozen)

        def forward(self, x, labels=None):
            out = self.net(x)
            loss = torch.nn.functional.mse_loss(out, labels) * 1e3
            losses.append(loss.item())
            return {"loss": loss, "logits": out}

    data = [{"x": torch.randn(8), "labels": torch.randn(1)} for _ in range(64)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=6, per_device_train_batch_size=8,
                                          max_grad_norm=0.01, report_to=[], save_strategy="no", use_cpu=True,
                                          disable_tqdm=True, learning_rate=1e-3, logging_steps=1)
    callback = GradHealthCallback(str(tmp_path / "logs"), every=5, first=2)
    transformers.Trainer(model=Regressor(), args=args, train_dataset=data, callbacks=[callback, Probe()]).train()
    run = reader.read_logdir(str(tmp_path / "logs")).runs[0]
    assert list(run.steps) == [0, 1, 5] and not run.problems
    assert run.source.get("clip_norm") == "0.01"  # the clip the records were clipped to, stated for the diagnosis
    for step, rows in zip(run.steps, run.records, strict=True):
        assert_records_close(_reference(seen[int(step)]), rows, list(run.layers))
        assert (rows[:, record.INDEX["missing"]] == record.FROZEN).sum() == 2 * frozen
        norm = np.sqrt(np.nansum(record.derived(rows)["norm"] ** 2))
        assert norm <= 0.01 * (1 + 1e-5), norm  # clipped: the loss' gradient is far larger than 0.01
    info, (loss_steps, loss) = _kinds_and_loss(str(tmp_path / "logs"))
    assert info == {n: NET_KINDS[n.split(".")[1]] for n in run.layers}
    # the loss of batch s (0-based) beside the record of the gradient it made, at step s; Trainer rounds it
    assert loss_steps.tolist() == list(range(6))
    np.testing.assert_allclose(loss, losses, rtol=1e-4)
