"""A labelled zoo of small real trainings, and a scorer of the diagnosis against its labels.

Each case of ``benchmarks/zoo_cases.py`` trains a small TF/Keras network on CPU, writes its gradient-health records
with the project's writers and its raw per-step training loss (scalar ``loss``) into one run directory, and saves
``labels.json`` there: per-layer ground truth derived from what each layer *does* (weight change over the run,
structure, injected faults, the raw loss), never from the diagnosis. The rule of each case is written next to it.
The PyTorch, Lightning, Hugging Face and JAX cases (``benchmarks/zoo_child.py``) train in a child process without
TensorFlow and leave the same run directory and labels.

The scorer reads every run back as ``tb-gradhealth report`` reads it: its records with
:func:`tb_gradhealth.reader.read_logdir`, the layers' kinds and the training loop with them, the loss and the
optimizer's skipped steps (:func:`tb_gradhealth.progress.read_progress`) and where a writer's replay found the first
NaN/Inf made (:func:`tb_gradhealth.origin.read_logdir`). It diagnoses the run at every logged step with the one
function behind the report, the tab and ``stop_on`` (``report --step S`` at each logged step ``S``) and prints:

(a) per status, precision and recall over (layer, logged step) pairs, pooled over all runs;
(b) per healthy run, the layers flagged at the last step and at any step, and those with a flagged episode in the
    diagnosis at any step (a past alarm in the timeline counts: a healthy run must have none);
(c) per sick run, rank #1 and ``first_bad``, whether each is a variable of a labelled culprit's layer and whether
    they agree;
(d) onset errors in logged steps, and for a global cause the detection lead over the loss;
(e) a ``stop_on=("nonfinite", "exploding")`` simulation: false halts on healthy runs, and for divergences the lead
    (logged steps between the halt and the first NaN);
(i) live = replay: the run's events fed into :class:`tb_gradhealth.live.LiveRun` in the order they were written, and
    at each logged step ``S``, once every event of a step <= ``S`` is in, the live diagnosis against the replay's at
    ``S`` (the answer, every layer's status and episodes): the first mismatch of each run;
(j) a stable cause: logged steps whose answer replaces the previous step's cause by a weaker one (see
    :func:`cause_violations`);
(f) the goals, PASS/FAIL with the measured figure; among them, runs labelled ``"recovered": false`` that read ok
    (no layer flagged) at their last step, flagged episodes that begin inside a clean twin's identical prefix
    (``identical_until``), variables labelled ``frozen`` that the diagnosis does not read frozen, (i) and (j).

A diagnosed ``missing`` counts as a flag (a parameter that should learn got no gradient); ``frozen`` (no gradient
by the user's choice) and ``inert`` do not.

    flock /tmp/gradhealth-heavy.lock python benchmarks/diagnosis_zoo.py            # train what is not cached, score
    python benchmarks/diagnosis_zoo.py --list
    python benchmarks/diagnosis_zoo.py --only sigmoid_mlp_10,nan_injection --refresh
    python benchmarks/diagnosis_zoo.py --light                 # without the keras.applications cases
    python benchmarks/diagnosis_zoo.py --score-only --markdown --json /tmp/zoo.json
    python benchmarks/diagnosis_zoo.py --score-only --gradients-only   # as a log without the loss reads

The cache (``--cache``, or ``$GRADHEALTH_ZOO_CACHE``, default ``benchmarks/.zoo-cache``) keeps each case's logdir:
scoring a cached zoo takes minutes where training takes hours, so thresholds and rules can be tuned against it without
retraining; half of it is the live feed, which ``--no-live`` leaves out.
A divergence halted more than one logged step before its labelled onset counts as a premature halt (it stopped
a training that was still sound), not as a lead.

**Onset of a global cause.** For a cause that acts on every layer at once (a learning rate, a loss change, gradients
that accumulate), a layer's onset is the first logged step at which its gradient norm or its update/weight ratio
leaves the range of the healthy twin (``[min, max]`` over the twin's seeds at the same step: the band is the twins'
own variability, never a constant of the diagnosis), and the loss running away is the latest acceptable onset, not
its definition. Such a label carries ``latest_onset`` (the loss label); a diagnosed ``first_step`` is right when it
lies in ``[onset, latest_onset + 1 logged step]``, and the scorer prints the detection lead over the loss (the loss
label's logged step minus the diagnosed onset). Without ``latest_onset`` an onset is right within one logged step.

Label format (``labels.json``)::

    {"case": name, "sick": bool, "layers": {layer: {"status": s, "onset": step | null,
                                                   "episodes": [{"status": s, "from": step}, ...] (optional),
                                                   "latest_onset": step (optional: a global cause),
                                                   "doubtful": bool (optional)}},
     "culprits": [layers acceptable as rank #1 / first_bad], "onset": step | null, "first_nan": step | null,
     "diverges": bool, "rule": "one line",
     "recovered": bool (optional: after its episode the loss came back to its level before it, measured),
     "identical_until": step (optional: the run is bitwise its clean twin up to and including this step)}

A sick layer has its status from ``onset`` to the end (healthy before). ``episodes`` (when given) replace that with
a chain, e.g. exploding from the onset then nonfinite from the first NaN: the expected status at a step is that
of the last episode begun at or before it. A ``doubtful`` layer sits within half a decade of its case's threshold:
it is left out of the pair counts and the goals (and counted apart). A ``frozen`` layer (a parameter frozen by the
user: no gradient, or a gradient that is never applied) is expected to read ``frozen``, never a flag.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

if __package__ in (None, ""):  # ``python benchmarks/diagnosis_zoo.py`` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SICK_STATUSES = ("vanishing", "exploding", "dead", "nonfinite")
#: Diagnosed statuses that do not count as a flag (``inert`` is informational: round-off only; ``frozen``: no gradient
#: by the user's choice). ``missing`` is a flag: a parameter that should learn got no gradient.
NOT_FLAGGED = frozenset({"healthy", "inert", "frozen"})
#: Statuses counted over (layer, logged step) pairs: the labelled diseases, and ``missing`` (never labelled: every
#: pair diagnosed missing is a false flag).
PAIR_STATUSES = (*SICK_STATUSES, "missing")
STOP_ON = ("nonfinite", "exploding")
#: The lead (logged steps between the halt and the first NaN) the stop_on goal asks for.
LEAD = 3
DEFAULT_CACHE = Path(__file__).resolve().parent / ".zoo-cache"


# --- diagnosis at every logged step ----------------------------------------------------------------------------


@dataclass
class Diagnosed:
    """The diagnosis of one run at each of its logged steps (what the scorer needs of it)."""

    layers: list[str]
    steps: list[int]
    #: status of each layer at each logged step (the diagnosis with ``at_step`` = that step)
    status: list[dict[str, str]]
    #: at the last step: ``LayerHealth.first_step`` per layer
    first_step: dict[str, int | None]
    rank1: str | None
    rank1_status: str | None
    first_bad: str | None
    first_bad_status: str | None
    #: layers with a flagged episode (any status but healthy/inert) in the diagnosis at any logged step
    episode_layers: list[str] = field(default_factory=list)
    #: per layer, the first step of every flagged episode in the diagnosis at any logged step
    episode_starts: dict[str, list[int]] = field(default_factory=dict)
    #: the run's answer (``RunHealth.answer``: None when nothing is flagged) at each logged step
    answers: list[dict[str, Any] | None] = field(default_factory=list)


def diagnose_steps(series: Any, *, progress: Any = None, diagnose: Callable[..., Any] | None = None,
                   thresholds: Any = None, each: Callable[[int, Any], None] | None = None) -> Diagnosed:
    """``diagnose(series, thresholds, step, progress)`` at every logged step of ``series`` (a
    :class:`tb_gradhealth.reader.RunSeries`); by default the function behind ``tb-gradhealth report --step S``,
    ``progress`` the :class:`tb_gradhealth.progress.Progress` the report gives it (:func:`evidence`). ``each(step,
    diagnosis)`` sees every step's diagnosis as it is made (the live comparison reuses it)."""
    from tb_gradhealth import _payloads, health

    diagnose = diagnose or _payloads.diagnose
    thresholds = thresholds if thresholds is not None else health.Thresholds()
    layers = list(series.layers)
    steps = [int(s) for s in series.steps]
    per_step, answers, last, starts = [], [], None, {}
    for s in steps:
        last = diagnose(series, thresholds, s, progress)
        if each is not None:
            each(s, last)
        per_step.append({lh.layer: lh.status for lh in last.layers})
        answers.append(last.answer)
        for lh in last.layers:
            for e in getattr(lh, "episodes", None) or ():
                if is_flag(e["status"]):
                    starts.setdefault(lh.layer, set()).add(int(e["from"]))
    if last is None or not last.layers:
        return Diagnosed(layers, steps, per_step, {}, None, None, None, None, answers=answers)
    fb = last.first_bad or {}
    return Diagnosed(
        layers=layers, steps=steps, status=per_step,
        first_step={lh.layer: lh.first_step for lh in last.layers},
        rank1=last.layers[0].layer, rank1_status=last.layers[0].status,
        first_bad=fb.get("layer"), first_bad_status=fb.get("status"),
        episode_layers=[n for n in layers if n in starts],
        episode_starts={n: sorted(starts[n]) for n in layers if n in starts},
        answers=answers,
    )


def is_flag(status: str | None) -> bool:
    return status is not None and status not in NOT_FLAGGED


# --- labels ----------------------------------------------------------------------------------------------------


def episodes(entry: Mapping[str, Any]) -> list[tuple[str, int | None]]:
    """A labelled layer's chain of (status, from step); ``None`` = from the start."""
    eps = entry.get("episodes")
    if eps:
        return [(e["status"], e.get("from")) for e in eps]
    return [(entry.get("status", "healthy"), entry.get("onset"))]


def expected_status(entry: Mapping[str, Any] | None, step: int) -> str:
    """The labelled status at ``step``: the last episode begun at or before it, healthy before the first."""
    if entry is None:
        return "healthy"
    out = "healthy"
    for status, start in episodes(entry):
        if start is None or step >= start:
            out = status
    return out


def _index_at_or_after(steps: Sequence[int], step: int | None) -> int | None:
    """Index of the first logged step at or after ``step`` (the logged step a labelled onset falls on)."""
    if step is None:
        return 0
    for i, s in enumerate(steps):
        if s >= step:
            return i
    return None


def _sick_entries(labels: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {name: e for name, e in labels["layers"].items()
            if not e.get("doubtful") and any(st in SICK_STATUSES for st, _ in episodes(e))}


# --- the live answer against the replay; a stable cause -------------------------------------------------------


def written_order(paths: Sequence[str], *, drop: Iterable[str] = ()) -> list[Any]:
    """A run's events in the order they were written: by wall time across its event files, ties by file (in
    ``paths`` order) then position; damaged records are skipped as the readers skip them. Summary values whose tag
    is in ``drop`` are left out (a log written before the loss was recorded)."""
    from google.protobuf.message import DecodeError
    from tensorboard.compat.proto import event_pb2

    from tb_gradhealth._eventfile import iter_framed

    drop = frozenset(drop)
    keyed = []
    for i, path in enumerate(paths):
        for j, (_, payload) in enumerate(iter_framed(path, [])):
            try:
                event = event_pb2.Event.FromString(payload)
            except DecodeError:
                continue
            if drop and any(v.tag in drop for v in event.summary.value):
                kept = event_pb2.Event()
                kept.CopyFrom(event)
                del kept.summary.value[:]
                kept.summary.value.extend(v for v in event.summary.value if v.tag not in drop)
                event = kept
            keyed.append((event.wall_time, i, j, event))
    keyed.sort(key=lambda k: k[:3])
    return [k[3] for k in keyed]


def check_points(events: Sequence[Any], steps: Sequence[int]) -> np.ndarray:
    """For each logged step ``S``: how many of ``events`` (in written order) are fed before ``S`` is checked: every
    event of a step <= ``S`` that carries a summary value, and no more. An event without one (a file's header,
    whose wall time is when its file was opened) is no part of any step. Where a writer wrote a block of steps at
    once (the Keras callback's records after their losses), a step is checked after the last of its events, with
    later steps' events already in, as the writer checks it."""
    at = np.array([e.step if len(e.summary.value) else np.inf for e in events], dtype=np.float64)
    # the smallest step of each event and every later one: ascending, so S is complete once it exceeds S
    later = np.minimum.accumulate(at[::-1])[::-1] if at.size else at
    return np.searchsorted(later, np.asarray(steps, dtype=np.float64), side="right")


def _canonical(x: Any) -> str:
    """A diagnosis' value as text that compares equal exactly when the values do (NaN equal to NaN)."""
    return json.dumps(x, sort_keys=True, default=str)


def difference(replay: Any, live: Any) -> str | None:
    """What differs between two diagnoses of one step (``RunHealth``-like): the answer, else the first layer (in
    the replay's ranking) whose status or episodes differ, or that only one of them has; None when they agree."""
    a, b = replay.answer, live.answer
    if _canonical(a) != _canonical(b):
        if a is None or b is None or a.get("headline") != b.get("headline"):
            return (f"answer: replay {a['headline'] if a else None!r}, live {b['headline'] if b else None!r}")
        keys = sorted(k for k in a.keys() | b.keys() if _canonical(a.get(k)) != _canonical(b.get(k)))
        return f"answer {a['headline']!r}: {', '.join(keys)} differ"
    theirs = {lh.layer: lh for lh in live.layers}
    for lh in replay.layers:
        other = theirs.pop(lh.layer, None)
        if other is None:
            return f"{lh.layer}: not in the live diagnosis"
        if lh.status != other.status:
            return f"{lh.layer}: replay {lh.status}, live {other.status}"
        if _canonical(lh.episodes) != _canonical(other.episodes):
            return f"{lh.layer}: episodes replay {_story(lh.episodes)}, live {_story(other.episodes)}"
    if theirs:
        return f"{next(iter(theirs))}: only in the live diagnosis"
    return None


def _story(episodes: Sequence[Mapping[str, Any]]) -> str:
    return " -> ".join(f"{e['status']} {e['from']}..{e['to']}" for e in episodes) or "none"


class LiveReplay:
    """The live answer of one run against the replay at each logged step: the run's events (:func:`written_order`)
    fed into a :class:`tb_gradhealth.live.LiveRun` of the series' record stream, and at each logged step ``S``, at
    its :func:`check_points`, ``LiveRun.diagnose(thresholds, S, origin)`` (the origin once the writer had found
    it: at its step and after) compared with the replay's diagnosis at ``S`` (:func:`difference`). Called with each
    step's replay diagnosis (``diagnose_steps(each=...)``), so the replay is not diagnosed twice."""

    def __init__(self, events: Sequence[Any], steps: Sequence[int], *, thresholds: Any, origin: Any = None,
                 stream: str | None = None, make_live: Callable[[], Any] | None = None) -> None:
        from tb_gradhealth import live

        self.live = make_live() if make_live is not None else live.LiveRun(**({"name": stream} if stream else {}))
        self.events, self.thresholds, self.origin = list(events), thresholds, origin
        self.index = {int(s): k for k, s in enumerate(steps)}
        self.until = check_points(self.events, steps)
        self.fed = 0
        at = [-np.inf] + [e.step if len(e.summary.value) else -np.inf for e in self.events]
        latest = np.maximum.accumulate(np.array(at, dtype=np.float64))  # [n]: the latest step of the first n events
        #: logged steps whose check comes with a later step's events already in (a block written at once)
        self.ahead = int(np.sum(latest[self.until] > np.asarray(steps, dtype=np.float64)))
        #: logged steps checked, and ``(step, what)`` of each whose live diagnosis differs from the replay's
        self.checked = 0
        self.mismatches: list[tuple[int, str]] = []

    def __call__(self, step: int, replay: Any) -> None:
        end = int(self.until[self.index[step]])
        while self.fed < end:
            self.live.add_event(self.events[self.fed])
            self.fed += 1
        known = self.origin if self.origin is not None and self.origin.step <= step else None
        self.checked += 1
        try:
            got = self.live.diagnose(self.thresholds, step, known)
        except Exception as e:  # noqa: BLE001 - a live run that cannot answer is a mismatch, not the end of scoring
            self.mismatches.append((step, f"live: {type(e).__name__}: {e}"))
            return
        what = difference(replay, got)
        if what is not None:
            self.mismatches.append((step, what))


#: The scorer's own severity order for a stable cause (worst first), stated here rather than read from the diagnosis
#: under test: a NaN/Inf is worse than a blow-up, which is worse than a gradient that vanished or died.
SEVERITY = ("nonfinite", "exploding", "vanishing", "dead", "missing", "inert", "healthy", "frozen")


def worst_status(answer: Mapping[str, Any]) -> int:
    """The most severe status of an answer's chain, as its index in :data:`SEVERITY` (lower is worse)."""
    return min(SEVERITY.index(e["status"]) for e in answer["chain"])


def cause_violations(steps: Sequence[int], answers: Sequence[Mapping[str, Any] | None]) -> list[tuple[int, str]]:
    """``(step, what)`` of each logged step whose answer weakens the previous step's. After an answer that names a
    cause, the next one may be the same chain (same layer, named by any of its variables, and start; its status may
    move along the chain), a chain that began earlier, one whose most severe status is more severe, or none (the run
    recovered; what follows is a new story). Anything else - a chain whose worst status is less severe, or of the
    same worst status begun later (or at the same step in another layer) - is a violation."""
    out = []
    for step, before, now in zip(steps[1:], answers, answers[1:], strict=False):
        if before is None or now is None:
            continue
        same = layer_of(now["layer"]) == layer_of(before["layer"]) and now["step"] == before["step"]
        if same or now["step"] < before["step"] or worst_status(now) < worst_status(before):
            continue
        out.append((int(step), f"{before['headline']} -> {now['headline']}"))
    return out


# --- scoring ---------------------------------------------------------------------------------------------------


@dataclass
class Halt:
    """Where a ``stop_on=STOP_ON`` callback would have halted a run, against its first NaN."""

    halt: int | None = None
    first_nan: int | None = None
    lead: int | None = None
    lead_at_least: bool = False
    #: logged steps before the first NaN: the largest lead the run allows (None without a NaN)
    lead_possible: int | None = None
    #: a divergence halted more than one logged step before its labelled onset
    premature: bool = False
    #: the first halt on a layer whose label is not doubtful: the one a healthy run is judged by (its doubtful
    #: layers' flags count for nothing, as in the flagged-layer rows)
    halt_clear: int | None = None


@dataclass
class RunScore:
    case: str
    sick: bool
    diverges: bool
    pairs: dict[str, dict[str, int]] = field(default_factory=dict)  # status -> tp/fp/fn
    doubtful_pairs: int = 0
    unlabelled: list[str] = field(default_factory=list)
    flagged_last: list[str] = field(default_factory=list)
    flagged_any: list[str] = field(default_factory=list)
    #: layers with a flagged episode in the diagnosis at any logged step (a healthy run must have none)
    episode_layers: list[str] = field(default_factory=list)
    #: the label ``recovered`` (false: the loss never came back after its episode; None: not labelled) and whether
    #: the diagnosis at the last step flags any layer
    recovered: bool | None = None
    flagged_at_end: bool = False
    #: the label ``identical_until`` (the last step of a clean twin's bitwise identical prefix) and the flagged
    #: episodes, ``layer@step``, whose first step lies inside it
    identical_until: int | None = None
    prefix_episodes: list[str] = field(default_factory=list)
    #: variables labelled frozen, and those the diagnosis reads frozen at the last step
    frozen: list[str] = field(default_factory=list)
    frozen_read: list[str] = field(default_factory=list)
    rank1: str | None = None
    rank1_status: str | None = None
    first_bad: str | None = None
    first_bad_status: str | None = None
    culprits: list[str] = field(default_factory=list)
    #: rank #1 / first_bad is a variable of a culprit's layer (the diagnosis names a layer by its largest variable)
    rank1_ok: bool | None = None
    first_bad_ok: bool | None = None
    rank1_exact: bool | None = None  # rank #1 is itself a labelled culprit variable
    same: bool | None = None
    #: per labelled sick layer: label, diagnosed status at the last step, the two onset errors (None = not found)
    layer_onsets: list[dict[str, Any]] = field(default_factory=list)
    run_onset_label: int | None = None
    run_onset_diag: int | None = None
    run_onset_error: int | None = None
    #: the ``stop_on`` simulation
    stop: Halt = field(default_factory=Halt)
    train_s: float | None = None
    train_cpu_s: float | None = None
    #: the per-model baseline (benchmarks/autotrainer_rule.py): with and without its training-progress gate
    autotrainer: str | None = None
    autotrainer_ungated: str | None = None
    #: AutoTrainer with every check of the run (symptom at any logged step, NaN/huge loss, NaN weights)
    autotrainer_fair: str | None = None
    #: SageMaker Debugger's VanishingGradient and ExplodingTensor rules, per tensor, any step
    sagemaker: str | None = None
    #: DeepDiagnosis' (ICSE 2022) checks on gradients and weights, per tensor, any step
    deepdiagnosis: str | None = None
    #: per gradient scale factor: (layer, logged step) pairs whose status differs from the unscaled records'
    scale_changes: dict[str, int] = field(default_factory=dict)
    #: the live feed (:class:`LiveReplay`): logged steps checked (None: not fed), those checked with a later
    #: step's events in, and ``(step, what)`` where the live diagnosis differs from the replay's
    live_checked: int | None = None
    live_ahead: int = 0
    live_mismatches: list[tuple[int, str]] = field(default_factory=list)
    #: ``(step, what)`` of each logged step whose answer weakens the previous step's (:func:`cause_violations`)
    cause_violations: list[tuple[int, str]] = field(default_factory=list)
    labelled_kinds: list[str] = field(default_factory=list)
    n_layers: int = 0
    n_steps: int = 0


def layer_of(variable: str) -> str:
    """The layer a variable belongs to: its name without the last ``/`` or ``.`` component (``dense_1/kernel`` ->
    ``dense_1``, PyTorch's ``fc1.weight`` -> ``fc1``)."""
    cut = max(variable.rfind("/"), variable.rfind("."))
    return variable[:cut] if cut > 0 else variable


def score_run(labels: Mapping[str, Any], d: Diagnosed) -> RunScore:
    """Compare one run's per-step diagnosis with its labels."""
    lab_layers: Mapping[str, Any] = labels["layers"]
    steps = d.steps
    r = RunScore(case=labels["case"], sick=bool(labels["sick"]), diverges=bool(labels.get("diverges")),
                 n_layers=len(d.layers), n_steps=len(steps))
    r.pairs = {s: {"tp": 0, "fp": 0, "fn": 0} for s in PAIR_STATUSES}
    r.unlabelled = [n for n in d.layers if n not in lab_layers]
    any_flag: dict[str, bool] = dict.fromkeys(d.layers, False)
    for i, step in enumerate(steps):
        for name in d.layers:
            entry = lab_layers.get(name)
            diag = d.status[i].get(name)
            if entry is not None and entry.get("doubtful"):
                r.doubtful_pairs += 1
                continue
            any_flag[name] = any_flag[name] or is_flag(diag)
            lab = expected_status(entry, step)
            for st in PAIR_STATUSES:
                c = r.pairs[st]
                c["tp"] += lab == st and diag == st
                c["fp"] += diag == st and lab != st
                c["fn"] += lab == st and diag != st
    if steps:
        r.flagged_last = [n for n in d.layers if is_flag(d.status[-1].get(n))
                          and not lab_layers.get(n, {}).get("doubtful")]
    r.flagged_any = [n for n in d.layers if any_flag[n]]
    r.episode_layers = [n for n in d.episode_layers if not lab_layers.get(n, {}).get("doubtful")]
    r.recovered = labels.get("recovered")
    r.flagged_at_end = bool(steps) and any(is_flag(d.status[-1].get(n)) for n in d.layers)
    r.identical_until = labels.get("identical_until")
    if r.identical_until is not None:
        r.prefix_episodes = [f"{n}@{s}" for n, starts in d.episode_starts.items() for s in starts
                             if s <= r.identical_until]
    r.frozen = [n for n in d.layers if lab_layers.get(n, {}).get("status") == "frozen"]
    r.frozen_read = [n for n in r.frozen if steps and d.status[-1].get(n) == "frozen"]
    culprits = set(labels.get("culprits") or [])
    r.culprits = sorted(culprits)
    r.rank1, r.rank1_status = d.rank1, d.rank1_status
    r.first_bad, r.first_bad_status = d.first_bad, d.first_bad_status
    if r.sick:
        layers = {layer_of(n) for n in culprits}
        r.rank1_ok = d.rank1 is not None and layer_of(d.rank1) in layers and is_flag(d.rank1_status)
        r.first_bad_ok = d.first_bad is not None and layer_of(d.first_bad) in layers
        r.rank1_exact = d.rank1 in culprits and is_flag(d.rank1_status)
        r.same = d.first_bad is not None and d.rank1 == d.first_bad
    r.layer_onsets = _layer_onsets(labels, d)
    r.cause_violations = cause_violations(steps, d.answers)
    r.run_onset_label = labels.get("onset")
    flagged_steps = [i for i in range(len(steps)) if any(is_flag(v) for v in d.status[i].values())]
    if flagged_steps:
        r.run_onset_diag = steps[flagged_steps[0]]
    if r.sick and r.run_onset_label is not None and flagged_steps:
        li = _index_at_or_after(steps, r.run_onset_label)
        r.run_onset_error = None if li is None else abs(flagged_steps[0] - li)
    halts = [i for i in range(len(steps)) if any(v in STOP_ON for v in d.status[i].values())]
    r.stop.halt = steps[halts[0]] if halts else None
    clear = [i for i in halts if any(v in STOP_ON and not lab_layers.get(n, {}).get("doubtful")
                                     for n, v in d.status[i].items())]
    r.stop.halt_clear = steps[clear[0]] if clear else None
    r.stop.first_nan = labels.get("first_nan")
    if r.diverges and halts and r.run_onset_label is not None:
        oi = _index_at_or_after(steps, r.run_onset_label)
        r.stop.premature = oi is not None and halts[0] < oi - 1  # halted while training was still sound
    if r.diverges and r.stop.first_nan is not None:
        ni = _index_at_or_after(steps, r.stop.first_nan)
        r.stop.lead_possible = len(steps) if ni is None else ni
    if r.diverges and halts:
        if r.stop.lead_possible is not None:
            r.stop.lead = r.stop.lead_possible - halts[0]
        else:  # no NaN within the run: the lead is at least the logged steps from the halt to the end
            r.stop.lead, r.stop.lead_at_least = len(steps) - halts[0], True
    return r


def _layer_onsets(labels: Mapping[str, Any], d: Diagnosed) -> list[dict[str, Any]]:
    steps = d.steps
    out = []
    for name, entry in _sick_entries(labels).items():
        chain = episodes(entry)
        first_status, first_from = next((st, fr) for st, fr in chain if st in SICK_STATUSES)
        last_status, last_from = chain[-1]
        diag_last = d.status[-1].get(name) if steps else None
        err_first_step = lead = None
        # first_step is the onset of the layer's chain of episodes: the labelled chain's first sick episode.
        li = _index_at_or_after(steps, first_from if "healthy" not in [st for st, _ in chain[1:]] else last_from)
        # a global cause: any onset from the departure from the twins to one logged step after the loss's
        latest = entry.get("latest_onset")
        hi = _index_at_or_after(steps, latest) if latest is not None else None
        hi = li if hi is None or li is None else max(hi, li)
        fs = d.first_step.get(name)
        applicable = last_status in SICK_STATUSES  # a chain may end healthy again: no onset to compare then
        if applicable and diag_last == last_status and fs is not None and li is not None and fs in steps:
            at = steps.index(fs)
            err_first_step = li - at if at < li else max(0, at - hi - (1 if latest is not None else 0))
            if latest is not None:
                lead = hi - at
        # within the window (a global cause) or within one logged step of the labelled onset
        ok = err_first_step is not None and err_first_step <= (0 if latest is not None else 1)
        err_first_flag = None
        fi = _index_at_or_after(steps, first_from)
        hits = [i for i in range(len(steps)) if d.status[i].get(name) == first_status]
        if hits and fi is not None:
            err_first_flag = abs(hits[0] - fi)
        out.append({"layer": name, "label": last_status, "label_from": last_from, "first_label": first_status,
                    "first_from": first_from, "diagnosed": diag_last,
                    "recalled": diag_last == last_status if applicable else not is_flag(diag_last),
                    "first_step": fs, "first_step_applicable": applicable, "err_first_step": err_first_step,
                    "err_first_flag": err_first_flag, "latest_onset": latest, "lead_over_loss": lead,
                    "onset_ok": ok if applicable else True})
    return out


#: Gradient scale factors of the sweep: the loss (or the targets' units) times a constant, with SGD's learning rate
#: divided by it (the same weights at every step), or under Adam, which divides the constant out.
SCALES = (1e-3, 1e-2, 1e-1, 1e1, 1e2, 1e3)


def scaled_gradients(records: np.ndarray, factor: float) -> np.ndarray:
    """The records of the same training whose gradient is ``factor`` (a power of ten) times larger: min, max and
    mean scale, the histogram shifts by whole decades, the weights and the updates are unchanged."""
    from tb_gradhealth import record

    k = round(math.log10(factor))
    if not math.isclose(10.0**k, factor):
        raise ValueError(f"scale factor {factor} is not a power of ten")
    out = records.copy()
    for name in ("min", "max", "mean"):
        out[..., record.INDEX[name]] *= factor
    hist = records[..., record.HIST_START:]
    shifted = np.zeros_like(hist)
    if k >= 0:
        shifted[..., k:] = hist[..., :hist.shape[-1] - k]
        shifted[..., -1] += np.nansum(hist[..., hist.shape[-1] - k:], axis=-1)
    else:
        shifted[..., :k] = hist[..., -k:]
        shifted[..., 0] += np.nansum(hist[..., :-k], axis=-1)
    out[..., record.HIST_START:] = np.where(np.isnan(hist[..., :1]), np.nan, shifted)
    return out


def scale_sweep(series: Any, base: Diagnosed, progress: Any = None) -> dict[str, int]:
    """Per factor of ``SCALES``: the (layer, logged step) pairs whose status changes from ``base`` when the records
    of ``series`` are those of gradients that many times larger (the loss in ``progress``, where recorded, times
    the same factor; the other evidence kept)."""
    from tb_gradhealth import reader

    out = {}
    for factor in SCALES:
        scaled = reader.RunSeries(run=series.run, layers=series.layers, steps=series.steps,
                                  records=scaled_gradients(series.records, factor), tags=series.tags,
                                  layer_info=series.layer_info, source=series.source)
        loss = None if progress is None else progress.loss
        evidence = progress if loss is None else progress._replace(loss=(loss[0], loss[1] * factor))
        d = diagnose_steps(scaled, progress=evidence)
        out[f"{factor:g}"] = sum(d.status[i].get(n) != base.status[i].get(n)
                                 for i in range(len(d.steps)) for n in d.layers)
    return out


def _ratio(a: int, b: int) -> float | None:
    return a / b if b else None


def pooled(runs: Iterable[RunScore]) -> dict[str, dict[str, Any]]:
    """Per status: TP/FP/FN summed over runs, precision and recall (None where undefined)."""
    out = {}
    runs = list(runs)
    for st in PAIR_STATUSES:
        tp = sum(r.pairs[st]["tp"] for r in runs)
        fp = sum(r.pairs[st]["fp"] for r in runs)
        fn = sum(r.pairs[st]["fn"] for r in runs)
        out[st] = {"tp": tp, "fp": fp, "fn": fn, "precision": _ratio(tp, tp + fp), "recall": _ratio(tp, tp + fn)}
    return out


def goals(runs: Sequence[RunScore]) -> list[dict[str, Any]]:
    """The goals of the diagnosis, each with PASS/FAIL and the measured figure."""
    healthy = [r for r in runs if not r.sick]
    sick = [r for r in runs if r.sick]
    onsets = [o for r in sick for o in r.layer_onsets]
    div = [r for r in runs if r.diverges]
    out = []

    def add(name: str, ok: bool, figure: str) -> None:
        out.append({"goal": name, "pass": bool(ok), "figure": figure})

    flagged = [r for r in healthy if r.flagged_any]
    add("0 flagged layers on every healthy run (any logged step)", not flagged,
        f"{len(flagged)} of {len(healthy)} healthy runs flagged; "
        f"{sum(len(r.flagged_any) for r in healthy)} layer flags in all"
        + (f" ({', '.join(f'{r.case}: {len(r.flagged_any)}' for r in flagged)})" if flagged else ""))
    past = [r for r in healthy if r.episode_layers]
    add("0 healthy runs with any episode at any step (a past episode in the timeline counts)", not past,
        f"{len(past)} of {len(healthy)} healthy runs with an episode"
        + (f" ({', '.join(f'{r.case}: {_short(r.episode_layers, 2)}' for r in past)})" if past else ""))
    recalled = sum(o["recalled"] for o in onsets)
    add("recall 100% of labelled sick layers with the labelled status (at the last step)",
        recalled == len(onsets), f"{recalled} of {len(onsets)} labelled sick layers")
    both = [r for r in sick if r.rank1_ok and r.first_bad_ok and r.same]
    add("rank #1 and first_bad are the same, truly sick layer in every sick run", len(both) == len(sick),
        f"{len(both)} of {len(sick)} sick runs")
    # The onset a user reads is first_step ("since"); the first step a layer is flagged comes later by design for
    # the slow diseases (sustain_steps), which the detection-latency line reports apart.
    errs = [o["err_first_step"] if o["err_first_step"] is not None else
            (0 if not o["first_step_applicable"] else math.inf) for o in onsets]
    within = sum(bool(o["onset_ok"]) for o in onsets)
    finite = [e for e in errs if math.isfinite(e)]
    leads = sorted(o["lead_over_loss"] for o in onsets if o.get("lead_over_loss") is not None)
    add("onset (first_step, the table's 'since') within one logged step of the label; for a global cause, "
        "from the departure from the twins to the loss label + 1",
        within == len(errs), f"{within} of {len(errs)} labelled sick layers; max error "
        f"{max(finite) if finite else '-'}; {len(errs) - len(finite)} never found"
        + (f"; lead over the loss (logged steps) min {leads[0]}, median {leads[len(leads) // 2]}, max {leads[-1]} "
           f"over {len(leads)} layers" if leads else ""))
    # A run whose first NaN comes before LEAD logged steps have passed cannot show that lead: not measurable.
    measurable = [r for r in div if not _too_early(r)]
    good = [r for r in measurable if r.stop.lead is not None and r.stop.lead >= LEAD and not r.stop.premature]
    add(f"stop_on halts every divergence >= {LEAD} logged steps before the first NaN (and not before its onset - 1)",
        len(good) == len(measurable),
        f"{len(good)} of {len(measurable)} measurable divergences; leads "
        + ", ".join(f"{r.case}: {_lead_text(r)}" for r in div))
    halted = [r for r in healthy if r.stop.halt_clear is not None]
    doubt = [r for r in healthy if r.stop.halt is not None and r.stop.halt_clear is None]
    add("stop_on never halts a healthy run (on a layer whose label is not doubtful)", not halted,
        f"{len(halted)} of {len(healthy)} healthy runs halted"
        + (f" ({', '.join(f'{r.case} at {r.stop.halt_clear}' for r in halted)})" if halted else "")
        + (f"; halted on doubtful layers only: {', '.join(f'{r.case} at {r.stop.halt}' for r in doubt)}"
           if doubt else ""))
    flags = sum(c["tp"] + c["fp"] for r in sick for c in r.pairs.values())
    right = sum(c["tp"] for r in sick for c in r.pairs.values())
    precision = right / flags if flags else None
    add("precision >= 95% over flagged (layer, logged step) pairs of the sick runs",
        precision is not None and precision >= 0.95,
        f"{right} of {flags} flagged pairs carry the labelled status" + (f" ({100 * precision:.1f}%)"
                                                                         if precision is not None else ""))
    single = [r for r in sick if len(r.culprits) <= 2 and r.culprits]
    ok = [r for r in single if r.rank1_ok]
    exact = [r for r in single if r.rank1_exact]
    add("rank #1 is the culprit where the label names one layer", len(ok) == len(single),
        f"{len(ok)} of {len(single)} single-culprit runs ({len(exact)} naming a labelled culprit variable itself)"
        + (f" (missed: {', '.join(r.case for r in single if not r.rank1_ok)})" if len(ok) < len(single) else ""))
    unrecovered = [r for r in runs if r.recovered is False]
    read_ok = [r for r in unrecovered if not r.flagged_at_end]
    add("runs that never recovered read ok at their last step (no layer flagged): 0", not read_ok,
        f"{len(read_ok)} of {len(unrecovered)} unrecovered runs read ok"
        + (f" ({', '.join(r.case for r in read_ok)})" if read_ok else ""))
    twinned = [r for r in runs if r.identical_until is not None]
    inside = [r for r in twinned if r.prefix_episodes]
    add("episodes beginning inside a clean twin's identical prefix: 0", not inside,
        f"{sum(len(r.prefix_episodes) for r in twinned)} episodes in {len(inside)} of {len(twinned)} runs with an "
        "identical prefix" + (f" ({', '.join(f'{r.case}: {_short(r.prefix_episodes, 2)}' for r in inside)})"
                              if inside else ""))
    frozen = sum(len(r.frozen) for r in runs)
    read = sum(len(r.frozen_read) for r in runs)
    add("every variable labelled frozen reads frozen at the last step", read == frozen,
        f"{read} of {frozen} frozen variables in {sum(bool(r.frozen) for r in runs)} runs")
    fed = [r for r in runs if r.live_checked is not None]
    differ = [r for r in fed if r.live_mismatches]
    if fed:  # not measured without the live feed (--no-live)
        add("live answer = replay at every logged step (LiveRun fed the events as written: the answer, every layer's "
            "status and episodes)", not differ,
            f"{sum(len(r.live_mismatches) for r in fed)} of {sum(r.live_checked for r in fed)} (run, logged step) "
            f"pairs differ, in {len(differ)} of {len(fed)} runs"
            + (f" ({', '.join(f'{r.case}: {len(r.live_mismatches)}' for r in differ)})" if differ else ""))
    weakened = [r for r in runs if r.cause_violations]
    add("a stable cause at every logged step (the same chain, one begun earlier, a more severe one, or none)",
        not weakened, f"{sum(len(r.cause_violations) for r in runs)} violating (run, logged step) pairs in "
        f"{len(weakened)} of {len(runs)} runs"
        + (f" ({', '.join(f'{r.case}: {len(r.cause_violations)}' for r in weakened)})" if weakened else ""))
    swept = [r for r in runs if r.scale_changes]
    changed = [r for r in swept if any(r.scale_changes.values())]
    add("identical verdicts across the gradient-scale sweep (x1e-3 ... x1e3)", not changed,
        f"{len(changed)} of {len(swept)} runs change"
        + (f" ({', '.join(f'{r.case}: {sum(r.scale_changes.values())} pairs' for r in changed)})" if changed else ""))
    return out


def _too_early(r: RunScore) -> bool:
    return r.stop.lead_possible is not None and r.stop.lead_possible < LEAD


def _lead_text(r: RunScore) -> str:
    if _too_early(r):
        return (f"not measurable (first NaN at step {r.stop.first_nan}, after {r.stop.lead_possible} logged step(s); "
                f"halted {'at ' + str(r.stop.halt) if r.stop.halt is not None else 'never'})")
    if r.stop.halt is None:
        return "no halt"
    premature = " (premature: before the onset)" if r.stop.premature else ""
    return f"{'>=' if r.stop.lead_at_least else ''}{r.stop.lead}{premature}"


# --- printing --------------------------------------------------------------------------------------------------


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{100 * x:.1f}%"
    if isinstance(x, list | tuple):
        return ", ".join(str(v) for v in x) if x else "-"
    return str(x)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], markdown: bool = False) -> str:
    cells = [[_fmt(c) for c in row] for row in rows]
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells]
        return "\n".join(lines)
    widths = [max(len(h), *(len(row[i]) for row in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def report(runs: Sequence[RunScore], markdown: bool = False) -> str:
    """Every table of the scorer as text (or Markdown)."""
    h = (lambda t: f"\n### {t}\n") if markdown else (lambda t: f"\n== {t} ==")
    out = []
    p = pooled(runs)
    out.append(h("(a) per status, over (layer, logged step) pairs, all runs pooled"))
    out.append(table(["status", "precision", "recall", "TP", "FP", "FN"],
                     [[st, v["precision"], v["recall"], v["tp"], v["fp"], v["fn"]] for st, v in p.items()],
                     markdown))
    doubt = sum(r.doubtful_pairs for r in runs)
    if doubt:
        out.append(f"({doubt} pairs of doubtful layers left out)")
    out.append(h("(b) healthy runs: flagged layers (goal 0)"))
    out.append(table(["run", "at last step", "at any step", "flagged layers (any step)", "with an episode"],
                     [[r.case, len(r.flagged_last), len(r.flagged_any), _short(r.flagged_any),
                       _short(r.episode_layers)] for r in runs if not r.sick], markdown))
    out.append(h("(c) sick runs: rank #1 and first_bad at the last step"))
    out.append(table(["run", "rank #1", "status", "culprit", "first_bad", "status", "culprit", "same"],
                     [[r.case, r.rank1, r.rank1_status, r.rank1_ok, r.first_bad, r.first_bad_status,
                       r.first_bad_ok, r.same] for r in runs if r.sick], markdown))
    out.append(h("(d) onset error in logged steps, per labelled sick layer (goal <= 1)"))
    rows = []
    for r in runs:
        if not r.sick:
            continue
        o = r.layer_onsets
        e1 = [x["err_first_step"] for x in o]
        e2 = [x["err_first_flag"] for x in o]
        leads = [x["lead_over_loss"] for x in o if x.get("lead_over_loss") is not None]
        rows.append([r.case, len(o), sum(x["recalled"] for x in o), _err_summary(e1), _err_summary(e2),
                     r.run_onset_label, r.run_onset_diag, r.run_onset_error,
                     f"{min(leads)}..{max(leads)}" if leads else "-"])
    out.append(table(["run", "sick layers", "recalled", "first_step err max/missing", "first flag err max/missing",
                      "run onset label", "run onset diag", "err", "lead over the loss"], rows, markdown))
    latency = sorted(x["err_first_flag"] for r in runs if r.sick for x in r.layer_onsets
                     if x["err_first_flag"] is not None)
    if latency:
        out.append(f"detection latency (logged steps from a labelled sick layer's onset to the first diagnosis that "
                   f"flags it): median {latency[len(latency) // 2]}, max {latency[-1]}, over {len(latency)} layers")
    out.append(h("(e) stop_on=('nonfinite', 'exploding') simulation"))
    out.append(table(["run", "kind", "halt at", "labelled onset", "first NaN", "lead (logged steps)"],
                     [[r.case, "divergence" if r.diverges else ("sick" if r.sick else "healthy"), r.stop.halt,
                       r.run_onset_label, r.stop.first_nan, _lead_text(r) if r.diverges else "-"] for r in runs],
                     markdown))
    out.append(h("(g) per model: baselines on the same records, against ours"))
    out.append(table(["run", "labelled", "AutoTrainer (last step)", "ungated", "AutoTrainer (every check)",
                      "SageMaker rules", "DeepDiagnosis", "ours (first_bad)"],
                     [[r.case, ", ".join(r.labelled_kinds) or "healthy", r.autotrainer or "-",
                       r.autotrainer_ungated or "-", r.autotrainer_fair or "-", r.sagemaker or "-",
                       r.deepdiagnosis or "-", r.first_bad_status or "-"] for r in runs], markdown))
    for name, verdicts in (("AutoTrainer (last step, loss gate)", [r.autotrainer for r in runs]),
                           ("AutoTrainer without its progress gate", [r.autotrainer_ungated for r in runs]),
                           ("AutoTrainer, every check + NaN loss/weights", [r.autotrainer_fair for r in runs]),
                           ("SageMaker VanishingGradient + ExplodingTensor", [r.sagemaker for r in runs]),
                           ("DeepDiagnosis (gradient and weight checks)", [r.deepdiagnosis for r in runs]),
                           ("ours", [r.first_bad_status for r in runs])):
        right, alarms = model_level(runs, verdicts)
        out.append(f"{name}: {right} of {sum(r.sick for r in runs)} sick runs named with a labelled status; "
                   f"{alarms} of {sum(not r.sick for r in runs)} healthy runs flagged")
    if any(r.scale_changes for r in runs):
        out.append(h("(h) gradient-scale sweep: (layer, logged step) pairs whose status changes (goal 0)"))
        out.append(table(["run"] + [f"x{f:g}" for f in SCALES],
                         [[r.case] + [r.scale_changes.get(f"{f:g}", "-") for f in SCALES] for r in runs], markdown))
    fed = [r for r in runs if r.live_checked is not None]
    if fed:
        out.append(h("(i) live = replay: the first mismatch of each run whose live diagnosis differs (goal: none)"))
        rows = [[r.case, r.live_checked, r.live_ahead, len(r.live_mismatches),
                 f"step {r.live_mismatches[0][0]}: {r.live_mismatches[0][1]}"] for r in fed if r.live_mismatches]
        out.append(table(["run", "logged steps", "checked with later steps' events in", "differ", "first mismatch"],
                         rows, markdown) if rows else "none")
        out.append(f"{sum(r.live_ahead for r in fed)} of {sum(r.live_checked for r in fed)} logged steps were "
                   f"checked with a later step's events already written (records written in blocks)")
    out.append(h("(j) a stable cause: steps whose answer weakens the previous step's (goal: none)"))
    rows = [[r.case, step, what] for r in runs for step, what in r.cause_violations]
    out.append(table(["run", "step", "previous answer -> answer"], rows, markdown) if rows else "none")
    out.append(h("(f) GOALS"))
    out.append(table(["goal", "result", "measured"],
                     [[g["goal"], "PASS" if g["pass"] else "FAIL", g["figure"]] for g in goals(runs)], markdown))
    return "\n".join(out)


def model_level(runs: Sequence[RunScore], verdicts: Sequence[str | None]) -> tuple[int, int]:
    """(sick runs whose verdict is one of their labelled statuses, healthy runs with any verdict)."""
    right = sum(1 for r, v in zip(runs, verdicts, strict=True) if r.sick and v in r.labelled_kinds)
    alarms = sum(1 for r, v in zip(runs, verdicts, strict=True) if not r.sick and v is not None)
    return right, alarms


def _secs(x: float | None) -> str | None:
    return None if x is None else f"{x:.1f}"


def _short(names: Sequence[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (f" (+{len(names) - n})" if len(names) > n else "") if names else "-"


def _err_summary(errs: Sequence[int | None]) -> str:
    found = [e for e in errs if e is not None]
    return f"{max(found) if found else '-'}/{len(errs) - len(found)}"


def figures(runs: Sequence[RunScore]) -> dict[str, Any]:
    """Everything as JSON-able data."""
    return {"pooled": pooled(runs), "goals": goals(runs), "runs": [r.__dict__ for r in runs]}


# --- cases on disk -----------------------------------------------------------------------------------------------


def load_case(case_dir: Path) -> tuple[dict[str, Any], Any]:
    """``(labels, RunSeries)`` of a cached case: its one gradient-health run."""
    from tb_gradhealth import reader

    labels = json.loads((case_dir / "labels.json").read_text())
    data = reader.read_logdir(str(case_dir))
    runs = [r for r in data.runs if r.num_steps]
    if len(runs) != 1:
        raise RuntimeError(f"{case_dir}: expected one gradient-health run, found {[r.run for r in runs]}")
    return labels, runs[0]


class Evidence(NamedTuple):
    """What ``tb-gradhealth report`` reads beside a run's records: ``progress`` (the loss, the skipped steps and
    the NaN origin, as the diagnosis takes them), ``origin`` (the :class:`tb_gradhealth.origin.NanOrigin`, or
    None) and ``paths``, the run's event files."""

    progress: Any
    origin: Any
    paths: Sequence[str]


def evidence(case_dir: Path, series: Any, *, loss: bool = True) -> Evidence:
    """The evidence the report gives the diagnosis of ``series`` in the logdir ``case_dir`` (as ``cli.report``
    reads it: the run's event files, and its earliest stored NaN origin); without the loss when ``loss`` is False
    (a log written before the loss was recorded)."""
    from tb_gradhealth import origin, progress, reader

    paths = list(progress.run_paths(reader.find_runs(str(case_dir)), series.run))
    found = origin.read_logdir(str(case_dir), [series.run]).get(series.run)
    recorded = progress.read_progress(paths).with_origin(found)
    return Evidence(recorded if loss else recorded._replace(loss=None), found, paths)


def score_cases(case_dirs: Sequence[Path], times: Mapping[str, float] | None = None, sweep: bool = False,
                loss_evidence: bool = True, live: bool = True) -> list[RunScore]:
    """Every cached case diagnosed at each logged step with the report's evidence (the loss left out when
    ``loss_evidence`` is False) and scored; ``live``: the live feed compared with it at each step too."""
    from benchmarks import autotrainer_rule, deepdiagnosis_rules, sagemaker_rules  # noqa: PLC0415
    from tb_gradhealth import health, progress
    from tb_gradhealth._streams import stream_of

    thresholds = health.Thresholds()
    out = []
    for case_dir in case_dirs:
        labels, run = load_case(case_dir)
        found = evidence(case_dir, run, loss=loss_evidence)
        feed = None
        if live:
            events = written_order(found.paths, drop=() if loss_evidence else progress.LOSS_TAGS)
            feed = LiveReplay(events, run.steps, thresholds=thresholds, origin=found.origin,
                              stream=stream_of(run.tags[0]) if run.tags else None)
        d = diagnose_steps(run, progress=found.progress, thresholds=thresholds, each=feed)
        r = score_run(labels, d)
        if feed is not None:
            r.live_checked, r.live_ahead, r.live_mismatches = feed.checked, feed.ahead, feed.mismatches
        loss = autotrainer_rule.losses(str(case_dir / run.run))
        r.autotrainer, r.autotrainer_ungated = autotrainer_rule.verdict(run.layers, run.records, loss)
        r.autotrainer_fair = autotrainer_rule.verdict_every_check(run.layers, run.records, loss)
        r.sagemaker = sagemaker_rules.verdict(run.records)
        r.deepdiagnosis = deepdiagnosis_rules.verdict(run.records)
        if sweep:
            r.scale_changes = scale_sweep(run, d, found.progress)
        r.labelled_kinds = sorted({e["status"] for e in labels["layers"].values() if e["status"] in SICK_STATUSES}
                                  | {st for e in labels["layers"].values() for st, _ in episodes(e)
                                     if st in SICK_STATUSES})
        r.train_s = (times or {}).get(labels["case"], labels.get("train_s"))
        r.train_cpu_s = labels.get("train_cpu_s")
        if r.unlabelled:
            print(f"[zoo] {r.case}: {len(r.unlabelled)} recorded layers without a label (scored as healthy): "
                  f"{_short(r.unlabelled)}", file=sys.stderr)
        out.append(r)
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get("GRADHEALTH_ZOO_CACHE", DEFAULT_CACHE)),
                    help="where each case's logdir is kept (default: benchmarks/.zoo-cache)")
    ap.add_argument("--refresh", action="store_true", help="retrain the selected cases even when cached")
    ap.add_argument("--only", default="", help="comma-separated case names")
    ap.add_argument("--half", choices=("heldout", "design", "both"), default="both",
                    help="the held-out half (benchmarks/zoo_heldout.py, never tuned on), the design half "
                         "(benchmarks/zoo_cases.py, the cases the rules were designed on) or both, scored apart")
    ap.add_argument("--sweep", action="store_true",
                    help="also diagnose every run with its gradients scaled by 1e-3 ... 1e3 (the same training with "
                         "the loss times a constant) and count the verdicts that change")
    ap.add_argument("--light", action="store_true",
                    help="leave out the keras.applications cases (minutes of CPU each), for quick iterations")
    ap.add_argument("--list", action="store_true", help="list the cases and their labelling rules, then exit")
    ap.add_argument("--gradients-only", action="store_true",
                    help="diagnose without the recorded loss (as a log written before the loss was recorded; the "
                         "live feed leaves the loss out too)")
    ap.add_argument("--no-live", action="store_true",
                    help="leave out the live feed (goal row 'live answer = replay'): about half the scoring time")
    ap.add_argument("--score-only", action="store_true", help="score the cached cases, train nothing")
    ap.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    ap.add_argument("--json", type=Path, default=None, help="write every figure to this JSON file")
    return ap.parse_args(argv)


def _registries(half: str) -> list[tuple[str, dict[str, Any], Callable[[str, Path], Any]]]:
    # TensorFlow only when training; the story cases register in both halves on import
    from benchmarks import zoo_cases, zoo_child, zoo_heldout, zoo_story_cases  # noqa: F401, PLC0415

    zoo_child.load_cases()  # the PyTorch, Lightning, Hugging Face and JAX cases join both halves

    out = []
    if half in ("heldout", "both"):
        out.append(("held-out half (never tuned on)", zoo_heldout.CASES, zoo_heldout.train))
    if half in ("design", "both"):
        out.append(("design half (the rules were designed on it)", zoo_cases.CASES, zoo_cases.train))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    only = [n for n in args.only.split(",") if n]
    halves = _registries(args.half)
    known = {n for _, cases, _ in halves for n in cases}
    unknown = [n for n in only if n not in known]
    if unknown:
        print(f"unknown case(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}", file=sys.stderr)
        return 2
    figures_out = {}
    for title, cases, train in halves:
        names = [n for n in (only or list(cases)) if n in cases and not (args.light and cases[n].heavy)]
        if not names:
            continue
        if args.list:
            for n in names:
                print(f"{n:24s} {cases[n].rule}")
            continue
        runs = _train_and_score(args, names, train)
        print(f"\n######## {title}: {len(runs)} cases ########")
        print(table(["case", "sick", "logged steps", "layers", "training s (wall)", "training s (CPU)"],
                    [[r.case, r.sick, r.n_steps, r.n_layers, _secs(r.train_s), _secs(r.train_cpu_s)] for r in runs],
                    args.markdown))
        print(report(runs, args.markdown))
        figures_out[title] = figures(runs)
    if args.json:
        args.json.write_text(json.dumps(figures_out, indent=1, default=str))
    return 0


def _train_and_score(args: argparse.Namespace, names: Sequence[str], train: Callable[[str, Path], Any]
                     ) -> list[RunScore]:
    times: dict[str, float] = {}
    start = time.perf_counter()
    if not args.score_only:
        for n in names:
            case_dir = args.cache / n
            if (case_dir / "labels.json").exists() and not args.refresh:
                continue
            t0 = time.perf_counter()
            train(n, case_dir)
            times[n] = time.perf_counter() - t0
            cpu = json.loads((case_dir / "labels.json").read_text()).get("train_cpu_s")
            print(f"[zoo] trained {n} in {times[n]:.1f} s ({cpu} CPU s)", flush=True)
        if times:
            print(f"[zoo] trained {len(times)} case(s) in {time.perf_counter() - start:.1f} s wall "
                  f"(import and set-up included; load average {os.getloadavg()[0]:.1f})", flush=True)
    dirs = [args.cache / n for n in names if (args.cache / n / "labels.json").exists()]
    return score_cases(dirs, times, sweep=args.sweep, loss_evidence=not args.gradients_only, live=not args.no_live)

if __name__ == "__main__":
    sys.exit(main())
