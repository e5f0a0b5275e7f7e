"""What the PyTorch writer records beside the gradients: each parameter's layer kind and activation from the module
tree, and the training loss given to ``StepRecorder.step``; both read back without TensorFlow as the diagnosis reads
them. The expected kinds and activations are written out from the model each case builds."""

from __future__ import annotations

import numpy as np
import pytest

from tb_gradhealth import health, layerinfo, progress, reader
from tb_gradhealth.writer import Writer

torch = pytest.importorskip("torch")
tgh = pytest.importorskip("tb_gradhealth.torch")
kinds = pytest.importorskip("tb_gradhealth.torch_kinds")

pytestmark = pytest.mark.torch
nn = torch.nn


class Block(nn.Module):
    """A residual block whose activation is a call in ``forward``: the module tree does not say which."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(6)
        self.proj = nn.Linear(6, 6)
        self.act = nn.GELU()

    def forward(self, x):
        return x + self.act(self.proj(self.norm(x)))


def test_each_parameter_gets_its_module_kind_and_the_next_activation():
    model = nn.Sequential(
        nn.Linear(4, 6), nn.Sigmoid(),                       # 0: Dense, sigmoid
        nn.Linear(6, 6), nn.Dropout(0.1), nn.ReLU(),         # 2: Dense, relu (dropout in between)
        nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Tanh(),       # 5: Dense, no activation; 6: BatchNorm, tanh
        Block(),                                             # 8: inside a custom module, unknown activation
        nn.Sequential(nn.Linear(6, 6), nn.GELU()),           # 9.0: Dense, gelu (a nested Sequential)
        nn.Linear(6, 3),                                     # 10: Dense, last: nothing after it
    )
    expected = {
        "0": ("Dense", "sigmoid"), "2": ("Dense", "relu"), "5": ("Dense", ""), "6": ("BatchNormalization", "tanh"),
        "8.norm": ("LayerNormalization", ""), "8.proj": ("Dense", ""), "9.0": ("Dense", "gelu"),
        "10": ("Dense", ""),
    }
    info = kinds.module_layer_info(model)
    assert list(info) == [n for n, _ in model.named_parameters()]
    assert info == {n: expected[n.rsplit(".", 1)[0]] for n, _ in model.named_parameters()}


def test_convolutions_embeddings_and_unknown_classes():
    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))

    model = nn.Sequential(nn.Embedding(10, 3), nn.Conv1d(3, 3, 1), nn.ELU(), Custom(), nn.Conv2d(3, 3, 1),
                          nn.Hardtanh())
    info = kinds.module_layer_info(model)
    assert info["0.weight"] == ("Embedding", "")
    assert info["1.weight"] == info["1.bias"] == ("Conv1D", "elu")
    assert info["3.scale"] == ("Custom", "")
    assert info["4.weight"] == ("Conv2D", "hard_tanh")


def test_a_shared_module_is_named_once():
    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.Sigmoid(), shared)
    assert kinds.module_layer_info(model) == {"0.weight": ("Dense", "sigmoid"), "0.bias": ("Dense", "sigmoid")}


def _flat_run(logdir, *, with_module: bool, loss_of=lambda step: 0.7, steps: int = 12):
    """A sigmoid MLP trained with a learning rate too small to move it, its loss given to the recorder."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Sigmoid(), nn.Linear(16, 16), nn.Sigmoid(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-9)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    with Writer(str(logdir)) as w:
        rec = tgh.StepRecorder(w, model if with_module else list(model.named_parameters()), opt, every=1)
        for step in range(steps):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            rec.step(step, loss=loss_of(step))
    return model


def test_step_recorder_keeps_the_layer_kinds_in_the_metadata(tmp_path):
    _flat_run(tmp_path / "module", with_module=True, steps=2)
    _flat_run(tmp_path / "pairs", with_module=False, steps=2)
    info = layerinfo.read_layer_info(reader.find_runs(str(tmp_path / "module"))["."])
    assert info == {"0.weight": ("Dense", "sigmoid"), "0.bias": ("Dense", "sigmoid"),
                    "2.weight": ("Dense", "sigmoid"), "2.bias": ("Dense", "sigmoid"),
                    "4.weight": ("Dense", ""), "4.bias": ("Dense", "")}
    assert layerinfo.read_layer_info(reader.find_runs(str(tmp_path / "pairs"))["."]) == {}  # no module, no kinds


def test_add_gradients_with_a_module_keeps_the_layer_kinds(tmp_path):
    model = nn.Sequential(nn.Linear(3, 2), nn.Tanh())
    model(torch.randn(4, 3)).sum().backward()
    with Writer(str(tmp_path)) as w:
        tgh.add_gradients(w, 0, model)
    assert layerinfo.read_layer_info(reader.find_runs(str(tmp_path))["."]) == {
        "0.weight": ("Dense", "tanh"), "0.bias": ("Dense", "tanh")}


class CountedLoss:
    """A loss whose host reads are counted (a device tensor's ``float()`` is a sync)."""

    def __init__(self, value: float) -> None:
        self.value, self.reads = value, 0

    def __float__(self) -> float:
        self.reads += 1
        return self.value


def test_the_loss_is_read_on_logged_steps_only(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = [CountedLoss(1.0 / (s + 1)) for s in range(12)]
    with Writer(str(tmp_path)) as w:
        rec = tgh.StepRecorder(w, model, opt, every=5, first=2)
        for s, loss in enumerate(losses):
            opt.zero_grad()
            model(torch.randn(4, 3)).sum().backward()
            rec.step(s, loss=loss)
    assert [loss.reads for loss in losses] == [1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0]
    steps, values = progress.read_loss(reader.find_runs(str(tmp_path))["."])
    assert steps.tolist() == [0, 1, 5, 10]
    np.testing.assert_allclose(values, [1.0, 0.5, 1 / 6, 1 / 11], rtol=1e-6)


def test_a_tensor_loss_is_written_as_the_keras_callback_writes_it(tmp_path):
    # The Keras callback writes its loss with Writer.add_loss; so does StepRecorder: the same tag, the same values.
    _flat_run(tmp_path / "torch", with_module=True, loss_of=lambda s: torch.tensor(0.7 + 1e-3 * s,
                                                                                  requires_grad=True))
    with Writer(str(tmp_path / "direct")) as w:
        for s in range(12):
            w.add_loss(s, 0.7 + 1e-3 * s)
    got = progress.read_loss(reader.find_runs(str(tmp_path / "torch"))["."])
    direct = progress.read_loss(reader.find_runs(str(tmp_path / "direct"))["."])
    assert got[0].tolist() == direct[0].tolist() == list(range(12))
    np.testing.assert_array_equal(got[1], direct[1])


def test_a_flat_loss_through_the_recorder_flags_the_layers_that_do_not_learn(tmp_path):
    # lr 1e-9 moves no weight: with the loss flat, the layers are not learning; the same records with a falling
    # loss are not flagged for it.
    for name, loss_of in (("flat", lambda s: 0.7), ("falling", lambda s: 2.0 / (s + 1))):
        _flat_run(tmp_path / name, with_module=True, loss_of=loss_of)
    statuses = {}
    for name in ("flat", "falling"):
        paths = reader.find_runs(str(tmp_path / name))["."]
        run = reader.read_logdir(str(tmp_path / name)).runs[0]
        h = health.diagnose_run(run.layers, run.steps, run.records, progress=progress.read_loss(paths),
                                layer_info=layerinfo.read_layer_info(paths))
        statuses[name] = {lh.layer: lh for lh in h.layers}
    flat = statuses["flat"]["0.weight"]
    assert flat.status == "vanishing" and any(r.startswith("not learning") for r in flat.reasons)
    assert "layer: Dense, activation sigmoid" in flat.reasons
    assert all(lh.status == "healthy" for lh in statuses["falling"].values())
