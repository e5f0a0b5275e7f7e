"""What the rules read at every (logged step, layer): the live gradient's RMS, the reference (the layers nearest the
loss), the loudest other variable of a layer, how fast a layer learns against its weights, trend windows. Pure numpy
statistics over ``[S, L]`` arrays; the rules themselves are in :mod:`tb_gradhealth.health.rules`."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tb_gradhealth import record

#: The reference layers are the last ``REFERENCE_FRACTION`` of the layers with a live gradient at a step, at least
#: ``REFERENCE_MIN`` of them: the layers nearest the loss, whose gradient has gone through the fewest Jacobians.
REFERENCE_FRACTION = 0.1
REFERENCE_MIN = 3
#: Spread (decades) under which every layer's update/weight ratio is one number: a layer-wise adaptive optimizer.
LAYERWISE_SPREAD = 0.05
#: ... while the variables' weight RMS spread over at least this many decades (else Adam would look the same).
WEIGHT_SPREAD = 0.3
#: Spread (decades) of update RMS / gradient RMS across the variables above which the optimizer rescales each
#: gradient (Adam, RMSprop, Adagrad): under SGD the update is the learning rate times the gradient for every
#: variable (momentum and weight decay move the ratio by a few tenths of a decade).
ADAPTIVE_SPREAD = 1.0
#: Logged steps at which a variable's gradient norm must repeat (to float32 precision) to read as clipped.
CLIP_STEPS = 3
#: Relative difference under which two recorded norms are the same number (float32 rounding of the clip).
CLIP_SAME = 1e-5
#: Logged steps evaluated together: keeps the temporaries of one block in cache.
_BLOCK = 64


def log10(x: np.ndarray) -> np.ndarray:
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


def _masked_max(values: np.ndarray, mask: np.ndarray, axis: int) -> np.ndarray:
    """Largest of ``values`` where ``mask`` along ``axis``, NaN where nothing is selected. ``np.nanmax`` warns on an
    all-NaN slice through :mod:`warnings`, whose filters are process-wide (not thread-safe to silence under a
    threaded server); an explicit mask raises nothing."""
    any_ = mask.any(axis=axis)
    top = np.max(np.where(mask, values, -np.inf), axis=axis, initial=-np.inf)
    return np.where(any_, top, np.nan)


def _masked_min(values: np.ndarray, mask: np.ndarray, axis: int) -> np.ndarray:
    """Smallest of ``values`` where ``mask`` along ``axis``, NaN where nothing is selected (see :func:`_masked_max`)."""
    return -_masked_max(-values, mask, axis)


def median_where(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Median over the last axis of ``values`` where ``mask`` (NaN where nothing is selected)."""
    rows = np.where(mask, values, np.nan)
    rows.sort(axis=-1)
    return _sorted_quantile(rows, 0.5)


def median_of_others(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``[S, L]``: for each element with ``mask``, the median of the *other* selected elements of its row (NaN where
    it is not selected or is alone): how the rest of the network stands, without the variable itself. In sorted
    order, the others' median is at the middle positions of the row with the element's own position removed."""
    rows = np.where(mask, values, np.nan)
    order = np.argsort(rows, axis=-1, kind="stable")  # NaN sort last
    ranked = np.take_along_axis(rows, order, axis=-1)
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.broadcast_to(np.arange(order.shape[1]), order.shape).copy(), axis=-1)
    n = np.sum(mask, axis=-1, keepdims=True)
    lo = np.maximum((n - 2) // 2, 0)
    hi = np.maximum((n - 1) // 2, 0)
    cap = ranked.shape[1] - 1
    first = np.take_along_axis(ranked, np.minimum(lo + (lo >= rank), cap), axis=-1)
    second = np.take_along_axis(ranked, np.minimum(hi + (hi >= rank), cap), axis=-1)
    return np.where(mask & (n > 1), (first + second) / 2.0, np.nan)


def history(records: np.ndarray) -> tuple[np.ndarray, ...]:
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


def update_stats(records: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def layerwise_common(upd_ratio: np.ndarray, weight_norm: np.ndarray, size: np.ndarray) -> np.ndarray:
    """Per step ``[S]``: the common update/weight ratio when every variable with weights has the same one although
    their weights' scales differ (LAMB, LARS: update = lr x ||w|| x direction; under Adam or SGD layers of different
    weight scales move by different fractions), else NaN."""
    with np.errstate(invalid="ignore", divide="ignore"):
        ratios = log10(upd_ratio)
        scale = log10(weight_norm / np.sqrt(np.where(size > 0, size, np.nan)))
    ok = np.isfinite(ratios) & np.isfinite(scale)
    r = np.where(ok, ratios, np.nan)
    w = np.where(ok, scale, np.nan)
    n = ok.sum(axis=1)
    with np.errstate(invalid="ignore", over="ignore"):
        spread = _masked_max(r, ok, axis=1) - _masked_min(r, ok, axis=1)
        wspread = _masked_max(w, ok, axis=1) - _masked_min(w, ok, axis=1)
        common = 10.0 ** median_where(r, ok)
    layerwise = (n >= 3) & (spread <= 2 * LAYERWISE_SPREAD) & (wspread >= WEIGHT_SPREAD)
    return np.where(layerwise, common, np.nan)


def adaptive(upd_rms: np.ndarray, rms: np.ndarray, live: np.ndarray, size: np.ndarray) -> bool:
    """The optimizer rescales each variable's gradient: over the logged steps, the median spread (largest minus
    smallest across the variables of at least 16 elements) of log10 update RMS / gradient RMS exceeds
    ``ADAPTIVE_SPREAD``; or, where every variable's gradient is of one size (the spread across them cannot show
    it), over time: the gradient's RMS moves by ``ADAPTIVE_SPREAD`` more decades than its update's (10th to 90th
    percentile over the logged steps, median over those variables). Under plain SGD the update follows the
    gradient's size; Adam's stays at the learning rate's while the gradient swings by decades. Momentum smooths
    batch-to-batch swings too, so SGD with momentum whose gradients swing by decades reads as adaptive here: the
    loss swinging with them is then evidence as well. False where updates are not recorded."""
    with np.errstate(invalid="ignore", divide="ignore"):
        log_upd, log_rms = log10(upd_rms), log10(rms)
        ratio = log_upd - log_rms
        ok = live & (size >= 16) & np.isfinite(ratio)
        spread = _masked_max(ratio, ok, axis=1) - _masked_min(ratio, ok, axis=1)
        typical = median_where(spread, np.isfinite(spread))
        if typical > ADAPTIVE_SPREAD:
            return True
        moved = _moved(log_rms, ok) - _moved(log_upd, ok)
        return bool(median_where(moved, np.isfinite(moved)) > ADAPTIVE_SPREAD)


def _moved(log_values: np.ndarray, ok: np.ndarray) -> np.ndarray:
    """``[L]`` decades from the 10th to the 90th percentile of each column's values over the rows where ``ok`` (NaN
    for a column with fewer than ``_MOVED_MIN_ROWS`` such rows)."""
    cols = np.where(ok, log_values, np.nan).T.copy()
    cols.sort(axis=-1)
    out = _sorted_quantile(cols, 0.9) - _sorted_quantile(cols, 0.1)
    return np.where(ok.sum(axis=0) >= _MOVED_MIN_ROWS, out, np.nan)


#: Logged steps a variable needs before its gradient's and update's movement over time are compared.
_MOVED_MIN_ROWS = 8


def layer_of(name: str) -> str | None:
    """The layer a variable belongs to: its name up to the last ``/`` or ``.`` (``conv1`` for ``conv1/kernel``);
    None for a name without one."""
    cut = max(name.rfind("/"), name.rfind("."))
    return name[:cut] if cut > 0 else None


def in_named_layer(name: str, layer: str) -> bool:
    """Whether the variable ``name`` belongs to the layer a framework calls ``layer`` (``exp_2`` for
    ``model/exp_2/kernel``, ``net.2`` for ``net.2.weight``): its layer path is that name or ends with it."""
    own = layer_of(name)
    return own is not None and (own == layer or own.endswith(("/" + layer, "." + layer)))


def _columns_by_layer(layers: Sequence[str]) -> dict[str, list[int]]:
    """Column indices of each layer's variables (:func:`layer_of`), layers in the order they first appear."""
    by: dict[str, list[int]] = {}
    for i, name in enumerate(layers):
        layer = layer_of(name)
        if layer is not None:
            by.setdefault(layer, []).append(i)
    return by


def layer_groups(layers: Sequence[str]) -> list[np.ndarray]:
    """Column indices of the variables of one layer (:func:`layer_of`), for layers with two or more variables:
    ``conv1/kernel`` and ``conv1/bias`` receive the same upstream gradient."""
    return [np.array(v) for v in _columns_by_layer(layers).values() if len(v) > 1]


def layer_below(layers: Sequence[str]) -> list[np.ndarray]:
    """Per variable, the column indices of the layer before its own in the records' order (the network's, input
    first): the layer its backward pass reaches next. Empty for the first layer and for a name without a layer."""
    empty = np.array([], dtype=np.int64)
    prev: dict[str, np.ndarray] = {}
    before = empty
    for layer, cols in _columns_by_layer(layers).items():
        prev[layer], before = before, np.array(cols)
    return [prev.get(layer_of(name), empty) for name in layers]


def output_group(groups: list[np.ndarray], n_layers: int) -> np.ndarray | None:
    """The column indices of the output layer (the group holding the last variable), None when it has one variable:
    its variables feed the loss directly, nothing after them can cancel their gradient."""
    return next((cols for cols in groups if cols.max() == n_layers - 1), None)


def loudest_sibling(log_rms: np.ndarray, groups: list[np.ndarray]) -> np.ndarray:
    """``[S, L]``: the largest log RMS among the *other* variables of each variable's layer (NaN if none)."""
    out = np.full(log_rms.shape, np.nan)
    for cols in groups:
        sub = np.where(np.isnan(log_rms[:, cols]), -np.inf, log_rms[:, cols])
        order = np.sort(sub, axis=1)
        top, second = order[:, -1], order[:, -2]
        others = np.where(sub >= top[:, None], second[:, None], top[:, None])
        out[:, cols] = np.where(np.isfinite(others), others, np.nan)
    return out


def layer_weight_scale(weight_norm: np.ndarray, size: np.ndarray, groups: list[np.ndarray]) -> np.ndarray:
    """``[S, L]`` log10 of the largest weight RMS among the variables of each variable's layer: the scale its
    update is measured against (a bias that starts at zero moves relative to its kernel, not to itself)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        own = log10(weight_norm / np.sqrt(np.where(size > 0, size, np.nan)))
    out = own.copy()
    for cols in groups:
        out[:, cols] = np.nanmax(np.where(np.isnan(own[:, cols]), -np.inf, own[:, cols]), axis=1)[:, None]
    return np.where(np.isfinite(out), out, np.nan)


def in_layer(mask: np.ndarray, groups: list[np.ndarray]) -> np.ndarray:
    """``[S, L]``: some *other* variable of the same layer has ``mask`` at that step."""
    out = np.zeros(mask.shape, dtype=bool)
    for cols in groups:
        count = mask[:, cols].sum(axis=1, keepdims=True)
        out[:, cols] = (count - mask[:, cols]) > 0
    return out


def small_weights(weight_norm: np.ndarray, upd_rms: np.ndarray, size: np.ndarray, groups: list[np.ndarray]
                   ) -> np.ndarray:
    """``[S, L]``: a parameter that started at or near zero on purpose (LayerScale at 1e-6, ReZero at 0, a
    zero-initialised bias or LayerNorm beta) and has not yet grown to its layer's scale: its relative growth is by
    design. The scale of its layer is the largest weight RMS of the other variables of its layer (its sibling
    kernel: the layer's largest variable has none above it; for a variable alone in its layer, the median weight
    RMS of the run's variables). It started near zero
    when, at its first record with weights, its weight is zero, or is both below its layer's scale and smaller than
    the optimizer's first step on it (its update RMS: on the optimizer's own scale it starts from nothing; a
    kernel whose first update dwarfs it is a learning rate too high, not a small parameter), and its layer took a
    first step smaller than itself (:func:`_steady_start`). It is still growing while its weight RMS stays below
    its layer's scale. No decade count: each parameter is judged against its
    layer and its own first step. False where weights are not recorded."""
    with np.errstate(invalid="ignore", divide="ignore"):
        w = weight_norm / np.sqrt(np.where(size > 0, size, np.nan))
        known = np.isfinite(w) & (weight_norm >= 0)
        log_w = log10(w)
        sibling = loudest_sibling(log_w, groups)  # NaN where every other variable of the layer is zero
        grouped = np.zeros(w.shape[1], dtype=bool)
        for g in groups:
            grouped[g] = True
        alone = np.broadcast_to(median_where(log_w, np.isfinite(log_w))[:, None], w.shape)
        scale = np.where(grouped, np.where(np.isnan(sibling), -np.inf, sibling), alone)
        below = (weight_norm == 0) | (log_w < scale)
        first = np.where(known.any(axis=0), np.argmax(known, axis=0), 0)
        cols = np.arange(w.shape[1])
        w0, u0 = w[first, cols], upd_rms[first, cols]
        near_zero = (known.any(axis=0) & ((w0 == 0) | ((w0 < u0) & below[first, cols]))
                     & _steady_start(w0, u0, groups))
        return near_zero[None, :] & below & known


def _steady_start(w0: np.ndarray, u0: np.ndarray, groups: list[np.ndarray]) -> np.ndarray:
    """``[L]``: at the first step, what a variable's layer is measured against moved by less than its own size (its
    largest sibling; for a variable alone in its layer, the run's median variable): the optimizer's step is small
    next to the layer, so a variable it moves by more than its own size is small, not blown up. Where the whole
    layer takes steps larger than itself (a learning rate too high), nothing in it started near zero."""
    with np.errstate(invalid="ignore", divide="ignore"):
        moved = log10(u0) - log10(w0)
        known = np.isfinite(moved)
        out = np.full(w0.shape, bool(np.median(moved[known]) < 0) if known.any() else False)
        for g in groups:
            for c in g:
                others = [o for o in g if o != c and w0[o] > 0]
                if others:
                    top = max(others, key=lambda o: w0[o])
                    out[c] = bool(u0[top] < w0[top])
    return out


def reference_layers(signal: np.ndarray) -> np.ndarray:
    """``[S, L]``: the reference layers: the last ``REFERENCE_FRACTION`` (at least ``REFERENCE_MIN``) of the
    layers with ``signal`` at each step, i.e. those nearest the loss."""
    n = signal.sum(axis=1)
    k = np.maximum(REFERENCE_MIN, np.ceil(REFERENCE_FRACTION * n)).astype(np.int64)
    from_end = np.cumsum(signal[:, ::-1], axis=1)[:, ::-1]
    return signal & (from_end <= k[:, None])


def reference(log_values: np.ndarray, signal: np.ndarray) -> np.ndarray:
    """``[S]``: median of ``log_values`` over the reference layers (:func:`reference_layers`)."""
    return median_where(log_values, reference_layers(signal))


def reference_top(log_values: np.ndarray, near_loss: np.ndarray) -> np.ndarray:
    """``[S, L]``: the largest of ``log_values`` over the reference layers (``near_loss``, :func:`reference_layers`)
    other than the column's own (-inf where there are none): the top of the range the layers nearest the loss span
    at that step. A reference layer is not measured against itself."""
    vals = np.where(near_loss & ~np.isnan(log_values), log_values, -np.inf)
    if vals.shape[1] < 2:
        return np.full(vals.shape, -np.inf)
    two = -np.partition(-vals, 1, axis=1)[:, :2]  # each row's largest and second largest
    first = vals == two[:, :1]
    alone = first.sum(axis=1, keepdims=True) == 1  # one column holds the row's largest: the others' top is the next
    return np.where(first & alone, two[:, 1:], two[:, :1])


def sliding_reduce(values: np.ndarray, window: int, reduce: np.ufunc, *, with_row: bool = False) -> np.ndarray:
    """``[S, L]`` ``reduce`` (``np.fmin`` / ``np.fmax``: NaN ignored) of each column over the previous ``window``
    rows, or with ``with_row`` over the last ``window`` rows up to the row itself; NaN where the window has no
    value. Reduced a block of rows at a time, so no ``[S, L, window]`` copy is made."""
    lead = window - 1 if with_row else window
    padded = np.concatenate([np.full((lead,) + values.shape[1:], np.nan), values])
    out = np.empty(values.shape)
    for a in range(0, values.shape[0], _BLOCK):
        b = min(a + _BLOCK, values.shape[0])
        win = np.lib.stride_tricks.sliding_window_view(padded[a:b + window - 1], window, axis=0)
        out[a:b] = reduce.reduce(win, axis=-1)
    return out


def window_range(log_rms: np.ndarray, window: int) -> np.ndarray:
    """``[S, L]`` decades between the largest and the smallest log RMS of each column over the last ``window`` rows,
    the row itself included (NaN ignored; 0 with fewer than two values)."""
    with np.errstate(invalid="ignore"):
        spread = (sliding_reduce(log_rms, window, np.fmax, with_row=True)
                  - sliding_reduce(log_rms, window, np.fmin, with_row=True))
    return np.where(np.isnan(spread), 0.0, spread)


#: Cells whose windows are gathered at once by :func:`window_median` (a bounded temporary).
_MEDIAN_CHUNK = 1 << 16


def window_median(values: np.ndarray, window: int, where: np.ndarray) -> np.ndarray:
    """``[S, L]`` median of each column over the previous ``window`` rows (not the row itself), NaN ignored, at the
    cells ``where`` (NaN elsewhere, and where the window has no value): where a column typically stood, moved by no
    single outlier (one batch that dropped by decades pulls a mean of logs down by a decade and more). Only the cells
    asked for are computed: a rule asks where its other conditions already hold, a few cells of a long run."""
    out = np.full(values.shape, np.nan)
    rows, cols = np.nonzero(where)
    padded = np.concatenate([np.full((window,) + values.shape[1:], np.nan), values])
    offsets = np.arange(window)
    for a in range(0, rows.size, _MEDIAN_CHUNK):
        r, c = rows[a:a + _MEDIAN_CHUNK], cols[a:a + _MEDIAN_CHUNK]
        win = padded[r[:, None] + offsets[None, :], c[:, None]]  # padded rows r .. r + window - 1: rows before r
        out[r, c] = _sorted_quantile(np.sort(win, axis=-1), 0.5)
    return out


def window_stats(log_rms: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """``[S, L]`` minimum and mean of each column over the previous ``window`` rows (not the row itself), NaN
    ignored (NaN where the window has no value)."""
    low = sliding_reduce(log_rms, window, np.fmin)
    padded = np.concatenate([np.full((window,) + log_rms.shape[1:], np.nan), log_rms])
    known = ~np.isnan(padded)
    total = np.concatenate([np.zeros((1,) + log_rms.shape[1:]), np.cumsum(np.where(known, padded, 0.0), axis=0)])
    count = np.concatenate([np.zeros((1,) + log_rms.shape[1:]), np.cumsum(known, axis=0)])
    n = count[window:-1] - count[:-window - 1]
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(n > 0, (total[window:-1] - total[:-window - 1]) / np.where(n > 0, n, 1), np.nan)
    return low, mean


def live_stats(records: np.ndarray) -> dict[str, np.ndarray]:
    """Per (step, layer): presence, missing, frozen (no gradient by the user's choice), NaN/Inf, all-zero, the RMS of
    the nonzero finite values and the norm of all finite values."""
    size, flag, nonfinite_count, zero, _, max_abs = history(records)
    present = ~np.isnan(size)
    frozen = present & (flag == record.FROZEN)
    missing = present & (flag > 0.5) & ~frozen
    values = present & ~missing & ~frozen
    nonfinite = values & (nonfinite_count > 0)
    dead = values & ~nonfinite & (size > 0) & (zero >= size)
    nonzero = size - nonfinite_count - zero
    with np.errstate(invalid="ignore", divide="ignore"):
        ssq = records[..., record.INDEX["ssq_rel"]]
        rms = np.where(nonzero > 0, max_abs * np.sqrt(ssq / np.where(nonzero > 0, nonzero, 1)), np.nan)
    live = values & ~nonfinite & ~dead & (rms > 0)
    norm = max_abs * np.sqrt(records[..., record.INDEX["ssq_rel"]])  # over every finite value
    return {"present": present, "missing": missing, "frozen": frozen, "nonfinite": nonfinite, "dead": dead,
            "live": live,
            "size": np.where(present, size, 0.0), "rms": rms, "max_abs": max_abs, "norm": norm}


def pinned_at_clip(norm: np.ndarray) -> np.ndarray:
    """``[S, L]``: the variable's gradient norm sits at its clip: it equals, to float32 rounding, the largest norm
    the variable has had, which it does at ``CLIP_STEPS`` or more logged steps (per-variable ``clipnorm``: the
    record holds the clipped gradient, so a gradient larger than the clip is recorded at the clip)."""
    with np.errstate(invalid="ignore"):
        top = _masked_max(norm, norm > 0, axis=0)
        at_top = (norm > 0) & (np.abs(norm - top) <= CLIP_SAME * top)
    return at_top & (at_top.sum(axis=0) >= CLIP_STEPS)


def in_runs_of(mask: np.ndarray, need: int) -> np.ndarray:
    """``[S, L]``: the elements of ``mask`` that belong to a run of at least ``need`` consecutive rows."""
    out = np.zeros(mask.shape, dtype=bool)
    if not mask.any():
        return out
    length = np.zeros(mask.shape, dtype=np.int64)  # length of the run so far
    for s in range(mask.shape[0]):
        length[s] = np.where(mask[s], (length[s - 1] if s else 0) + 1, 0)
    total = length.copy()  # length of the whole run, carried back from its last row
    for s in range(mask.shape[0] - 2, -1, -1):
        total[s] = np.where(mask[s] & mask[s + 1], total[s + 1], total[s])
    return mask & (total >= need)


def condemned_since(held: np.ndarray, end: int, start: int = 0) -> int:
    """Where an episode confirmed by evidence that arrives later begins: the first position of the unbroken stretch
    of ``held`` (``[S]`` bool, the layer's own level condition at each logged step) that ends at ``end`` (the step
    the evidence flags), not before ``start``; ``end`` itself where the condition does not hold there.

    The later evidence (a loss swinging by decades under an adaptive optimizer, a loss rising while the updates
    grow) does not make the layer sick: it condemns a state the layer was already in, which a gate had been
    excusing (the adaptive optimizer keeping each step at the others' pace) or which no rule alone could judge (an
    update above its first one). The episode therefore starts where that state began, not where the evidence
    arrived; a step where the condition fails breaks the stretch (the state began again after it)."""
    k = end
    while held[end] and k > start and held[k - 1]:
        k -= 1
    return k
