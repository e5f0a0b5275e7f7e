"""The training loop's progress beside the gradient records, read from a run's event files (or TensorBoard's data
provider) without TensorFlow: the loss, and which logged steps the optimizer skipped.

Every writer of this package records the loss with :meth:`tb_gradhealth.writer.Writer.add_loss` (the Keras
callback, ``torch.StepRecorder``, the Lightning, Hugging Face and Keras-on-JAX callbacks): the scalar
:data:`LOSS_TAG` (format v1: one float per logged step, in the same ``.gradhealth`` event file as the records; the
version is part of the tag, so a later format gets a new tag and this reader keeps reading v1). Other code gives the
same evidence with a plain ``loss`` (or Keras TensorBoard's ``batch_loss``) scalar, e.g. ``tf.summary.scalar("loss",
x)``. A log without any of them (written before the loss was recorded) has no
progress, and the diagnosis uses the gradients alone.

Writers that know whether the optimizer applied a logged step (a loss scaler skips a step whose scaled gradient
overflowed) write the scalar :data:`SKIPPED_TAG` on it: 1 skipped, 0 applied. It is the diagnosis' evidence of a
skip; a log without it has none.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from tensorboard.util import tensor_util

from tb_gradhealth._eventfile import iter_summary_values
from tb_gradhealth._streams import run_of

#: The loss as the Keras callback records it (v1).
LOSS_TAG = "gradhealth_progress_v1/loss"
#: Tags read as the training loss, the first one present wins.
LOSS_TAGS = (LOSS_TAG, "loss", "batch_loss")
#: Whether the optimizer skipped a logged step (1) or applied it (0), where a writer knows (a loss scaler's steps).
SKIPPED_TAG = "amp/step_skipped"
#: Every scalar tag this module reads.
TAGS = (*LOSS_TAGS, SKIPPED_TAG)
#: The plugin that holds them in TensorBoard (the writers give them its metadata).
SCALARS_PLUGIN = "scalars"
#: Steps of each scalar the plugin asks the data provider for at most (its trend reads quartile medians).
PROVIDER_POINTS = 1000


class Progress(NamedTuple):
    """What a run recorded of its progress, each ``(steps int64 [n], values float64 [n])`` ascending, or None where
    the run has none: ``loss`` (the first of :data:`LOSS_TAGS` present) and ``skipped`` (:data:`SKIPPED_TAG`); and
    ``origin``, ``(step, layer)`` where a writer replayed the run's first NaN/Inf step and found the layer that
    made it (``layer`` None: outside any layer; :mod:`tb_gradhealth.origin`)."""

    loss: tuple[np.ndarray, np.ndarray] | None = None
    skipped: tuple[np.ndarray, np.ndarray] | None = None
    origin: tuple[int, str | None] | None = None

    def seen(self) -> tuple:
        """What changes when the run records more of any: ``(points, last step, last value)`` of each series, and
        the origin."""
        return (*(None if x is None else (x[0].size, int(x[0][-1]), float(x[1][-1])) for x in (self.loss,
                                                                                                self.skipped)),
                self.origin)

    def with_origin(self, found: Any) -> Progress:
        """This progress with a :class:`tb_gradhealth.origin.NanOrigin` (or None) as its ``origin``."""
        return self._replace(origin=None if found is None else (int(found.step), found.layer or None))


def scalar_value(value: Any) -> float | None:
    """A summary value of one of :data:`TAGS` as this module reads it (a scalar written as a float32 tensor comes
    back as that float32), or None when it is not a number."""
    if value.HasField("simple_value"):
        return float(value.simple_value)
    if value.HasField("tensor"):
        try:
            arr = tensor_util.make_ndarray(value.tensor)
        except (ValueError, TypeError):
            return None
        return float(arr.reshape(-1)[0]) if arr.size == 1 and arr.dtype.kind in "fiu" else None
    return None


def _series(by_step: Mapping[int, float]) -> tuple[np.ndarray, np.ndarray] | None:
    if not by_step:
        return None
    steps = np.array(sorted(by_step), dtype=np.int64)
    return steps, np.array([by_step[int(s)] for s in steps], dtype=np.float64)


def progress_of(found: Mapping[str, Mapping[int, float]]) -> Progress:
    """The :class:`Progress` of ``{tag: {step: value}}`` (a step written twice holds its last value): the loss of
    the first of :data:`LOSS_TAGS` that has a value, and the skip flags."""
    loss = next((s for tag in LOSS_TAGS if (s := _series(found.get(tag, {}))) is not None), None)
    return Progress(loss, _series(found.get(SKIPPED_TAG, {})))


def read_progress(paths: Sequence[str], storage_options: Mapping[str, Any] | None = None) -> Progress:
    """The :class:`Progress` of a run's event files. Damage is skipped silently: the gradient reader reports it."""
    found: dict[str, dict[int, float]] = {tag: {} for tag in TAGS}
    for event, value in iter_summary_values(paths, storage_options):
        series = found.get(value.tag)
        if series is not None and (x := scalar_value(value)) is not None:
            series[int(event.step)] = x
    return progress_of(found)


def read_loss(paths: Sequence[str], storage_options: Mapping[str, Any] | None = None
              ) -> tuple[np.ndarray, np.ndarray] | None:
    """``(steps int64 [n], loss float64 [n])`` of the first of :data:`LOSS_TAGS` in a run's event files, ascending
    (a step written twice keeps its last value), or None when the run has none (:func:`read_progress`)."""
    return read_progress(paths, storage_options).loss


def read_provider_progress(data_provider: Any, ctx: Any, experiment_id: str, run: str,
                           downsample: int = PROVIDER_POINTS) -> Progress:
    """:func:`read_progress` through TensorBoard's data provider (the plugin's reading) for ``run`` (a run
    directory): at most ``downsample`` steps of each scalar (TensorBoard keeps a sample of every scalar tag)."""
    from tensorboard.data import provider

    data = data_provider.read_scalars(ctx, experiment_id=experiment_id, plugin_name=SCALARS_PLUGIN,
                                      downsample=downsample,
                                      run_tag_filter=provider.RunTagFilter(runs=[run], tags=list(TAGS)))
    found = (data or {}).get(run, {})
    return progress_of({tag: {int(p.step): float(p.value) for p in found.get(tag, ())} for tag in TAGS})


def read_provider(data_provider: Any, ctx: Any, experiment_id: str, run: str, downsample: int = PROVIDER_POINTS
                  ) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`read_loss` through TensorBoard's data provider: the loss of :func:`read_provider_progress`."""
    return read_provider_progress(data_provider, ctx, experiment_id, run, downsample).loss


class ProviderProgress:
    """:func:`read_provider_progress` for the plugin, read again only when the data provider lists new data for the
    run's tags: listing them (their last step and wall time) is much cheaper than reading their values, and the tab
    asks for a run's diagnosis on every view. Thread-safe; keeps the last ``entries`` runs."""

    def __init__(self, data_provider: Any, entries: int = 64) -> None:
        self._provider, self._entries = data_provider, entries
        self._cache: OrderedDict[tuple[str, str], tuple[tuple, Progress]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, ctx: Any, experiment_id: str, run: str) -> Progress:
        """The progress of ``run`` (a run directory) as :func:`read_provider_progress` gives it."""
        from tensorboard.data import provider

        listing = self._provider.list_scalars(ctx, experiment_id=experiment_id, plugin_name=SCALARS_PLUGIN,
                                              run_tag_filter=provider.RunTagFilter(runs=[run], tags=list(TAGS)))
        tags = (listing or {}).get(run, {})
        if not tags:
            return Progress()
        key, seen = (experiment_id, run), tuple(sorted((t, ts.max_step, ts.max_wall_time) for t, ts in tags.items()))
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit[0] == seen:
                self._cache.move_to_end(key)
                return hit[1]
        found = read_provider_progress(self._provider, ctx, experiment_id, run)
        with self._lock:
            self._cache[key] = (seen, found)
            self._cache.move_to_end(key)
            while len(self._cache) > self._entries:
                self._cache.popitem(last=False)
        return found


def run_paths(runs: Mapping[str, Sequence[str]], run: str) -> Sequence[str]:
    """The event files of ``run`` in :func:`tb_gradhealth.reader.find_runs`' map (a stream ``"run [name]"`` is in
    its run's directory)."""
    if run in runs:
        return runs[run]
    return runs.get(run_of(run), ())
