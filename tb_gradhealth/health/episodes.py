"""Episodes: a layer's per-step statuses become runs of one status (slow diseases confirmed over several logged steps,
explosions back-dated to where they left their floor), and the run-wide onset and timeline."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tb_gradhealth.health import thresholds as th
from tb_gradhealth.health.answer import deepest_first
from tb_gradhealth.health.levels import condemned_since, layer_groups
from tb_gradhealth.health.recovery import Lasting, Losses, Recovery
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
    joined: bool = False  # the chain is dated where another variable's blow-up, going on when it began, began
    #: exploding runs that are other variables' blow-up, which no rule of this one flagged (:func:`sweep_blowup`), by
    #: first position: (row the blow-up began, the variables it began in, decades this one's gradient rose by then)
    swept: dict[int, tuple[int, tuple[int, ...], float]] = field(default_factory=dict)
    need: int = 1  # logged steps a slow status had to last to be confirmed (shorter on a short run)
    #: runs carried on past their rules because the layer has not recovered, by first position: the loss's figures
    lasting: dict[int, Lasting] = field(default_factory=dict)
    #: records since the layer last raised a flag, where its exploding run is held open over them (:func:`_hold_open`)
    quiet: int = 0

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


def _confirm(runs: list[list[int]], steps: np.ndarray, need: int, sustain: int) -> tuple[int, int] | None:
    """Relabel in place the runs that need confirmation; returns the trailing unconfirmed slow run, if any.

    A vanishing, dead or missing run is confirmed when it lasts ``sustain`` logged steps (``sustain_steps``). A
    vanishing one on a run with too few logged steps for that is confirmed over ``need`` of them (half the layer's
    logged steps) when those cover ``sustain`` training steps or more (``steps``: the rows' steps; counted from the
    logged step before the run, or from step 0): four logged steps 100 steps apart are a sustained stretch, the first
    three steps of a run logged at every step are not. Dead and missing need ``sustain`` logged steps whatever the
    run's length: a parameter used at some steps only (an expert that got no token, a branch not taken, embedding
    rows) has no gradient, or an all-zero one, at one step or another, and a zero-initialised multiplier (ReZero, a
    zero-initialised residual branch) cuts its branch's gradient at the first step by design. A run that directly
    follows a flagged one needs no confirmation: a layer that is already sick (a saturating layer collapsing to zero
    inside a divergence). A healthy stretch of at most ``CHAIN_GAP`` steps between two exploding or nonfinite runs
    continues the first (one quiet minibatch in a divergence is not a recovery); a record with a gradient never
    becomes missing or dead.
    """
    unconfirmed = None
    for k, r in enumerate(runs):
        length = r[2] - r[1] + 1
        span = int(steps[r[2]]) - (int(steps[r[1] - 1]) if r[1] > 0 else -1)
        confirmed = length >= sustain or (r[0] == th.VANISHING and length >= need and span >= sustain)
        after_flag = k > 0 and runs[k - 1][0] in th.FLAG_CODES
        if r[0] in (th.VANISHING, th.DEAD, th.MISSING) and not confirmed and not after_flag:
            if k == len(runs) - 1:
                unconfirmed = (r[0], length)
            r[0] = th.HEALTHY
    for k in range(1, len(runs) - 1):
        r = runs[k]
        if r[0] == th.HEALTHY and r[2] - r[1] + 1 <= CHAIN_GAP and runs[k - 1][0] in _BRIDGED \
                and runs[k + 1][0] in _BRIDGED:
            r[0] = runs[k - 1][0]
    return unconfirmed


#: The statuses a short healthy stretch between two flagged runs does not interrupt: a divergence's quiet minibatch.
_BRIDGED = frozenset({th.EXPLODING, th.NONFINITE})


def _quiet_after_blowup(runs: list[list[int]]) -> int:
    """The length of a trailing healthy stretch of at most ``CHAIN_GAP`` records right after an exploding run (0
    when there is none): the records since the layer last raised a flag, read before recovery carries the run on."""
    if len(runs) < 2:
        return 0
    last, prev = runs[-1], runs[-2]
    length = last[2] - last[1] + 1
    return length if last[0] == th.HEALTHY and prev[0] == th.EXPLODING and length <= CHAIN_GAP else 0


def _hold_open(runs: list[list[int]], quiet: int) -> int:
    """Relabel in place the trailing healthy stretch as exploding where the layer last raised a flag ``quiet``
    (at most ``CHAIN_GAP``) records ago and its exploding run ended there anyway (recovery read as measured: the
    loss back to its level, or the run's own end for an episode that began the run); returns ``quiet``, or 0 when
    nothing is held. The bridge above joins such a stretch to the run when the layer flags again after it, so as
    of its steps the episode has not ended yet: reading it as ended there and as one episode a step later would
    tell two stories about the same step (and move the run's answer to another layer and back). The episode ends
    once the layer has raised no flag for more than ``CHAIN_GAP`` logged steps. Not after a nonfinite run: a finite
    record is a fact, and nonfinite is judged at the diagnosed step."""
    if not quiet or len(runs) < 2 or runs[-1][0] != th.HEALTHY or runs[-2][0] != th.EXPLODING:
        return 0
    runs[-1][0] = th.EXPLODING
    return quiet


#: Records of a healthy stretch needed for "where a layer typically stood" before an exploding run is back-dated.
TYPICAL_POINTS = 3


def _backdate(runs: list[list[int]], col: np.ndarray, t: th.Thresholds, own: np.ndarray | None = None,
              late: np.ndarray | None = None) -> None:
    """An exploding run after a healthy one starts where the layer's RMS left its own range against the rest of the
    network (``col``: its log RMS minus the median of the other variables'): over the logged steps just before the
    run (at most ``growth_window`` of them), the first of the trailing stretch at which it stood more than minibatch
    noise (twice the trend's per-step slope, 0.4 decades) above the highest it stood over the healthy stretch before
    them, no more than ``CHAIN_GAP`` steps in a row falling back (a quiet minibatch in the middle of the rise does
    not move the onset). That range needs ``TYPICAL_POINTS`` records: the first record or two of a run (gradients at
    initialisation) are no range to leave. A rise within the layer's own earlier swings is what a clean run's
    gradients do too. A rise of the whole network together (gradients growing as training gets going) or back to
    where the layer already stood is no onset: a run whose records up to a step are those of a clean run (a clipped
    twin's, until the first step its clip bites) has no episode there, and a cause acting on every layer at once is
    dated where its first rule fires. A run flagged by a loss that swings by decades (``late``) is no clean run's:
    there the layer's own RMS (``own``) is read, for a blow-up alike in every layer."""
    for k in range(1, len(runs)):
        code, first, last = runs[k]
        prev = runs[k - 1]
        if code != th.EXPLODING or prev[0] != th.HEALTHY:
            continue
        lo = max(prev[1], first - t.growth_window, 1)
        read = own if own is not None and late is not None and late[first:last + 1].any() else col
        before = read[prev[1]:lo]  # where it stood over the healthy stretch, before the steps searched
        if np.count_nonzero(np.isfinite(before)) < TYPICAL_POINTS:
            continue
        j = _rise_start(read, first, lo, np.nanmax(before) + t.step_noise)
        runs[k][1], prev[2] = j, min(prev[2], j - 1)


def _rise_start(read: np.ndarray, first: int, lo: int, line: float) -> int:
    """The first position of the stretch before ``first`` (down to ``lo``) over which ``read`` stood above
    ``line``, no more than ``CHAIN_GAP`` positions in a row falling back; ``first`` when the one before it did not."""
    j, gap = first, 0
    for r in range(first - 1, lo - 1, -1):
        if read[r] > line:
            j, gap = r, 0
        else:
            gap += 1
            if gap > CHAIN_GAP:
                break
    return j


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


def _lasting(runs: list[list[int]], weight: np.ndarray, small: np.ndarray, recovery: Recovery
             ) -> dict[int, Lasting]:
    """An exploding or nonfinite run goes on over the healthy steps after it until it has recovered
    (:class:`Recovery`: the loss back to its level before the run, or without a loss the layer's gradient and
    update back in their earlier range) and its weights are no longer ``BLOWN_UP`` times their norm before the run
    (a blow-up of the weights that is not undone leaves the layer damaged even when its gradient looks ordinary).
    Not while the weights are small by design (``small``: a parameter that started near zero and is still below its
    layer's scale is meant to grow by any factor). Returns, per run carried on (keyed by its first position), the
    figures that carried it."""
    carried: dict[int, Lasting] = {}
    for k in range(len(runs) - 1):
        code, first, last = runs[k]
        nxt = runs[k + 1]
        if code not in (th.EXPLODING, th.NONFINITE) or nxt[0] != th.HEALTHY:
            continue
        before = weight[first - 1] if first > 0 else weight[first]
        j = last
        why = None
        while j + 1 <= nxt[2]:
            well, figures = recovery.recovered(first, last, j + 1)
            blown = before > 0 and weight[j + 1] >= BLOWN_UP * before and not small[j + 1]
            if well and not blown:
                break
            j += 1
            why = figures if not well else why
        if j > last:
            runs[k][2], nxt[1] = j, j + 1
            if why is not None:
                carried[first] = why
    return carried


def sustain_needed(logged: int, sustain_steps: int) -> int:
    """Logged steps a slow status must last: ``sustain_steps``, or half the layer's logged steps (at least one) on a
    run too short for it, so a run with 1-4 records can still show vanishing or dead (with less certainty)."""
    return max(1, min(sustain_steps, (logged + 1) // 2))


def track(ev: Steps, i: int, t: th.Thresholds, steps: np.ndarray, losses: Losses | None = None) -> Track:
    """The layer's confirmed runs over the steps where it has a record (``steps``: every logged step of the run,
    ``losses``: the recorded loss, for recovery)."""
    rows = np.flatnonzero(ev.columns("present")[i])
    runs = _runs(ev.columns("raw")[i, rows].astype(np.int64))
    need = sustain_needed(len(rows), t.sustain_steps)
    unconfirmed = _confirm(runs, steps[rows], need, t.sustain_steps)
    runs = _merge_equal(runs)
    quiet = _quiet_after_blowup(runs)
    _confirmed_late(runs, ev.columns("exp_late")[i, rows], ev.columns("exp_level")[i, rows])
    log_rms = ev.columns("log_rms")[i, rows]
    _backdate(runs, log_rms - ev.columns("others")[i, rows], t, log_rms, ev.columns("exp_late")[i, rows])
    recovery = Recovery(steps[rows], losses, log_rms, ev.columns("log_upd")[i, rows], t)
    carried = _lasting(runs, ev.columns("weight_norm")[i, rows], ev.columns("small")[i, rows], recovery)
    runs = _merge_equal([r for r in runs if r[2] >= r[1]])
    quiet = _hold_open(runs, quiet)
    runs = _merge_equal(runs)
    lasting = {a: carried[a] for _, a, _ in runs if a in carried}
    return Track(rows, [tuple(r) for r in runs], unconfirmed, need=need, lasting=lasting, quiet=quiet)


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


def join_blowup(tracks: list[Track | None], ev: Steps, layers: Sequence[str], t: th.Thresholds) -> frozenset[str]:
    """One blow-up, one onset: a variable whose current chain begins exploding, or NaN/Inf, while another
    variable's exploding chain is going on (begun earlier, not over yet) was reached by that blow-up where its own
    gradient left its range: its chain starts at the first of the steps from the blow-up's start at which its RMS
    stood more than minibatch noise (twice the trend's per-step slope) above the highest it stood before the blow-up
    began, no more than ``CHAIN_GAP`` steps in a row falling back (``Track.joined``). A network that diverges
    reaches its layers one after another, and a layer crosses a rule's line (or overflows) later than its gradient
    starts to grow; the search never goes before the first chain's start, which is dated where that layer's records
    left their range, so no chain moves into steps the diagnosis calls clean. A layer whose gradient did not rise
    before its own flag keeps its onset; only an exploding chain starts a blow-up (NaN/Inf injected in one layer,
    units that died, are other events).
    Returns the variables whose onset moved that way."""
    flagged = [(c, tr, chain_code(tr)) for c, tr in enumerate(tracks) if tr is not None and tr.code in th.FLAG_CODES]
    chains = sorted((int(tr.rows[tr.chain_start()]), int(tr.rows[tr.runs[-1][2]]), c, code)
                    for c, tr, code in flagged if code in (th.EXPLODING, th.NONFINITE))
    began: dict[int, int] = {}  # column -> the row where the blow-up it is part of began
    going: list[tuple[int, int]] = []  # heap of (row its blow-up began, last row) of the chains begun so far
    for _, group in itertools.groupby(chains, key=lambda chain: chain[0]):
        group = list(group)
        start = group[0][0]
        while going and going[0][1] < start:  # over before this start, so before every later one too
            heapq.heappop(going)
        for _, _, c, _ in group:
            if going:
                began[c] = going[0][0]
        for s, e, c, code in group:
            if code == th.EXPLODING:
                heapq.heappush(going, (began.get(c, s), e))
    moved = []
    for c, row in began.items():
        track = tracks[c]
        own = ev.columns("log_rms")[c, track.rows]
        lo, first = int(np.searchsorted(track.rows, row)), track.chain_start()
        if not np.isfinite(own[:lo]).any():
            continue
        j = _rise_start(own, first, lo, np.nanmax(own[:lo]) + t.step_noise)
        if j < first:
            track.chain_from, track.joined = j, True
            moved.append(c)
    return frozenset(layers[c] for c in moved)


def sweep_blowup(tracks: list[Track | None], ev: Steps, layers: Sequence[str], t: th.Thresholds) -> frozenset[str]:
    """One blow-up, every layer it reached. A blow-up spans the exploding chains of any variables that overlap (from
    the first one's start to the last one's end, carried on while the run has not recovered). A variable that no
    rule flagged over that span but whose gradient rose with it, standing at the blow-up's first step half the
    growth line or more above its lowest over the ``growth_window`` logged steps before (the runaway-loss rule's reading
    of a gradient that rose with a runaway loss), is exploding over the span (``Track.swept``). A network that
    diverges does not flag every layer: the rules' lines sit above what the first layers to blow up show, and the
    rest rise with them by a decade or so and then look ordinary while the loss stays where the blow-up left it. A
    variable whose gradient did not rise keeps its status, and nothing moves before a blow-up's start, so a run the
    diagnosis calls clean there stays clean. Returns the variables swept up that way."""
    log_rms = ev.columns("log_rms")
    swept = set()
    for start, end, began in _blowups(tracks):
        for c, tr in enumerate(tracks):
            if tr is None or c in began:
                continue
            a, b = int(np.searchsorted(tr.rows, start)), int(np.searchsorted(tr.rows, end, side="right")) - 1
            if a > b or tr.rows[a] != start:
                continue
            k = next(k for k, (_, lo, hi) in enumerate(tr.runs) if lo <= a <= hi)
            if tr.runs[k][0] != th.HEALTHY or tr.runs[k][2] < b:
                continue
            own = log_rms[c, tr.rows]
            before = own[max(0, a - t.growth_window):a]
            before = before[np.isfinite(before)]
            if not before.size or not own[a] - before.min() >= t.growth_decades / 2:
                continue
            code, lo, hi = tr.runs[k]
            tr.runs[k:k + 1] = ([(code, lo, a - 1)] if a > lo else []) + [(th.EXPLODING, a, b)] + (
                [(code, b + 1, hi)] if b < hi else [])
            tr.swept[a] = (start, began, float(own[a] - before.min()))
            swept.add(c)
    return frozenset(layers[c] for c in swept)


def _blowups(tracks: list[Track | None]) -> list[tuple[int, int, tuple[int, ...]]]:
    """``(first row, last row, the variables it began in, last in network order first)`` of each blow-up: the
    flagged chains that begin exploding, overlapping ones taken together, by start."""
    chains = []
    for c, tr in enumerate(tracks):
        if tr is None:
            continue
        k = 0
        while k < len(tr.runs):
            if tr.runs[k][0] not in th.FLAG_CODES:
                k += 1
                continue
            j = k
            while j + 1 < len(tr.runs) and tr.runs[j + 1][0] in th.FLAG_CODES:
                j += 1
            a = tr.chain_start() if j == len(tr.runs) - 1 else tr.runs[k][1]
            code = next(code for code, lo, hi in tr.runs if lo <= a <= hi)
            if (code if code in th.FLAG_CODES else tr.runs[k][0]) == th.EXPLODING:  # a start moved into the runs before
                chains.append((int(tr.rows[a]), int(tr.rows[tr.runs[j][2]]), c))
            k = j + 1
    out: list[tuple[int, int, tuple[int, ...]]] = []
    for start, end, c in sorted(chains):
        if out and start == out[-1][0]:
            out[-1] = (start, max(out[-1][1], end), (c, *out[-1][2]))
        elif out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end), out[-1][2])
        else:
            out.append((start, end, (c,)))
    return [(start, end, tuple(sorted(began, reverse=True))) for start, end, began in out]


def _overlapping_start(track: Track, others: Sequence[Track]) -> int | None:
    """The earliest row at which a flagged chain of ``others`` overlapping ``track``'s current chain starts: any
    such chain that starts earlier, and one that starts later only when it begins with the same status (a bias
    that blew up before its kernel's units died keeps its own onset)."""
    a, z = track.rows[track.chain_start()], track.rows[track.runs[-1][2]]
    first = chain_code(track)
    starts = [int(o.rows[o.chain_start()]) for o in others
              if o.code in th.FLAG_CODES and o.rows[o.chain_start()] <= z and a <= o.rows[o.runs[-1][2]]
              and (o.rows[o.chain_start()] < a or chain_code(o) == first)]
    return min(starts) if starts else None


def chain_code(track: Track) -> int:
    """The status the track's current chain begins with (its current status when that is not flagged)."""
    start = track.chain_start()
    return next((code for code, a, b in track.runs if a <= start <= b), track.code)


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
