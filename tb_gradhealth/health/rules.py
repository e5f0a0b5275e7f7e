"""The per-step rules: every rule evaluated for every (logged step, layer) at once on ``[S, L]`` arrays, which gives
each layer a raw status per step. Vanishing and exploding are judged against the *reference* (the layers nearest the
loss), never a statistic that sinks with the disease; what the rules read is computed in
:mod:`tb_gradhealth.health.levels`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from tb_gradhealth.health import thresholds as th
from tb_gradhealth.health.levels import (
    adaptive,
    in_layer,
    in_runs_of,
    layer_below,
    layer_groups,
    layer_weight_scale,
    layerwise_common,
    live_stats,
    log10,
    loudest_sibling,
    median_of_others,
    median_where,
    output_group,
    pinned_at_clip,
    reference,
    reference_layers,
    reference_top,
    small_weights,
    update_stats,
    window_median,
    window_range,
    window_stats,
)

if TYPE_CHECKING:
    from tb_gradhealth.health.progress import LossWindows

#: Trend and update rules skip tensors smaller than this: a one-element bias crossing zero has an RMS that dips by
#: decades and comes back, which says nothing about the network.
TREND_MIN_SIZE = 16
#: Round-off: a gradient RMS below this fraction of the largest it has been in the run (a hundred float32 epsilons)
#: is what float32 arithmetic leaves of a gradient that is zero in exact arithmetic: a converged model, not a
#: disease. Relative to the run's own history, so it does not depend on the loss's scale.
ROUNDOFF = 100 * float(np.finfo(np.float32).eps)
#: Logged steps over which the positive-feedback signature of a divergence must hold.
FEEDBACK_STEPS = 2


#: A step whose recorded gradients' global norm is within this fraction of the clip the loop states was clipped to
#: it (``clip_grad_norm_`` divides by the norm plus 1e-6, and the records hold float32 norms).
CLIP_REACHED = 1e-3


def clip_room(norm: np.ndarray, clip_norm: float | None) -> np.ndarray:
    """``[S]``: the decades by which each logged step's gradients could still grow before the global norm
    ``clip_norm`` the loop states (``source["clip_norm"]``) holds them: ``log10(clip / global norm)`` over every
    variable's ``norm`` ``[S, L]``, at most ``log10(1 / (1 - CLIP_REACHED))`` at a step the loop clipped (the
    records hold the gradient after the clip, at it, or before, above it). Infinite without a clip."""
    if clip_norm is None or not clip_norm > 0:
        return np.full(norm.shape[0], np.inf)
    total = np.sqrt(np.nansum(np.where(np.isfinite(norm), norm, np.nan) ** 2, axis=1))
    with np.errstate(divide="ignore"):
        return np.log10(clip_norm) - np.log10(total)


def clipped_steps(room: np.ndarray) -> np.ndarray:
    """``[S]``: the logged steps whose gradients the loop clipped to the global norm it states: their global norm
    reached the clip (``room`` from :func:`clip_room`). False without a clip."""
    return room <= -np.log10(1.0 - CLIP_REACHED)


def _feedback(log_rms: np.ndarray, log_upd: np.ndarray, t: th.Thresholds,
              near_clip: np.ndarray | None = None) -> np.ndarray:
    """``[S, L]``: the signature of a learning-rate divergence, free of the gradient's scale: each update moves the
    layer's weights by more than ``update_ratio_above`` of their RMS (``log_upd``: update RMS over the layer's weight
    RMS), and the gradient and the update both grew by more than minibatch noise (the trend's own per-step slope,
    ``2 * growth_decades / growth_window``) at each of the last ``FEEDBACK_STEPS`` logged steps: the step makes the
    next gradient larger. An adaptive optimizer's update does not grow with the gradient, so it never shows this,
    nor does a step whose gradients sit within ``growth_decades`` of the global norm the loop clips to
    (``near_clip`` ``[S]``, the steps clipped included): the clip holds every later step's size before the gradient
    grows by what the trend rule calls growth, so the loop the signature predicts cannot run away."""
    rise = t.step_noise

    def up(x: np.ndarray) -> np.ndarray:
        out = np.zeros(x.shape, dtype=bool)
        with np.errstate(invalid="ignore"):
            out[1:] = x[1:] - x[:-1] >= rise
        return out

    with np.errstate(invalid="ignore"):
        step = (log_upd > np.log10(t.update_ratio_above)) & up(log_rms) & up(log_upd)
    if near_clip is not None:
        step &= ~near_clip[:, None]
    out = step.copy()
    for j in range(1, FEEDBACK_STEPS):
        out[j:] &= step[:-j]
        out[:j] = False
    return out


def _stalled_reference(ref: np.ndarray, ref_upd: np.ndarray, log_rms: np.ndarray, log_upd: np.ndarray,
                       signal: np.ndarray, t: th.Thresholds) -> np.ndarray:
    """``[S]``: the layers nearest the loss are sick themselves, so they cannot be the reference: where updates are
    recorded, they barely learn (update RMS below ``update_ratio_below`` of their weights' RMS) while the network's
    median layer learns ``update_decades`` faster and its gradient is ``vanish_decades`` above theirs."""
    if not t.update_ratio_below > 0:
        return np.zeros(ref.shape, dtype=bool)
    with np.errstate(invalid="ignore"):
        all_rms = median_where(log_rms, signal)
        all_upd = median_where(log_upd, signal & np.isfinite(log_upd))
        return ((ref_upd < np.log10(t.update_ratio_below)) & (all_upd - ref_upd >= t.update_decades)
                & (all_rms - ref >= t.vanish_decades))


@dataclass
class Steps:
    """The rules evaluated on ``[S, L]`` records (or ``[1, L]`` for a single step)."""

    raw: np.ndarray  # int8 status code per (step, layer); ABSENT where no record
    size: np.ndarray
    rms: np.ndarray  # RMS of the nonzero finite values: a sparse gradient is judged on the rows that got one
    max_abs: np.ndarray
    norm: np.ndarray  # L2 norm of the finite values (what a clip caps)
    log_rms: np.ndarray  # NaN where the gradient is not live (absent, missing, nonfinite, all-zero)
    ref: np.ndarray  # [S] log10 RMS of the reference layers (nearest the loss)
    log_upd: np.ndarray  # log10 learning rate: update RMS / weight RMS of its layer, NaN where not recorded
    log_grad: np.ndarray  # log10 gradient RMS / weight RMS of its layer, NaN where either is not known
    ref_upd: np.ndarray  # [S] log10 learning rate of the reference layers
    upd_ratio: np.ndarray  # ||update|| / ||weight||, NaN where not recorded
    weight_norm: np.ndarray  # ||weight||, NaN where not recorded
    sibling: np.ndarray  # log10 RMS of the loudest other variable of the same layer
    base: np.ndarray  # log10 RMS the trend is measured from (lowest of the previous window)
    flags: dict[str, np.ndarray]
    proportional: bool = False  # updates are recorded and follow the gradient's size (plain SGD)
    clip_norm: float | None = None  # the global norm the loop states it clips the gradients to

    def __getattr__(self, name: str) -> np.ndarray:
        try:
            return self.__dict__["flags"][name]
        except KeyError:
            raise AttributeError(name) from None

    def dec(self, s: int, i: int) -> float:
        return float(self.log_rms[s, i] - self.ref[s])

    def columns(self, name: str) -> np.ndarray:
        """``[L, S]`` contiguous copy of a per-(step, layer) array, made once: the per-layer passes read columns."""
        cache = self.__dict__.setdefault("_columns", {})
        if name not in cache:
            cache[name] = np.ascontiguousarray(getattr(self, name).T)
        return cache[name]


class _Levels(NamedTuple):
    """Where each (step, layer) stands before any rule is applied."""

    log_rms: np.ndarray  # NaN where the gradient is not live
    sibling: np.ndarray  # log10 RMS of the loudest other variable of the same layer
    inert: np.ndarray  # round-off only: far below its siblings and below the vanishing line
    signal: np.ndarray  # live and not round-off: what the relative rules judge
    ref: np.ndarray  # [S] log10 RMS of the reference layers
    log_upd: np.ndarray  # log10 update RMS over its layer's weight RMS, NaN where not recorded
    ref_upd: np.ndarray  # [S] the same for the reference layers
    upd_rms: np.ndarray
    upd_ratio: np.ndarray  # ||update|| / ||weight||
    weight_norm: np.ndarray
    clipped: np.ndarray  # the gradient norm sits at its clip (per-variable clipping)
    clip_room: np.ndarray  # [S] decades the gradients could grow before the global clip the loop states holds them
    scale: np.ndarray  # log10 weight RMS of its layer (its largest variable's), NaN where not recorded

    @property
    def global_clipped(self) -> np.ndarray:
        """``[S]`` the loop clipped the step's gradients to the global norm it states."""
        return clipped_steps(self.clip_room)

    def dec(self) -> np.ndarray:
        """``[S, L]`` decades above (+) or below (-) the reference."""
        return self.log_rms - self.ref[:, None]


def _round_off(quiet_sibling: np.ndarray, low: np.ndarray, n_layers: int, groups: list[np.ndarray]) -> np.ndarray:
    """``[S, L]`` inert: far below the other variables of its layer and below the vanishing line. The last layer's
    variables feed the loss directly: nothing after them can cancel their gradient to round-off."""
    inert = quiet_sibling & low
    head = output_group(groups, n_layers)
    if head is not None:
        inert[:, head] = False
    return inert


def _references(ref: np.ndarray, log_rms: np.ndarray, log_upd: np.ndarray, signal: np.ndarray,
                t: th.Thresholds) -> tuple[np.ndarray, np.ndarray]:
    """The reference's log RMS and log learning rate per step; where the layers nearest the loss are sick
    themselves (:func:`_stalled_reference`), the network's median takes their place."""
    ref_upd = reference(np.where(signal, log_upd, np.nan), signal & np.isfinite(log_upd))
    stalled = _stalled_reference(ref, ref_upd, log_rms, log_upd, signal, t)
    if stalled.any():
        ref = np.where(stalled, median_where(log_rms, signal), ref)
        ref_upd = np.where(stalled, median_where(log_upd, signal & np.isfinite(log_upd)), ref_upd)
    return ref, ref_upd


def _levels(records: np.ndarray, n_layers: int, v: dict[str, np.ndarray], groups: list[np.ndarray],
            t: th.Thresholds, clip_norm: float | None = None) -> _Levels:
    """Each variable's live log RMS against the reference and its siblings (round-off candidates out of the
    reference), its learning rate against the reference layers', and whether its gradient sits at a clip."""
    live, rms = v["live"], v["rms"]
    log_rms = np.where(live, log10(rms), np.nan)
    sibling = loudest_sibling(log_rms, groups)
    quiet_sibling = live & (log_rms <= sibling - t.inert_decades)
    ref = reference(log_rms, live & ~quiet_sibling)
    low = (log_rms - ref[:, None] <= -t.vanish_decades) | (rms < t.vanish_rms_below)
    inert = _round_off(quiet_sibling, low, n_layers, groups)
    signal = live & ~inert
    upd_rms, upd_ratio, weight_norm = update_stats(records)
    scale = layer_weight_scale(weight_norm, v["size"], groups)
    log_upd = log10(upd_rms) - scale
    ref, ref_upd = _references(ref, log_rms, log_upd, signal, t)
    return _Levels(log_rms, sibling, inert, signal, ref, log_upd, ref_upd, upd_rms, upd_ratio, weight_norm,
                   pinned_at_clip(v["norm"]), clip_room(v["norm"], clip_norm), scale)


#: Consecutive steps a dynamic loss scaler may skip while it finds its scale: halving from the default initial scale
#: (2**16 in PyTorch's GradScaler, 2**15 in Keras' LossScaleOptimizer) to 1 takes 16 skips; past that, the
#: gradients overflow unscaled and the scaler cannot recover.
SCALER_HALVINGS = 16


def _skipped(nonfinite: np.ndarray, lv: _Levels, told: np.ndarray | None, t: th.Thresholds) -> np.ndarray:
    """``[S]`` steps the optimizer skipped, on evidence. The signature: NaN/Inf in a layer whose weights are finite
    while no layer was updated (dynamic loss scaling skips a whole step after an overflow). A NaN update has no
    finite element either, so the signature alone is no evidence: the step counts as skipped when the writer says so
    (``told``, ``[S]``: 1 skipped, 0 applied, NaN unknown: the ``amp/step_skipped`` scalar; its word needs no
    signature, e.g. the zeros that clipping an infinite total norm leaves), or when the next logged record is finite
    (a NaN update would have made every later gradient NaN). The last record of a run has no next one: it stopped
    there, and nothing says a step was skipped. A stretch of skipped steps that does not end is a loss scaler that
    cannot recover (NaN/Inf at every step): ``sustain_steps`` on the signature alone, :data:`SCALER_HALVINGS` where
    the writer said each was skipped."""
    signature = nonfinite & (lv.upd_rms == 0) & (lv.weight_norm > 0) & np.isfinite(lv.weight_norm)
    told = np.full(nonfinite.shape[0], np.nan) if told is None else told
    step = (signature.any(axis=1) & ~(lv.upd_rms > 0).any(axis=1)) | (told == 1)
    any_nan = nonfinite.any(axis=1)
    out = np.zeros(step.shape, dtype=bool)
    cuts = np.flatnonzero(np.diff(np.concatenate([[0], step.astype(np.int8), [0]])))
    for a, b in zip(cuts[::2], cuts[1::2], strict=True):  # each stretch [a, b) of consecutive candidate rows
        said = told[a:b]
        went_on = b < step.size and not any_nan[b]
        all_said = bool(np.all(said == 1))
        evidence = all_said or (went_on and not np.any(said == 0))
        out[a:b] = evidence and b - a < (SCALER_HALVINGS if all_said else t.sustain_steps)
    return out


class _Guards(NamedTuple):
    """What keeps a rule from firing where its evidence means something else."""

    learns: np.ndarray  # the layer learns within update_decades of the reference layers' pace (or no updates)
    calm: np.ndarray  # ... and not update_decades faster
    above_roundoff: np.ndarray  # not at round-off of the largest gradient it has had
    small: np.ndarray  # weights that started near zero on purpose: their relative growth is by design
    converged: np.ndarray  # the layers nearest the loss receive only round-off
    big: np.ndarray  # large enough for a trend or an update ratio of its own
    layerwise: np.ndarray  # [S] a layer-wise adaptive optimizer (LAMB, LARS)


def _running_peak(log_values: np.ndarray) -> np.ndarray:
    """The largest value of each column up to each row, the row included (NaN ignored; -inf before any value)."""
    return np.fmax.accumulate(np.where(np.isnan(log_values), -np.inf, log_values), axis=0)


def _roundoff_line(log_values: np.ndarray) -> np.ndarray:
    """Log10 of round-off (``ROUNDOFF``) of the largest value each column has had up to each row: below it, a value
    is what float32 arithmetic leaves of a zero."""
    return _running_peak(log_values) + np.log10(ROUNDOFF)


def _guards(lv: _Levels, size: np.ndarray, groups: list[np.ndarray], t: th.Thresholds) -> _Guards:
    with np.errstate(invalid="ignore"):
        speed = lv.log_upd - lv.ref_upd[:, None]  # NaN where updates are not recorded: the gradient rules decide
        learns = (t.update_decades > 0) & (speed > -t.update_decades)
        calm = (t.update_decades > 0) & (speed < t.update_decades)
        above_roundoff = ~(lv.log_rms < _roundoff_line(lv.log_rms))
        converged = np.broadcast_to((lv.ref < _roundoff_line(lv.ref))[:, None], lv.log_rms.shape)
    return _Guards(learns, calm, above_roundoff, small_weights(lv.weight_norm, lv.upd_rms, size, groups), converged,
                   size >= TREND_MIN_SIZE, np.isfinite(layerwise_common(lv.upd_ratio, lv.weight_norm, size)))


def _peak_before(log_sig: np.ndarray, window: int) -> np.ndarray:
    """``[S, L]`` the largest log RMS of each column before the previous ``window`` rows (-inf where none): the
    scale the variable had reached before the stretch a trend is measured over."""
    peak = _running_peak(log_sig)
    out = np.full(log_sig.shape, -np.inf)
    out[window + 1:] = peak[:-window - 1]
    return out


def _against_learning(loss: LossWindows | None, t: th.Thresholds, shape: tuple[int, int]) -> np.ndarray:
    """``[S, 1]``: the recorded loss says the network is not learning at that step: it rises over the trend's window
    or swings by an order of magnitude (False where no loss is recorded)."""
    if loss is None:
        return np.zeros((shape[0], 1), dtype=bool)
    return (loss.rises | loss.swings(t))[:, None]


def _trend(lv: _Levels, signal: np.ndarray, g: _Guards, t: th.Thresholds, loss: LossWindows | None = None
           ) -> tuple[np.ndarray, np.ndarray]:
    """``[S, L]`` exploding by trend and the base it is measured from (the lowest log RMS of the previous window,
    over the steps with ``signal``): RMS grew ``growth_decades`` above that base and half as much above the window's
    mean and its median (a return from a one-batch dip to where the layer stood is no growth), a base taken no lower
    than round-off of the largest the layer has been (a rise out of round-off is no growth), not rising out of the
    vanishing zone (a branch whose scale grows by design) and not at round-off, and
    growing past where a learning layer goes: above every other reference layer *and* above the largest it had
    been before the window, each by more than minibatch noise (0.4 decades, ``2 * growth_decades / growth_window``;
    a reference layer also by outgrowing the median layer by the growth line), or
    with the reference rising by decades too (half the growth line: the whole network grows) while the loss rises
    or swings, or is not recorded (a fit scaling up to large targets grows every gradient while its loss holds or
    falls). A gradient that rises
    *to* the reference or back to its own earlier scale is a layer starting to learn (a zero-initialised parameter,
    query and key kernels leaving their small init); within a decade below the reference it is a flag only where
    the loss says the network does not learn (it rises or swings by decades)."""
    log_sig = np.where(signal, lv.log_rms, np.nan)
    base, typical = window_stats(log_sig, t.growth_window)
    ref_low, ref_mean = window_stats(lv.ref[:, None], t.growth_window)
    with np.errstate(invalid="ignore"):
        dec = lv.dec()
        # the layers nearest the loss rise by decades too (half the growth line): the whole network grows
        ref_grew = (lv.ref - ref_low[:, 0] >= t.growth_decades / 2)[:, None]
        # past a scale by more than minibatch noise (twice the trend's own per-step slope, as the onset reads it)
        noise = t.step_noise
        near_loss = reference_layers(signal)
        top = np.fmax(reference_top(lv.log_rms, near_loss), _peak_before(log_sig, t.growth_window))
        beyond = log_sig > top + noise
        # a layer nearest the loss is past the others only when it also outgrew the network (by the growth line
        # beyond the median layer's growth over the window): an output weight growing alone beside its calm bias,
        # not one growing with every hidden layer while the fit scales up
        grown = log_sig - base
        outgrew = grown - median_where(grown, ~np.isnan(grown))[:, None] >= t.growth_decades
        beyond &= ~near_loss | outgrew
        # ... unless the loss holds or falls meanwhile: the fit scaling up to its targets (a regression whose output
        # must reach 1e5 grows every gradient with its weights) grows the whole network too, and the loss says which
        not_learning = _against_learning(loss, t, dec.shape)
        whole = ref_grew & (not_learning | (loss is None))
        heading = whole | beyond | ((dec >= -1.0) & not_learning)
        out_of_zone = ~(typical - ref_mean <= -t.vanish_decades)
        # grown from no lower than round-off of the largest it has been: a converged model's gradients sit at
        # round-off, and one harder batch lifts them by decades out of it, still far below where they started
        grew = (signal & (log_sig - np.fmax(base, _roundoff_line(log_sig)) >= t.growth_decades)
                & (log_sig - typical >= t.growth_decades / 2) & heading & g.above_roundoff & out_of_zone)
        # above the window's median as well as its mean: one batch that dropped by decades pulls the mean of logs
        # down, and the return from it to where the layer stood is no growth
        trend = grew & (log_sig - window_median(log_sig, t.growth_window, grew) >= t.growth_decades / 2)
    return trend, base


def _exploding(lv: _Levels, v: dict[str, np.ndarray], signal: np.ndarray, g: _Guards, groups: list[np.ndarray],
               t: th.Thresholds, loss: LossWindows | None = None) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The exploding rules (see docs/DIAGNOSIS.md) judged on the variables with ``signal``, and the trend's base."""
    live, dec = v["live"], lv.dec()
    trend, base = _trend(lv, signal, g, t, loss)
    inputs, head_gap, head_quiet = _huge_inputs(lv, signal, g, v["size"], groups, t)
    swings = _adaptive_swings(lv, v, loss, t)[:, None]
    behind = _judged_by_relative(lv.log_rms.shape[1], groups)
    near_clip = lv.clip_room < t.growth_decades
    with np.errstate(invalid="ignore"):
        flags = {
            # An adaptive optimizer keeps the steps of a layer far above the reference at the others' pace, which
            # is no disease; a loss that swings by decades at the same time says the gradients are out of control.
            "exp_rel": signal & (dec >= t.explode_decades) & (~g.calm | swings) & g.above_roundoff & behind,
            # The absolute bounds judge a layer the reference cannot (the whole network is huge); a layer far above
            # the reference is judged by the relative rule and its learning rate (a fresh first convolution on raw
            # pixels under Adam exceeds the bounds for a step and is healthy).
            "exp_rms": live & (v["rms"] > t.explode_rms_above) & ~(dec >= t.explode_decades),
            "exp_max": live & (v["max_abs"] > t.explode_max_abs_above) & ~(dec >= t.explode_decades),
            "exp_update": live & g.big & (lv.upd_ratio > t.explode_update_ratio) & ~g.small,
            "exp_feedback": live & g.big & ~g.small & _feedback(lv.log_rms, lv.log_upd, t, near_clip),
            # A tensor too small for a trend of its own (a one-element bias) grows with its layer: its trend counts
            # while a larger variable of the layer grows by the trend rule too. A step clipped to the global norm
            # the loop states had the clip's size, whatever one layer's share of it grew to.
            "exp_trend": trend & (g.big | in_layer(trend & g.big, groups)) & ~lv.global_clipped[:, None],
            "exp_capped": _capped(lv, g, t),
            "exp_inputs": inputs,
            # The relative rule's level condition without its adaptive gate: the state a swinging loss condemns.
            "exp_level": signal & (dec >= t.explode_decades) & g.above_roundoff,
            "head_gap": head_gap,
            "head_quiet": head_quiet,
        }
    return flags, base


def _judged_by_relative(n: int, groups: list[np.ndarray]) -> np.ndarray:
    """``[L]``: the variables the relative rule judges, all but the output layer's (when it has a weight and a bias
    and is not the whole model). That rule reads a gradient grown on its way back from the loss, and nothing
    amplifies the output layer's: its weight sits above its bias by its inputs' scale, which the huge-inputs rule
    reads from the first step (once the bias has fitted the targets' mean, its gradient is the mean residual, kept
    near zero by the bias itself, and the gap says only that)."""
    out = np.ones(n, dtype=bool)
    head = output_group(groups, n)
    if head is not None and len(head) < n:
        out[head] = False
    return out


def _head_gap(log_rms: np.ndarray, size: np.ndarray, usable: np.ndarray, head: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
    """``([S]`` decades the output layer's loudest variable sits above its quietest, ``[S]`` the quietest's log
    RMS``)``, where the loudest is the larger tensor (a weight over its bias) and both are live above round-off
    (NaN elsewhere). A weight's gradient is its bias's times the layer's inputs, so the gap is their scale."""
    sub = log_rms[:, head]
    ok = ~np.isnan(sub) & usable[:, head]
    rows = np.arange(sub.shape[0])
    loud = np.argmax(np.where(ok, sub, -np.inf), axis=1)
    quiet = np.argmin(np.where(ok, sub, np.inf), axis=1)
    valid = ok.sum(axis=1) >= 2
    valid &= size[rows, head[loud]] > size[rows, head[quiet]]
    quiet_log = np.where(valid, sub[rows, quiet], np.nan)
    return np.where(valid, sub[rows, loud] - quiet_log, np.nan), quiet_log


def _huge_inputs(lv: _Levels, signal: np.ndarray, g: _Guards, size: np.ndarray, groups: list[np.ndarray],
                 t: th.Thresholds) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``([S, L]`` exploding, ``[S]`` the gap, ``[S]`` the bias's log RMS``)``: the activations blew up on their
    way forward. From the first logged step on, for ``sustain_steps`` logged steps or more, the output layer's weight
    gradient sits ``inert_decades`` or more above its own bias's (whose gradient is the loss's, unamplified: nothing
    after the output layer can cancel it, so this gap is not round-off, it is the scale of the layer's inputs);
    every variable ``explode_decades`` or more above that bias is then exploding, whatever the optimizer does with
    it. Only from the first step: once the bias has fitted the targets' mean, its gradient is the mean residual,
    which it keeps near zero itself, and a gap that opens later says that, not huge inputs (a regression whose
    targets are in the tens of thousands). A constant factor on the loss moves both gradients alike; a model that is
    only its output layer reads its data, not activations."""
    n = lv.log_rms.shape[1]
    head = output_group(groups, n)
    if head is None or len(head) == n:
        nothing = np.full(lv.log_rms.shape[0], np.nan)
        return np.zeros(lv.log_rms.shape, dtype=bool), nothing, nothing
    gap, quiet = _head_gap(lv.log_rms, size, g.above_roundoff & ~g.converged, head)
    with np.errstate(invalid="ignore"):
        from_start = np.logical_and.accumulate(gap >= t.inert_decades)
        held = from_start & (from_start.sum() >= t.sustain_steps)
        flag = held[:, None] & signal & g.above_roundoff & (lv.log_rms - quiet[:, None] >= t.explode_decades)
    return flag, gap, quiet


def _capped(lv: _Levels, g: _Guards, t: th.Thresholds) -> np.ndarray:
    """``[S, L]`` exploding under per-variable clipping, which hides the gradient's size from every other rule: at
    each of ``sustain_steps`` consecutive logged steps the gradient sits at its clip and the clipped update moves
    the layer's weights by more than ``update_ratio_above`` of their RMS (``log_upd``, as the feedback rule reads
    it: a zero-initialised bias moves by little next to its kernel). The clip, not the gradient, sets every step,
    and every step replaces a large part of the weights: a learning rate too high, held back only by the clip."""
    with np.errstate(invalid="ignore"):
        step = lv.clipped & (lv.log_upd > np.log10(t.update_ratio_above)) & g.big & ~g.small
    return in_runs_of(step, t.sustain_steps)


def _adaptive_swings(lv: _Levels, v: dict[str, np.ndarray], loss: LossWindows | None, t: th.Thresholds
                     ) -> np.ndarray:
    """``[S]``: the loss swings by an order of magnitude or more under an adaptive optimizer (one that rescales
    each gradient, :func:`levels.adaptive`): there the update rules cannot see a blow-up, and the loss is the
    evidence. Under SGD the gradient and update rules see it themselves."""
    if loss is None or not adaptive(lv.upd_rms, v["rms"], v["live"], v["size"]):
        return np.zeros(v["live"].shape[0], dtype=bool)
    return loss.swings(t)


def _jump_peaks(log_rms: np.ndarray, t: th.Thresholds) -> np.ndarray:
    """``[S, L]``: the higher end of a jump of ``growth_decades`` or more between consecutive rows. A gradient
    swinging from the first logged step on was already blown up there when it is the high end of the first jump
    (the swing's window, which only looks back, cannot say so); a gradient that rose once, with the loss, was not
    before the jump."""
    out = np.zeros(log_rms.shape, dtype=bool)
    with np.errstate(invalid="ignore"):
        d = np.diff(log_rms, axis=0)
        out[1:] |= d >= t.growth_decades
        out[:-1] |= -d >= t.growth_decades
    return out


def _volatile(signal: np.ndarray, g: _Guards, groups: list[np.ndarray], log_rms: np.ndarray, swing: np.ndarray,
              swings: np.ndarray, t: th.Thresholds) -> tuple[np.ndarray, np.ndarray]:
    """``([S, L]`` exploding, ``[S, L]`` its level condition``)``: a gradient whose RMS swings by ``growth_decades``
    or more (``swing``, over the loss's window) while the loss swings by decades under an adaptive optimizer
    (``swings``). When every layer blows up alike, the layers nearest the loss included, none stands above the
    reference and the optimizer keeps every step small; gradients that jump by decades from batch to batch with the
    loss are that blow-up. A constant factor on the loss moves neither swing. Only at a batch that stands half the
    growth line or more above the median of the window's records (a spike above where the layer typically stood):
    a gradient that drops by decades for a batch and comes back (a GAN's generator while its discriminator is
    fooled, its loss near zero) spans as many decades, and neither the drop nor the return is a blow-up. The level
    condition (the swing alone) is the state the loss's evidence condemns, back to where it began."""
    with np.errstate(invalid="ignore"):
        level = signal & (swing >= t.growth_decades) & g.above_roundoff & ~g.converged
        flag = swings[:, None] & level
        flag &= log_rms - window_median(log_rms, 2 * t.growth_window, flag) >= t.growth_decades / 2
    return flag & (g.big | in_layer(flag & g.big, groups)), level


def _swinging(exploding: np.ndarray, live: np.ndarray, swings: np.ndarray) -> np.ndarray:
    """``[S, L]``: an exploding flag goes on while the loss keeps swinging by an order of magnitude or more
    (``swings`` ``[S]``): under an adaptive optimizer the gradient rules see the blow-up only at the batches where it
    grows, and a loss that jumps by decades batch after batch is the same blow-up going on."""
    out = np.zeros(exploding.shape, dtype=bool)
    prev = np.zeros(exploding.shape[1], dtype=bool)
    for s in range(exploding.shape[0]):
        prev = swings[s] & live[s] & (exploding[s] | prev)
        out[s] = prev
    return out


def _runaway(lv: _Levels, signal: np.ndarray, g: _Guards, base: np.ndarray, loss: LossWindows | None,
             t: th.Thresholds) -> np.ndarray:
    """``[S, L]``: the loss runs away (:meth:`LossWindows.runs_away`: an order of magnitude above its level over the
    previous window, and above where training started) and this variable's gradient rose with it, by half the
    growth line or more above the lowest of the window (``base``): a divergence under any optimizer, seen by the
    loss even where the gradients cannot show it (units that died in the blow-up pass none, the rest grow with the
    loss)."""
    if loss is None:
        return np.zeros(lv.log_rms.shape, dtype=bool)
    with np.errstate(invalid="ignore"):
        rose = lv.log_rms - base >= t.growth_decades / 2
    return loss.runs_away(t)[:, None] & signal & rose & g.above_roundoff


#: The rules that read a layer's own gradient and update; then those that need the loss: a runaway loss, the
#: gradients swinging with a swinging loss, and a flag the swing carries on.
GRADIENT_RULES = ("exp_rel", "exp_rms", "exp_max", "exp_update", "exp_feedback", "exp_trend", "exp_capped",
                  "exp_inputs")
EXPLODING_RULES = (*GRADIENT_RULES, "exp_runaway", "exp_volatile", "exp_swing")


def _reached_below(dec: np.ndarray, signal: np.ndarray, below: list[np.ndarray], t: th.Thresholds) -> np.ndarray:
    """``[S, L]``: some variable of the layer before this one (:func:`layer_below`) has a gradient within
    ``vanish_decades`` of the reference. A gradient that vanishes on its way back from the loss is small in every
    layer it has still to reach: where the layer below gets a sound one, the backward pass went through this layer,
    and its own small gradient is its parameters' scale (a normalisation's gain, a bias) or its inputs', not a
    vanishing gradient."""
    out = np.zeros(dec.shape, dtype=bool)
    with np.errstate(invalid="ignore"):
        sound = signal & (dec > -t.vanish_decades)
    for c, cols in enumerate(below):
        if cols.size:
            out[:, c] = sound[:, cols].any(axis=1)
    return out


def _vanishing(lv: _Levels, rms: np.ndarray, g: _Guards, t: th.Thresholds, below: list[np.ndarray],
               saturated: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The vanishing rules. ``below``: per variable, the columns of the layer before its own
    (:func:`layer_below`). ``saturated``: ``[S, L]`` the fraction of the variable's layer's outputs pinned near a
    bound of its saturating activation, where they are recorded (NaN elsewhere)."""
    with np.errstate(invalid="ignore"):
        dec = lv.dec()
        far_below = lv.signal & (dec <= -t.vanish_decades) & ~g.converged
        reached = _reached_below(dec, lv.signal, below, t)
        # Units pinned near a bound pass almost nothing back (tanh' and sigmoid' there are at most 4% of their
        # largest): with as many of its outputs there as ``dead_units`` asks of dead rectifier units, a layer far
        # below the reference is vanishing even where an adaptive optimizer keeps its updates at pace, which it
        # does whatever the gradient's size.
        pinned = saturated >= t.dead_units if saturated is not None else False
        stalled = far_below & (~g.learns | pinned)
        return {
            "van_rel": stalled & ~reached,
            # far below and not learning, but the backward pass went through it: a note, not a flag
            "van_passed": stalled & reached,
            # Under LAMB/LARS every layer moves by the same fraction of its weights whatever its gradient, so
            # "learns" is no evidence below the floor: there the direction is Adam's epsilon, not the gradient.
            "van_abs": lv.signal & (rms < t.vanish_rms_below) & (~g.learns | g.layerwise[:, None]) & ~g.converged,
        }


def _raw(v: dict[str, np.ndarray], flags: dict[str, np.ndarray], exploding: np.ndarray) -> np.ndarray:
    """``[S, L]`` status code per (step, layer): where several rules match, the first of the statuses' order wins
    (missing, nonfinite, dead, exploding, vanishing, dead units, inert); a frozen parameter has no values to judge.
    Dead units (a layer's output says most of its units are dead) make a layer dead that its gradient alone leaves
    healthy or inert; a gradient rule's verdict stands."""
    raw = np.full(v["live"].shape, th.HEALTHY, dtype=np.int8)
    raw[flags["inert"]] = th.INERT
    raw[flags["units_dead"]] = th.DEAD
    raw[flags["van_rel"] | flags["van_abs"]] = th.VANISHING
    raw[exploding] = th.EXPLODING
    raw[v["dead"]] = th.DEAD
    raw[v["nonfinite"]] = th.NONFINITE
    raw[v["missing"]] = th.MISSING
    raw[flags["idle"] & ~flags["stopped"] & flags["routed"][:, None]] = th.HEALTHY
    raw[v["frozen"]] = th.FROZEN
    raw[~flags["present"]] = th.ABSENT
    return raw


def idle_records(v: dict[str, np.ndarray]) -> np.ndarray:
    """``[S, L]`` no gradient at that step: a ``None`` one (missing) or an all-zero one (a ``.grad`` zeroed and not
    refilled, as for an expert that got no token under ``zero_grad(set_to_none=False)``)."""
    return v["missing"] | v["dead"]


def routed(idle: np.ndarray, live: np.ndarray, missing: np.ndarray, kept: np.ndarray, sustain_steps: int) -> bool:
    """Whether the run chooses its gradient paths step by step (mixture-of-experts routing, a branch taken at some
    steps, embedding rows): some variable had a gradient at a record right after one where it had none, that one
    a ``None`` gradient (a parameter outside the graph at one step and inside it at another: nothing but a per-step
    choice of path does that) or an all-zero one after a record with a gradient, ending a stretch of all-zero ones
    shorter than ``sustain_steps`` (a zero-initialised branch cuts its gradient at the first steps only, by design;
    a layer all-zero for ``sustain_steps`` was a dead episode when it happened, whatever follows). Then a stretch
    without gradient is that parameter being idle, not missing or dead (:func:`stopped` says when it is more).
    ``kept``: the records that count (not at a step the optimizer skipped, whose zeros a clip of an infinite norm
    made)."""
    for c in np.flatnonzero(idle.any(axis=0) & live.any(axis=0)):
        rows = np.flatnonzero(kept[:, c])
        seq = idle[rows, c]
        length = np.zeros(seq.size, dtype=np.int64)  # idle records in a row, up to each one
        for k in np.flatnonzero(seq):
            length[k] = (length[k - 1] if k else 0) + 1
        was_idle, now_live = seq[:-1], live[rows[1:], c]
        used_before = np.concatenate(([False], np.logical_or.accumulate(live[rows, c])[:-2]))
        zero_back = used_before & (length[:-1] < sustain_steps)
        back = was_idle & now_live & (missing[rows[:-1], c] | zero_back)
        if back.any():
            return True
    return False


#: In a run that routes its gradients, the logged steps (in units of ``sustain_steps``) a parameter that had a
#: gradient must then go without one before it is missing: the stretch over which a routed expert stopped being used.
STOPPED_SUSTAINS = 4


def stopped(idle: np.ndarray, live: np.ndarray, kept: np.ndarray, sustain_steps: int) -> np.ndarray:
    """``[S, L]`` the records of a stretch without gradient that, in a run that routes its gradients, is more than
    idleness: the parameter had a gradient before it, and the stretch has lasted ``STOPPED_SUSTAINS`` x
    ``sustain_steps`` logged steps and at least half of the parameter's logged steps so far (an expert its router
    stopped picking). Where the stretch is still shorter, it is idle: a parameter not picked for a few dozen steps,
    or not yet picked at all, is routing at work."""
    out = np.zeros(idle.shape, dtype=bool)
    need = STOPPED_SUSTAINS * sustain_steps
    for c in np.flatnonzero(idle.any(axis=0)):
        rows = np.flatnonzero(kept[:, c])
        run = idle[rows, c]
        if run.size < need or not run[-1]:
            continue
        start = run.size - int(np.argmin(run[::-1])) if not run.all() else 0
        length = run.size - start
        if start > 0 and live[rows[:start], c].any() and length >= need and 2 * length >= run.size:
            out[rows[start:], c] = True
    return out


def _units_dead(dead_fraction: np.ndarray | None, live: np.ndarray, t: th.Thresholds) -> np.ndarray:
    """``[S, L]``: the variable's layer's output has ``dead_units`` or more of its units dead for every input of the
    batch, after a rectifier (``dead_fraction``: :attr:`tb_gradhealth.health.forward.Units.dead`, NaN where not
    recorded), while its gradient is live: the units left still pass one, so no gradient rule sees the layer
    compute with a fraction of its width. Confirmed over ``sustain_steps`` logged steps, as every dead run is."""
    if dead_fraction is None:
        return np.zeros(live.shape, dtype=bool)
    with np.errstate(invalid="ignore"):
        return live & (dead_fraction >= t.dead_units)


def evaluate(records: np.ndarray, layers: Sequence[str], t: th.Thresholds, loss: LossWindows | None = None,
             told_skipped: np.ndarray | None = None, dead_fraction: np.ndarray | None = None,
             clip_norm: float | None = None, saturated_fraction: np.ndarray | None = None) -> Steps:
    """Every rule at every (logged step, layer); see docs/DIAGNOSIS.md for each rule's reason. ``loss``: the
    recorded loss around each logged step, where it is recorded (the trend's evidence, a swinging loss).
    ``told_skipped``: ``[S]`` whether the writer says the optimizer skipped the step (1), applied it (0) or does
    not know (NaN). A step the optimizer skipped is no evidence of any status: every layer's record there is left
    out of the episodes (its NaN/Inf stays in the notes). ``dead_fraction``: ``[S, L]`` the fraction of each
    variable's layer's units dead for every input of the batch where its output is recorded after a rectifier
    (NaN elsewhere; None: no output recorded). ``clip_norm``: the global norm the loop clips the recorded
    gradients to, where it says so (:func:`clipped_steps`). ``saturated_fraction``: ``[S, L]`` the fraction of each
    variable's layer's outputs near a bound of its saturating activation, where it is recorded (NaN elsewhere)."""
    clip_norm = clip_norm if clip_norm is not None and clip_norm > 0 else None
    v = live_stats(records)
    groups = layer_groups(layers)
    lv = _levels(records, len(layers), v, groups, t, clip_norm)
    g = _guards(lv, v["size"], groups, t)
    exp, base = _exploding(lv, v, lv.signal, g, groups, t, loss)
    # A variable far quieter than an exploding sibling is not receiving round-off: its layer's inputs are huge. It
    # is then judged by the exploding rules like any live variable (its own trend grows with its layer's); it stays
    # out of the vanishing rules, whose reference its layer's explosion has lifted.
    inert = lv.inert & ~in_layer(np.logical_or.reduce([exp[k] for k in GRADIENT_RULES]), groups)
    if (inert != lv.inert).any():
        exp, base = _exploding(lv, v, v["live"] & ~inert, g, groups, t, loss)
    swings = _adaptive_swings(lv, v, loss, t)
    # the update follows the gradient's size (plain SGD): recorded, and not rescaled per variable or over time
    proportional = bool(np.isfinite(lv.upd_rms).any()) and not adaptive(lv.upd_rms, v["rms"], v["live"], v["size"])
    swing = window_range(lv.log_rms, 2 * t.growth_window)
    exp["exp_volatile"], volatile_level = _volatile(v["live"] & ~inert, g, groups, lv.log_rms, swing, swings, t)
    carried = np.logical_or.reduce([exp[k] for k in (*GRADIENT_RULES, "exp_volatile")])
    exp["exp_swing"] = _swinging(carried, v["live"], swings)
    # Flagged only because the loss swings: the episode is back-dated over the stretch where ``exp_level`` held.
    exp["exp_late"] = swings[:, None] & ((exp["exp_rel"] & g.calm) | exp["exp_swing"] | exp["exp_volatile"])
    exp["exp_level"] = exp["exp_level"] | volatile_level | (v["live"] & ~inert & _jump_peaks(lv.log_rms, t))
    exp["exp_runaway"] = _runaway(lv, v["live"] & ~inert, g, base, loss, t)
    exp["grad_swing"] = swing
    exp["others"] = median_of_others(lv.log_rms, v["live"])  # the rest of the network, for where a rise began
    skip_step = _skipped(v["nonfinite"], lv, told_skipped, t)
    kept = v["present"] & ~skip_step[:, None]
    idle = idle_records(v) & kept
    flags = {"present": v["present"] & ~skip_step[:, None], "nonfinite": v["nonfinite"],
             "skipped": v["nonfinite"] & skip_step[:, None], "skip_step": skip_step, "recorded": v["present"],
             "inert": inert, "learns": g.learns, "calm": g.calm, "small": g.small, "converged": g.converged,
             "zero_grad": v["dead"], "idle": idle,
             "stopped": stopped(idle, v["live"], kept, t.sustain_steps),
             "routed": np.full(idle.shape[0], routed(idle, v["live"], v["missing"], kept, t.sustain_steps)),
             "units_dead": _units_dead(dead_fraction, v["live"], t),
             **exp, **_vanishing(lv, v["rms"], g, t, layer_below(layers), saturated_fraction)}
    if dead_fraction is not None:
        flags["dead_fraction"] = dead_fraction
    exploding = np.logical_or.reduce([flags[k] for k in EXPLODING_RULES])
    flags["clipped"] = lv.clipped
    flags["global_clipped"] = lv.global_clipped
    flags["loss_rise"] = np.full(v["live"].shape[0], np.nan) if loss is None else loss.rise
    flags["loss_jump"] = np.full(v["live"].shape[0], np.nan) if loss is None or loss.jump is None else loss.jump
    return Steps(raw=_raw(v, flags, exploding), size=v["size"], rms=v["rms"], max_abs=v["max_abs"], norm=v["norm"],
                  log_rms=lv.log_rms, ref=lv.ref, log_upd=lv.log_upd, log_grad=lv.log_rms - lv.scale,
                  upd_ratio=lv.upd_ratio,
                  weight_norm=lv.weight_norm, ref_upd=lv.ref_upd, sibling=lv.sibling, base=base, flags=flags,
                  proportional=proportional, clip_norm=clip_norm)
