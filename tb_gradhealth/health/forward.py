"""The forward record as evidence: which variables each recorded output speaks for, their units' dead and saturated
fractions at each logged step, and a forward blow-up through depth (docs/DIAGNOSIS.md, "The layers' outputs").

A writer records the outputs of the layers that own variables and of the activation layers after them (a PyTorch
``Linear`` and the ``nn.ReLU`` it feeds, a Keras ``Dense(activation="relu")``). An output row speaks for the
variables of its layer (as :func:`levels.in_named_layer` matches them: ``net.0`` for ``net.0.weight``); an
activation row with no variable of its own speaks for the layer recorded before it, whose units it activates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from tb_gradhealth import record
from tb_gradhealth.health.kinds import RECTIFIERS, SATURATING
from tb_gradhealth.health.levels import layer_of

#: A forward blow-up: the RMS of a layer's output on the way to the largest may fall below the largest before it by
#: at most this factor (a climb through depth, not two unrelated scales; an activation after each layer lowers it).
CLIMB_DIP = 10.0


class Forward(NamedTuple):
    """A run's forward records as the diagnosis reads them: ``layers`` (recorded outputs, forward order),
    ``steps`` int ``[A]`` ascending, ``records`` float64 ``[A, R, record.ACT_NUM_FIELDS]`` (a row all-NaN where
    an output has no record) and ``info`` ``{output: (kind, activation)}`` where the writer knew them."""

    layers: Sequence[str]
    steps: np.ndarray
    records: np.ndarray
    info: Mapping[str, tuple[str, str]] = {}

    @classmethod
    def of(cls, value: Any) -> Forward | None:
        """A :class:`Forward` from a tuple ``(layers, steps, records[, info])`` or an object with those attributes
        (``layer_info`` for ``info``: :class:`tb_gradhealth.reader.ActivationSeries`); None for None. ValueError
        for records of the wrong shape."""
        if value is None:
            return None
        if not isinstance(value, tuple):
            value = (value.layers, value.steps, value.records, getattr(value, "layer_info", {}))
        layers, steps, records, *info = value
        records = np.asarray(records, dtype=np.float64)
        steps = np.asarray(steps, dtype=np.int64)
        if records.ndim != 3 or records.shape[2] != record.ACT_NUM_FIELDS or records.shape[:2] != (
                steps.size, len(layers)):
            raise ValueError(f"activations: records must have shape [{steps.size}, {len(layers)}, "
                             f"{record.ACT_NUM_FIELDS}], got {records.shape}")
        return cls(tuple(layers), steps, records, dict(info[0]) if info else {})


class Units(NamedTuple):
    """What the forward records say of each variable's layer, at the gradient records' logged steps: ``output``
    ``[L]`` the row that holds its layer's output ("" where none does), ``shown`` ``[L]`` the row after its
    activation (its layer's own row, or the activation row that follows it), ``activation`` ``[L]`` that row's
    activation, ``position`` ``[L]`` the forward position of ``output`` (-1 none); ``[S, L]`` (NaN where not
    recorded at that step): ``dead`` the fraction of units dead for every input of the batch after a rectifier,
    ``saturated`` the fraction of outputs of a bounded activation within :data:`record.SATURATION_MARGIN` of a
    bound, ``rms`` of the activated output."""

    output: list[str]
    shown: list[str]
    activation: list[str]
    position: np.ndarray
    dead: np.ndarray
    saturated: np.ndarray
    rms: np.ndarray


def _activation(fw: Forward, r: int) -> str:
    return str(fw.info.get(fw.layers[r], ("", ""))[1]).lower()


def speaks_for(fw: Forward, variables: Sequence[str]) -> tuple[list[int], list[int]]:
    """``(own, shown)`` per variable: the first output row of its layer and the row that shows its units after
    their activation (the last activation row that follows its layer's before the next layer with variables, else
    its own row); -1 where no row is its layer's."""
    by_suffix: dict[str, list[int]] = {}
    for i, v in enumerate(variables):
        for suffix in _layer_suffixes(v):
            by_suffix.setdefault(suffix, []).append(i)
    owned = [by_suffix.get(str(row), []) for row in fw.layers]
    own, shown = [-1] * len(variables), [-1] * len(variables)
    after: dict[int, int] = {}
    current = -1
    for r, names in enumerate(owned):
        if names:
            current = r
            for i in names:
                if own[i] < 0:
                    own[i] = r
        elif current >= 0 and _activation(fw, r):
            after[current] = r
    for i, r in enumerate(own):
        if r >= 0:
            shown[i] = after.get(r, r)
    return own, shown


def _layer_suffixes(variable: str) -> list[str]:
    """Every name a framework may give the variable's layer (:func:`levels.in_named_layer`): its layer path
    (:func:`levels.layer_of`) and each tail of it after a ``/`` or ``.`` (``model/exp_2`` and ``exp_2``)."""
    own = layer_of(variable)
    if own is None:
        return []
    return [own] + [own[k + 1:] for k, ch in enumerate(own) if ch in "/."]


def _at_steps(fw: Forward, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``([S]`` the forward record's row of each gradient step, ``[S]`` whether it has one at exactly that step)."""
    k = np.searchsorted(fw.steps, steps)
    hit = (k < fw.steps.size) & (fw.steps[np.minimum(k, max(fw.steps.size - 1, 0))] == steps) if fw.steps.size \
        else np.zeros(steps.shape, dtype=bool)
    return np.minimum(k, max(fw.steps.size - 1, 0)), hit


def read_units(fw: Forward, variables: Sequence[str], steps: np.ndarray) -> Units:
    """Each variable's layer's output at the gradient records' ``steps`` (:class:`Units`): the forward record at
    exactly that step, NaN where none is."""
    own, shown = speaks_for(fw, variables)
    shape = (np.asarray(steps).size, len(variables))
    dead, saturated, rms = np.full(shape, np.nan), np.full(shape, np.nan), np.full(shape, np.nan)
    k, hit = _at_steps(fw, np.asarray(steps, dtype=np.int64))
    d = record.act_derived(fw.records) if fw.steps.size else None
    acts = [_activation(fw, r) if r >= 0 else "" for r in shown]
    for i, r in enumerate(shown):
        if r < 0 or d is None:
            continue
        rms[hit, i] = d["rms"][k[hit], r]
        if acts[i] in RECTIFIERS:
            dead[hit, i] = d["dead_fraction"][k[hit], r]
        if acts[i] in SATURATING:
            saturated[hit, i] = d["saturated_fraction"][k[hit], r]
    names = [str(fw.layers[r]) if r >= 0 else "" for r in own]
    return Units(names, [str(fw.layers[r]) if r >= 0 else "" for r in shown], acts,
                 np.array(own, dtype=np.int64), dead, saturated, rms)


class Blowup(NamedTuple):
    """A forward blow-up at one logged step: the RMS of the outputs of the layers with variables grew ``growth``
    times from ``first`` (its row) to ``peak``."""

    step: int
    first: int
    peak: int
    first_rms: float
    peak_rms: float
    layers: int

    @property
    def growth(self) -> float:
        return self.peak_rms / self.first_rms


def blowup_at(fw: Forward, a: int, rows: Sequence[int], growth: float) -> Blowup | None:
    """The forward blow-up at the forward record's row ``a`` over the output ``rows`` (the layers with variables, in
    forward order), None where there is none: from the first of them with a finite positive RMS, the largest is
    ``growth`` times its RMS or more, and on the way there no output falls below the largest before it by more
    than :data:`CLIMB_DIP`."""
    if not rows:
        return None
    rms = record.act_derived(fw.records[a, list(rows)])["rms"]
    ok = np.flatnonzero(np.isfinite(rms) & (rms > 0))
    if ok.size < 2:
        return None
    vals = rms[ok]
    peak = int(np.argmax(vals))
    if peak == 0 or not vals[peak] >= growth * vals[0]:
        return None
    climb = vals[: peak + 1]
    if np.any(climb < np.maximum.accumulate(climb) / CLIMB_DIP):
        return None
    return Blowup(int(fw.steps[a]), int(rows[ok[0]]), int(rows[ok[peak]]), float(vals[0]), float(vals[peak]),
                  peak + 1)


def first_blowup(fw: Forward, own: Sequence[int], since: int, until: int, growth: float) -> Blowup | None:
    """The first forward blow-up (:func:`blowup_at`) at a logged step of the forward records from the latest one at
    or before ``since`` to ``until``, over the outputs that hold a variable's layer (``own``: each variable's row)."""
    rows = sorted({r for r in own if r >= 0})
    start = max(int(np.searchsorted(fw.steps, since, side="right")) - 1, 0)
    end = int(np.searchsorted(fw.steps, until, side="right"))
    for a in range(start, end):
        found = blowup_at(fw, a, rows, growth)
        if found is not None:
            return found
    return None


def latest_at(fw: Forward, step: int) -> int | None:
    """The forward records' row of the latest logged step at or before ``step``, None where none is."""
    a = int(np.searchsorted(fw.steps, step, side="right")) - 1
    return a if a >= 0 else None


def layer_fields(fw: Forward, a: int, r: int) -> dict[str, Any]:
    """One output's latest fields for the JSON: its RMS, dead and saturated fractions (None where not known)."""
    d = record.act_derived(fw.records[a, r][None])

    def num(x: np.ndarray) -> float | None:
        v = float(x[0])
        return v if math.isfinite(v) else None

    return {"output": str(fw.layers[r]), "step": int(fw.steps[a]), "activation": _activation(fw, r),
            "rms": num(d["rms"]), "dead_fraction": num(d["dead_fraction"]),
            "saturated_fraction": num(d["saturated_fraction"])}


def with_activations(info: Mapping[str, tuple[str, str]], units: Units | None, variables: Sequence[str]
                     ) -> Mapping[str, tuple[str, str]]:
    """``info`` with the activation the forward records name for a variable's units where they name one: the
    activation its layer's output goes through (a Keras ``Dense`` without activation, "linear" in its gradient's
    metadata, followed by a ``ReLU`` layer has relu units), so its reasons and fixes are worded for it."""
    if units is None:
        return info
    out = dict(info)
    for i, name in enumerate(variables):
        if units.activation[i]:
            out[name] = (out.get(name, ("", ""))[0], units.activation[i])
    return out


def output_history(fw: Forward, variables: Sequence[str], variable: str, max_points: int) -> dict[str, Any] | None:
    """The output that shows ``variable``'s units (:func:`speaks_for` over all the run's ``variables``: after their
    activation) at each logged step of the forward records, for the layer drawer: ``{"output", "activation",
    "steps", "rms", "dead_fraction", "saturated_fraction", "total_steps"}`` (None where a value is not known), at
    most ``max_points`` steps evenly spread with the last one kept; None where no recorded output is its layer's."""
    _, shown = speaks_for(fw, variables)
    r = shown[list(variables).index(variable)]
    if r < 0:
        return None
    rows = np.flatnonzero(~np.isnan(fw.records[:, r, record.ACT_INDEX["size"]]))
    if not rows.size:
        return None
    total = int(rows.size)
    if rows.size > max_points:
        rows = rows[np.unique(np.linspace(0, rows.size - 1, max_points).round().astype(np.int64))]
    d = record.act_derived(fw.records[rows, r])

    def nums(x: np.ndarray) -> list[float | None]:
        return [float(v) if math.isfinite(v) else None for v in np.asarray(x, dtype=np.float64)]

    return {"output": str(fw.layers[r]), "activation": _activation(fw, r), "steps": [int(s) for s in fw.steps[rows]],
            "rms": nums(d["rms"]), "dead_fraction": nums(d["dead_fraction"]),
            "saturated_fraction": nums(d["saturated_fraction"]), "total_steps": total}


def depth_profile(fw: Forward, step: int) -> dict[str, Any] | None:
    """The forward depth profile at the latest logged step of the forward records at or before ``step``:
    ``{"step", "outputs": [{"output", "activation", "rms", "dead_fraction", "saturated_fraction"}]}`` in forward
    order, the outputs with no record there left out; None where none is recorded by then."""
    a = latest_at(fw, step)
    if a is None:
        return None
    present = ~np.isnan(fw.records[a, :, record.ACT_INDEX["size"]])
    outputs = []
    for r in np.flatnonzero(present):
        fields = layer_fields(fw, a, int(r))
        del fields["step"]
        outputs.append(fields)
    return {"step": int(fw.steps[a]), "outputs": outputs}
