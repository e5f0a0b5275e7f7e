"""The per-step rules: every rule evaluated for every (logged step, layer) at once on ``[S, L]`` arrays, which gives
each layer a raw status per step. Vanishing and exploding are judged against the *reference* (the layers nearest the
loss), never a statistic that sinks with the disease."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tb_gradhealth import record
from tb_gradhealth.health.thresholds import (
    _ABSENT,
    DEAD,
    EXPLODING,
    HEALTHY,
    INERT,
    MISSING,
    NONFINITE,
    SKIPPED,
    VANISHING,
    Thresholds,
)

#: The reference layers are the last ``REFERENCE_FRACTION`` of the layers with a live gradient at a step, at least
#: ``REFERENCE_MIN`` of them: the layers nearest the loss, whose gradient has gone through the fewest Jacobians.
REFERENCE_FRACTION = 0.1
REFERENCE_MIN = 3
#: Trend and update rules skip tensors smaller than this: a one-element bias crossing zero has an RMS that dips by
#: decades and comes back, which says nothing about the network.
TREND_MIN_SIZE = 16
#: Round-off: a gradient RMS below this fraction of the largest it has been in the run (a hundred float32 epsilons)
#: is what float32 arithmetic leaves of a gradient that is zero in exact arithmetic: a converged model, not a
#: disease. Relative to the run's own history, so it does not depend on the loss's scale.
ROUNDOFF = 100 * float(np.finfo(np.float32).eps)
#: A variable whose weight RMS is this many decades below the median of the run's variables started near zero on
#: purpose (LayerScale at 1e-6, ReZero at 0, a zero-initialised bias); its relative growth is by design.
SMALL_WEIGHT_DECADES = 2.0


def _log10(x: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where((x > 0) & np.isfinite(x), np.log10(np.where(x > 0, x, 1.0)), np.nan)


def _sorted_quantile(sorted_rows: np.ndarray, q: float) -> np.ndarray:
    """Quantile ``q`` of each row of a row-sorted array, ignoring NaN (sorted last); NaN for an all-NaN row.

    Linear interpolation between order statistics, as ``np.nanquantile`` does, without its per-row Python loop.
    """
    n = np.sum(~np.isnan(sorted_rows), axis=-1)
    pos = q * np.maximum(n - 1, 0)
    lo_i = np.floor(pos).astype(np.int64)
    hi_i = np.minimum(lo_i + 1, np.maximum(n - 1, 0))
    lo = np.take_along_axis(sorted_rows, lo_i[..., None], axis=-1)[..., 0]
    hi = np.take_along_axis(sorted_rows, hi_i[..., None], axis=-1)[..., 0]
    return np.where(n > 0, lo + (hi - lo) * (pos - lo_i), np.nan)


def _median_where(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Median over the last axis of ``values`` where ``mask`` (NaN where nothing is selected)."""
    rows = np.where(mask, values, np.nan)
    rows.sort(axis=-1)
    return _sorted_quantile(rows, 0.5)


def _history(records: np.ndarray) -> tuple[np.ndarray, ...]:
    """size, missing, NaN+Inf count, zero count, RMS and max|g| over ``[S, L]``: the few fields the rules need.

    The same formulas as :func:`record.derived` (a test checks they agree), computed without the other ~15
    quantities ``derived`` returns: this is the bulk of the diagnosis on large runs.
    """
    f = record.INDEX
    size = records[..., f["size"]]
    n = record.finite_count(records)
    m = record.max_abs(records)
    with np.errstate(invalid="ignore", divide="ignore"):
        rms = np.where(n > 0, m * np.sqrt(records[..., f["ssq_rel"]] / np.where(n > 0, n, 1)), np.nan)
    return size, records[..., f["missing"]], size - n, records[..., f["zero"]], rms, m


def _update_stats(records: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """RMS of the applied update, ||update|| / ||weight|| and ||weight||, NaN where not recorded (the ratio also
    where the weight is 0)."""
    f = record.INDEX
    if np.isnan(records[..., f["update_max_abs"]]).all() and np.isnan(records[..., f["weight_max_abs"]]).all():
        nan = np.full(records.shape[:-1], np.nan)
        return nan, nan, nan
    with np.errstate(invalid="ignore", divide="ignore"):
        upd = records[..., f["update_max_abs"]] * np.sqrt(records[..., f["update_ssq_rel"]])
        weight = records[..., f["weight_max_abs"]] * np.sqrt(records[..., f["weight_ssq_rel"]])
        size = records[..., f["size"]]
        rms = np.where(size > 0, upd / np.sqrt(np.where(size > 0, size, 1.0)), np.nan)
        ok = (weight > 0) & np.isfinite(weight) & np.isfinite(upd)
        return rms, np.where(ok, upd / np.where(ok, weight, 1.0), np.nan), weight


#: Spread (decades) under which every layer's update/weight ratio is one number: a layer-wise adaptive optimizer.
LAYERWISE_SPREAD = 0.05
#: ... while the variables' weight RMS spread over at least this many decades (else Adam would look the same).
WEIGHT_SPREAD = 0.3


def layerwise_common(upd_ratio: np.ndarray, weight_norm: np.ndarray, size: np.ndarray) -> np.ndarray:
    """Per step ``[S]``: the common update/weight ratio when every variable with weights has the same one although
    their weights' scales differ (LAMB, LARS: update = lr x ||w|| x direction; under Adam or SGD layers of different
    weight scales move by different fractions), else NaN."""
    with np.errstate(invalid="ignore", divide="ignore"):
        ratios = _log10(upd_ratio)
        scale = _log10(weight_norm / np.sqrt(np.where(size > 0, size, np.nan)))
    ok = np.isfinite(ratios) & np.isfinite(scale)
    r = np.where(ok, ratios, np.nan)
    w = np.where(ok, scale, np.nan)
    n = ok.sum(axis=1)
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN rows
        spread = np.nanmax(r, axis=1) - np.nanmin(r, axis=1)
        wspread = np.nanmax(w, axis=1) - np.nanmin(w, axis=1)
        common = 10.0 ** np.nanmedian(r, axis=1)
    layerwise = (n >= 3) & (spread <= 2 * LAYERWISE_SPREAD) & (wspread >= WEIGHT_SPREAD)
    return np.where(layerwise, common, np.nan)


def layer_groups(layers: Sequence[str]) -> list[np.ndarray]:
    """Column indices of the variables of one layer (same name up to the last ``/`` or ``.``), for layers with two
    or more variables: ``conv1/kernel`` and ``conv1/bias`` receive the same upstream gradient."""
    by: dict[str, list[int]] = {}
    for i, name in enumerate(layers):
        cut = max(name.rfind("/"), name.rfind("."))
        if cut > 0:
            by.setdefault(name[:cut], []).append(i)
    return [np.array(v) for v in by.values() if len(v) > 1]


def _loudest_sibling(log_rms: np.ndarray, groups: list[np.ndarray]) -> np.ndarray:
    """``[S, L]``: the largest log RMS among the *other* variables of each variable's layer (NaN if none)."""
    out = np.full(log_rms.shape, np.nan)
    for cols in groups:
        sub = np.where(np.isnan(log_rms[:, cols]), -np.inf, log_rms[:, cols])
        order = np.sort(sub, axis=1)
        top, second = order[:, -1], order[:, -2]
        others = np.where(sub >= top[:, None], second[:, None], top[:, None])
        out[:, cols] = np.where(np.isfinite(others), others, np.nan)
    return out


def _layer_weight_scale(weight_norm: np.ndarray, size: np.ndarray, groups: list[np.ndarray]) -> np.ndarray:
    """``[S, L]`` log10 of the largest weight RMS among the variables of each variable's layer: the scale its
    update is measured against (a bias that starts at zero moves relative to its kernel, not to itself)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        own = _log10(weight_norm / np.sqrt(np.where(size > 0, size, np.nan)))
    out = own.copy()
    for cols in groups:
        out[:, cols] = np.nanmax(np.where(np.isnan(own[:, cols]), -np.inf, own[:, cols]), axis=1)[:, None]
    return np.where(np.isfinite(out), out, np.nan)


#: Logged steps over which the positive-feedback signature of a divergence must hold.
FEEDBACK_STEPS = 2


def _feedback(log_rms: np.ndarray, log_upd: np.ndarray, t: Thresholds) -> np.ndarray:
    """``[S, L]``: the signature of a learning-rate divergence, free of the gradient's scale: each update moves the
    layer's weights by more than ``update_ratio_above`` of their RMS (``log_upd``: update RMS over the layer's weight
    RMS), and the gradient and the update both grew by more than minibatch noise (the trend's own per-step slope,
    ``2 * growth_decades / growth_window``) at each of the last ``FEEDBACK_STEPS`` logged steps: the step makes the
    next gradient larger. An adaptive optimizer's update does not grow with the gradient, so it never shows this."""
    rise = 2.0 * t.growth_decades / t.growth_window

    def up(x: np.ndarray) -> np.ndarray:
        out = np.zeros(x.shape, dtype=bool)
        with np.errstate(invalid="ignore"):
            out[1:] = x[1:] - x[:-1] >= rise
        return out

    with np.errstate(invalid="ignore"):
        step = (log_upd > np.log10(t.update_ratio_above)) & up(log_rms) & up(log_upd)
    out = step.copy()
    for j in range(1, FEEDBACK_STEPS):
        out[j:] &= step[:-j]
        out[:j] = False
    return out


def _stalled_reference(ref: np.ndarray, ref_upd: np.ndarray, log_rms: np.ndarray, log_upd: np.ndarray,
                       signal: np.ndarray, t: Thresholds) -> np.ndarray:
    """``[S]``: the layers nearest the loss are sick themselves, so they cannot be the reference: where updates are
    recorded, they barely learn (update RMS below ``update_ratio_below`` of their weights' RMS) while the network's
    median layer learns ``update_decades`` faster and its gradient is ``vanish_decades`` above theirs."""
    if not t.update_ratio_below > 0:
        return np.zeros(ref.shape, dtype=bool)
    with np.errstate(invalid="ignore"):
        all_rms = _median_where(log_rms, signal)
        all_upd = _median_where(log_upd, signal & np.isfinite(log_upd))
        return ((ref_upd < np.log10(t.update_ratio_below)) & (all_upd - ref_upd >= t.update_decades)
                & (all_rms - ref >= t.vanish_decades))


def _in_layer(mask: np.ndarray, groups: list[np.ndarray]) -> np.ndarray:
    """``[S, L]``: some *other* variable of the same layer has ``mask`` at that step."""
    out = np.zeros(mask.shape, dtype=bool)
    for cols in groups:
        count = mask[:, cols].sum(axis=1, keepdims=True)
        out[:, cols] = (count - mask[:, cols]) > 0
    return out


def _small_weights(weight_norm: np.ndarray, size: np.ndarray) -> np.ndarray:
    """``[S, L]``: the variable's weight RMS is at least ``SMALL_WEIGHT_DECADES`` below the median weight RMS of the
    run's variables at that step (a parameter initialised near zero), False where weights are not recorded."""
    with np.errstate(invalid="ignore", divide="ignore"):
        w = _log10(weight_norm / np.sqrt(np.where(size > 0, size, np.nan)))
        zero = weight_norm == 0
        typical = _median_where(w, np.isfinite(w))
        return zero | (w < typical[:, None] - SMALL_WEIGHT_DECADES)


def _reference(log_values: np.ndarray, signal: np.ndarray) -> np.ndarray:
    """``[S]``: median of ``log_values`` over the reference layers: the last ``REFERENCE_FRACTION`` (at least
    ``REFERENCE_MIN``) of the layers with ``signal`` at each step, i.e. those nearest the loss."""
    n = signal.sum(axis=1)
    k = np.maximum(REFERENCE_MIN, np.ceil(REFERENCE_FRACTION * n)).astype(np.int64)
    from_end = np.cumsum(signal[:, ::-1], axis=1)[:, ::-1]
    return _median_where(log_values, signal & (from_end <= k[:, None]))


def _window_stats(log_rms: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """``[S, L]`` minimum and mean of each column over the previous ``window`` rows (not the row itself), NaN
    ignored (NaN where the window has no value)."""
    padded = np.concatenate([np.full((window,) + log_rms.shape[1:], np.nan), log_rms])
    low = np.empty(log_rms.shape)
    for a in range(0, log_rms.shape[0], _BLOCK):
        b = min(a + _BLOCK, log_rms.shape[0])
        win = np.lib.stride_tricks.sliding_window_view(padded[a:b + window - 1], window, axis=0)
        low[a:b] = np.fmin.reduce(win, axis=-1)
    known = ~np.isnan(padded)
    total = np.concatenate([np.zeros((1,) + log_rms.shape[1:]), np.cumsum(np.where(known, padded, 0.0), axis=0)])
    count = np.concatenate([np.zeros((1,) + log_rms.shape[1:]), np.cumsum(known, axis=0)])
    n = count[window:-1] - count[:-window - 1]
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(n > 0, (total[window:-1] - total[:-window - 1]) / np.where(n > 0, n, 1), np.nan)
    return low, mean


#: Logged steps evaluated together: keeps the temporaries of one block in cache.
_BLOCK = 64
_FLAG_NAMES = ("present", "nonfinite", "exp_rel", "exp_rms", "exp_max", "exp_trend", "exp_update", "exp_feedback",
               "van_rel", "van_abs", "learns", "inert", "small", "converged")


@dataclass
class _Steps:
    """The rules evaluated on ``[S, L]`` records (or ``[1, L]`` for a single step)."""

    raw: np.ndarray  # int8 status code per (step, layer); _ABSENT where no record
    size: np.ndarray
    rms: np.ndarray  # RMS of the nonzero finite values: a sparse gradient is judged on the rows that got one
    max_abs: np.ndarray
    log_rms: np.ndarray  # NaN where the gradient is not live (absent, missing, nonfinite, all-zero)
    ref: np.ndarray  # [S] log10 RMS of the reference layers (nearest the loss)
    log_upd: np.ndarray  # log10 learning rate: update RMS / weight RMS of its layer, NaN where not recorded
    ref_upd: np.ndarray  # [S] log10 learning rate of the reference layers
    upd_ratio: np.ndarray  # ||update|| / ||weight||, NaN where not recorded
    weight_norm: np.ndarray  # ||weight||, NaN where not recorded
    sibling: np.ndarray  # log10 RMS of the loudest other variable of the same layer
    base: np.ndarray  # log10 RMS the trend is measured from (lowest of the previous window)
    flags: dict[str, np.ndarray]

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


def _live(records: np.ndarray) -> dict[str, np.ndarray]:
    """Per (step, layer): presence, missing, NaN/Inf, all-zero and the RMS of the nonzero finite values."""
    size, missing, nonfinite_count, zero, _, max_abs = _history(records)
    present = ~np.isnan(size)
    missing = present & (missing > 0.5)
    values = present & ~missing
    nonfinite = values & (nonfinite_count > 0)
    dead = values & ~nonfinite & (size > 0) & (zero >= size)
    nonzero = size - nonfinite_count - zero
    with np.errstate(invalid="ignore", divide="ignore"):
        ssq = records[..., record.INDEX["ssq_rel"]]
        rms = np.where(nonzero > 0, max_abs * np.sqrt(ssq / np.where(nonzero > 0, nonzero, 1)), np.nan)
    live = values & ~nonfinite & ~dead & (rms > 0)
    return {"present": present, "missing": missing, "nonfinite": nonfinite, "dead": dead, "live": live,
            "size": np.where(present, size, 0.0), "rms": rms, "max_abs": max_abs}


def _evaluate(records: np.ndarray, layers: Sequence[str], t: Thresholds) -> _Steps:
    """Every rule at every (logged step, layer); see docs/DIAGNOSIS.md for each rule's reason."""
    v = _live(records)
    live, rms, size = v["live"], v["rms"], v["size"]
    log_rms = np.where(live, _log10(rms), np.nan)
    sibling = _loudest_sibling(log_rms, layer_groups(layers))
    quiet_sibling = live & (log_rms <= sibling - t.inert_decades)
    ref = _reference(log_rms, live & ~quiet_sibling)
    dec = log_rms - ref[:, None]
    low = (dec <= -t.vanish_decades) | (rms < t.vanish_rms_below)
    inert = quiet_sibling & low
    # The last layer's variables feed the loss directly: nothing after them can cancel their gradient to round-off.
    for g in layer_groups(layers):
        if g.max() == len(layers) - 1:
            inert[:, g] = False
    signal = live & ~inert
    upd_rms, upd_ratio, weight_norm = _update_stats(records)
    # NaN/Inf that the optimizer did not apply (dynamic loss scaling): no update at all, finite weights. (A NaN
    # update has no finite element either, but the weights it produced are NaN at the next step: see _confirm.)
    # The optimizer skips a whole step, so one layer with that signature and no layer updated mark the step.
    signature = v["nonfinite"] & (upd_rms == 0) & (weight_norm > 0) & np.isfinite(weight_norm)
    step_skipped = signature.any(axis=1) & ~(upd_rms > 0).any(axis=1)
    skipped = v["nonfinite"] & step_skipped[:, None]
    groups = layer_groups(layers)
    log_upd = _log10(upd_rms) - _layer_weight_scale(weight_norm, size, groups)
    ref_upd = _reference(np.where(signal, log_upd, np.nan), signal & np.isfinite(log_upd))
    stalled = _stalled_reference(ref, ref_upd, log_rms, log_upd, signal, t)
    if stalled.any():  # the layers nearest the loss are sick themselves: the network's median is the reference
        ref = np.where(stalled, _median_where(log_rms, signal), ref)
        ref_upd = np.where(stalled, _median_where(log_upd, signal & np.isfinite(log_upd)), ref_upd)
        dec = log_rms - ref[:, None]
    with np.errstate(invalid="ignore"):
        speed = log_upd - ref_upd[:, None]  # NaN where updates are not recorded: the gradient rules alone decide
        learns = (t.update_decades > 0) & (speed > -t.update_decades)
        calm = (t.update_decades > 0) & (speed < t.update_decades)
    layerwise = np.isfinite(layerwise_common(upd_ratio, weight_norm, size))
    log_sig = np.where(signal, log_rms, np.nan)
    base, typical = _window_stats(log_sig, t.growth_window)
    ref_growth = ref - _window_stats(ref[:, None], t.growth_window)[0][:, 0]
    big = size >= TREND_MIN_SIZE
    with np.errstate(invalid="ignore"):
        # A gradient ROUNDOFF below its own peak so far is round-off (a converged model): never exploding.
        peak = np.fmax.accumulate(np.where(np.isnan(log_rms), -np.inf, log_rms), axis=0)
        above_roundoff = ~(log_rms < peak + np.log10(ROUNDOFF))
        # A parameter that started near zero on purpose (LayerScale, ReZero, a zero bias) grows by decades: its
        # update/weight ratio and a weight norm that stays larger say nothing about a blow-up while it is small.
        small = _small_weights(weight_norm, size)
        # When the layers nearest the loss get only round-off, the model has converged: nothing is vanishing.
        ref_peak = np.fmax.accumulate(np.where(np.isnan(ref), -np.inf, ref))
        converged = (ref < ref_peak + np.log10(ROUNDOFF))[:, None]
        # A gradient rising out of the vanishing zone (a branch whose scale is growing) is recovering.
        out_of_zone = ~(typical - _window_stats(ref[:, None], t.growth_window)[1] <= -t.vanish_decades)
        flags = {
            "present": v["present"], "nonfinite": v["nonfinite"], "skipped": skipped, "inert": inert,
            "learns": learns, "calm": calm,
            "exp_rel": signal & (dec >= t.explode_decades) & ~calm & above_roundoff,
            # The absolute bounds judge a layer the reference cannot (the whole network is huge); a layer far above
            # the reference is judged by the relative rule and its learning rate (a fresh first convolution on raw
            # pixels under Adam exceeds the bounds for a step and is healthy).
            "exp_rms": live & (rms > t.explode_rms_above) & ~(dec >= t.explode_decades),
            "exp_max": live & (v["max_abs"] > t.explode_max_abs_above) & ~(dec >= t.explode_decades),
            "exp_update": live & big & (upd_ratio > t.explode_update_ratio) & ~small,
            "exp_feedback": live & big & ~small & _feedback(log_rms, log_upd, t),
            "exp_trend": signal & (log_sig - base >= t.growth_decades)
            & (log_sig - typical >= t.growth_decades / 2) & ((dec >= -1.0) | (ref_growth >= t.growth_decades)[:, None])
            & above_roundoff & out_of_zone,
            "small": small,
            "van_rel": signal & (dec <= -t.vanish_decades) & ~learns & ~converged,
            # Under LAMB/LARS every layer moves by the same fraction of its weights whatever its gradient, so
            # "learns" is no evidence below the floor: there the direction is Adam's epsilon, not the gradient.
            "van_abs": signal & (rms < t.vanish_rms_below) & (~learns | layerwise[:, None]) & ~converged,
            "converged": np.broadcast_to(converged, live.shape),
        }
    # A tensor too small for a trend of its own (a one-element bias) grows with its layer: its trend counts while a
    # larger variable of the layer grows by the trend rule too.
    flags["exp_trend"] &= big | _in_layer(flags["exp_trend"] & big, groups)
    exploding = (flags["exp_rel"] | flags["exp_rms"] | flags["exp_max"] | flags["exp_update"] | flags["exp_trend"]
                 | flags["exp_feedback"])
    # A variable far quieter than an exploding sibling is not receiving round-off: its layer's inputs are huge.
    inert &= ~_in_layer(exploding, groups)
    flags["inert"] = inert
    raw = np.full(live.shape, HEALTHY, dtype=np.int8)
    raw[inert] = INERT
    raw[flags["van_rel"] | flags["van_abs"]] = VANISHING
    raw[exploding] = EXPLODING
    raw[v["dead"]] = DEAD
    raw[v["nonfinite"]] = NONFINITE
    raw[skipped] = SKIPPED
    raw[v["missing"]] = MISSING
    raw[~v["present"]] = _ABSENT
    return _Steps(raw=raw, size=size, rms=rms, max_abs=v["max_abs"], log_rms=log_rms, ref=ref, log_upd=log_upd,
                  upd_ratio=upd_ratio, weight_norm=weight_norm,
                  ref_upd=ref_upd, sibling=sibling, base=base, flags=flags)
