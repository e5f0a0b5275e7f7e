"""The training loss of a run, read from its event files without TensorFlow: evidence beside the gradient records.

Every writer of this package records the loss with :meth:`tb_gradhealth.writer.Writer.add_loss` (the Keras
callback, ``torch.StepRecorder``, the Lightning, Hugging Face and Keras-on-JAX callbacks): the scalar
:data:`LOSS_TAG` (format v1: one float per logged step, in the same ``.gradhealth`` event file as the records; the
version is part of the tag, so a later format gets a new tag and this reader keeps reading v1). Other code gives the
same evidence with a plain ``loss`` (or Keras TensorBoard's ``batch_loss``) scalar, e.g. ``tf.summary.scalar("loss",
x)``. A log without any of them (written before the loss was recorded) has no
progress, and the diagnosis uses the gradients alone.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tensorboard.util import tensor_util

from tb_gradhealth._eventfile import iter_summary_values
from tb_gradhealth._streams import run_of

#: The loss as the Keras callback records it (v1).
LOSS_TAG = "gradhealth_progress_v1/loss"
#: Tags read as the training loss, the first one present wins.
LOSS_TAGS = (LOSS_TAG, "loss", "batch_loss")
#: The plugin that holds them in TensorBoard (the writers give them its metadata).
SCALARS_PLUGIN = "scalars"
#: Steps of the loss the plugin asks the data provider for at most (its trend reads quartile medians).
PROVIDER_POINTS = 1000


def _value(value: Any) -> float | None:
    if value.HasField("simple_value"):
        return float(value.simple_value)
    if value.HasField("tensor"):
        try:
            arr = tensor_util.make_ndarray(value.tensor)
        except (ValueError, TypeError):
            return None
        return float(arr.reshape(-1)[0]) if arr.size == 1 and arr.dtype.kind in "fiu" else None
    return None


def read_loss(paths: Sequence[str], storage_options: Mapping[str, Any] | None = None
              ) -> tuple[np.ndarray, np.ndarray] | None:
    """``(steps int64 [n], loss float64 [n])`` of the first of :data:`LOSS_TAGS` in a run's event files, ascending
    (a step written twice keeps its last value), or None when the run has none. Damage is skipped silently: the
    gradient reader reports it."""
    found: dict[str, dict[int, float]] = {tag: {} for tag in LOSS_TAGS}
    for event, value in iter_summary_values(paths, storage_options):
        series = found.get(value.tag)
        if series is not None and (x := _value(value)) is not None:
            series[int(event.step)] = x
    for tag in LOSS_TAGS:
        if found[tag]:
            steps = np.array(sorted(found[tag]), dtype=np.int64)
            return steps, np.array([found[tag][int(s)] for s in steps], dtype=np.float64)
    return None


def read_provider(data_provider: Any, ctx: Any, experiment_id: str, run: str, downsample: int = PROVIDER_POINTS
                  ) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`read_loss` through TensorBoard's data provider (the plugin's reading): the first of :data:`LOSS_TAGS`
    that ``run`` (a run directory) has as a scalar, at most ``downsample`` of its steps (TensorBoard keeps a
    sample of every scalar tag), or None when it has none."""
    from tensorboard.data import provider

    data = data_provider.read_scalars(ctx, experiment_id=experiment_id, plugin_name=SCALARS_PLUGIN,
                                      downsample=downsample,
                                      run_tag_filter=provider.RunTagFilter(runs=[run], tags=list(LOSS_TAGS)))
    found = (data or {}).get(run, {})
    for tag in LOSS_TAGS:
        by_step = {int(p.step): float(p.value) for p in found.get(tag, ())}  # a step written twice: its last value
        if by_step:
            steps = np.array(sorted(by_step), dtype=np.int64)
            return steps, np.array([by_step[int(s)] for s in steps], dtype=np.float64)
    return None


class ProviderLosses:
    """:func:`read_provider` for the plugin, read again only when the data provider lists new loss data for the run:
    listing a run's loss tags (their last step and wall time) is much cheaper than reading their values, and the tab
    asks for a run's diagnosis on every view. Thread-safe; keeps the last ``entries`` runs."""

    def __init__(self, data_provider: Any, entries: int = 64) -> None:
        self._provider, self._entries = data_provider, entries
        self._cache: OrderedDict[tuple[str, str], tuple[tuple, tuple[np.ndarray, np.ndarray] | None]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, ctx: Any, experiment_id: str, run: str) -> tuple[np.ndarray, np.ndarray] | None:
        """The loss of ``run`` (a run directory) as :func:`read_provider` gives it."""
        from tensorboard.data import provider

        listing = self._provider.list_scalars(ctx, experiment_id=experiment_id, plugin_name=SCALARS_PLUGIN,
                                              run_tag_filter=provider.RunTagFilter(runs=[run], tags=list(LOSS_TAGS)))
        tags = (listing or {}).get(run, {})
        if not tags:
            return None
        key, seen = (experiment_id, run), tuple(sorted((t, ts.max_step, ts.max_wall_time) for t, ts in tags.items()))
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit[0] == seen:
                self._cache.move_to_end(key)
                return hit[1]
        loss = read_provider(self._provider, ctx, experiment_id, run)
        with self._lock:
            self._cache[key] = (seen, loss)
            self._cache.move_to_end(key)
            while len(self._cache) > self._entries:
                self._cache.popitem(last=False)
        return loss


def run_paths(runs: Mapping[str, Sequence[str]], run: str) -> Sequence[str]:
    """The event files of ``run`` in :func:`tb_gradhealth.reader.find_runs`' map (a stream ``"run [name]"`` is in
    its run's directory)."""
    if run in runs:
        return runs[run]
    return runs.get(run_of(run), ())
