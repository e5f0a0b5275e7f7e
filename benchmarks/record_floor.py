"""The record beside its floor, one read of every gradient, for PyTorch (eager and ``compile=True``), JAX (jit) and
TensorFlow (the packed XLA function), on the CPU or a GPU.

    python benchmarks/record_floor.py [--quick] [--device auto|cpu] [--parts torch,jax,tf] [--models mlp,gpt]
                                      [--baseline TREE]

Each model is its parameters' shapes (the MLP and the GPT of ``torch_jax_overhead.py``) filled with the same
seeded gradient-like values in every framework (normal, a scale per tensor, 30% exact zeros as after a ReLU), and
weights alike. Each framework runs in a process of its own (TensorFlow and ``torch._dynamo`` do not share one);
within it every method runs once per round, rounds interleaved so that load hits all alike; medians. Rows:

* ``floor: norms``: one read of every gradient and one small host copy: its norm (``torch._foreach_norm``,
  ``jnp.linalg.norm`` of each leaf in one ``jax.jit``, ``tf.reduce_sum(g * g)`` of each in one
  ``jit_compile=True`` function): the norm pass every ratio (``x norm pass``) and goal is stated against;
* ``floor: norms, again``: the same method timed as a second one: its ratio to the first is the run's noise;
* ``floor: sums``: one sum of each gradient, a cheaper read printed beside (``x sums``), never a goal's basis;
* ``record``: every gradient's record and its one host copy; ``record + weights``: with the weights' norms,
  beside the norm pass of the gradients and the weights (``floor: norms, gradients + weights``);
* the first call of a compiled record (inductor, XLA) is printed beside its row.

A goal row passes when the record's ratio to its norm pass is at most the goal times (1 + the run's noise); the
script exits 1 when one fails (or a part that ran failed) and prints one table. ``--baseline TREE`` runs every
part a second time with the ``tb_gradhealth`` of another checkout (e.g. ``git worktree add /tmp/before REV``) and
prints its figures beside (``before``): the two in one run, under the same load. ``--device auto`` takes a GPU
where the framework sees one (PyTorch: CUDA; JAX, TensorFlow: their default device), else the CPU; ``--quick``
runs fewer rounds and compiles each model's record once (``compile=True`` with the weights), to finish in a few
minutes on a GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this tree's tb_gradhealth, not an installed one

WIDTHS = (512, 1024, 1024, 1024, 1024, 10)
HIST_SAMPLE = 4096
#: The ratio of each record to its norm pass that the goal rows accept (times 1 + the run's noise). On a GPU, where
#: a pass costs memory bandwidth and a kernel launch, the fused records (one loop a tensor) should cost about one
#: read. On a CPU every goal guards against a regression: the figures docs/PERFORMANCE.md gives for this machine (2
#: shared cores, one thread), rounded up by about a fifth; the eager record's (its compiled loop: 3.5x-3.6x) is
#: well inside the 6x users asked for.
GOALS = {
    "gpu": {
        ("torch", "record (eager)"): 6.0, ("torch", "record + weights (eager)"): 6.0,
        ("torch", "record (compile=True)"): 2.0, ("torch", "record + weights (compile=True)"): 2.0,
        ("jax", "record (jit)"): 3.0, ("jax", "record + weights (jit)"): 3.0,
        ("tf", "record (XLA packed)"): 3.0, ("tf", "record + weights (XLA packed)"): 3.0,
    },
    "cpu": {
        ("torch", "record (eager)"): 4.5, ("torch", "record + weights (eager)"): 3.2,
        ("torch", "record (compile=True)"): 5.0, ("torch", "record + weights (compile=True)"): 3.0,
        ("jax", "record (jit)"): 7.0, ("jax", "record + weights (jit)"): 5.0,
        ("tf", "record (XLA packed)"): 3.0, ("tf", "record + weights (XLA packed)"): 1.5,
    },
}
#: The norm pass and the sums of each kind of row.
FLOORS = {"record": ("floor: norms", "floor: sums"),
          "record + weights": ("floor: norms, gradients + weights", "floor: sums, gradients + weights")}


def model_shapes(name: str) -> tuple[str, list[tuple[int, ...]]]:
    """``(title, parameter shapes)`` of the benchmark's models (those of ``torch_jax_overhead.py``)."""
    if name == "mlp":
        shapes = [s for a, b in zip(WIDTHS[:-1], WIDTHS[1:], strict=True) for s in ((b, a), (b,))]
        return "MLP " + "-".join(map(str, WIDTHS)), shapes
    if name == "gpt":
        vocab, dim, blocks, seq = 8192, 256, 4, 64
        block = [(3 * dim, dim), (3 * dim,), (dim, dim), (dim,), (4 * dim, dim), (4 * dim,), (dim, 4 * dim), (dim,),
                 (dim,), (dim,), (dim,), (dim,)]
        shapes = [(seq, dim), (vocab, dim), *block * blocks, (dim,), (dim,), (vocab, dim), (vocab,)]
        return f"GPT ({blocks} blocks, width {dim}, vocabulary {vocab}, context {seq})", shapes
    raise ValueError(f"unknown model {name!r}")


def model_arrays(name: str) -> tuple[str, list[np.ndarray], list[np.ndarray]]:
    """``(title, gradients, weights)`` float32, the same in every framework."""
    title, shapes = model_shapes(name)
    grads, weights = [], []
    for i, shape in enumerate(shapes):
        rng = np.random.default_rng(i)
        g = rng.standard_normal(shape, dtype=np.float32) * np.float32(10.0 ** rng.uniform(-5, -2))
        g[rng.random(shape) < 0.3] = 0.0
        grads.append(g)
        weights.append(rng.standard_normal(shape, dtype=np.float32) * np.float32(0.05))
    return title, grads, weights


def median_times(methods: dict, rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    """``(median seconds, first call's seconds)`` of each method, rounds interleaved, each round in a new order
    (what runs before a method, evicting its data from the caches or not, changes from round to round)."""
    first = {}
    for k, f in methods.items():
        t = time.perf_counter()
        f()
        first[k] = time.perf_counter() - t
        f()  # warm
    times: dict[str, list[float]] = {k: [] for k in methods}
    order = np.random.default_rng(0)
    for _ in range(rounds):
        for k in order.permutation(list(methods)):
            t = time.perf_counter()
            methods[k]()
            times[k].append(time.perf_counter() - t)
    return {k: float(np.median(v)) for k, v in times.items()}, first


# --- one framework a process ------------------------------------------------------------------------------------


def torch_methods(name: str, args: argparse.Namespace) -> dict:
    import torch

    import tb_gradhealth.torch as tgh

    _, g_np, w_np = model_arrays(name)
    grads = [torch.from_numpy(g).to(args.torch_device) for g in g_np]
    weights = [torch.from_numpy(w).to(args.torch_device) for w in w_np]
    names = [f"p{i}" for i in range(len(grads))]
    named, wdict = dict(zip(names, grads, strict=True)), dict(zip(names, weights, strict=True))
    both = grads + weights
    methods = {
        "floor: norms": lambda: torch.stack(torch._foreach_norm(grads)).cpu(),
        "floor: norms, again": lambda: torch.stack(torch._foreach_norm(grads)).cpu(),
        "floor: sums": lambda: torch.stack([g.sum() for g in grads]).cpu(),
        "floor: norms, gradients + weights": lambda: torch.stack(torch._foreach_norm(both)).cpu(),
        "floor: sums, gradients + weights": lambda: torch.stack([g.sum() for g in both]).cpu(),
        "record (eager)": lambda: tgh.to_memory(tgh.compute(named, seed=1, hist_sample=HIST_SAMPLE)),
        "record + weights (eager)": lambda: tgh.to_memory(tgh.compute(named, wdict, seed=1, hist_sample=HIST_SAMPLE)),
    }
    if not args.no_compile and not args.quick:  # --quick: one compile a model (the record with the weights)
        methods["record (compile=True)"] = lambda: tgh.to_memory(
            tgh.compute(named, seed=1, hist_sample=HIST_SAMPLE, compile=True))
    if not args.no_compile:
        methods["record + weights (compile=True)"] = lambda: tgh.to_memory(
            tgh.compute(named, wdict, seed=1, hist_sample=HIST_SAMPLE, compile=True))
    return methods


def torch_device(args: argparse.Namespace) -> tuple[str, str]:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    args.torch_device = "cuda" if args.device == "auto" and torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if args.torch_device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    if args.torch_device == "cpu":
        name += f", eager record by {_cpu_path()}"
    return ("gpu" if args.torch_device == "cuda" else "cpu"), f"{name}, PyTorch {torch.__version__}"


def _cpu_path() -> str:
    """What computes the eager record on a CPU in the tree under test: its compiled loop or torch ops."""
    try:
        from tb_gradhealth import _cpustats
    except ImportError:  # a tree from before the compiled loop
        return "torch ops"
    return "the compiled loop" if _cpustats.library() is not None else "torch ops (the compiled loop did not load)"


def jax_methods(name: str, args: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp

    import tb_gradhealth.jax as jgh

    _, g_np, w_np = model_arrays(name)
    grads = {f"p{i:02d}": jnp.asarray(g) for i, g in enumerate(g_np)}
    weights = {f"p{i:02d}": jnp.asarray(w) for i, w in enumerate(w_np)}
    both = {"g": grads, "w": weights}
    norms = jax.jit(lambda t: jnp.stack([jnp.linalg.norm(v) for v in jax.tree_util.tree_leaves(t)]))
    sums = jax.jit(lambda t: jnp.stack([jnp.sum(v) for v in jax.tree_util.tree_leaves(t)]))
    rec = jax.jit(lambda g: jgh.compute(g, seed=1, hist_sample=HIST_SAMPLE))
    rec_w = jax.jit(lambda g, w: jgh.compute(g, w, seed=1, hist_sample=HIST_SAMPLE))
    return {
        "floor: norms": lambda: np.asarray(norms(grads)),
        "floor: norms, again": lambda: np.asarray(norms(grads)),
        "floor: sums": lambda: np.asarray(sums(grads)),
        "floor: norms, gradients + weights": lambda: np.asarray(norms(both)),
        "floor: sums, gradients + weights": lambda: np.asarray(sums(both)),
        "record (jit)": lambda: jgh.to_memory(rec(grads)),
        "record + weights (jit)": lambda: jgh.to_memory(rec_w(grads, weights)),
    }


def jax_device(args: argparse.Namespace) -> tuple[str, str]:
    import jax

    if args.device == "cpu":
        jax.config.update("jax_platforms", "cpu")
    device = jax.devices()[0]
    return ("cpu" if device.platform == "cpu" else "gpu"), f"{device.device_kind}, JAX {jax.__version__}"


def tf_methods(name: str, args: argparse.Namespace) -> dict:
    import tensorflow as tf

    from tb_gradhealth import summary

    _, g_np, w_np = model_arrays(name)
    grads = [tf.constant(g) for g in g_np]
    weights = [tf.constant(w) for w in w_np]
    norms = tf.function(lambda t: tf.stack([tf.reduce_sum(v * v) for v in t]), jit_compile=True, autograph=False)
    sums = tf.function(lambda t: tf.stack([tf.reduce_sum(v) for v in t]), jit_compile=True, autograph=False)

    @tf.function(jit_compile=True, autograph=False)
    def rec(g, w):
        r = summary.compute(g, w, seed=1, hist_sample=HIST_SAMPLE)
        return r.counts, r.values

    def host(pair: tuple) -> list[np.ndarray]:
        return [t.numpy() for t in pair]

    return {
        "floor: norms": lambda: norms(grads).numpy(),
        "floor: norms, again": lambda: norms(grads).numpy(),
        "floor: sums": lambda: sums(grads).numpy(),
        "floor: norms, gradients + weights": lambda: norms(grads + weights).numpy(),
        "floor: sums, gradients + weights": lambda: sums(grads + weights).numpy(),
        "record (XLA packed)": lambda: host(rec(grads, None)),
        "record + weights (XLA packed)": lambda: host(rec(grads, weights)),
    }


def tf_device(args: argparse.Namespace) -> tuple[str, str]:
    import tensorflow as tf

    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    if args.device == "cpu":
        tf.config.set_visible_devices([], "GPU")
    gpus = tf.config.get_visible_devices("GPU")
    return ("gpu" if gpus else "cpu"), f"{gpus[0].name if gpus else 'CPU'}, TensorFlow {tf.__version__}"


def run_child(part: str, args: argparse.Namespace) -> dict:
    """One framework's medians for every model (in this process)."""
    device, methods_of = PARTS[part]
    kind, name = device(args)
    out = {"kind": kind, "device": name, "models": {}}
    for name in args.models:
        title, shapes = model_shapes(name)
        med, first = median_times(methods_of(name, args), args.rounds)
        out["models"][name] = {"title": title, "params": int(sum(np.prod(s) for s in shapes)), "tensors": len(shapes),
                               "times": med, "first": {k: v for k, v in first.items() if k.startswith("record")}}
    return out


PARTS = {"torch": (torch_device, torch_methods), "jax": (jax_device, jax_methods), "tf": (tf_device, tf_methods)}
MISSING = {"torch": "torch", "jax": "jax", "tf": "tensorflow"}


# --- the table -------------------------------------------------------------------------------------------------


def run_part(part: str, args: argparse.Namespace, tree: Path = ROOT) -> dict:
    """One framework's results from a child process that imports ``tree``'s ``tb_gradhealth``: ``{"skipped": why}``
    where the framework is not installed, ``{"failed": why}`` where the child failed."""
    import importlib.util

    if importlib.util.find_spec(MISSING[part]) is None:
        return {"skipped": f"{MISSING[part]} is not installed"}
    cmd = [sys.executable, __file__, "--child", part, "--tree", str(tree), "--device", args.device, "--models",
           ",".join(args.models), "--rounds", str(args.rounds), "--threads", str(args.threads)]
    cmd += (["--no-compile"] if args.no_compile else []) + (["--quick"] if args.quick else [])
    env = dict(os.environ)
    if args.threads == 1:  # XLA:CPU on one thread (JAX and TensorFlow); before either starts
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
                            " intra_op_parallelism_threads=1").strip()
    if part == "tf":
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"failed": f"timed out after {args.timeout} s"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        return {"failed": f"exit {done.returncode}: {done.stderr.strip()[-600:]}"}
    return json.loads(lines[-1])


def rows_of(part: str, result: dict, before: dict | None = None) -> list[dict]:
    """The table's rows of one framework: each method's median, its ratio to its norm pass (and to its sums), the
    goal's verdict, and (``before``: the baseline's results) the baseline's median and ratio."""
    rows = []
    for name, m in result["models"].items():
        t = m["times"]
        noise = abs(t["floor: norms, again"] / t["floor: norms"] - 1.0)
        old = (before or {}).get("models", {}).get(name, {}).get("times", {})
        for method, v in t.items():
            weights = method.startswith("record + weights") or method.endswith("gradients + weights")
            norms, sums = FLOORS["record + weights" if weights else "record"]
            goal = GOALS[result["kind"]].get((part, method))
            ratio = v / t[norms]
            rows.append({"part": part, "model": name, "method": method, "ms": v * 1e3, "ratio": ratio,
                         "sums": v / t[sums], "goal": goal,
                         "ok": None if goal is None else ratio <= goal * (1.0 + noise), "noise": noise,
                         "first": m["first"].get(method),
                         "before_ms": old[method] * 1e3 if method in old else None,
                         "before_ratio": old[method] / old[norms] if method in old and norms in old else None})
    return rows


def print_table(results: dict[str, dict], load: tuple[str, str], baseline: dict[str, dict] | None = None) -> bool:
    """One table of every framework's rows (with the baseline's beside, when given); whether every goal row
    passed and every part that ran finished."""
    print(f"load average before: {load[0]}; after: {load[1]}")
    failed = False
    for part, res in results.items():
        if "models" in res:
            print(f"{part}: {res['device']} ({res['kind']} goals)")
    for name in next((r["models"] for r in results.values() if "models" in r), {}):
        title, shapes = model_shapes(name)
        print(f"{name}: {title}, {sum(int(np.prod(s)) for s in shapes):,} values in {len(shapes)} tensors")
    before_cols = baseline is not None
    head = f"| {'framework':<9} | {'model':<5} | {'per call':<44} | "
    rule = f"|{'-' * 11}|{'-' * 7}|{'-' * 46}|"
    if before_cols:
        head += f"{'before ms':>9} | {'before x':>8} | "
        rule += f"{'-' * 10}:|{'-' * 9}:|"
    print(head + f"{'ms':>7} | {'x norm pass':>11} | {'x sums':>6} | {'goal (x norm pass)':>26} |")
    print(rule + f"{'-' * 8}:|{'-' * 12}:|{'-' * 7}:|{'-' * 27}:|")
    for part, res in results.items():
        if "models" not in res:
            why = res.get("skipped") or res.get("failed")
            failed |= "failed" in res
            print(f"| {part:<9} | {'-':<5} | {'skipped' if 'skipped' in res else 'FAILED':<44} | {why[:300]} |")
            continue
        for r in rows_of(part, res, None if baseline is None else baseline.get(part)):
            if r["method"] == "floor: norms, again":
                mark = f"noise {r['noise']:.1%}"
            elif r["goal"] is None:
                mark = ""
            else:
                mark = f"<= {r['goal']:g}x (+{r['noise']:.1%}) " + ("met" if r["ok"] else "NOT met")
                failed |= not r["ok"]
            method = r["method"] + (f", first {r['first']:.1f} s" if r["first"] else "")
            line = f"| {part:<9} | {r['model']:<5} | {method:<44} | "
            if before_cols:
                line += (f"{r['before_ms']:>9.2f} | {r['before_ratio']:>8.2f} | " if r["before_ms"] is not None
                         else f"{'-':>9} | {'-':>8} | ")
            print(line + f"{r['ms']:>7.2f} | {r['ratio']:>11.2f} | {r['sums']:>6.2f} | {mark:>26} |")
    return not failed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds (5), one compile=True row a model")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 15, --quick 5)")
    p.add_argument("--device", choices=("auto", "cpu"), default="auto")
    p.add_argument("--parts", default="torch,jax,tf")
    p.add_argument("--models", default="mlp,gpt")
    p.add_argument("--no-compile", action="store_true", help="skip torch compile=True")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads on the CPU (default 1 there, the framework's own on a GPU machine)")
    p.add_argument("--timeout", type=int, default=900, help="seconds a framework's part may take")
    p.add_argument("--baseline", type=Path, default=None,
                   help="another checkout whose tb_gradhealth runs beside this one's (its figures: 'before')")
    p.add_argument("--child", choices=sorted(PARTS), help=argparse.SUPPRESS)
    p.add_argument("--tree", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.models = [m for m in args.models.split(",") if m]
    args.rounds = args.rounds or (5 if args.quick else 15)
    if args.child:
        sys.path.insert(0, str(args.tree.resolve()))  # that checkout's tb_gradhealth
        if args.child == "torch":  # a PyTorch user's process has no TensorFlow (see torch_jax_overhead.py)
            sys.modules["tensorflow"] = None
        print(json.dumps(run_child(args.child, args)))
        return
    if args.threads is None:
        args.threads = 1 if args.device == "cpu" or not _gpu_visible() else 0
    before = _load()
    results, baseline = {}, None if args.baseline is None else {}
    for part in [p for p in args.parts.split(",") if p]:
        if baseline is not None:  # the two checkouts one after the other, part by part: the same load for both
            baseline[part] = run_part(part, args, args.baseline)
        results[part] = run_part(part, args)
    after = _load()
    sys.exit(0 if print_table(results, (before, after), baseline) else 1)


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def _gpu_visible() -> bool:
    """Whether an NVIDIA GPU is visible (without importing a framework)."""
    return Path("/dev/nvidia0").exists() or bool(os.environ.get("CUDA_VISIBLE_DEVICES", "").strip(" -1"))


if __name__ == "__main__":
    main()
