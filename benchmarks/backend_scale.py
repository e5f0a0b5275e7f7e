"""Backend at scale: a real ``tensorboard`` process (started as a user starts it, with no flag) over one run of
1,000 layers x 1,000 logged steps (1M layer-steps), 1,000 x 10,000 (10M) and 1,000 x 100,000 (100M), optionally
side by side with TensorBoard's own histogram route over per-variable histogram and scalar summaries of the same run
(``--histograms``).

For each size it measures, in one run on this machine: start of the ``tensorboard`` process → first *complete*
``health`` answer (every step and layer: cold), warm ``health`` / ``series`` / ``profile`` / ``histograms`` latency
(medians; in a burst, and ``*_fresh_listing_s`` after the plugin's 1 s listing cache expired), a health request with
new thresholds (a fresh diagnosis), and the peak RSS of TensorBoard plus its data server (sampled every 0.25 s from
start to the end of the measurements). It prints a table and the growth from the first size to the last. Goals
(:data:`GOALS`): up to 10M layer-steps cold <= 30 s, warm health <= 0.5 s, series <= 0.1 s, peak RSS <= 2 GB; at
100M (1,000 x 100,000: a 10 GB logdir, generated once into ``--data``) peak RSS <= 4 GB; 100 runs
peak RSS <= 2.5 GB. It also appends steps to the served run and times the first answers that include them.

Generated logs (the numpy ``Writer``'s layout) are cached in ``--data``. No TensorFlow is needed to generate them;
the ``tensorboard`` process imports it if installed, as it does for users. Run it under the team's lock:

    flock /tmp/gradhealth-heavy.lock python benchmarks/backend_scale.py [--sizes 1000x1000,1000x10000,1000x100000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

import numpy as np

from tb_gradhealth import _eventfile, _tiers, metadata, testing

ROOT = Path(__file__).resolve().parent.parent

_WRAPPER = """
import sys
sys.path.insert(0, {root!r})
from tensorboard import default, program
from tb_gradhealth.plugin import GradHealthLoader
tb = program.TensorBoard(plugins=default.get_plugins() + [GradHealthLoader])
tb.configure(argv=[None] + sys.argv[1:])
sys.exit(tb.main())
"""



def entry_point_installed() -> bool:
    return any(ep.name == "gradhealth" for ep in importlib_metadata.entry_points().select(group="tensorboard_plugins"))


#: The installed ``tensorboard`` with a longer listen queue for its HTTP server (werkzeug's is 128 connections).
_WRAPPER_QUEUE = """
import sys
import werkzeug.serving
werkzeug.serving.BaseWSGIServer.request_queue_size = {queue}
from tensorboard import main
sys.argv = ["tensorboard"] + sys.argv[1:]
main.run_main()
"""


def start_tensorboard(logdir: str, port: int, samples: str | None, listen_queue: int | None = None
                      ) -> subprocess.Popen:
    """The installed ``tensorboard`` when the package's entry point is installed, else the same TensorBoard
    program with the plugin added by a wrapper (the repository on PYTHONPATH). ``listen_queue``: the server's
    listen queue instead of werkzeug's 128 (what a deployment could change; needs the entry point installed)."""
    args = ["--logdir", logdir, "--port", str(port), "--host", "127.0.0.1", "--reload_interval", "5"]
    if samples:
        args += ["--samples_per_plugin", samples]
    if listen_queue is not None and entry_point_installed():
        cmd = [sys.executable, "-c", _WRAPPER_QUEUE.format(queue=int(listen_queue)), *args]
    elif entry_point_installed():
        cmd = [sys.executable, "-m", "tensorboard.main", *args]
    else:
        cmd = [sys.executable, "-c", _WRAPPER.format(root=str(ROOT)), *args]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def get(url: str, timeout: float = 120.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
            if r.headers.get("Content-Encoding") == "gzip":
                import gzip

                body = gzip.decompress(body)
            return r.status, body
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, b""


def timed(url: str) -> tuple[float, int, bytes]:
    t = time.perf_counter()
    code, body = get(url)
    return time.perf_counter() - t, code, body


def own_rss_mb(pid: int) -> float:
    """RSS of the process itself (without its children)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def rss_mb(pid: int) -> float:
    """RSS of a process and all its descendants (TensorBoard's data server is a child process)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def json_when(url: str, done: Callable[[Any], bool]) -> Callable[[], Any]:
    """A :func:`wait_until` predicate: ``url``'s JSON once it answers 200 and ``done(json)`` holds, else None."""

    def check() -> Any:
        code, body = get(url)
        if code == 200:
            data = json.loads(body)
            if done(data):
                return data
        return None

    return check


def wait_until(pred, deadline: float, interval: float = 0.25):
    while time.monotonic() < deadline:
        out = pred()
        if out:
            return out
        time.sleep(interval)
    return None


def generate(data: Path, layers: int, steps: int, histograms: bool) -> tuple[Path, Path | None]:
    gh = data / f"gh_{layers}x{steps}"
    if not (gh / "done").exists():
        shutil.rmtree(gh, ignore_errors=True)  # a half-written earlier attempt would add duplicate steps
        t = time.perf_counter()
        testing.make_scale_logdir(str(gh), layers, steps, run="scale")
        (gh / "done").write_text("")
        print(f"  generated {gh} in {time.perf_counter() - t:.1f} s", flush=True)
    hist = data / f"histograms_{layers}x{steps}"
    if histograms and not (hist / "done").exists():
        shutil.rmtree(hist, ignore_errors=True)
        t = time.perf_counter()
        testing.make_histogram_logdir(str(hist), layers, steps, run="histograms")
        (hist / "done").write_text("")
        print(f"  generated {hist} in {time.perf_counter() - t:.1f} s", flush=True)
    return gh, hist if histograms else None


def generate_many(data: Path, n_runs: int, layers: int, steps: int) -> Path:
    logdir = data / f"gh_{n_runs}runs_{layers}x{steps}"
    if not (logdir / "done").exists():
        shutil.rmtree(logdir, ignore_errors=True)
        t = time.perf_counter()
        for i in range(n_runs):
            testing.make_scale_logdir(str(logdir), layers, steps, run=f"run_{i:03d}", seed=i)
        (logdir / "done").write_text("")
        print(f"  generated {logdir} in {time.perf_counter() - t:.1f} s", flush=True)
    return logdir


def bench_many(logdir: Path, n_runs: int, layers: int, steps: int, limit: float) -> dict:
    """A logdir of many runs: start → ``runs`` lists every run with every step; then the complete ``health`` of
    every run once (the first request of each is cold), warm ``health`` and ``series``; peak RSS."""
    port = testing.free_port()
    base = f"http://127.0.0.1:{port}/data/plugin/gradhealth"
    t0 = time.monotonic()
    proc = start_tensorboard(str(logdir), port, None)
    peak = PeakRss(proc.pid)
    out: dict = {"logdir_mb": round(du_mb(logdir), 1), "layer_steps": n_runs * layers * steps}
    try:
        deadline = t0 + limit
        listed = json_when(f"{base}/runs", lambda d: len(d["runs"]) == n_runs and all(
            r["num_steps"] == steps and len(r["layers"]) == layers for r in d["runs"]))
        data = wait_until(listed, deadline, 1.0)
        out["all_runs_listed_s"] = round(time.monotonic() - t0, 2) if data else None
        if data is None:
            out["error"] = "runs did not list every run completely in time"
            return out
        names = [r["run"] for r in data["runs"]]
        t = time.monotonic()
        complete = 0
        for name in names:
            code, body = get(f"{base}/health?run={urllib.parse.quote(name)}", timeout=limit)
            h = json.loads(body) if code == 200 else {}
            complete += int(h.get("step") == steps - 1 and len(h.get("layers", ())) == layers)
        out["health_every_run_s"] = round(time.monotonic() - t, 2)
        out["runs_complete"] = complete
        out["warm_health_s"] = round(statistics.median(
            timed(f"{base}/health?run={urllib.parse.quote(n)}")[0] for n in names[:5]), 4)
        out["series_s"] = round(statistics.median(
            timed(f"{base}/series?run={urllib.parse.quote(n)}&layer={urllib.parse.quote(data['runs'][0]['layers'][7])}")[0]
            for n in names[:10]), 4)
        out["runs_route_warm_s"] = round(timed(f"{base}/runs")[0], 3)
        return out
    finally:
        out["peak_rss_mb"] = round(peak.stop())
        stop(proc)


def append_steps(path: Path, layers: list[str], first: int, count: int = 1) -> None:
    """Append ``count`` steps from ``first`` to an event file in the ``Writer``'s layout (step-block tags, the
    metadata on a new block's first event), as a training job does."""
    rms = 10.0 ** np.linspace(-6.0, -2.0, len(layers))
    with open(path, "ab") as f:
        for step in range(first, first + count):
            tag = metadata.tag_for(layers, step=step)
            new_block = tag != metadata.tag_for(layers, step=step - 1)
            records = testing.synthetic_records(rms)
            f.write(_eventfile.frame(testing.record_event(step, tag, records, layers=layers if new_block else None)))


#: Steps appended to the run while it is served.
APPENDED = 10


def appended_while_serving(base: str, run_dir: Path, layers: list[str], steps: int, deadline: float) -> dict:
    """Append :data:`APPENDED` steps to the served run and time the first ``health`` (then ``series``) answer that
    includes them; the file is cut back to its size afterwards (the logdir is cached for the next benchmark)."""
    (path,) = run_dir.iterdir()
    size = path.stat().st_size
    out: dict = {}
    try:
        t = time.monotonic()
        append_steps(path, layers, steps, APPENDED)
        got = wait_until(json_when(f"{base}/health?run=scale", lambda h: h["step"] == steps + APPENDED - 1),
                         deadline, 0.05)
        out["appended_health_s"] = round(time.monotonic() - t, 3) if got else None
        t = time.monotonic()
        append_steps(path, layers, steps + APPENDED, 1)
        q = urllib.parse.quote(layers[len(layers) // 2])
        got = wait_until(json_when(f"{base}/series?run=scale&layer={q}",
                                   lambda b: b["window_last"][-1] == steps + APPENDED), deadline, 0.05)
        out["appended_series_s"] = round(time.monotonic() - t, 3) if got else None
    finally:
        with open(path, "r+b") as f:
            f.truncate(size)
    return out


def du_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


class PeakRss:
    """Samples the RSS of a process tree (TensorBoard and its data server) every ``interval`` s; ``peak`` in MB,
    ``peak_own`` of the TensorBoard process alone and ``peak_children`` of its data server."""

    def __init__(self, pid: int, interval: float = 0.25):
        self.peak = self.peak_own = self.peak_children = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(pid, interval), daemon=True)
        self._thread.start()

    def _run(self, pid: int, interval: float) -> None:
        while not self._stop.wait(interval):
            total, own = rss_mb(pid), own_rss_mb(pid)
            self.peak = max(self.peak, total)
            self.peak_own = max(self.peak_own, own)
            self.peak_children = max(self.peak_children, total - own)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak


def bench_gradhealth(logdir: Path, layers: int, steps: int, limit: float, samples: str | None = None) -> dict:
    """``samples`` None: plain ``tensorboard --logdir`` (the package's loader keeps every step by default)."""
    port = testing.free_port()
    base = f"http://127.0.0.1:{port}/data/plugin/gradhealth"
    t0 = time.monotonic()
    proc = start_tensorboard(str(logdir), port, samples)
    peak = PeakRss(proc.pid)
    out: dict = {"logdir_mb": round(du_mb(logdir), 1), "layer_steps": layers * steps}
    try:
        deadline = t0 + limit
        up = wait_until(lambda: get(f"http://127.0.0.1:{port}/data/plugins_listing", 5)[0] == 200, deadline, 0.1)
        out["server_up_s"] = round(time.monotonic() - t0, 2) if up else None

        complete = json_when(f"{base}/health?run=scale",
                             lambda h: h["step"] == steps - 1 and len(h["layers"]) == layers)
        h = wait_until(complete, deadline, 0.5)
        out["first_complete_health_s"] = round(time.monotonic() - t0, 2) if h else None
        if h is None:
            out["error"] = "no complete health answer in time"
            return out
        runs = json.loads(get(f"{base}/runs")[1])["runs"]
        out["num_steps_served"] = runs[0]["num_steps"]
        health_t = [timed(f"{base}/health?run=scale")[0] for _ in range(5)]
        out["warm_health_s"] = round(statistics.median(health_t), 4)
        out["health_json_kb"] = round(len(get(f"{base}/health?run=scale")[1]) / 1e3)
        names = runs[0]["layers"]
        picks = [names[i * (len(names) - 1) // 19] for i in range(20)]
        q = urllib.parse.quote
        series_t = [timed(f"{base}/series?run=scale&layer={q(n)}")[0] for n in picks]
        out["series_s"] = round(statistics.median(series_t), 4)
        hist_t = [timed(f"{base}/histograms?run=scale&layer={q(n)}")[0] for n in picks[:10]]
        out["histograms_s"] = round(statistics.median(hist_t), 4)
        prof_t = [timed(f"{base}/profile?run=scale&step={s}")[0] for s in (steps // 4, steps // 2, steps - 1)]
        out["profile_s"] = round(statistics.median(prof_t), 4)
        # The same after the plugin's 1 s listing cache expired (each request then asks the data server first).
        slow_h, slow_s = [], []
        for n in picks[:4]:
            time.sleep(1.1)
            slow_h.append(timed(f"{base}/health?run=scale")[0])
            time.sleep(1.1)
            slow_s.append(timed(f"{base}/series?run=scale&layer={q(n)}")[0])
        out["warm_health_fresh_listing_s"] = round(statistics.median(slow_h), 4)
        out["series_fresh_listing_s"] = round(statistics.median(slow_s), 4)
        other = timed(f"{base}/health?run=scale&vanish_decades=2.5")[0]
        out["health_new_thresholds_s"] = round(other, 3)
        out.update(appended_while_serving(base, logdir / "scale", names, steps, deadline + limit))
        out["rss_mb"] = round(rss_mb(proc.pid))
        return out
    finally:
        out["peak_rss_mb"] = round(peak.stop())
        out["peak_rss_tensorboard_mb"] = round(peak.peak_own)
        out["peak_rss_data_server_mb"] = round(peak.peak_children)
        stop(proc)


def bench_histogram_route(logdir: Path, layers: int, steps: int, limit: float) -> dict:
    port = testing.free_port()
    base = f"http://127.0.0.1:{port}/data/plugin"
    t0 = time.monotonic()
    proc = start_tensorboard(str(logdir), port, None)  # TensorBoard's defaults for histograms and scalars
    out: dict = {"logdir_mb": round(du_mb(logdir), 1)}
    names = [f"block_{i // 2:04d}/{'kernel' if i % 2 == 0 else 'bias'}" for i in range(layers)]
    q = urllib.parse.quote
    try:
        deadline = t0 + limit
        up = wait_until(lambda: get(f"http://127.0.0.1:{port}/data/plugins_listing", 5)[0] == 200, deadline, 0.1)
        out["server_up_s"] = round(time.monotonic() - t0, 2) if up else None
        last_tag = q(f"{names[-1]}-grad")

        complete = json_when(f"{base}/histograms/histograms?run=histograms&tag={last_tag}",
                             lambda data: bool(data) and data[-1][1] == steps - 1)
        data = wait_until(complete, deadline, 0.5)
        out["first_complete_histogram_s"] = round(time.monotonic() - t0, 2) if data else None
        if data is None:
            out["error"] = "histogram route did not serve the last step in time"
            return out
        out["histogram_points_per_tag"] = len(data)
        sample = [names[i * (len(names) - 1) // 19] for i in range(20)]
        hist_t = [timed(f"{base}/histograms/histograms?run=histograms&tag={q(n + '-grad')}")[0] for n in sample]
        scal_t = [timed(f"{base}/scalars/scalars?run=histograms&tag={q(n + '-grad-' + s)}")[0]
                  for n in sample[:10] for s in ("mean", "std", "max", "min")]
        out["histogram_route_s"] = round(statistics.median(hist_t), 4)
        out["scalar_route_s"] = round(statistics.median(scal_t), 4)
        out["every_layer_once_s"] = round(layers * (statistics.mean(hist_t) + 4 * statistics.mean(scal_t)), 1)
        out["rss_mb"] = round(rss_mb(proc.pid))
        return out
    finally:
        stop(proc)


#: Goals of one run (cold: start to the first complete ``health``), by size in layer-steps: up to 10M, then 100M.
GOALS = {"cold_s": 30.0, "warm_s": 0.5, "series_s": 0.1, "rss_mb": 2048.0}
GOALS_100M = {"rss_mb": 4096.0}
#: Goals of the logdir of many runs.
GOALS_MANY = {"rss_mb": 2560.0}
#: Memory a run needs while served (bytes a layer-step kept: the decoded records and the diagnosis' temporaries; the
#: plugin keeps at most about ``_tiers.LAYER_STEPS`` of a run), to skip a size this machine cannot hold rather than
#: run it out of memory.
NEED_BYTES_PER_LAYER_STEP = 320
NEED_BASE_MB = 1000


def available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("inf")


def met(g: dict) -> bool:
    """Whether one run's figures meet the goals of its size."""
    if g.get("layer_steps", 0) > 10_000_000:
        return (g.get("peak_rss_mb") or 1e9) <= GOALS_100M["rss_mb"]
    return ((g.get("first_complete_health_s") or 1e9) <= GOALS["cold_s"]
            and (g.get("warm_health_s") or 1e9) <= GOALS["warm_s"]
            and (g.get("series_s") or 1e9) <= GOALS["series_s"]
            and (g.get("peak_rss_mb") or 1e9) <= GOALS["rss_mb"])


def print_table(results: dict) -> None:
    """One row per size, and the growth from the smallest to the largest."""
    rows = [(size, r["gradhealth"]) for size, r in results.items() if "gradhealth" in r]
    print("\n| run | layer-steps | logdir MB | cold health | warm health | series | histograms | new steps: health / "
          "series | peak RSS TB + data server (TB / data server) | goals |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for size, g in rows:
        if "skipped" in g:
            print(f"| {size} | {g.get('layer_steps', 0):,} | | {g['skipped']} | | | | | | |")
            continue
        print(f"| {size} | {g.get('layer_steps', 0):,} | {g.get('logdir_mb')} | {g.get('first_complete_health_s')} s | "
              f"{g.get('warm_health_s')} s | {g.get('series_s')} s | {g.get('histograms_s')} s | "
              f"{g.get('appended_health_s')} s / {g.get('appended_series_s')} s | {g.get('peak_rss_mb')} MB "
              f"({g.get('peak_rss_tensorboard_mb')} / {g.get('peak_rss_data_server_mb')}) | "
              f"{'met' if met(g) else 'NOT met'} |")
    measured = [(size, g) for size, g in rows if "skipped" not in g]
    if len(measured) > 1:
        (s0, a), (s1, b) = measured[0], measured[-1]
        k = b.get("layer_steps", 0) / max(1, a.get("layer_steps", 1))
        ratio = {key: round(b[key] / a[key], 2) for key in ("first_complete_health_s", "peak_rss_mb")
                 if a.get(key) and b.get(key)}
        print(f"\ngrowth {s0} -> {s1} ({k:g}x layer-steps): cold time x{ratio.get('first_complete_health_s')}, "
              f"peak RSS x{ratio.get('peak_rss_mb')}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000x1000,1000x10000,1000x100000",
                    help="LAYERSxSTEPS,... (default: %(default)s)")
    ap.add_argument("--data", default="/tmp/gradhealth-bench-data-blocks", help="where generated logdirs are cached")
    ap.add_argument("--histograms", action="store_true", help="also time TensorBoard's histogram route on the same run")
    ap.add_argument("--limit", type=float, default=600.0, help="seconds allowed for a server to answer completely")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    ap.add_argument("--many", default="100x200x1000", metavar="RUNSxLAYERSxSTEPS",
                    help="also a logdir of that many runs (default: %(default)s; 'none' to skip)")
    args = ap.parse_args(argv)
    data = Path(args.data)
    data.mkdir(parents=True, exist_ok=True)
    results = {}
    for size in args.sizes.split(","):
        layers, steps = (int(x) for x in size.lower().split("x"))
        print(f"== {layers} layers x {steps} steps", flush=True)
        kept = min(layers * steps, 2 * max(_tiers.LAYER_STEPS, _tiers.MIN_ROWS * layers))
        need = NEED_BASE_MB + kept * NEED_BYTES_PER_LAYER_STEP / 2**20
        if need > available_mb():
            skipped = f"not run: needs about {need / 1024:.0f} GB, {available_mb() / 1024:.0f} GB available"
            print("  " + skipped, flush=True)
            results[size] = {"gradhealth": {"layer_steps": layers * steps, "skipped": skipped}}
            continue
        gh, hist = generate(data, layers, steps, args.histograms)
        r = {"gradhealth": bench_gradhealth(gh, layers, steps, args.limit)}
        print("  gradhealth:", json.dumps(r["gradhealth"]), flush=True)
        if hist is not None:
            r["histogram_route"] = bench_histogram_route(hist, layers, steps, args.limit)
            print("  histograms:", json.dumps(r["histogram_route"]), flush=True)
            g, s = r["gradhealth"], r["histogram_route"]
            if g.get("warm_health_s") and s.get("every_layer_once_s"):
                r["ratios"] = {
                    "every_layer_ranked_vs_every_layer_once": round(s["every_layer_once_s"] / g["warm_health_s"], 1),
                    "series_vs_histogram_route": round(s["histogram_route_s"] / g["series_s"], 2),
                    "first_complete_gh_vs_hist": round(g["first_complete_health_s"] / s["first_complete_histogram_s"],
                                                       2),
                }
                print("  ratios:    ", json.dumps(r["ratios"]), flush=True)
        results[size] = r
    print_table(results)
    if args.many != "none":
        n_runs, layers, steps = (int(x) for x in args.many.lower().split("x"))
        print(f"== {n_runs} runs x {layers} layers x {steps} steps", flush=True)
        many = bench_many(generate_many(data, n_runs, layers, steps), n_runs, layers, steps, args.limit)
        print("  gradhealth:", json.dumps(many), flush=True)
        print(f"  peak RSS {many.get('peak_rss_mb')} MB (goal <= {GOALS_MANY['rss_mb']:.0f} MB)", flush=True)
        results[f"{args.many} runs"] = {"many": many}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    goals = all(met(r["gradhealth"]) if "gradhealth" in r else (r["many"].get("peak_rss_mb") or 1e9) <= GOALS_MANY[
        "rss_mb"] for r in results.values())
    print("goals met" if goals else "goals NOT met", flush=True)
    return 0 if goals else 1


if __name__ == "__main__":
    sys.exit(main())
