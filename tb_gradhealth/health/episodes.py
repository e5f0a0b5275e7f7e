"""Episodes: a layer's per-step statuses become runs of one status (slow diseases confirmed over several logged steps,
explosions back-dated to where they left their floor), and the run-wide onset and timeline."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tb_gradhealth.health import thresholds as th
from tb_gradhealth.health.answer import deepest_first
from tb_gradhealth.health.levels import condemned_since, layer_groups
from tb_gradhealth.health.result import LayerHealth
from tb_gradhealth.health.rules import TREND_MIN_SIZE, Steps

#: An exploding episode goes on while the layer's weight norm stays this many times its norm before the episode:
#: a blow-up of the weights that is not undone leaves the layer damaged even when its gradient looks normal again.
BLOWN_UP = 10.0


@dataclass
class Track:
    """One layer's statuses over its present rows, as runs ``(code, first_row, last_row)`` after confirmation."""

    rows: np.ndarray  # row indices (into steps) where the layer has a record
    runs: list[tuple[int, int, int]]  # (code, first position, last position) into ``rows``
    unconfirmed: tuple[int, int] | None  # (code, length) of a trailing slow run not yet confirmed
    chain_from: int | None = None  # a position where the chain starts instead (a small tensor follows its layer)
    need: int = 1  # logged steps a slow status had to last to be confirmed (shorter on a short run)

    @property
    def code(self) -> int:
        return self.runs[-1][0] if self.runs else th.MISSING

    def chain_start(self) -> int:
        """Position where the trailing chain of flagged runs starts (the last run's start when it is not flagged)."""
        k = len(self.runs) - 1
        if self.runs[k][0] not in th.FLAG_CODES:
            return self.runs[k][1]
        while k > 0 and self.runs[k - 1][0] in th.FLAG_CODES:
            k -= 1
        return self.runs[k][1] if self.chain_from is None else self.chain_from


def _runs(codes: np.ndarray) -> list[list[int]]:
    if codes.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(codes)) + 1
    starts = np.concatenate([[0], cuts])
    ends = np.concatenate([cuts - 1, [codes.size - 1]])
    return [[int(codes[a]), int(a), int(b)] for a, b in zip(starts, ends, strict=True)]


def _merge_equal(runs: list[list[int]]) -> list[list[int]]:
    out: list[list[int]] = []
    for r in runs:
        if out and out[-1][0] == r[0]:
            out[-1][2] = r[2]
        else:
            out.append(list(r))
    return out


#: A healthy stretch of at most this many logged steps between two flagged episodes does not end the chain: one
#: quiet minibatch in the middle of a divergence is not a recovery.
CHAIN_GAP = 2


def _confirm(runs: list[list[int]], need: int, skip_need: int, dead_need: int) -> tuple[int, int] | None:
    """Relabel in place the runs that need confirmation; returns the trailing unconfirmed slow run, if any.

    A vanishing (dead) run shorter than ``need`` (``dead_need``) logged steps is healthy, unless it directly follows
    a flagged run: a layer that is already sick needs no confirmation (a saturating layer collapsing to zero inside a
    divergence). ``dead_need`` is at least two logged steps even on a short run, since a zero-initialised
    multiplier (ReZero, a zero-initialised residual branch) cuts its branch's gradient at the first step by design.
    Skipped NaN/Inf steps are nonfinite when they last ``skip_need`` steps (``sustain_steps`` whatever
    the run's length: dynamic loss scaling skips the first steps of every run), when NaN follows them, or when a
    run that never skipped a step before ends on them after its first ``skip_need`` steps (it stopped there: a NaN
    update has no finite value, so it looks skipped; a live run's latest step may show this until the next record
    shows the optimizer went on). A healthy
    stretch of at most ``CHAIN_GAP`` steps between two flagged runs continues the first.
    """
    unconfirmed = None
    scaled = False  # the run skipped a NaN/Inf step before and went on: it uses dynamic loss scaling
    for k, r in enumerate(runs):
        short = r[2] - r[1] + 1 < (dead_need if r[0] == th.DEAD else need)
        after_flag = k > 0 and runs[k - 1][0] in th.FLAG_CODES
        if r[0] == th.SKIPPED:
            leads_to_nan = k + 1 < len(runs) and runs[k + 1][0] == th.NONFINITE
            # A run without loss scaling that ends on it stopped there (stop_on, a crash): nothing shows the
            # optimizer went on, and a NaN update leaves no finite update either.
            ends_on_it = k == len(runs) - 1 and r[1] >= skip_need and not scaled
            scaled = scaled or k + 1 < len(runs)
            r[0] = th.NONFINITE if leads_to_nan or ends_on_it or r[2] - r[1] + 1 >= skip_need else th.HEALTHY

        elif r[0] in (th.VANISHING, th.DEAD) and short and not after_flag:
            if k == len(runs) - 1:
                unconfirmed = (r[0], r[2] - r[1] + 1)
            r[0] = th.HEALTHY
    for k in range(1, len(runs) - 1):
        r = runs[k]
        if r[0] == th.HEALTHY and r[2] - r[1] + 1 <= CHAIN_GAP and runs[k - 1][0] in th.FLAG_CODES \
                and runs[k + 1][0] in th.FLAG_CODES:
            r[0] = runs[k - 1][0]
    return unconfirmed


def _backdate(runs: list[list[int]], col: np.ndarray, t: th.Thresholds) -> None:
    """An exploding run after a healthy one starts where the layer's RMS left its floor: the step after the last
    one within twice the trend's own per-step slope (``2 * growth_decades / growth_window``, 0.4 decades) of the
    lowest RMS of the ``growth_window`` steps before the run. A quiet minibatch in the middle of the rise does not
    move the onset; minibatch noise (a few tenths of a decade) does not start it."""
    rise = 2.0 * t.growth_decades / t.growth_window
    w = t.growth_window
    for k in range(1, len(runs)):
        code, first, _ = runs[k]
        prev = runs[k - 1]
        if code != th.EXPLODING or prev[0] != th.HEALTHY:
            continue
        lo = max(prev[1], first - w)
        window = col[lo:first]
        if not np.isfinite(window).any():
            continue
        floor = np.nanmin(window)
        at_floor = np.flatnonzero(window <= floor + rise)
        j = lo + int(at_floor[-1]) + 1
        runs[k][1], prev[2] = j, min(prev[2], j - 1)


def _confirmed_late(runs: list[list[int]], late: np.ndarray, level: np.ndarray) -> None:
    """An exploding run after a healthy one whose first step is flagged by evidence that arrived later (``late``:
    the loss swinging by decades under an adaptive optimizer) starts where the state that evidence condemns began
    (:func:`levels.condemned_since` over ``level``, the relative rule's level condition without its adaptive gate),
    within the healthy run before it."""
    for k in range(1, len(runs)):
        code, first, _ = runs[k]
        prev = runs[k - 1]
        if code != th.EXPLODING or prev[0] != th.HEALTHY or not late[first]:
            continue
        j = condemned_since(level, first, prev[1])
        runs[k][1], prev[2] = j, min(prev[2], j - 1)


def _blown_up(runs: list[list[int]], weight: np.ndarray, small: np.ndarray) -> None:
    """An exploding run goes on over the healthy steps after it while the weight norm stays ``BLOWN_UP`` times its
    norm before the run (or at its first step): the blow-up was not undone. Not while the weights are small by
    design (``small``: a parameter that started near zero and is still below its layer's scale, a LayerScale or a
    zero-initialised bias or beta is meant to grow by any factor); one that grew past its layer's scale (a beta
    blown above its gamma) is judged like any other."""
    for k in range(len(runs) - 1):
        code, first, last = runs[k]
        nxt = runs[k + 1]
        if code != th.EXPLODING or nxt[0] != th.HEALTHY:
            continue
        before = weight[first - 1] if first > 0 else weight[first]
        if not before > 0:
            continue
        j = last
        while j + 1 <= nxt[2] and weight[j + 1] >= BLOWN_UP * before and not small[j + 1]:
            j += 1
        if j > last:
            runs[k][2], nxt[1] = j, j + 1


def sustain_needed(logged: int, sustain_steps: int) -> int:
    """Logged steps a slow status must last: ``sustain_steps``, or half the layer's logged steps (at least one) on a
    run too short for it, so a run with 1-4 records can still show vanishing or dead (with less certainty)."""
    return max(1, min(sustain_steps, (logged + 1) // 2))


def track(ev: Steps, i: int, t: th.Thresholds) -> Track:
    """The layer's confirmed runs over the steps where it has a record."""
    rows = np.flatnonzero(ev.columns("present")[i])
    runs = _runs(ev.columns("raw")[i, rows].astype(np.int64))
    need = sustain_needed(len(rows), t.sustain_steps)
    unconfirmed = _confirm(runs, need, t.sustain_steps, min(t.sustain_steps, max(2, need)))
    runs = _merge_equal(runs)
    _confirmed_late(runs, ev.columns("exp_late")[i, rows], ev.columns("exp_level")[i, rows])
    _backdate(runs, ev.columns("log_rms")[i, rows], t)
    _blown_up(runs, ev.columns("weight_norm")[i, rows], ev.columns("small")[i, rows])
    runs = _merge_equal([r for r in runs if r[2] >= r[1]])
    return Track(rows, [tuple(r) for r in runs], unconfirmed, need=need)


def flagged_episodes(track: Track, steps: np.ndarray) -> list[dict[str, Any]]:
    return [{"status": th.STATUSES[code], "from": int(steps[track.rows[a]]), "to": int(steps[track.rows[b]])}
            for code, a, b in track.runs if code in th.FLAG_CODES]


def follow_siblings(tracks: list[Track | None], ev: Steps, layers: Sequence[str]) -> frozenset[str]:
    """A variable whose own onset is not evidence of when it went wrong takes its layer's: when a variable of its
    layer large enough for a trend has a flagged chain overlapping its current one, its chain starts where that
    one's did. Two kinds: a tensor too small for a trend (a one-element bias has an RMS of one or a
    few numbers, so its own onset is noise), and one whose chain began at a step flagged only by later evidence (a
    loss swinging by decades under an adaptive optimizer dates the layer's blow-up, not which of its variables
    showed it first), which only moves earlier. Returns the layers whose onset was taken that way."""
    small = ev.size.max(axis=0) < TREND_MIN_SIZE
    late = ev.columns("exp_late")
    moves: dict[int, int] = {}
    for cols in layer_groups(layers):
        # first the variables flagged by later evidence, from their siblings' own chains, then the small ones
        # from their siblings' chains as they then start
        for by_late in (True, False):
            found = {}
            for c in (int(c) for c in cols if bool(small[c]) != by_late):
                track = tracks[c]
                if track is None or track.code not in th.FLAG_CODES:
                    continue
                own = int(track.rows[track.chain_start()])
                if by_late and not late[c, own]:
                    continue
                others = [tracks[int(o)] for o in cols if int(o) != c and not small[o] and tracks[int(o)] is not None]
                start = _overlapping_start(track, others)
                if start is not None and not (by_late and start >= own):
                    found[c] = min(int(np.searchsorted(track.rows, start)), len(track.rows) - 1)
            for c, pos in found.items():
                tracks[c].chain_from = pos
            moves.update(found)
    return frozenset(layers[c] for c in moves)


def _overlapping_start(track: Track, others: Sequence[Track]) -> int | None:
    """The earliest row at which a flagged chain of ``others`` overlapping ``track``'s current chain starts."""
    a, z = track.rows[track.chain_start()], track.rows[track.runs[-1][2]]
    starts = [int(o.rows[o.chain_start()]) for o in others
              if o.code in th.FLAG_CODES and o.rows[o.chain_start()] <= z and a <= o.rows[o.runs[-1][2]]]
    return min(starts) if starts else None


def onset(layers: list[LayerHealth]) -> dict[str, Any] | None:
    """The first step any layer was flagged (any episode, current or past), ties to the deepest layer."""
    best = None
    for lh in layers:
        for e in lh.episodes:
            key = (e["from"], -lh.index)
            if best is None or key < best[0]:
                best = (key, {"layer": lh.layer, "status": e["status"], "step": e["from"]})
    return best[1] if best else None


def run_timeline(layers: list[LayerHealth], answer: dict[str, Any] | None, depth: np.ndarray
              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(timeline, earlier)``. The timeline is chronological from the answer's chain start: entry 0 is the answer's
    first status on its layer ("first to go wrong"), then each other status when a layer first reached it from there
    on ("first layer to reach <status>"). Episodes that began before the chain are in ``earlier`` ("earlier,
    recovered" when every one of them ended before it, else "earlier, lasted past step N"). Ties at one step go to
    the answer's layer, else to the deepest layer's largest variable (:func:`deepest_first`); ``layers`` counts the
    layers that ever had the status. Without an answer, every episode is ``earlier``."""
    start = answer["step"] if answer is not None else None
    ever: dict[str, set[str]] = {}
    late: dict[str, tuple[tuple, LayerHealth, int]] = {}
    early: dict[str, tuple[tuple, LayerHealth, int]] = {}
    early_to: dict[str, int] = {}
    sizes = np.array([lh.size for lh in sorted(layers, key=lambda x: x.index)], dtype=np.float64)
    for lh in layers:
        for e in lh.episodes:
            st = e["status"]
            ever.setdefault(st, set()).add(lh.layer)
            before = start is None or e["from"] < start
            ours = answer is not None and lh.layer == answer["layer"]
            key = (e["from"], not ours, *(-k for k in deepest_first(depth, sizes, lh.index)))
            bucket = early if before else late
            if st not in bucket or key < bucket[st][0]:
                bucket[st] = (key, lh, e["from"])
            if before:
                early_to[st] = max(early_to.get(st, e["to"]), e["to"])
    earlier = [_entry(st, lh, step, len(ever[st]), "earlier, recovered" if start is None or early_to[st] < start
                      else f"earlier, lasted past step {start}") for st, (_, lh, step) in sorted(
                          early.items(), key=lambda kv: kv[1][0])]
    if answer is None:
        return [], earlier
    first = {"status": answer["status"], "step": answer["step"], "layer": answer["layer"],
             "layers": len(ever.get(answer["status"], ())) or 1, "label": "first to go wrong"}
    rest = [_entry(st, lh, step, len(ever[st]), f"first layer to reach {st}")
            for st, (_, lh, step) in sorted(late.items(), key=lambda kv: kv[1][0]) if st != answer["status"]]
    return [first, *rest], earlier


def _entry(status: str, lh: LayerHealth, step: int, count: int, label: str) -> dict[str, Any]:
    return {"status": status, "step": int(step), "layer": lh.layer, "layers": count, "label": label}


def _nonfinite_origin(nonfinite: np.ndarray) -> tuple[int, int, int] | None:
    """(first step row with NaN/Inf, deepest layer nonfinite there, how many layers were) or None."""
    rows = np.flatnonzero(nonfinite.any(axis=1))
    if rows.size == 0:
        return None
    r = int(rows[0])
    bad = np.flatnonzero(nonfinite[r])
    return r, int(bad[-1]), int(bad.size)
