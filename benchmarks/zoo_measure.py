"""Labels of the zoo's child-process cases (``benchmarks/zoo_child.py``) from what their loops measured: numpy only.

A :class:`Trace` is what a loop measured with its own framework beside the writer, step by step: the loss, each
parameter's gradient as the optimizer received it (``none``, ``nonfinite``, ``zero``, ``live``), its weight norm
before the step and how much of it the step moved. The rules below turn it into labels; none reads the diagnosis or
its constants:

* **healthy** (:func:`healthy_labels`): every loss finite and the mean of the last tenth of the steps below that of
  the first tenth; every trained parameter moved; every frozen parameter bitwise unchanged (labelled ``frozen``).
* **departure** (:func:`weight_departures`, ``zoo_cases.twin_departures``): a variable's first step outside the
  range of its healthy twins (``[min, max]`` over their seeds at the same step).
* **blow-up** (:func:`blow_up`): from its departure, a weight norm reaches twice its value before the departure
  within :data:`FEW` steps and never comes back below it; one that reaches 1.5x without that is doubtful
  (:func:`near_blow_up`).
* **loss label** (:func:`loss_over_running_min`): the first step whose loss is ``factor`` times its running minimum
  (a non-finite loss counts).
* **recovery** (:func:`recovery`): after an episode, the loss came back when the mean of its last quarter is at or
  below the mean of its steps before the episode.
* **identical prefix** (:func:`identical_until`): the last step up to which two runs logged bitwise equal records and
  losses.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks.zoo_cases import _chain

#: A blow-up doubles a weight norm within this many steps of its departure.
FEW = 5
SICK = ("vanishing", "exploding", "dead", "nonfinite")


@dataclass
class Trace:
    """What a loop measured per step (rows) and parameter (columns), beside its gradient-health records."""

    names: list[str]
    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    #: the gradient the optimizer received: "none" (no gradient), "nonfinite", "zero" (exactly), "live"
    states: list[list[str]] = field(default_factory=list)
    #: weight norms before each step
    wnorm: list[list[float]] = field(default_factory=list)
    #: ||w_after - w_before|| / ||w_before|| of each step (0: the step left the parameter bitwise unchanged)
    moved: list[list[float]] = field(default_factory=list)
    w_start: list[np.ndarray] = field(default_factory=list)
    w_end: list[np.ndarray] = field(default_factory=list)

    def add(self, step: int, loss: float, states: Sequence[str], wnorm: Sequence[float], moved: Sequence[float]
            ) -> None:
        self.steps.append(int(step))
        self.loss.append(float(loss))
        self.states.append(list(states))
        self.wnorm.append([float(v) for v in wnorm])
        self.moved.append([float(v) for v in moved])

    def column(self, name: str, what: str = "wnorm") -> np.ndarray:
        """One parameter's series of ``wnorm`` or ``moved``."""
        return np.array(getattr(self, what), dtype=np.float64)[:, self.names.index(name)]

    def state_counts(self) -> dict[str, dict[str, int]]:
        """Per parameter, how many steps its gradient was in each state (evidence beside a label)."""
        out: dict[str, dict[str, int]] = {}
        for i, n in enumerate(self.names):
            col = [row[i] for row in self.states]
            out[n] = {st: col.count(st) for st in ("none", "nonfinite", "zero", "live") if st in col}
        return out


def tenths(loss: Sequence[float]) -> tuple[float, float]:
    """Mean loss of the first and of the last tenth of the steps."""
    x = np.asarray(loss, dtype=np.float64)
    k = max(1, x.size // 10)
    return float(x[:k].mean()), float(x[-k:].mean())


def healthy_labels(trace: Trace, rule: str, *, frozen: Sequence[str] = (), evidence: Mapping[str, Any] | None = None,
                   learned: tuple[float, float] | None = None) -> dict[str, Any]:
    """The healthy rule (module docstring); raises where the run does not satisfy it (the label would be a guess).
    ``learned``: what shows learning where the loss cannot (a GAN's), as ``(before, after)`` of a distance that
    falls as the model learns; by default the loss's first and last tenth."""
    first, last = tenths(trace.loss) if learned is None else learned
    if not (np.isfinite(trace.loss).all() and last < first):
        raise RuntimeError(f"a run labelled healthy did not learn: {first:.3g} -> {last:.3g}")
    layers = {}
    for i, n in enumerate(trace.names):
        same = np.array_equal(trace.w_start[i], trace.w_end[i])
        if n in frozen and not same:
            raise RuntimeError(f"{n} is frozen but its weights changed")
        if n not in frozen and same:
            raise RuntimeError(f"{n} is trained but its weights never changed")
        layers[n] = {"status": "frozen" if n in frozen else "healthy", "onset": None}
    return {"sick": False, "layers": layers, "culprits": [], "onset": None, "first_nan": None, "diverges": False,
            "rule": rule, "evidence": {"loss_first_last_tenth": list(tenths(trace.loss)), "learned": [first, last],
                                       "gradient_states": trace.state_counts(), **(evidence or {})}}


def weight_departures(trace: Trace, twins: Sequence[Trace], names: Sequence[str]) -> dict[str, int | None]:
    """Per variable of ``names``, the first step at which its weight norm lies outside its twins' ``[min, max]`` at
    that step (a non-finite norm counts as outside); None: never."""
    out: dict[str, int | None] = {}
    for n in names:
        own = trace.column(n)
        band = np.array([[t.column(n)[t.steps.index(s)] if s in t.steps else np.nan for t in twins]
                         for s in trace.steps])
        out[n] = next((s for s, x, b in zip(trace.steps, own, band, strict=True)
                       if np.isfinite(b).any() and not (np.nanmin(b) <= x <= np.nanmax(b))), None)
    return out


def blow_up(steps: Sequence[int], wnorm: np.ndarray, departure: int | None) -> int | None:
    """The blow-up rule (module docstring): the step the weight norm first reaches twice its value before
    ``departure``, if that is within :data:`FEW` steps of it and the norm never comes back below; else None."""
    if departure is None:
        return None
    i = list(steps).index(departure)
    base = wnorm[max(i - 1, 0)]
    above = ~(wnorm < 2.0 * base)  # NaN counts as above
    hit = next((j for j in range(i, len(steps)) if above[j]), None)
    if hit is None or hit - i > FEW or not above[hit:].all():
        return None
    return int(steps[hit])


def near_blow_up(wnorm: np.ndarray, steps: Sequence[int], departure: int | None) -> bool:
    """Whether a weight norm that left its twins' range reached 1.5x its value before ``departure`` at some step
    without satisfying the blow-up rule: within reach of the rule's threshold, a doubtful label."""
    if departure is None or blow_up(steps, wnorm, departure) is not None:
        return False
    i = list(steps).index(departure)
    after = wnorm[i:]
    return bool(np.any(~(after < 1.5 * wnorm[max(i - 1, 0)])))


def loss_over_running_min(steps: Sequence[int], loss: Sequence[float], factor: float = 10.0) -> int | None:
    """The first step whose loss is at least ``factor`` times the minimum of the losses before it (NaN counts)."""
    x = np.asarray(loss, dtype=np.float64)
    for j in range(1, x.size):
        low = np.nanmin(x[:j]) if np.isfinite(x[:j]).any() else math.nan
        if not np.isfinite(x[j]) or x[j] >= factor * low:
            return int(steps[j])
    return None


def first_nonfinite(trace: Trace) -> dict[str, int | None]:
    """Per variable, the first step whose gradient was NaN/Inf (or whose loss was: backprop of a NaN loss is NaN)."""
    out: dict[str, int | None] = {}
    for i, n in enumerate(trace.names):
        out[n] = next((s for s, row, v in zip(trace.steps, trace.states, trace.loss, strict=True)
                       if row[i] == "nonfinite" or not math.isfinite(v)), None)
    return out


def cause_labels(trace: Trace, starts: Mapping[str, int | None], status: str, rule: str, *,
                 latest: Mapping[str, int | None] | None = None, culprits: Sequence[str] | None = None,
                 **extra: Any) -> dict[str, Any]:
    """Labels of variables sick with ``status`` from their start (None: healthy), NaN/Inf from the step measured;
    ``latest``: per variable the latest acceptable onset (a global cause's loss label)."""
    nan = first_nonfinite(trace)
    layers: dict[str, Any] = {}
    for n in trace.names:
        start = starts.get(n)
        st = [("nonfinite" if nan[n] is not None and s >= nan[n] else
               status if start is not None and s >= start else "healthy") for s in trace.steps]
        entry = _chain(trace.steps, st)
        late = (latest or {}).get(n)
        if start is not None and late is not None and late > start and entry["status"] == status:
            entry["latest_onset"] = late
        layers[n] = entry
    sick = [n for n, e in layers.items() if e["status"] in SICK]
    nan_steps = [s for s in nan.values() if s is not None]
    return {"sick": bool(sick), "layers": layers,
            "culprits": list(culprits) if culprits is not None else [n for n in trace.names if starts.get(n)],
            "onset": min((e["onset"] for e in layers.values() if e["status"] in SICK), default=None),
            "first_nan": min(nan_steps) if nan_steps else None, "diverges": False, "rule": rule, **extra}


def recovery(trace: Trace, episode: int) -> dict[str, Any]:
    """Whether the loss came back after an episode that began at step ``episode`` (module docstring), with the
    figures it was measured from."""
    x = np.asarray(trace.loss, dtype=np.float64)
    i = trace.steps.index(episode)
    before = float(np.mean(x[:max(i, 1)]))
    q = x[-max(1, x.size // 4):]
    last = float(np.mean(q)) if np.isfinite(q).all() else math.inf
    return {"recovered": bool(last <= before), "loss_before_episode": before, "loss_last_quarter": last}


def identical_until(a: tuple[Sequence[int], np.ndarray, Mapping[int, float]],
                    b: tuple[Sequence[int], np.ndarray, Mapping[int, float]]) -> int | None:
    """The last step up to which two runs logged bitwise equal records and losses: each run is ``(steps, records
    [S, L, F], {step: loss})`` as read back from its event files. None: they differ at their first step."""
    steps_a, rec_a, loss_a = a
    steps_b, rec_b, loss_b = b
    last = None
    for i, s in enumerate(steps_a):
        if i >= len(steps_b) or steps_b[i] != s or rec_a[i].shape != rec_b[i].shape:
            break
        la, lb = loss_a.get(s), loss_b.get(s)
        same_loss = la == lb or (la is not None and lb is not None and math.isnan(la) and math.isnan(lb))
        if not (np.array_equal(rec_a[i], rec_b[i], equal_nan=True) and same_loss):
            break
        last = int(s)
    return last


def read_run(log_dir: str) -> tuple[list[int], np.ndarray, dict[int, float]]:
    """``(steps, records, {step: loss})`` of the one gradient-health run under ``log_dir``, as the scorer reads it."""
    from tb_gradhealth import progress, reader

    runs = [r for r in reader.read_logdir(log_dir).runs if r.num_steps]
    if len(runs) != 1:
        raise RuntimeError(f"{log_dir}: expected one gradient-health run, got {[r.run for r in runs]}")
    loss = progress.read_loss(progress.run_paths(reader.find_runs(log_dir), runs[0].run))
    by_step = {} if loss is None else {int(s): float(v) for s, v in zip(*loss, strict=True)}
    return [int(s) for s in runs[0].steps], runs[0].records, by_step
