"""The zoo's plain PyTorch loops (``benchmarks/diagnosis_zoo.py``), trained in a child process
(``benchmarks/zoo_child.py``) and recorded with :class:`tb_gradhealth.torch.StepRecorder` at every step, loss
included.

The loops are those people run every day: fine-tuning a head on a frozen backbone, a mixture of experts whose idle
experts get no gradient, a transformer and a regression trained under Adam/AdamW until the loss sits at its floor,
mixed precision whose first steps overflow (``GradScaler``, ``unscale_``, ``clip_grad_norm_``), a GAN whose
discriminator learns 100x too fast, and a learning rate that grows until NaN. Each class has one instance in the
design half (``zoo_cases.CASES``) and others in the held-out half (``zoo_heldout.CASES``), written before the rules
for them were changed. A :class:`Probe` measures each step with torch beside the recorder; the labels come from
those measurements and from twins (``benchmarks/zoo_measure.py``), never from the diagnosis (the loop and the probe:
``benchmarks/zoo_torch_loop.py``). Torch is imported
inside the functions: the zoo's TensorFlow process imports this module to list the cases.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from benchmarks import zoo_cases, zoo_heldout, zoo_measure
from benchmarks.zoo_cases import CLASSES, FEATURES, image_data, teacher_data
from benchmarks.zoo_child import case
from benchmarks.zoo_measure import Trace
from benchmarks.zoo_torch_loop import Probe, batches, ce, mse, plain_loop, recorder

DESIGN, HELDOUT = zoo_cases.CASES, zoo_heldout.CASES


# --- 1. fine-tuning a head on a frozen backbone --------------------------------------------------------------------

FROZEN_RULE = ("healthy: a backbone trained for {warm} steps on one task, then frozen (requires_grad_(False), the "
               "optimizer over the head only) while a new head learns another task on its features; frozen "
               "parameters measured bitwise unchanged (labelled frozen), every head parameter moved and the loss "
               "falls (checked){stale}")
STALE = ("; the backbone keeps the .grad of its last warm-up step (only the head's optimizer zeroes its gradients), "
         "so a stale gradient sits on every frozen parameter")


def _mlp_backbone(seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU())


def _conv_backbone(seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                               torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(2), torch.nn.Flatten())  # the quadrants' features


def _finetune(log_dir: str, *, backbone: Any, width: int, data: Callable[[int], tuple[np.ndarray, np.ndarray]],
              optimizer: Callable[[Any], Any], warm: int, steps: int, stale: bool, rule: str) -> dict[str, Any]:
    """Warm the backbone up on task 0 (a head of its own, SGD), freeze it, then fine-tune a new head on task 1."""
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone, self.head = backbone, torch.nn.Linear(width, CLASSES)

        def forward(self, x: Any) -> Any:
            return self.head(self.backbone(x))

    warm_net = torch.nn.Sequential(backbone, torch.nn.Linear(width, CLASSES))
    warm_opt = torch.optim.SGD(warm_net.parameters(), lr=0.05, momentum=0.9)
    source = batches(*data(0), 32)
    for _ in range(warm):
        xb, yb = next(source)
        warm_opt.zero_grad()
        ce(warm_net(xb), yb).backward()
        warm_opt.step()
    net = Net()
    net.backbone.requires_grad_(False)
    if not stale:
        net.backbone.zero_grad(set_to_none=True)
    frozen = [n for n, p in net.named_parameters() if not p.requires_grad]
    opt = optimizer([p for p in net.parameters() if p.requires_grad])
    trace = plain_loop(log_dir, net, opt, batches(*data(1), 32), steps=steps, loss_fn=ce)
    stale_grads = [n for n, p in net.named_parameters() if n in frozen and p.grad is not None]
    if stale != bool(stale_grads):
        raise RuntimeError(f"stale gradients on the frozen parameters: {stale_grads}, expected {stale}")
    return zoo_measure.healthy_labels(trace, rule, frozen=frozen, evidence={"stale_grad": stale_grads})


def _teacher_task(seed: int) -> Callable[[int], tuple[np.ndarray, np.ndarray]]:
    return lambda task: teacher_data(40 * 32, seed + task)


def _image_task(seed: int) -> Callable[[int], tuple[np.ndarray, np.ndarray]]:
    def data(task: int) -> tuple[np.ndarray, np.ndarray]:
        x, y = image_data(40 * 32, seed + task, 16)
        return np.transpose(x, (0, 3, 1, 2)).copy(), (y + task) % CLASSES  # task 1 relabels the quadrants

    return data


def _finetune_case(half: dict, name: str, *, conv: bool, seed: int, optimizer: str, lr: float, stale: bool,
                   warm: int, steps: int = 120) -> None:
    rule = FROZEN_RULE.format(warm=warm, stale=STALE if stale else "") + (
        f" ({'conv' if conv else 'MLP'} backbone, head under {optimizer}({lr:g}))")

    def run(log_dir: str) -> dict[str, Any]:
        import torch

        build = getattr(torch.optim, optimizer)
        return _finetune(log_dir, backbone=_conv_backbone(seed) if conv else _mlp_backbone(seed),
                         width=128 if conv else 64, data=_image_task(seed) if conv else _teacher_task(seed),
                         optimizer=lambda ps: build(ps, lr=lr), warm=warm, steps=steps, stale=stale, rule=rule)

    case(half, name, rule)(run)


_finetune_case(DESIGN, "torch_frozen_backbone_mlp", conv=False, seed=401, optimizer="Adam", lr=1e-2, stale=False,
               warm=100)
_finetune_case(HELDOUT, "torch_frozen_backbone_conv", conv=True, seed=409, optimizer="AdamW", lr=1e-2, stale=False,
               warm=150)
_finetune_case(HELDOUT, "torch_frozen_backbone_stale_grad", conv=False, seed=419, optimizer="SGD", lr=0.1,
               stale=True, warm=100)


# --- 2. a mixture of experts --------------------------------------------------------------------------------------

MOE_RULE = ("healthy: tokens routed to the top-{k} of {experts} experts (a router, a Switch load-balancing loss, "
            "Adam); an expert that receives no token at a step gets no gradient ({idle}); measured per step: the "
            "tokens each expert received (every expert used at >= half of the steps, some idle at some steps); "
            "the loss falls and every parameter moved (checked)")
MOE_TOKENS = 2  # tokens per sequence


def _moe_model(seed: int, *, experts: int, k: int, width: int = 16) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(seed)

    class MoE(nn.Module):
        """Top-``k`` routing of each token to ``experts`` two-layer MLPs; ``aux_loss``: the Switch Transformer's
        load-balancing loss (experts x the sum of each expert's token fraction times its mean router probability);
        ``usage``: the tokens each expert received in the last forward pass."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(FEATURES, width)
            self.router = nn.Linear(width, experts)
            self.experts = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                                       nn.Linear(2 * width, width)) for _ in range(experts))
            self.head = nn.Linear(width, CLASSES)
            self.usage: list[int] = []
            self.aux_loss: Any = 0.0

        def forward(self, x: Any) -> Any:
            b, t, _ = x.shape
            h = self.embed(x).reshape(b * t, width)
            probs = torch.softmax(self.router(h), dim=-1)
            gate, chosen = probs.topk(k, dim=-1)
            gate = gate / gate.sum(-1, keepdim=True)
            out = torch.zeros_like(h)
            self.usage = []
            for e, expert in enumerate(self.experts):
                token, slot = (chosen == e).nonzero(as_tuple=True)
                self.usage.append(int(token.numel()))
                if token.numel():  # an expert without a token is not called: no gradient reaches it
                    out = out.index_add(0, token, expert(h[token]) * gate[token, slot, None])
            top1 = torch.nn.functional.one_hot(chosen[:, 0], experts).float().mean(0)
            self.aux_loss = 0.01 * experts * (top1 * probs.mean(0)).sum()
            return self.head((h + out).reshape(b, t, width).mean(1))

    return MoE()


def _moe_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sequences of ``MOE_TOKENS`` tokens whose class is a linear teacher's on their mean token."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, MOE_TOKENS, FEATURES)).astype(np.float32)
    y = np.argmax(x.mean(1) @ rng.standard_normal((FEATURES, CLASSES)), axis=1).astype(np.int64)
    return x, y


def _moe_case(half: dict, name: str, *, seed: int, experts: int, k: int, batch: int, set_to_none: bool,
              steps: int = 150, lr: float = 3e-3) -> None:
    idle = ".grad None: zero_grad(set_to_none=True)" if set_to_none else \
        "its .grad stays exactly zero: zero_grad(set_to_none=False)"
    rule = MOE_RULE.format(k=k, experts=experts, idle=idle) + f"; {batch * MOE_TOKENS} tokens a step"

    def run(log_dir: str) -> dict[str, Any]:
        import torch

        model = _moe_model(seed, experts=experts, k=k)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        usage: list[list[int]] = []

        def loss_fn(logits: Any, y: Any) -> Any:
            usage.append(list(model.usage))
            return ce(logits, y)

        trace = plain_loop(log_dir, model, opt, batches(*_moe_data(steps * batch, seed), batch), steps=steps,
                           loss_fn=loss_fn, set_to_none=set_to_none)
        used = (np.array(usage) > 0).mean(axis=0)
        idle_steps = {f"experts.{e}": [s for s, row in zip(trace.steps, usage, strict=True) if row[e] == 0]
                      for e in range(experts)}
        if used.min() < 0.5 or not any(idle_steps.values()):
            raise RuntimeError(f"expert usage outside the class (every expert at >= half of the steps, some idle): "
                               f"{used.round(2).tolist()}")
        return zoo_measure.healthy_labels(trace, rule, evidence={
            "tokens_per_expert_per_step": usage, "fraction_of_steps_used": used.round(3).tolist(),
            "idle_steps": idle_steps})

    case(half, name, rule)(run)


_moe_case(DESIGN, "torch_moe_top1", seed=431, experts=8, k=1, batch=8, set_to_none=True)
_moe_case(HELDOUT, "torch_moe_top2_zero_grads", seed=433, experts=12, k=2, batch=12, set_to_none=False)
_moe_case(HELDOUT, "torch_moe_top1_wide", seed=439, experts=6, k=1, batch=5, set_to_none=True, lr=1e-3)


# --- 3. trained to convergence under Adam/AdamW -------------------------------------------------------------------

CONVERGE_RULE = ("healthy: {what} under {optimizer}({lr:g}) on a fixed data set until the loss sits at its floor "
                 "(measured: the median loss of the last quarter of the steps at least 2 decades below the first "
                 "step's, the per-batch loss noisy there); a continuation of {more} steps does not diverge (every "
                 "loss finite, its median at most 10x the last quarter's, its largest below the first step's)")
TOKENS = 8


def _token_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Token sets whose class is a linear teacher's on the token with the largest first feature (attention has to
    find it)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, TOKENS, 16)).astype(np.float32)
    pick = x[np.arange(n), np.argmax(x[:, :, 0], axis=1)]
    return x, np.argmax(pick @ rng.standard_normal((16, CLASSES)), axis=1).astype(np.int64)


def _transformer(seed: int, *, layers: int, checkpoint: bool, width: int = 32) -> Any:
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint as ckpt

    torch.manual_seed(seed)

    class Classifier(nn.Module):
        """Token embedding, learned positions, ``layers`` pre-norm encoder layers (each under activation
        checkpointing when ``checkpoint``), mean pooling, a linear head."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(16, width)
            self.pos = nn.Parameter(0.02 * torch.randn(TOKENS, width))
            self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0,
                                                                   batch_first=True, norm_first=True)
                                        for _ in range(layers))
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, CLASSES)

        def forward(self, x: Any) -> Any:
            h = self.embed(x) + self.pos
            for block in self.blocks:
                h = ckpt(block, h, use_reentrant=False) if checkpoint and self.training else block(h)
            return self.head(self.norm(h).mean(1))

    return Classifier()


def _regression_mlp(seed: int, depth: int = 3, width: int = 64) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    layers: list[Any] = []
    for i in range(depth):
        layers += [nn.Linear(FEATURES if i == 0 else width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def _regression_targets(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A linear teacher plus a smaller tanh one on Gaussian inputs: realisable by the MLP, so the fit's loss has a
    floor far below its start."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, FEATURES)).astype(np.float32)
    w, v = rng.standard_normal((FEATURES, 1)), rng.standard_normal((FEATURES, 1))
    y = x @ w / math.sqrt(FEATURES) + 0.3 * np.tanh(x @ v / math.sqrt(FEATURES))
    return x, y.astype(np.float32)


def converged_labels(trace: Trace, continuation: Sequence[float], rule: str) -> dict[str, Any]:
    """The convergence rule (``CONVERGE_RULE``) checked on the loop's losses and its continuation's; raises where
    it does not hold."""
    loss = np.asarray(trace.loss)
    floor = float(np.median(loss[-len(loss) // 4:]))
    more = np.asarray(continuation)
    ok = (floor <= 1e-2 * loss[0] and np.isfinite(more).all() and np.median(more) <= 10 * floor
          and more.max() < loss[0])
    if not ok:
        raise RuntimeError(f"not converged, or the continuation diverged: first {loss[0]:.3g}, floor {floor:.3g}, "
                           f"continuation median {np.median(more):.3g} max {more.max():.3g}")
    q = loss[-len(loss) // 4:]
    return zoo_measure.healthy_labels(trace, rule, evidence={
        "loss_first": float(loss[0]), "floor_median_last_quarter": floor,
        "last_quarter_min_max": [float(q.min()), float(q.max())],
        "continuation_median_max": [float(np.median(more)), float(more.max())]})


def _converge_case(half: dict, name: str, *, what: str, build: Callable[[], Any], data: tuple[np.ndarray, np.ndarray],
                   loss_fn: Callable[[Any, Any], Any], optimizer: str, lr: float, steps: int, batch: int = 32,
                   more: int = 100) -> None:
    rule = CONVERGE_RULE.format(what=what, optimizer=optimizer, lr=lr, more=more)

    def run(log_dir: str) -> dict[str, Any]:
        import torch

        model = build()
        opt = getattr(torch.optim, optimizer)(model.parameters(), lr=lr)
        source = batches(*data, batch)
        trace = plain_loop(log_dir, model, opt, source, steps=steps, loss_fn=loss_fn)
        tail = plain_loop(None, model, opt, source, steps=more, loss_fn=loss_fn)  # the same training, on
        return converged_labels(trace, tail.loss, rule)

    case(half, name, rule)(run)


_converge_case(DESIGN, "torch_transformer_adamw_converged", what="a one-layer transformer classifier",
               build=lambda: _transformer(443, layers=1, checkpoint=False), data=_token_data(256, 443), loss_fn=ce,
               optimizer="AdamW", lr=3e-3, steps=300)
_converge_case(HELDOUT, "torch_regression_adam_converged", what="a tanh MLP regression",
               build=lambda: _regression_mlp(449), data=_regression_targets(512, 449), loss_fn=mse, optimizer="Adam",
               lr=1e-3, steps=300)
_converge_case(HELDOUT, "torch_transformer_checkpointed_converged",
               what="a two-layer transformer classifier under activation checkpointing",
               build=lambda: _transformer(457, layers=2, checkpoint=True), data=_token_data(192, 457), loss_fn=ce,
               optimizer="AdamW", lr=2e-3, steps=300)


# --- 4. mixed precision: the first steps overflow, unscale_ and clip_grad_norm_ before the recorder -----------------

AMP_RULE = ("healthy: float16 autocast with a GradScaler starting at {scale}, whose first steps overflow; the loop "
            "calls scaler.unscale_ and clip_grad_norm_({clip:g}) before the recorder (on an overflowed step the "
            "total norm is infinite, so clipping multiplies every gradient by 0: finite ones become 0, infinite "
            "ones NaN); measured: the steps the scaler skipped (its scale dropped, every weight bitwise unchanged) "
            "are the steps whose gradient was not finite; every other step applies; the loss falls (checked)")


def _amp_case(half: dict, name: str, *, build: Callable[[], Any], data: tuple[np.ndarray, np.ndarray],
              scale_log2: int, optimizer: str, lr: float, momentum: float = 0.0, clip: float = 1.0, steps: int = 60,
              batch: int = 32) -> None:
    rule = AMP_RULE.format(scale=f"2^{scale_log2}", clip=clip) + (
        f" ({optimizer}({lr:g}{f', momentum={momentum:g}' if momentum else ''}))")

    def run(log_dir: str) -> dict[str, Any]:
        import torch

        model = build()
        opt = getattr(torch.optim, optimizer)(model.parameters(), lr=lr, **({"momentum": momentum} if momentum else {}))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**scale_log2)
        rec = recorder(log_dir, model, opt, scaler=scaler)
        probe = Probe(list(model.named_parameters()))
        source = batches(*data, batch)
        scales, applied = [], []
        for s in range(1, steps + 1):
            xb, yb = next(source)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = ce(model(xb), yb)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            probe.before()
            scales.append(scaler.get_scale())
            applied.append(rec.step(s, loss=loss))
            probe.after(s, float(loss.detach()))
        rec.writer.close()
        trace = probe.finish()
        scales.append(scaler.get_scale())
        skipped = [s for s, a in zip(trace.steps, applied, strict=True) if not a]
        unchanged = [s for s, row in zip(trace.steps, trace.moved, strict=True) if not any(row)]
        overflowed = [s for s, row in zip(trace.steps, trace.states, strict=True) if "nonfinite" in row]
        dropped = [s for i, s in enumerate(trace.steps) if scales[i + 1] < scales[i]]
        if not skipped or not (skipped == unchanged == overflowed == dropped):
            raise RuntimeError(f"skipped {skipped}, unchanged {unchanged}, overflowed {overflowed}, scale dropped "
                               f"{dropped}: not the class")
        return zoo_measure.healthy_labels(trace, rule, evidence={"skipped_steps": skipped, "scale_per_step": scales})

    case(half, name, rule)(run)


def _amp_mlp(seed: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64),
                         nn.ReLU(), nn.Linear(64, CLASSES))


def _amp_cnn(seed: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(64, CLASSES))


def _nchw(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return np.transpose(x, (0, 3, 1, 2)).copy(), y.astype(np.int64)


_amp_case(DESIGN, "torch_amp_unscale_clip_mlp", build=lambda: _amp_mlp(461), data=teacher_data(60 * 32, 461),
          scale_log2=24, optimizer="Adam", lr=1e-3)
_amp_case(HELDOUT, "torch_amp_unscale_clip_cnn", build=lambda: _amp_cnn(463),
          data=_nchw(*image_data(100 * 32, 463, 16)), scale_log2=30, optimizer="SGD", lr=0.05, momentum=0.9,
          steps=100)
# The same recipe at two other seeds, each trained until its loss sits near float32's floor (1e-8 to 1e-6, its
# gradients at round-off of where they started): written to study gradients that rise out of round-off.
for _seed in (473, 475):
    _amp_case(DESIGN, f"torch_amp_unscale_clip_cnn_s{_seed}", build=lambda s=_seed: _amp_cnn(s),
              data=_nchw(*image_data(100 * 32, _seed, 16)), scale_log2=30, optimizer="SGD", lr=0.05, momentum=0.9,
              steps=100)


# --- 5. a GAN whose discriminator learns 100x too fast -----------------------------------------------------------

GAN_RULE = ("a GAN on a 2-D Gaussian, {optimizer} at lr {lr:g} for the generator and {d_lr:g} for the "
            "discriminator; this run records the {side}. Twins: the GAN with both at {lr:g}, 3 seeds (this run's "
            "among them). A layer is exploding from the step its weight norm leaves the twins' range if from there "
            "it doubles within 5 steps and never comes back below double (the doubling is the latest onset); "
            "doubtful if it reaches 1.5x otherwise; healthy otherwise. A run whose layers all stay healthy must "
            "learn: the energy distance between its samples and the data falls (checked). Measured per step: how "
            "much of each weight norm the update moves")
GAN_NOISE, GAN_BATCH = 8, 64


def _gan_data(n: int, seed: int) -> np.ndarray:
    """``n`` points of a correlated 2-D Gaussian away from the origin (where the generator starts)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, 2)) @ np.array([[0.6, 0.3], [0.0, 0.2]]) + np.array([1.5, -1.0])
            ).astype(np.float32)


def _energy_distance(a: np.ndarray, b: np.ndarray) -> float:
    """The energy distance between two samples (0 for equal distributions)."""
    def mean_dist(u: np.ndarray, v: np.ndarray) -> float:
        return float(np.mean(np.linalg.norm(u[:, None] - v[None], axis=-1)))

    return 2 * mean_dist(a, b) - mean_dist(a, a) - mean_dist(b, b)


def _gan(seed: int, *, width: int, optimizer: str, lr: float, d_lr: float, steps: int, side: str | None,
         log_dir: str | None) -> tuple[Trace, Trace, list[float]]:
    """Train the GAN (``seed``: the initialisation; the data and the noise are the same for every seed); ``side``
    (``"discriminator"``, ``"generator"`` or None) is recorded into ``log_dir``. Returns the probes' traces of the
    discriminator and the generator, and the energy distance to the data before and after training."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    gen = nn.Sequential(nn.Linear(GAN_NOISE, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                        nn.Linear(width, 2))
    disc = nn.Sequential(nn.Linear(2, width), nn.LeakyReLU(0.2), nn.Linear(width, width), nn.LeakyReLU(0.2),
                         nn.Linear(width, 1))
    kw = {"betas": (0.5, 0.999)} if optimizer == "Adam" else {}
    g_opt = getattr(torch.optim, optimizer)(gen.parameters(), lr=lr, **kw)
    d_opt = getattr(torch.optim, optimizer)(disc.parameters(), lr=d_lr, **kw)
    rec = None
    if side is not None:
        rec = recorder(log_dir, disc, d_opt) if side == "discriminator" else recorder(log_dir, gen, g_opt)
    pd, pg = Probe(list(disc.named_parameters())), Probe(list(gen.named_parameters()))
    real = torch.from_numpy(_gan_data(steps * GAN_BATCH, 7))
    noise = torch.Generator().manual_seed(11)
    held_noise = torch.randn(512, GAN_NOISE, generator=torch.Generator().manual_seed(13))
    held_data = _gan_data(512, 17)
    bce = nn.functional.binary_cross_entropy_with_logits

    def distance() -> float:
        with torch.no_grad():
            return _energy_distance(gen(held_noise).double().numpy(), held_data)

    def apply(s: int, loss: Any, probe: Probe, opt: Any, recorded: bool) -> None:
        """One side's optimizer step (through the recorder on the recorded side), measured by its probe."""
        loss.backward()
        probe.before()
        if recorded:
            rec.step(s, loss=loss)
        else:
            opt.step()
        probe.after(s, float(loss.detach()))

    before = distance()
    for s in range(1, steps + 1):
        xb = real[(s - 1) * GAN_BATCH:s * GAN_BATCH]
        z = torch.randn(GAN_BATCH, GAN_NOISE, generator=noise)
        d_opt.zero_grad()
        fake = gen(z).detach()
        apply(s, bce(disc(xb), torch.ones(GAN_BATCH, 1)) + bce(disc(fake), torch.zeros(GAN_BATCH, 1)), pd, d_opt,
              side == "discriminator")
        g_opt.zero_grad()
        apply(s, bce(disc(gen(z)), torch.ones(GAN_BATCH, 1)), pg, g_opt, side == "generator")
    if rec is not None:
        rec.writer.close()
    return pd.finish(), pg.finish(), [before, distance()]


def gan_labels(trace: Trace, twins: Sequence[Trace], rule: str, learned: Sequence[float]) -> dict[str, Any]:
    """The GAN rule (``GAN_RULE``) on one side's trace against its twins' traces of the same side."""
    groups = zoo_cases.groups(trace.names)
    mains = {g: trace.names[idx[0]] for g, idx in groups.items()}  # a Linear's weight, then its bias
    dep = zoo_measure.weight_departures(trace, twins, list(mains.values()))
    starts, latest = {}, {}
    doubtful = []
    for g, idx in groups.items():
        w = trace.column(mains[g])
        blow = zoo_measure.blow_up(trace.steps, w, dep[mains[g]])
        for i in idx:
            starts[trace.names[i]] = dep[mains[g]] if blow is not None else None
            latest[trace.names[i]] = blow
        if zoo_measure.near_blow_up(w, trace.steps, dep[mains[g]]):
            doubtful += [trace.names[i] for i in idx]
    moved = np.asarray(trace.moved)
    evidence = {"weight_departures": dep, "doubled_at": {mains[g]: latest[mains[g]] for g in groups},
                "update_over_weight_per_step": {n: [round(float(v), 6) for v in moved[:, i]]
                                                for i, n in enumerate(trace.names)},
                "weight_norm_per_step": {n: [round(v, 4) for v in trace.column(n).tolist()] for n in mains.values()},
                "twin_weight_norm_range_last": {n: [min(t.column(n)[-1] for t in twins),
                                                    max(t.column(n)[-1] for t in twins)] for n in mains.values()},
                "energy_distance_before_after": list(learned)}
    if not any(starts.values()):
        labels = zoo_measure.healthy_labels(trace, rule, evidence=evidence, learned=(learned[0], learned[1])) \
            if not doubtful else zoo_measure.cause_labels(trace, {}, "healthy", rule, evidence=evidence)
    else:
        labels = zoo_measure.cause_labels(trace, starts, "exploding", rule, latest=latest, evidence=evidence)
        labels["latest_onset"] = max(v for v in latest.values() if v is not None)
    for n in doubtful:
        labels["layers"][n]["doubtful"] = True
    return labels


def _gan_case(half: dict, name: str, *, side: str, seed: int, width: int, optimizer: str, lr: float,
              d_factor: float, steps: int) -> None:
    rule = GAN_RULE.format(optimizer=optimizer, lr=lr, d_lr=lr * d_factor, side=side)

    def run(log_dir: str) -> dict[str, Any]:
        kw = {"width": width, "optimizer": optimizer, "lr": lr, "steps": steps}
        twins = [_gan(s, d_lr=lr, side=None, log_dir=None, **kw) for s in (seed, seed + 1, seed + 2)]
        d, g, learned = _gan(seed, d_lr=lr * d_factor, side=side, log_dir=log_dir, **kw)
        k = 0 if side == "discriminator" else 1
        return gan_labels((d, g)[k], [t[k] for t in twins], rule, learned)

    case(half, name, rule)(run)


for _half, _prefix, _seed, _width in ((DESIGN, "torch_gan", 467, 64), (HELDOUT, "torch_gan_w48", 479, 48)):
    for _side in ("discriminator", "generator"):
        _gan_case(_half, f"{_prefix}_{_side}", side=_side, seed=_seed, width=_width, optimizer="Adam", lr=1e-3,
                  d_factor=1.0, steps=300)
        _gan_case(_half, f"{_prefix}_fast_d_{_side}", side=_side, seed=_seed, width=_width, optimizer="Adam",
                  lr=1e-3, d_factor=100.0, steps=300)
# A generator whose loss, under the fast discriminator, drops by decades for one step and comes back to where it
# stood (the discriminator fooled for a batch, then not): written to study a swing that is a dip, not a rise.
_gan_case(DESIGN, "torch_gan_w96_fast_d_generator", side="generator", seed=521, width=96, optimizer="Adam", lr=1e-3,
          d_factor=100.0, steps=300)


# --- 8. a learning rate that grows until NaN ----------------------------------------------------------------------

GROWING_RULE = ("a small LeakyReLU CNN under SGD(momentum 0.9) whose learning rate grows {growth:g}x a step "
                "from {lr:g} (LambdaLR), until 3 steps after its first NaN loss; twins: the same CNN at the "
                "constant {lr:g}, 3 seeds (this run's among them). Every variable is exploding from the first step "
                "its gradient norm or update/weight leaves the twins' range, at the latest from the loss label (the "
                "first step whose loss is 10x its running minimum), then nonfinite from its first NaN/Inf gradient "
                "(measured); first_nan: the first NaN/Inf loss or gradient; diverges")


def _small_cnn(seed: int, channels: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    # LeakyReLU: no unit dies on the way up, so the growing steps reach float32's overflow
    return nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.LeakyReLU(0.1), nn.MaxPool2d(2),
                         nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.LeakyReLU(0.1), nn.AdaptiveAvgPool2d(2),
                         nn.Flatten(), nn.Linear(8 * channels, CLASSES))


def _growing_lr_case(half: dict, name: str, *, seed: int, channels: int, lr: float, growth: float = 1.3,
                     steps: int = 80) -> None:
    rule = GROWING_RULE.format(growth=growth, lr=lr) + f" ({channels} channels)"

    def run(log_dir: str) -> dict[str, Any]:
        import torch

        data = _nchw(*image_data(steps * 32, seed, 16))

        def train(d: str | None, s: int, grow: bool) -> Trace:
            model = _small_cnn(s, channels)
            opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: growth**k) if grow else None
            return plain_loop(d, model, opt, batches(*data, 32), steps=steps, loss_fn=ce, scheduler=sched,
                              stop_after_nan=3 if grow else None)

        with tempfile.TemporaryDirectory() as keep:
            twins = [os.path.join(keep, str(s)) for s in (seed, seed + 1, seed + 2)]
            for d, s in zip(twins, (seed, seed + 1, seed + 2), strict=True):
                train(d, s, grow=False)
            trace = train(log_dir, seed, grow=True)
            dep = zoo_cases.twin_departures(log_dir, twins)
        loss_label = zoo_measure.loss_over_running_min(trace.steps, trace.loss)
        nan = zoo_measure.first_nonfinite(trace)
        if loss_label is None or all(v is None for v in nan.values()):
            raise RuntimeError(f"the growing learning rate did not diverge: loss label {loss_label}, NaN {nan}")
        starts = {n: min(d, loss_label) if d is not None else loss_label for n, d in dep.items()}
        labels = zoo_measure.cause_labels(trace, starts, "exploding", rule,
                                          latest=dict.fromkeys(trace.names, loss_label), culprits=trace.names,
                                          latest_onset=loss_label)
        labels["diverges"] = True
        labels["evidence"] = {"departures": dep, "loss_label": loss_label, "loss": trace.loss,
                              "first_nonfinite_gradient": nan}
        return labels

    case(half, name, rule)(run)


_growing_lr_case(DESIGN, "torch_growing_lr_cnn", seed=487, channels=8, lr=1e-3)
_growing_lr_case(HELDOUT, "torch_growing_lr_cnn_wide", seed=491, channels=16, lr=3e-4)
