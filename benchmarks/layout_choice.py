"""Packed (one tag per writer call, one [L, 18+W] tensor per step) vs one tag per layer, measured.

Writes a synthetic run of ``--layers`` x ``--steps`` records (default 1,000 x 1,000) in both layouts, then prints
for each: bytes on disk (per layer-step), and the time TensorBoard's loaders take to load it and serve every
record: the Python ``EventMultiplexer`` + ``MultiplexerDataProvider`` (``tensor_size_guidance`` keeps every
step), and the Rust data server (``tensorboard_data_server``, ``--samples-per-plugin gradhealth=all``, read over
gRPC with TensorBoard's ``GrpcDataProvider``) when it is installed.

Records are synthetic but shaped like real ones: each layer's gradients span ~7 decades around a centre that drifts
4 decades from the first to the last layer (a vanishing-gradient profile), so the packed tensor's shared histogram
window is wider than one layer's (the cost of packing). Events are written with the package's own TFRecord
framing (:mod:`tb_gradhealth._eventfile`), the bytes TensorBoard's writer produces.

Usage: python benchmarks/layout_choice.py [--layers 1000] [--steps 1000] [--skip-python-per-layer]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
from tensorboard import context
from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
from tensorboard.compat.proto import event_pb2, tensor_pb2, tensor_shape_pb2, types_pb2

from tb_gradhealth import _eventfile, metadata, record

PLUGIN = metadata.PLUGIN_NAME


def synthetic_rows(layers: int, step: int, rng: np.random.Generator) -> np.ndarray:
    """Memory-form records of ``layers`` layers at one step (realistic field values and histogram spread)."""
    rows = record.empty((layers,))
    size = rng.integers(1_000, 1_000_000, layers)
    centre = -3.0 - 4.0 * np.arange(layers) / max(layers - 1, 1) + 0.001 * step
    rows[:, record.INDEX["size"]] = size
    rows[:, record.INDEX["zero"]] = size // 100
    m = 10.0 ** (centre + 2)
    rows[:, record.INDEX["min"]] = -m
    rows[:, record.INDEX["max"]] = m * 0.9
    rows[:, record.INDEX["mean"]] = m * 1e-3
    rows[:, record.INDEX["ssq_rel"]] = size * 1e-3
    rows[:, record.INDEX["weight_max_abs"]] = 0.3
    rows[:, record.INDEX["weight_ssq_rel"]] = size * 0.1
    rows[:, record.INDEX["missing"]] = 0
    nonzero = size - size // 100
    rows[:, record.INDEX["hist_sample"]] = np.minimum(nonzero, 4096)
    offsets = np.arange(-4, 4)
    shape = np.exp(-0.5 * (offsets / 1.5) ** 2)
    shape /= shape.sum()
    for i in range(layers):
        bins = np.floor(centre[i]).astype(int) + 38 + offsets
        rows[i, record.HIST_START + bins] = np.rint(shape * nonzero[i])
    return rows


def tensor_proto(a: np.ndarray) -> tensor_pb2.TensorProto:
    shape = tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=d) for d in a.shape])
    return tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_shape=shape, tensor_content=a.tobytes())


def event_bytes(step: int, tag: str, disk: np.ndarray, md) -> bytes:
    ev = event_pb2.Event(wall_time=1.7e9 + step, step=step)
    v = ev.summary.value.add(tag=tag, tensor=tensor_proto(disk))
    if md is not None:
        v.metadata.CopyFrom(md)
    return ev.SerializeToString()


class RecordFile:
    """An event file written with the package's TFRecord framing (:mod:`tb_gradhealth._eventfile`)."""

    def __init__(self, logdir: str) -> None:
        os.makedirs(logdir, exist_ok=True)
        self._f = open(os.path.join(logdir, "events.out.tfevents.0000000001.bench"), "wb")  # noqa: SIM115
        self.write(event_pb2.Event(wall_time=1.7e9, file_version="brain.Event:2").SerializeToString())

    def write(self, data: bytes) -> None:
        self._f.write(_eventfile.frame(data))

    def close(self) -> None:
        self._f.close()


def write_run(root: str, layout: str, layers: int, steps: int) -> tuple[str, float]:
    logdir = os.path.join(root, layout)
    names = [f"model/block_{i // 2}/{'kernel' if i % 2 == 0 else 'bias'}" for i in range(layers)]
    out = RecordFile(os.path.join(logdir, "run"))
    rng = np.random.default_rng(0)
    t = time.perf_counter()
    if layout == "packed":
        tag = metadata.tag_for(names)
        md = metadata.create_summary_metadata(names)
        for s in range(steps):
            out.write(event_bytes(s, tag, record.to_disk(synthetic_rows(layers, s, rng)), md if s == 0 else None))
    else:
        tags = [metadata.tag_for([n]) for n in names]
        mds = [metadata.create_summary_metadata([n]) for n in names]
        for s in range(steps):
            rows = synthetic_rows(layers, s, rng)
            for i in range(layers):
                disk = record.to_disk(rows[i : i + 1])
                out.write(event_bytes(s, tags[i], disk, mds[i] if s == 0 else None))
    out.close()
    return logdir, time.perf_counter() - t


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def check(data: dict, layers: int, steps: int) -> None:
    tags = data["run"]
    rows = sum(d.numpy.shape[0] for series in tags.values() for d in series)
    if rows != layers * steps:
        raise AssertionError(f"read {rows} layer-steps, expected {layers * steps}")


def python_loader(logdir: str, layers: int, steps: int) -> tuple[float, float]:
    t = time.perf_counter()
    mux = plugin_event_multiplexer.EventMultiplexer(tensor_size_guidance={PLUGIN: 0})
    mux.AddRunsFromDirectory(logdir)
    mux.Reload()
    t_load = time.perf_counter() - t
    dp = data_provider.MultiplexerDataProvider(mux, logdir)
    ctx = context.RequestContext()
    t = time.perf_counter()
    dp.list_tensors(ctx, experiment_id="", plugin_name=PLUGIN)
    data = dp.read_tensors(ctx, experiment_id="", plugin_name=PLUGIN, downsample=steps)
    t_read = time.perf_counter() - t
    check(data, layers, steps)
    return t_load, t_read


def rust_loader(logdir: str, layers: int, steps: int) -> tuple[float, float] | None:
    try:
        import grpc
        import tensorboard_data_server
        from tensorboard.data import grpc_provider
        from tensorboard.data.proto import data_provider_pb2_grpc
    except ImportError:
        return None
    binary = tensorboard_data_server.server_binary()
    if not binary:
        return None
    tmp = tempfile.mkdtemp()
    port_file = os.path.join(tmp, "port")
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [binary, "--logdir", logdir, "--port", "0", "--port-file", port_file, "--reload", "once",
         "--samples-per-plugin", f"{PLUGIN}=all", "--die-after-stdin"],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        while not (os.path.exists(port_file) and open(port_file).read().endswith("\n")):
            time.sleep(0.01)
        port = int(open(port_file).read())
        channel = grpc.insecure_channel(f"localhost:{port}", options=[("grpc.max_receive_message_length", 1 << 30)])
        dp = grpc_provider.GrpcDataProvider(f"localhost:{port}", data_provider_pb2_grpc.TensorBoardDataProviderStub(
            channel))
        ctx = context.RequestContext()
        while True:  # loading is done when every tag reaches the last step
            listing = dp.list_tensors(ctx, experiment_id="", plugin_name=PLUGIN).get("run", {})
            done = sum(ts.max_step == steps - 1 for ts in listing.values())
            if listing and done == len(listing) and len(listing) in (1, layers):
                break
            time.sleep(0.05)
        t_load = time.perf_counter() - t0
        t = time.perf_counter()
        data = dp.read_tensors(ctx, experiment_id="", plugin_name=PLUGIN, downsample=steps)
        t_read = time.perf_counter() - t
        check(data, layers, steps)
        return t_load, t_read
    finally:
        proc.stdin.close()
        proc.terminate()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=1000)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--skip-python-per-layer", action="store_true", help="the slowest case (minutes at 1000x1000)")
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="gh-layout-")
    n = args.layers * args.steps
    print(f"{args.layers} layers x {args.steps} steps = {n} layer-steps")
    print(f"{'layout':10s} {'MB':>8s} {'B/l-s':>6s} {'write s':>8s} {'py load':>8s} {'py read':>8s} "
          f"{'rust load':>9s} {'rust read':>9s}")
    try:
        for layout in ("packed", "per_layer"):
            logdir, t_write = write_run(root, layout, args.layers, args.steps)
            size = dir_bytes(logdir)
            rs = rust_loader(logdir, args.layers, args.steps)
            py = None
            if not (layout == "per_layer" and args.skip_python_per_layer):
                py = python_loader(logdir, args.layers, args.steps)
            fmt = lambda r: (f"{r[0]:8.2f} {r[1]:8.2f}" if r else f"{'-':>8s} {'-':>8s}")
            fmt_rs = f"{rs[0]:9.2f} {rs[1]:9.2f}" if rs else f"{'-':>9s} {'-':>9s}"
            print(f"{layout:10s} {size / 1e6:8.1f} {size / n:6.1f} {t_write:8.1f} {fmt(py)} {fmt_rs}", flush=True)
            shutil.rmtree(logdir, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
