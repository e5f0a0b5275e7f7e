"""Long runs in bounded memory: the recent steps one by one, older steps merged into windows of equal length.

A pretraining run of 1,000 tensors logged for 10^5 steps holds 10^8 records; no layout of them fits a TensorBoard
process. The plugin (:mod:`tb_gradhealth.filereader`) keeps at most :func:`row_budget` rows a run: when a run grows
past it, the oldest steps are merged (:func:`mean_step`) into windows of ``width`` steps, the width doubling when the
windows outgrow their share, and the most recent quarter of the budget stays at every step. Each window is kept as
its *mean step* (:func:`record.scale` of the merged record by ``1/steps``): exact extremes and NaN/Inf totals over
the window, counts and sums of squares per step, so the diagnosis and the charts read a window as one step of the
same scale, and ``record.scale(row, steps)`` gives back the exact merge. The first step with a NaN/Inf stays a row of
its own, so the nonfinite onset stays exact; other onsets in the merged part are exact to their window. The CLI
reads every step (:func:`reader.read_logdir`); only the plugin's copy is tiered.
"""

from __future__ import annotations

import numpy as np

from tb_gradhealth import record

#: Records a run may hold in the plugin before its older steps are merged (~420 MB of float64 planes, 25 used).
LAYER_STEPS: int = 1 << 21
#: A run keeps at least this many rows, however many layers it has.
MIN_ROWS: int = 1024


def row_budget(n_layers: int, layer_steps: int = LAYER_STEPS, min_rows: int = MIN_ROWS) -> int:
    """Rows a run of ``n_layers`` layers may hold before :func:`plan` merges its older ones."""
    return max(min_rows, layer_steps // max(1, n_layers))


def mean_step(rows: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The mean step of windows: ``rows`` ``[k, ..., L, F]`` mean steps of ``weights`` ``[k, ..., L]`` steps each
    (0 where a layer has no record: its row is all-NaN), merged along the first axis -> ``(records [..., L, F],
    steps [..., L])``; a layer with no record in a window stays all-NaN with 0 steps. Rows may be cut inside the
    histogram (the bins no record of the run used left out): one :func:`record.merge_all` over every window given."""
    rows = np.asarray(rows, dtype=np.float64)
    weights = np.asarray(weights, dtype=np.int64)
    present = (weights > 0) & ~np.isnan(rows[..., record.INDEX["size"]])
    total = np.where(present, weights, 0).sum(axis=0)
    scaled = rows if np.all(weights[present] == 1) else record.scale(rows, np.where(present, weights, 1))
    merged = record.merge_all(np.where(present[..., None], scaled, record.empty()[: rows.shape[-1]]), axis=0)
    with np.errstate(divide="ignore"):
        out = record.scale(merged, np.where(total > 0, 1.0 / np.maximum(total, 1), 1.0))
    out[total == 0] = np.nan
    return out, total


def window_sums(rows: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """The merged record of each window from its mean step ``rows`` ``[..., F]`` and its ``steps`` ``[...]``: the
    exact counts come back as whole numbers (the mean step's are fractions)."""
    out = record.scale(rows, steps)
    counts = [record.INDEX[name] for name in record.COUNT_FIELDS + ("hist_sample",)
              if record.INDEX[name] < out.shape[-1]]
    out[..., counts] = np.round(out[..., counts])
    return out


def plan(n_rows: int, n_old: int, width: int, budget: int, pinned: int | None) -> tuple[list[tuple[int, int]], int,
                                                                                        int]:
    """Which rows become which row when a run of ``n_rows`` rows outgrows ``budget``: ``(groups, old, width)``.

    Rows ``[0, n_old)`` are windows of about ``width`` steps; later ones are single steps. The single steps beyond
    the last ``budget // 4`` join the windows (``width`` rows a window), and while the windows number more than
    ``budget // 4`` adjacent pairs merge and ``width`` doubles. ``groups``: consecutive ``(start, end)`` row ranges
    covering every row, one new row each; the ``pinned`` row (the first NaN/Inf step) is always a group of its own.
    ``old``: how many of the new rows are windows; ``width``: their width in steps now.
    """
    keep = budget // 4
    move_end = max(n_old, n_rows - keep)
    windows = _split(_chunks(0, n_old, 1), pinned) + _split(_chunks(n_old, move_end, width), pinned)
    while len(windows) > keep and width < (1 << 40):
        width *= 2
        windows = _split(_pairs(windows, pinned), pinned)
    singles = [(i, i + 1) for i in range(move_end, n_rows)]
    return windows + singles, len(windows), width


def _chunks(start: int, end: int, size: int) -> list[tuple[int, int]]:
    return [(s, min(s + size, end)) for s in range(start, end, size)]


def _split(groups: list[tuple[int, int]], pinned: int | None) -> list[tuple[int, int]]:
    """The groups with the pinned row taken out of the one that holds it, as a group of its own."""
    if pinned is None:
        return groups
    out: list[tuple[int, int]] = []
    for s, e in groups:
        if s <= pinned < e and e - s > 1:
            out.extend(g for g in ((s, pinned), (pinned, pinned + 1), (pinned + 1, e)) if g[1] > g[0])
        else:
            out.append((s, e))
    return out


def _pairs(groups: list[tuple[int, int]], pinned: int | None) -> list[tuple[int, int]]:
    """Adjacent groups merged two by two; the pinned row's group merges with nothing."""
    out: list[tuple[int, int]] = []
    i = 0
    while i < len(groups):
        s, e = groups[i]
        nxt = groups[i + 1] if i + 1 < len(groups) else None
        alone = pinned is not None and (s <= pinned < e or (nxt is not None and nxt[0] <= pinned < nxt[1]))
        if nxt is None or alone:
            out.append((s, e))
            i += 1
        else:
            out.append((s, nxt[1]))
            i += 2
    return out
