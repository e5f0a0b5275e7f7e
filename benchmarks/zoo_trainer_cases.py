"""The zoo's runs through a trainer (``benchmarks/diagnosis_zoo.py``): a Lightning GRU language model and a
Hugging Face ``Trainer`` GPT-2, each recorded by the project's callback at every step (``every=1``), trained in a
child process (``benchmarks/zoo_child.py``).

* **An unrecovered divergence, recurrent** (Lightning): a GRU language model under SGD at lr 20 without gradient
  clipping, beside its twins with ``gradient_clip_val`` (the recipe of PyTorch's word language model). The
  unclipped run is exploding from its departure from the clipped twins; whether its loss came back is measured
  (``"recovered"``). The clipped run is healthy.
* **Clipped and unclipped twins** (Hugging Face): a tiny GPT-2 under SGD at a high lr with ``max_grad_norm=1.0``
  and without clipping: bit-identical until the first step whose gradient norm exceeds the clip. That prefix is
  measured by comparing the two runs' records and losses (``"identical_until"``); the clipped run is healthy, the
  unclipped one labelled by its own measured outcome.

Labels come from the runs' measurements (``benchmarks/zoo_measure.py``), never from the diagnosis. Lightning,
transformers and torch are imported inside the functions.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks import zoo_cases, zoo_heldout, zoo_measure
from benchmarks.zoo_child import case
from benchmarks.zoo_measure import Trace
from benchmarks.zoo_torch_loop import Probe

DESIGN, HELDOUT = zoo_cases.CASES, zoo_heldout.CASES


def markov_text(n: int, vocab: int, seed: int) -> np.ndarray:
    """``n`` tokens of a random first-order Markov chain whose every token has 3 likely successors: a language a
    small model learns (its entropy is far below ``log(vocab)``). The successors are three permutations of the
    vocabulary, so every token is as frequent as any other."""
    rng = np.random.default_rng(seed)
    nxt = np.stack([rng.permutation(vocab) for _ in range(3)], axis=1)
    p = np.array([0.6, 0.25, 0.15])
    out = np.empty(n, np.int64)
    out[0] = 0
    for i in range(1, n):
        out[i] = nxt[out[i - 1], rng.choice(3, p=p)] if rng.random() > 0.05 else rng.integers(0, vocab)
    return out


# --- 6. an unrecovered divergence in a Lightning GRU language model -----------------------------------------------

GRU_RULE = ("a GRU language model (Lightning, SGD at lr {lr:g}, batch {batch} x {bptt} tokens of a Markov-chain "
            "language) {clip}; twins: the run with gradient_clip_val={twin_clip:g}, 3 seeds (this run's among "
            "them). {label}")
GRU_SICK = ("Every variable is exploding from the first step its gradient norm or update/weight leaves the clipped "
            "twins' range, at the latest from the loss label (the first step from which the loss stays above every "
            "twin's); NaN/Inf as measured. recovered: the mean loss of the last quarter of the steps at or below "
            "its mean over the steps before the episode (measured; the twins' last quarter and the weights' "
            "movement beside)")
GRU_HEALTHY = "Healthy: the loss falls and ends at or below the unclipped run's (checked)"


def _gru_run(log_dir: str, *, seed: int, clip: float | None, lr: float, steps: int, vocab: int, hidden: int,
             batch: int, bptt: int, text: np.ndarray) -> Trace:
    """Train the GRU LM with Lightning for ``steps`` optimizer steps (from step 0), recorded at every step into
    ``log_dir`` by :class:`tb_gradhealth.lightning.GradHealth`; returns what its probe measured."""
    import lightning.pytorch as pl
    import torch
    from torch import nn

    from tb_gradhealth.lightning import GradHealth

    torch.manual_seed(seed)

    class LanguageModel(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, 32)
            self.gru = nn.GRU(32, hidden, batch_first=True)
            self.out = nn.Linear(hidden, vocab)

        def training_step(self, batch: Any, _: int) -> Any:
            x, y = batch
            h, _ = self.gru(self.embed(x))
            return nn.functional.cross_entropy(self.out(h).reshape(-1, vocab), y.reshape(-1))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=lr)

    class Measure(pl.Callback):
        """The probe at Lightning's hooks: the gradient state and weights before the step, the move after."""

        def on_train_start(self, trainer: Any, module: Any) -> None:
            self.probe = Probe(list(module.named_parameters()))

        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            self.step = trainer.global_step
            self.probe.before()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.probe.after(self.step, float(outputs["loss"]))

    tokens = torch.from_numpy(text)
    n = (len(tokens) - 1) // (batch * bptt) * batch * bptt
    xs = tokens[:n].reshape(batch, -1).unfold(1, bptt, bptt).transpose(0, 1)
    ys = tokens[1:n + 1].reshape(batch, -1).unfold(1, bptt, bptt).transpose(0, 1)
    loader = torch.utils.data.DataLoader(list(zip(xs, ys, strict=True)), batch_size=None, shuffle=False)
    measure = Measure()
    trainer = pl.Trainer(max_steps=steps, gradient_clip_val=clip, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[GradHealth(log_dir, every=1), measure], default_root_dir=log_dir)
    model = LanguageModel()
    trainer.fit(model, loader)
    return measure.probe.finish()


def _gru_case(half: dict, name: str, *, seed: int, clipped: bool, lr: float = 20.0, clip: float = 0.25,
              steps: int = 120, vocab: int = 32, hidden: int = 64, batch: int = 20, bptt: int = 35) -> None:
    rule = GRU_RULE.format(lr=lr, batch=batch, bptt=bptt, twin_clip=clip,
                           clip=f"with gradient_clip_val={clip:g}" if clipped else "without gradient clipping",
                           label=GRU_HEALTHY if clipped else GRU_SICK) + f" ({hidden} units)"
    kw = {"lr": lr, "steps": steps, "vocab": vocab, "hidden": hidden, "batch": batch, "bptt": bptt}

    def run(log_dir: str) -> dict[str, Any]:
        text = markov_text(batch * bptt * steps + 1, vocab, seed)
        with tempfile.TemporaryDirectory() as keep:
            if clipped:
                trace = _gru_run(log_dir, seed=seed, clip=clip, text=text, **kw)
                other = _gru_run(os.path.join(keep, "unclipped"), seed=seed, clip=None, text=text, **kw)
                return _clipped_labels(trace, other, rule, ends_below=True)
            twin_dirs = [os.path.join(keep, str(s)) for s in (seed, seed + 1, seed + 2)]
            twins = [_gru_run(d, seed=s, clip=clip, text=text, **kw)
                     for d, s in zip(twin_dirs, (seed, seed + 1, seed + 2), strict=True)]
            trace = _gru_run(log_dir, seed=seed, clip=None, text=text, **kw)
            dep = zoo_cases.twin_departures(log_dir, twin_dirs)
        return unrecovered_labels(trace, twins, dep, rule)

    case(half, name, rule)(run)


def _clipped_labels(trace: Trace, unclipped: Trace, rule: str, *, ends_below: bool) -> dict[str, Any]:
    """The clipped twin: healthy when it learns and (``ends_below``) ends at or below the unclipped run's loss
    (checked); the two losses' last quarters are kept beside."""
    k = max(1, len(trace.loss) // 4)
    own, other = float(np.mean(trace.loss[-k:])), float(np.mean(unclipped.loss[-k:]))
    if ends_below and not own <= other:
        raise RuntimeError(f"the clipped run ends above the unclipped one: {own:.3g} > {other:.3g}")
    return zoo_measure.healthy_labels(trace, rule, evidence={"loss_last_quarter": own,
                                                             "unclipped_loss_last_quarter": other})


def unrecovered_labels(trace: Trace, twins: Sequence[Trace], dep: dict[str, int | None], rule: str
                       ) -> dict[str, Any]:
    """A global cause (a learning rate without clipping) labelled from its twins: every variable exploding from its
    departure, at the latest from the loss label; ``recovered`` measured (:func:`zoo_measure.recovery`)."""
    loss_label = zoo_cases.loss_departure(trace.loss, [t.loss for t in twins])
    if loss_label is None:
        raise RuntimeError("the unclipped run's loss never left its clipped twins'")
    loss_label = trace.steps[loss_label - 1]  # loss_departure counts steps from 1
    starts = {n: min(d, loss_label) if d is not None else loss_label for n, d in dep.items()}
    labels = zoo_measure.cause_labels(trace, starts, "exploding", rule, latest=dict.fromkeys(trace.names, loss_label),
                                      culprits=trace.names, latest_onset=loss_label)
    rec = zoo_measure.recovery(trace, labels["onset"])
    labels["recovered"] = rec["recovered"]
    labels["diverges"] = labels["first_nan"] is not None
    k = max(1, len(trace.loss) // 4)
    moved = {n: zoo_cases.rel_change(a, b) for n, a, b in zip(trace.names, trace.w_start, trace.w_end, strict=True)}
    twin_moved = {n: [zoo_cases.rel_change(t.w_start[i], t.w_end[i]) for t in twins]
                  for i, n in enumerate(trace.names)}
    labels["evidence"] = {**rec, "departures": dep, "loss_label": loss_label,
                          "twin_loss_last_quarter": [float(np.mean(t.loss[-k:])) for t in twins],
                          "weight_rel_change": moved, "twin_weight_rel_change": twin_moved, "loss": trace.loss}
    return labels


_gru_case(DESIGN, "lightning_gru_lm_unclipped", seed=503, clipped=False)
_gru_case(DESIGN, "lightning_gru_lm_clipped", seed=503, clipped=True)
_gru_case(HELDOUT, "lightning_gru_lm_unclipped_h96", seed=509, clipped=False, hidden=96, bptt=30)
_gru_case(HELDOUT, "lightning_gru_lm_clipped_h96", seed=509, clipped=True, hidden=96, bptt=30)


# --- 7. clipped and unclipped twins under the Hugging Face Trainer ------------------------------------------------

GPT2_RULE = ("a tiny GPT-2 ({layers} layers, width {width}; Hugging Face Trainer, SGD at lr {lr:g}, batch {batch} x "
             "{ctx} tokens of a Markov-chain language) {clip}. {label}")
GPT2_CLIPPED = "Healthy: the twin with clipping; the loss falls (checked)"
GPT2_UNCLIPPED = ("identical_until: the last step up to which its records and losses are bitwise those of the twin "
                  "with max_grad_norm=1.0 (measured). Labelled by its own outcome: if its loss leaves the clipped "
                  "twins' (3 seeds, this run's among them) for good, every variable is exploding from its departure "
                  "from their range, at the latest from that loss label, with recovered measured (the mean loss of "
                  "the last quarter at or below its mean before the episode); otherwise healthy (the loss falls, "
                  "checked)")


def _gpt2_run(log_dir: str, *, seed: int, max_grad_norm: float, lr: float, steps: int, width: int, layers: int,
              vocab: int, batch: int, ctx: int, text: np.ndarray) -> tuple[Trace, list[float]]:
    """Train the tiny GPT-2 with ``transformers.Trainer`` (``max_grad_norm`` 0: no clipping) for ``steps`` steps,
    recorded at every step into ``log_dir`` by :class:`tb_gradhealth.transformers.GradHealthCallback`; the data's
    order is the same for every ``seed`` (which sets the initialisation). Returns what its probe measured and the
    gradient norm before clipping that Trainer logs at every step."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    from tb_gradhealth.transformers import GradHealthCallback

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab, n_positions=ctx, n_embd=width, n_layer=layers, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    chunks = torch.from_numpy(text[:len(text) // ctx * ctx]).reshape(-1, ctx)
    data = [{"input_ids": c, "labels": c} for c in chunks]
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    constant = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)

    class Measure(TrainerCallback):
        """The probe after clipping, just before the optimizer step; the loss and the gradient norm before clipping
        that Trainer logs at every step."""

        grad_norm: list[float] = []

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.probe = Probe(list(kw["model"].named_parameters()))

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.probe.before()

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.probe.after(state.global_step, float("nan"))

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "loss" in logs:
                self.probe.trace.loss[-1] = float(logs["loss"])
                self.grad_norm.append(float(logs["grad_norm"]))

    measure = Measure()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=batch, logging_steps=1,
                                 logging_nan_inf_filter=False, max_grad_norm=max_grad_norm, report_to=[],
                                 save_strategy="no", seed=seed, data_seed=0, use_cpu=True, disable_tqdm=True,
                                 dataloader_num_workers=0)
        trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, constant),
                          callbacks=[GradHealthCallback(log_dir, every=1), measure])
        trainer.remove_callback(PrinterCallback)  # the logs of every step, printed
        trainer.train()
    return measure.probe.finish(), measure.grad_norm


def _gpt2_case(half: dict, name: str, *, seed: int, clipped: bool, lr: float, steps: int = 80, width: int = 16,
               layers: int = 2, vocab: int = 48, batch: int = 8, ctx: int = 32) -> None:
    rule = GPT2_RULE.format(layers=layers, width=width, lr=lr, batch=batch, ctx=ctx,
                            clip="with max_grad_norm=1.0" if clipped else "without clipping (max_grad_norm=0)",
                            label=GPT2_CLIPPED if clipped else GPT2_UNCLIPPED)
    kw = {"lr": lr, "steps": steps, "width": width, "layers": layers, "vocab": vocab, "batch": batch, "ctx": ctx}

    def run(log_dir: str) -> dict[str, Any]:
        text = markov_text(batch * ctx * steps, vocab, seed)
        with tempfile.TemporaryDirectory() as keep:
            if clipped:
                trace, _ = _gpt2_run(log_dir, seed=seed, max_grad_norm=1.0, text=text, **kw)
                other, _ = _gpt2_run(os.path.join(keep, "unclipped"), seed=seed, max_grad_norm=0.0, text=text, **kw)
                return _clipped_labels(trace, other, rule, ends_below=False)
            twin_dirs = [os.path.join(keep, str(s)) for s in (seed, seed + 1, seed + 2)]
            runs = [_gpt2_run(d, seed=s, max_grad_norm=1.0, text=text, **kw)
                    for d, s in zip(twin_dirs, (seed, seed + 1, seed + 2), strict=True)]
            twins, twin_norm = [t for t, _ in runs], runs[0][1]
            trace, _ = _gpt2_run(log_dir, seed=seed, max_grad_norm=0.0, text=text, **kw)
            prefix = zoo_measure.identical_until(zoo_measure.read_run(log_dir), zoo_measure.read_run(twin_dirs[0]))
            dep = zoo_cases.twin_departures(log_dir, twin_dirs)
        if zoo_cases.loss_departure(trace.loss, [t.loss for t in twins]) is not None:
            labels = unrecovered_labels(trace, twins, dep, rule)
        else:
            labels = zoo_measure.healthy_labels(trace, rule)
        labels["identical_until"] = prefix
        # beside it, where Trainer's own gradient norm (before clipping) first exceeded the clip in the twin
        labels["evidence"]["twin_first_step_over_the_clip"] = next(
            (s for s, g in zip(twins[0].steps, twin_norm, strict=True) if g > 1.0), None)
        return labels

    case(half, name, rule)(run)



for _half, _name, _kw in ((DESIGN, "hf_gpt2_sgd", {"seed": 521, "lr": 5.0}),
                          (DESIGN, "hf_gpt2_sgd_s563", {"seed": 563, "lr": 4.0}),
                          (HELDOUT, "hf_gpt2_sgd_s547", {"seed": 547, "lr": 4.0}),
                          (HELDOUT, "hf_gpt2_sgd_w24", {"seed": 547, "lr": 3.0, "width": 24})):
    _gpt2_case(_half, f"{_name}_unclipped", clipped=False, **_kw)
    _gpt2_case(_half, f"{_name}_clipped", clipped=True, **_kw)
