"""Synthetic gradient-health logdirs with a known diagnosis, for tests and benchmarks; no TensorFlow.

Events are TensorBoard's protos framed by :mod:`tb_gradhealth._eventfile` (the package's one event-file writer).
Part of the package so that the test suite and the benchmarks import it the same way (``from tb_gradhealth
import testing``), and so that a dashboard or a CI gate built on the plugin can be tested against known runs.

* :func:`make_demo_logdir` writes demo-like runs whose diagnosis is known in advance (used by the reader, plugin,
  CLI, browser and tensorboard-process tests): ``healthy``, ``vanishing`` (early layers decades below the rest),
  ``exploding`` (growing, then NaN at a known step in the deepest layer first) and ``xss`` (a layer named like an
  HTML injection).
* :func:`make_scale_logdir` writes one run of N layers x M steps quickly (vectorised records) for
  ``benchmarks/backend_scale.py``; :func:`make_histogram_logdir` writes the same run logged the common TensorBoard
  way (a 30-bucket histogram and 4 scalars per variable per step) for the side-by-side histogram-route figure.
* :func:`data_server` starts TensorBoard's own data server (the default loader of ``tensorboard``) on a logdir and
  returns its ingester: ``ingester.data_provider`` is a real ``context.data_provider`` for in-process plugin tests.
"""

from __future__ import annotations

import functools
import os
import socket
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.util import tensor_util

from tb_gradhealth import _eventfile, metadata, record
from tb_gradhealth.writer import Writer

WALL_TIME0 = 1_700_000_000.0
XSS_LAYER = "<img src=x onerror=alert(1)>"

_counter = [0]


def event_file_path(run_dir: str, wall_time: float = WALL_TIME0) -> str:
    """A fresh TensorBoard-style event file name in ``run_dir`` (``tfevents`` in the name is what readers look for)."""
    os.makedirs(run_dir, exist_ok=True)
    _counter[0] += 1
    name = f"events.out.tfevents.{int(wall_time)}.{socket.gethostname()}.{os.getpid()}.{_counter[0]}.v2"
    return os.path.join(run_dir, name)


def frame(data: bytes, crc: int | None = None) -> bytes:
    """One TFRecord (the product's framing); ``crc`` overrides the data checksum, to write a corrupt record."""
    framed = _eventfile.frame(data)
    return framed if crc is None else framed[:-4] + struct.pack("<I", crc)


def version_event(wall_time: float = WALL_TIME0) -> bytes:
    return event_pb2.Event(wall_time=wall_time, step=0, file_version="brain.Event:2").SerializeToString()


def record_event(
    step: int,
    tag: str,
    rows: np.ndarray | None = None,
    *,
    layers: Sequence[str] | None = None,
    wall_time: float | None = None,
    tensor: np.ndarray | None = None,
    plugin_content: bytes | None = None,
    kind: str = "gradients",
) -> bytes:
    """A serialized event holding one gradient-health record tensor (memory-form ``rows`` → disk form).

    ``layers`` attaches the tag's metadata (TensorBoard keeps the first it sees); ``tensor`` writes a raw tensor
    instead of ``to_disk(rows)`` and ``plugin_content`` raw metadata content (both for corruption tests).
    """
    value = summary_pb2.Summary.Value(tag=tag)
    value.tensor.CopyFrom(tensor_util.make_tensor_proto(record.to_disk(rows) if tensor is None else tensor))
    if layers is not None or plugin_content is not None:
        md = metadata.create_summary_metadata(list(layers or []), kind=kind)
        if plugin_content is not None:
            md.plugin_data.content = plugin_content
        value.metadata.CopyFrom(md)
    wt = WALL_TIME0 + step if wall_time is None else wall_time
    return event_pb2.Event(wall_time=wt, step=int(step), summary=summary_pb2.Summary(value=[value])).SerializeToString()


def scalar_event(step: int, tag: str, value: float, wall_time: float | None = None) -> bytes:
    """A TF2-style scalar summary (the scalars plugin's metadata), as the writers' ``add_scalars`` produce."""
    md = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"),
        data_class=summary_pb2.DATA_CLASS_SCALAR,
    )
    v = summary_pb2.Summary.Value(tag=tag, metadata=md)
    v.tensor.CopyFrom(tensor_util.make_tensor_proto(np.float32(value)))
    wt = WALL_TIME0 + step if wall_time is None else wall_time
    return event_pb2.Event(wall_time=wt, step=int(step), summary=summary_pb2.Summary(value=[v])).SerializeToString()


def write_events(path: str, events: Iterable[bytes], *, with_version: bool = True) -> str:
    """Write serialized events to ``path`` as TFRecords (appending if it exists)."""
    with open(path, "ab") as f:
        if with_version:
            f.write(frame(version_event()))
        for e in events:
            f.write(frame(e))
    return path


def write_records(
    run_dir: str,
    layers: Sequence[str],
    steps: Sequence[int],
    records: np.ndarray,
    *,
    name: str = "gradients",
    scalars: dict[str, Sequence[float]] | None = None,
    metadata_every_event: bool = False,
    wall_time0: float = WALL_TIME0,
) -> str:
    """Write memory-form ``records [S, L, F]`` of ``layers`` at ``steps`` as one tag; returns the event file path.

    Rows that are all-NaN in ``records`` are not allowed (a writer writes every layer of its tag at a step).
    Wall times are ``wall_time0 + step``.
    """
    tag = metadata.tag_for(list(layers), name)
    events = []
    for i, step in enumerate(steps):
        with_md = metadata_every_event or i == 0
        events.append(record_event(step, tag, records[i], layers=layers if with_md else None,
                                   wall_time=wall_time0 + step))
        for stag, values in (scalars or {}).items():
            events.append(scalar_event(step, stag, values[i]))
    return write_events(event_file_path(run_dir), events)


# --- demo-like runs with a known diagnosis ------------------------------------------------------------------------


@dataclass
class RunFacts:
    """What a generated run is known to contain, for assertions."""

    layers: list[str]
    steps: list[int]
    vanishing: list[str] = field(default_factory=list)
    exploding: list[str] = field(default_factory=list)
    healthy: list[str] = field(default_factory=list)
    nan_step: int | None = None
    first_nan_layer: str | None = None


def _records(scales: np.ndarray, sizes: Sequence[int], rng: np.random.Generator, nan_mask=None) -> np.ndarray:
    """Memory-form records of Gaussian gradients with per-(step, layer) scale, and weights of RMS 0.05."""
    steps, n_layers = scales.shape
    out = np.empty((steps, n_layers, record.NUM_FIELDS))
    weights = [rng.normal(0.0, 0.05, size=n) for n in sizes]
    for s in range(steps):
        for j, n in enumerate(sizes):
            g = rng.normal(0.0, 1.0, size=n) * scales[s, j]
            if nan_mask is not None and nan_mask[s, j]:
                g[: max(1, n // 10)] = np.nan
            out[s, j] = record.compute(g, weight=weights[j], hist_sample=None)
    return out


def _dense_layers(n: int, prefix: str = "dense") -> list[str]:
    return [f"{prefix}_{i // 2}/{'kernel' if i % 2 == 0 else 'bias'}" for i in range(n)]


def make_healthy(logdir: str, run: str = "healthy", steps: int = 30, seed: int = 0) -> RunFacts:
    rng = np.random.default_rng(seed)
    layers = _dense_layers(8)
    sizes = [256 if i % 2 == 0 else 16 for i in range(len(layers))]
    base = 10.0 ** rng.uniform(-3.0, -2.3, size=len(layers))
    scales = base[None, :] * np.exp(rng.normal(0.0, 0.1, size=(steps, len(layers))))
    step_list = list(range(10, steps * 10 + 10, 10))  # logged every 10 steps, from step 10
    recs = _records(scales, sizes, rng)
    loss = list(np.linspace(2.0, 0.5, steps))
    write_records(os.path.join(logdir, run), layers, step_list, recs, scalars={"loss": loss})
    return RunFacts(layers, step_list, healthy=list(layers))


def make_vanishing(logdir: str, run: str = "vanishing", steps: int = 30, seed: int = 1) -> RunFacts:
    """A deep sigmoid-like stack: the first three variables sit 4-6 decades below the median layer, all along."""
    rng = np.random.default_rng(seed)
    layers = [f"sigmoid_{i}/kernel" for i in range(10)]
    sizes = [128] * len(layers)
    base = np.array([1e-9, 1e-8, 1e-7] + list(10.0 ** np.linspace(-3.3, -2.7, 7)))
    scales = base[None, :] * np.exp(rng.normal(0.0, 0.1, size=(steps, len(layers))))
    step_list = list(range(steps))
    write_records(os.path.join(logdir, run), layers, step_list, _records(scales, sizes, rng))
    return RunFacts(layers, step_list, vanishing=layers[:3], healthy=layers[3:])


def make_exploding(logdir: str, run: str = "exploding", steps: int = 40, nan_step: int = 30, seed: int = 2) -> RunFacts:
    """Gradients grow x2 per step from step 10 (deeper layers larger); at ``nan_step`` the deepest (last) layer
    turns NaN first, and from the next step on every layer is NaN."""
    rng = np.random.default_rng(seed)
    layers = [f"linear_{i}/kernel" for i in range(8)]
    sizes = [128] * len(layers)
    depth = 10.0 ** np.linspace(-3.0, -2.0, len(layers))
    growth = 2.0 ** np.maximum(0, np.arange(steps) - 10)
    scales = growth[:, None] * depth[None, :]
    nan_mask = np.zeros((steps, len(layers)), dtype=bool)
    nan_mask[nan_step, -1] = True
    nan_mask[nan_step + 1 :, :] = True
    step_list = list(range(steps))
    write_records(os.path.join(logdir, run), layers, step_list, _records(scales, sizes, rng, nan_mask))
    return RunFacts(layers, step_list, exploding=list(layers), nan_step=nan_step, first_nan_layer=layers[-1])


def make_xss(logdir: str, run: str = "xss", steps: int = 10, seed: int = 3) -> RunFacts:
    rng = np.random.default_rng(seed)
    layers = [XSS_LAYER, "dense/kernel", "dense/bias"]
    scales = np.full((steps, len(layers)), 1e-3) * np.exp(rng.normal(0.0, 0.1, size=(steps, len(layers))))
    step_list = list(range(steps))
    write_records(os.path.join(logdir, run), layers, step_list, _records(scales, [64, 64, 8], rng))
    return RunFacts(layers, step_list, healthy=list(layers))


def make_sigmoid_stack(logdir: str, run: str = "sigmoid_stack", steps: int = 30, seed: int = 5
                       ) -> tuple[RunFacts, np.ndarray]:
    """:func:`make_vanishing`'s gradients, written by :class:`tb_gradhealth.writer.Writer` as a writer that knows
    the model writes them: every layer a sigmoid ``Dense`` in the tags' metadata, and a training loss that halves
    over the run (:meth:`Writer.add_loss`). Returns the facts and the loss written, one value per step."""
    rng = np.random.default_rng(seed)
    layers = [f"sigmoid_{i}/kernel" for i in range(10)]
    base = np.array([1e-9, 1e-8, 1e-7] + list(10.0 ** np.linspace(-3.3, -2.7, 7)))
    scales = base[None, :] * np.exp(rng.normal(0.0, 0.1, size=(steps, len(layers))))
    recs = _records(scales, [128] * len(layers), rng)
    loss = np.linspace(1.0, 0.5, steps)
    with Writer(os.path.join(logdir, run)) as w:
        for s in range(steps):
            w.add_records(s, layers, recs[s], layer_info=[("Dense", "sigmoid")] * len(layers))
            w.add_loss(s, loss[s])
    return RunFacts(layers, list(range(steps)), vanishing=layers[:3], healthy=layers[3:]), loss


def make_demo_logdir(logdir: str) -> dict[str, RunFacts]:
    """The four demo-like runs in ``logdir`` (about 0.2 s); returns what each run is known to contain."""
    return {
        "healthy": make_healthy(logdir),
        "vanishing": make_vanishing(logdir),
        "exploding": make_exploding(logdir),
        "xss": make_xss(logdir),
    }


# --- scale generators (benchmark) ---------------------------------------------------------------------------------

def write_events_fast(path: str, events: Iterable[bytes]) -> str:
    """Like :func:`write_events` into a fresh file, streaming and buffered: for logdirs of millions of events."""
    with open(path, "wb") as f:
        batch = [frame(version_event())]
        for e in events:
            batch.append(frame(e))
            if len(batch) >= 65536:
                f.write(b"".join(batch))
                batch = []
        f.write(b"".join(batch))
    return path


@functools.cache
def _profile_sums() -> dict[str, float]:
    """The :data:`record.GRAD_SUMS` fields other than ``mean`` and ``ssq_rel`` (which :func:`synthetic_records`
    sets on their own) of a unit-RMS Gaussian profile with max|g| = 3: a relative sum per value, a mean as is."""
    z = np.clip(np.random.default_rng(0).standard_normal(4096), -3.0, 3.0)
    z[0] = 3.0
    sums = record.grad_sums(z, 3.0)
    return {s.name: sums[s.name] if s.mean else sums[s.name] / z.size for s in record.GRAD_SUMS
            if s.name not in ("mean", "ssq_rel")}


def synthetic_records(rms: np.ndarray, size: int = 4096) -> np.ndarray:
    """Memory-form records ``[..., F]`` of Gaussian-like gradients with the given RMS, built arithmetically (no
    per-element work): exact counts, max|g| = 3 RMS, histogram in the three decades around the RMS."""
    rms = np.asarray(rms, dtype=np.float64)
    rec = np.zeros(rms.shape + (record.NUM_FIELDS,))
    rec[..., record.INDEX["size"]] = size
    m = 3.0 * rms
    rec[..., record.INDEX["min"]] = -m
    rec[..., record.INDEX["max"]] = m
    rec[..., record.INDEX["mean"]] = 0.01 * rms
    rec[..., record.INDEX["ssq_rel"]] = size / 9.0
    rec[..., record.INDEX["weight_max_abs"]] = 0.15
    rec[..., record.INDEX["weight_ssq_rel"]] = size / 9.0
    for name in ("update_max_abs", "update_ssq_rel", "micro_batches", "noise_ssq_rel"):
        rec[..., record.INDEX[name]] = np.nan
    rec[..., record.INDEX["hist_sample"]] = size
    for name, per_value in _profile_sums().items():  # any other gradient sum of record.GRAD_SUMS
        s = record.GRAD_SUMS[record.GRAD_SUM_NAMES.index(name)]
        rec[..., record.INDEX[name]] = per_value * (rms**s.power if s.mean else size)
    centre = np.clip(np.floor(np.log10(rms)).astype(int) + 38, 1, record.HIST_BINS - 2)
    hist = np.zeros(rms.shape + (record.HIST_BINS,))
    np.put_along_axis(hist, (centre - 1)[..., None], 0.2 * size, axis=-1)
    np.put_along_axis(hist, centre[..., None], 0.7 * size, axis=-1)
    np.put_along_axis(hist, (centre + 1)[..., None], 0.1 * size, axis=-1)
    rec[..., record.HIST_START :] = hist
    return rec


def make_scale_logdir(logdir: str, n_layers: int, n_steps: int, run: str = "scale", seed: int = 0) -> RunFacts:
    """One run of ``n_layers`` x ``n_steps`` (one event per step, ~100 bytes a layer-step on disk), in the numpy
    ``Writer``'s layout: step-block tags (``metadata.tag_for(layers, step=s)``), the metadata on each tag's first
    event. Streams to disk, so the largest sizes need little memory.

    Layer RMS spans ~4 decades with depth (a mildly vanishing stack) and drifts slowly over steps."""
    rng = np.random.default_rng(seed)
    layers = [f"block_{i // 2:04d}/{'kernel' if i % 2 == 0 else 'bias'}" for i in range(n_layers)]
    depth = 10.0 ** np.linspace(-6.0, -2.0, n_layers)
    seen: set[str] = set()

    def events() -> Iterable[bytes]:
        for s in range(n_steps):
            rms = depth * np.exp(rng.normal(0.0, 0.05, size=n_layers)) * (1.0 + 0.5 * s / max(1, n_steps))
            tag = metadata.tag_for(layers, step=s)
            first = tag not in seen
            seen.add(tag)
            yield record_event(s, tag, synthetic_records(rms), layers=layers if first else None)

    write_events_fast(event_file_path(os.path.join(logdir, run)), events())
    return RunFacts(layers, list(range(n_steps)))


def make_histogram_logdir(logdir: str, n_layers: int, n_steps: int, run: str = "histograms", *,
                          scalars: bool = True) -> str:
    """The common TensorBoard way of logging the same run: per variable per step a 30-bucket ``tf.summary.histogram``
    (v2 tensor ``[30, 3]`` float64) and mean/std/max/min scalars, one event per summary (as TF2 writes them)."""
    from tensorboard.plugins.histogram import summary_v2 as hist_v2

    rng = np.random.default_rng(0)
    names = [f"block_{i // 2:04d}/{'kernel' if i % 2 == 0 else 'bias'}" for i in range(n_layers)]
    scalar_md = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"),
        data_class=summary_pb2.DATA_CLASS_SCALAR,
    ).SerializeToString()
    # Summary bytes per (variable, step) are built once per variable and reused: only the event header (wall time,
    # step) changes, which is what dominates a loader's work anyway. Varying values would not change the sizes.
    hist_bodies, scalar_bodies = [], []
    for name in names:
        sample = rng.normal(0.0, 1e-3, size=1000)
        hist_bodies.append(hist_v2.histogram_pb(f"{name}-grad", sample, buckets=30).SerializeToString())
        per = []
        for stat in ("mean", "std", "max", "min"):
            v = summary_pb2.Summary.Value(tag=f"{name}-grad-{stat}")
            v.metadata.ParseFromString(scalar_md)
            v.tensor.CopyFrom(tensor_util.make_tensor_proto(np.float32(rng.normal())))
            per.append(summary_pb2.Summary(value=[v]).SerializeToString())
        scalar_bodies.append(per)
    hist_parts = [b"\x2a" + _varint(len(b)) + b for b in hist_bodies]
    scalar_parts = [[b"\x2a" + _varint(len(b)) + b for b in per] for per in scalar_bodies]

    def events() -> Iterable[bytes]:
        for s in range(n_steps):
            head = struct.pack("<Bd", 0x09, WALL_TIME0 + s) + b"\x10" + _varint(s)
            for j in range(n_layers):
                yield head + hist_parts[j]
                if scalars:
                    for part in scalar_parts[j]:
                        yield head + part

    path = event_file_path(os.path.join(logdir, run))
    write_events_fast(path, events())
    return path


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


# --- a real TensorBoard data provider over a logdir (the Rust data server TensorBoard runs by default) ------------


def data_server(logdir: str, samples_per_plugin: dict[str, int] | None = None, *, reload_interval: float = 0,
                last_steps: dict[str, int] | None = None, timeout: float = 30.0):
    """Start TensorBoard's data server (``tensorboard_data_server``) on ``logdir`` and return its ingester, whose
    ``data_provider`` is what ``context.data_provider`` is inside ``tensorboard``. Waits until every run of
    ``last_steps`` has gradhealth data up to that step (it loads in the background). The server exits with this
    process (``--die-after-stdin``). No TensorFlow involved."""
    import time

    from tensorboard.data import server_ingester
    from tensorboard.util import grpc_util

    ingester = server_ingester.SubprocessServerDataIngester(
        server_binary=server_ingester.get_server_binary(),
        logdir=logdir,
        reload_interval=reload_interval,
        channel_creds_type=grpc_util.ChannelCredsType.LOCAL,
        samples_per_plugin=dict(samples_per_plugin or {}),
    )
    ingester.start()
    deadline = time.monotonic() + timeout
    while last_steps:
        listing = ingester.data_provider.list_tensors(None, experiment_id="", plugin_name=metadata.PLUGIN_NAME)
        seen = {run: max(ts.max_step for ts in tags.values()) for run, tags in listing.items() if tags}
        if all(seen.get(run, -1) >= step for run, step in last_steps.items()):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"data server: {seen} in {logdir} after {timeout} s, waiting for {last_steps}")
        time.sleep(0.05)
    return ingester


def read_back(logdir: str, plugin: str = metadata.PLUGIN_NAME) -> dict:
    """``{tag: (metadata content bytes, [(step, value)])}`` of the runs in ``logdir``, read back through TensorBoard's
    own in-process data provider with every step kept (tensors of ``plugin``, or scalars with ``"scalars"``)."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer

    mux = plugin_event_multiplexer.EventMultiplexer(tensor_size_guidance={plugin: 0, "scalars": 0})
    mux.AddRunsFromDirectory(logdir)
    mux.Reload()
    dp = data_provider.MultiplexerDataProvider(mux, logdir)
    ctx = context.RequestContext()
    out = {}
    if plugin == "scalars":
        listing = dp.list_scalars(ctx, experiment_id="", plugin_name=plugin)
        data = dp.read_scalars(ctx, experiment_id="", plugin_name=plugin, downsample=10**9)
    else:
        listing = dp.list_tensors(ctx, experiment_id="", plugin_name=plugin)
        data = dp.read_tensors(ctx, experiment_id="", plugin_name=plugin, downsample=10**9)
    for run, tags in listing.items():
        for tag, ts in tags.items():
            points = [(d.step, d.value if plugin == "scalars" else d.numpy) for d in data[run][tag]]
            out[tag] = (ts.plugin_content, points)
    return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for a server a test or benchmark starts)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_steps(facts: dict[str, RunFacts]) -> dict[str, int]:
    return {run: f.steps[-1] for run, f in facts.items()}
