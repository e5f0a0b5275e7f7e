"""Many tabs at once: N concurrent cold ``health`` requests on one large run, against one request alone.

A real ``tensorboard`` process, started as users start it (the plugin through its loader reads the event files
itself), serves one run of L layers x S steps. Each scenario first appends a new step to the run's event file, as a
training job does, and waits: the plugin's caches then hold nothing for the new data, so every request of the
scenario is cold (the new step is read and the run diagnosed again). Scenarios, in this order:

* ``one``: a single ``health`` request;
* ``same``: N concurrent identical requests (the single-flight case: one decode and one diagnosis shared by all);
* ``warm``: the same N requests again, answered from the cache: the time that is serving alone (TensorBoard's
  threaded server moving N answers of ~0.5 MB, and this client receiving them);
* ``varied``: N concurrent requests spread over 10 threshold settings (10 distinct diagnoses, computed at most
  ``plugin.DIAGNOSES_AT_ONCE`` at a time).

It prints per scenario the client-side latency p50 / p99 / max (request sent to last byte received; the answers are
parsed only after all arrived) and the peak RSS of the TensorBoard process (the data
server, a child process, is reported apart), with the goals p99(same) <= 2 x one, peak RSS(same) <= 1.5 x one.
Run under the team's lock (it generates a ~150 MB logdir once, cached in ``--data``):

    flock /tmp/gradhealth-heavy.lock python benchmarks/concurrent_health.py [--layers 500 --steps 2000 -n 200]
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import backend_scale as bs  # this script's directory is on sys.path when it runs

from tb_gradhealth import testing

THRESHOLD_VARIANTS = [f"vanish_decades={v}" for v in (2, 2.5, 3, 3.5, 4, 4.5, 5, 5.5, 6, 6.5)]


class RssSampler:
    """Peak RSS of a process (and with its children) sampled every 20 ms while active."""

    def __init__(self, pid: int):
        self.pid, self.peak, self.peak_total = pid, 0.0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, bs.own_rss_mb(self.pid))
            self.peak_total = max(self.peak_total, bs.rss_mb(self.pid))
            time.sleep(0.02)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def fetch(url: str) -> tuple[int, bytes, str]:
    """Status, body as sent (gzip-encoded when the server compressed it) and its ``Content-Encoding``."""
    req = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, r.read(), r.headers.get("Content-Encoding", "")
    except urllib.error.HTTPError as e:
        return e.code, e.read(), ""


def fire(urls: list[str]) -> tuple[list[float], list[dict]]:
    """Send every URL at once from its own thread; returns latencies (s: request sent to last byte received) and
    JSON answers. Answers are decompressed and parsed after every request completed, so that this client's own
    work (200 x 2.5 MB of JSON under one interpreter lock) is not counted as the server's latency."""
    barrier = threading.Barrier(len(urls))
    lat: list[float] = [0.0] * len(urls)
    raw: list[tuple[int, bytes, str]] = [(0, b"", "")] * len(urls)

    def one(i: int) -> None:
        barrier.wait()
        t0 = time.perf_counter()
        raw[i] = fetch(urls[i])
        lat[i] = time.perf_counter() - t0

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(urls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bodies = [json.loads(gzip.decompress(body) if enc == "gzip" else body) if code == 200 else {"status": code}
              for code, body, enc in raw]
    return lat, bodies


def scenario(base: str, proc_pid: int, path: Path, layers: list[str], step: int, urls: list[str],
             append: bool = True) -> dict:
    """``urls`` at once; with ``append``, after a new step (``step``) is appended, so that every request is cold."""
    if append:
        bs.append_steps(path, layers, step)
        time.sleep(12)  # TensorBoard reloads every 5 s; the plugin's listing lives 1 s
    rss0 = bs.own_rss_mb(proc_pid)
    with RssSampler(proc_pid) as rss:
        t0 = time.perf_counter()
        lat, bodies = fire([base + u for u in urls])
        wall = time.perf_counter() - t0
    steps = {b.get("step") for b in bodies}
    if steps != {step}:
        raise RuntimeError(f"answers at steps {steps}, expected {step} (TensorBoard had not loaded it yet?)")
    lat.sort()
    return {"n": len(urls), "p50_s": statistics.median(lat), "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            "max_s": lat[-1], "wall_s": wall, "rss_before_mb": rss0, "rss_peak_mb": rss.peak,
            "rss_peak_with_data_server_mb": rss.peak_total}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=500)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("-n", type=int, default=200, help="concurrent requests")
    ap.add_argument("--data", default="/tmp/gradhealth-bench-data")
    ap.add_argument("--listen-queue", type=int, default=None,
                    help="TensorBoard's listen queue (default: werkzeug's 128, as users run it): what of the tail "
                         "is TensorBoard's server")
    args = ap.parse_args(argv)

    cached = Path(args.data) / f"concurrent_{args.layers}x{args.steps}"
    if not cached.exists():
        testing.make_scale_logdir(str(cached), args.layers, args.steps, run="big")
    work = Path(tempfile.mkdtemp(prefix="gh-concurrent-"))
    shutil.copytree(cached, work / "logs")
    (path,) = (work / "logs" / "big").iterdir()
    # The generator's layer names (make_scale_logdir).
    layers = [f"block_{i // 2:04d}/{'kernel' if i % 2 == 0 else 'bias'}" for i in range(args.layers)]
    port = testing.free_port()
    proc = bs.start_tensorboard(str(work / "logs"), port, None, args.listen_queue)  # as users start it
    base = f"http://127.0.0.1:{port}/data/plugin/gradhealth"
    try:
        bs.wait_until(bs.json_when(f"{base}/runs", lambda b: any(r["num_steps"] == args.steps for r in b["runs"])),
                      time.monotonic() + 600)
        step = args.steps
        results = {"one": scenario(base, proc.pid, path, layers, step, ["/health?run=big"])}
        results["same"] = scenario(base, proc.pid, path, layers, step + 1, ["/health?run=big"] * args.n)
        # The same answers once more, now cached: what is left is serving them (TensorBoard's server, the client).
        results["warm"] = scenario(base, proc.pid, path, layers, step + 1, ["/health?run=big"] * args.n, False)
        varied = [f"/health?run=big&{THRESHOLD_VARIANTS[i % len(THRESHOLD_VARIANTS)]}" for i in range(args.n)]
        results["varied"] = scenario(base, proc.pid, path, layers, step + 2, varied)
    finally:
        bs.stop(proc)
        shutil.rmtree(work, ignore_errors=True)

    print(f"{args.n} concurrent cold health requests, {args.layers} layers x {args.steps} steps, "
          f"real tensorboard process ({time.strftime('%Y-%m-%d')}), listen queue "
          f"{args.listen_queue or 'werkzeug default (128)'}")
    print(f"{'scenario':<8} {'n':>4} {'p50 s':>7} {'p99 s':>7} {'max s':>7} {'RSS before MB':>14} "
          f"{'RSS peak MB':>12} {'+data server MB':>16}")
    for name, r in results.items():
        print(f"{name:<8} {r['n']:>4} {r['p50_s']:>7.2f} {r['p99_s']:>7.2f} {r['max_s']:>7.2f} "
              f"{r['rss_before_mb']:>14.0f} {r['rss_peak_mb']:>12.0f} {r['rss_peak_with_data_server_mb']:>16.0f}")
    one, same = results["one"], results["same"]
    print(f"p99(same) / one = {same['p99_s'] / one['p99_s']:.2f} (goal <= 2); "
          f"peak RSS(same) / peak RSS(one) = {same['rss_peak_mb'] / one['rss_peak_mb']:.2f} (goal <= 1.5)")
    warm = results["warm"]
    print(f"serving the cached answers alone (warm): p99 {warm['p99_s']:.2f} s, "
          f"{warm['p99_s'] / same['p99_s']:.0%} of p99(same)")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
