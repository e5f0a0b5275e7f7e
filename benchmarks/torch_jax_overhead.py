"""Cost per logged step of the device-side records (tb_gradhealth.torch / tb_gradhealth.jax) against the numpy
path (gradients copied to the host, reduced by ``record.compute``), one training step and one plain norm pass
over the same gradients, for a PyTorch and a JAX MLP of a few million parameters on the CPU.

    python benchmarks/torch_jax_overhead.py [--rounds 15] [--threads 1] [--no-compile]

Every method runs once per round, rounds interleaved (so machine load hits all alike); the table gives medians and
ratios to the plain norm pass of the same framework, and the bytes each logged step copies to the host per layer.

* ``norm pass``: the cheapest per-layer statistic anyone logs: every gradient's L2 norm (``torch._foreach_norm``
  / ``jnp.linalg.norm`` per leaf in one jit), stacked, copied to the host;
* ``record``: every layer's full record (counts, extremes, mean, relative sum of squares, the 77-bin histogram,
  weight norms), one host copy of ``[L, 94]`` float32; torch eager, torch ``compile=True`` (inductor), jax.jit;
* ``numpy path``: ``grad.detach().cpu().numpy()`` (on a CPU no copy; on a GPU the whole gradient crosses PCIe) and
  ``record.compute`` per layer in float64 numpy, as ``Writer.add_gradients`` does;
* ``train step``: forward, backward and an SGD step of the same model and batch.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from tb_gradhealth import record

WIDTHS = (512, 1024, 1024, 1024, 1024, 10)
BATCH = 64


def _timer(fn, sync=lambda out: out):
    def run() -> float:
        t = time.perf_counter()
        sync(fn())
        return time.perf_counter() - t

    return run


def torch_methods(compile_: bool) -> tuple[dict, int, int, dict]:
    import torch

    import tb_gradhealth.torch as tgh

    torch.manual_seed(0)
    layers = []
    for a, b in zip(WIDTHS[:-1], WIDTHS[1:], strict=True):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(BATCH, WIDTHS[0]), torch.randint(0, WIDTHS[-1], (BATCH,))

    def train_step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    train_step()
    params = list(model.parameters())
    grads = [p.grad for p in params]

    def norm_pass():
        return torch.stack(torch._foreach_norm(grads)).cpu().numpy()

    def numpy_path():
        return np.stack([record.compute(p.grad.detach().cpu().numpy(), p.detach().cpu().numpy()) for p in params])

    methods = {
        "norm pass": norm_pass,
        "record (eager)": lambda: tgh.to_memory(tgh.compute(model, True, seed=1)),
        "numpy path": numpy_path,
        "train step": train_step,
    }
    extra = {}
    if compile_:
        t = time.perf_counter()
        tgh.to_memory(tgh.compute(model, True, seed=1, compile=True))
        extra["first compile (s)"] = time.perf_counter() - t
        methods["record (compile=True)"] = lambda: tgh.to_memory(tgh.compute(model, True, seed=2, compile=True))
    packed = tgh.compute(model, True)
    n_params = sum(p.numel() for p in params)
    return methods, len(params), packed.numel() * packed.element_size(), {"params": n_params, **extra,
                                                                            "grad bytes": 4 * n_params}


def jax_methods() -> tuple[dict, int, int, dict]:
    import jax
    import jax.numpy as jnp

    import tb_gradhealth.jax as jgh

    rng = np.random.default_rng(0)
    params = {f"layer{i}": {"kernel": jnp.asarray(rng.normal(size=(a, b)) / np.sqrt(a), jnp.float32),
                            "bias": jnp.zeros(b)} for i, (a, b) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:], strict=True))}
    x = jnp.asarray(rng.normal(size=(BATCH, WIDTHS[0])), jnp.float32)
    y = jnp.asarray(rng.integers(0, WIDTHS[-1], BATCH))

    def loss(p):
        h = x
        for i in range(len(WIDTHS) - 1):
            h = h @ p[f"layer{i}"]["kernel"] + p[f"layer{i}"]["bias"]
            if i < len(WIDTHS) - 2:
                h = jax.nn.relu(h)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(h), y[:, None], axis=1))

    @jax.jit
    def step(p):
        g = jax.grad(loss)(p)
        return jax.tree_util.tree_map(lambda w, d: w - 1e-3 * d, p, g), g

    state = {"p": params}
    _, grads = step(params)
    grads = jax.block_until_ready(grads)
    norms = jax.jit(lambda g: jnp.stack([jnp.linalg.norm(v) for v in jax.tree_util.tree_leaves(g)]))
    rec = jax.jit(lambda g, p: jgh.compute(g, p, seed=1))
    for f in (lambda: norms(grads), lambda: rec(grads, params)):
        jax.block_until_ready(f())

    def train_step():
        state["p"], g = step(state["p"])
        return jax.block_until_ready(g)

    leaves, wleaves = jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(params)
    methods = {
        "norm pass": lambda: np.asarray(jax.device_get(norms(grads))),
        "record (jit)": lambda: jgh.to_memory(rec(grads, params)),
        "numpy path": lambda: np.stack([record.compute(np.asarray(g), np.asarray(w))
                                        for g, w in zip(leaves, wleaves, strict=True)]),
        "train step": train_step,
    }
    n_params = sum(int(v.size) for v in leaves)
    packed = rec(grads, params)
    return methods, len(leaves), int(packed.size) * 4, {"params": n_params, "grad bytes": 4 * n_params}


def measure(methods: dict, rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in methods}
    runs = {k: _timer(f) for k, f in methods.items()}
    for f in runs.values():
        f()  # warm-up
    for _ in range(rounds):
        for k, f in runs.items():
            times[k].append(f())
    return {k: float(np.median(v)) for k, v in times.items()}


def report(name: str, med: dict[str, float], n_layers: int, record_bytes: int, info: dict) -> None:
    base = med["norm pass"]
    print(f"\n{name}: {info['params']:,} parameters in {n_layers} tensors, batch {BATCH}; "
          + ", ".join(f"{k} {v:.1f}" for k, v in info.items() if k.startswith("first")))
    print(f"| {'per logged step':<24} | {'median ms':>9} | {'x norm pass':>11} | {'host bytes / layer':>18} |")
    print(f"|{'-' * 26}|{'-' * 11}:|{'-' * 13}:|{'-' * 20}:|")
    for k, v in med.items():
        if k.startswith("record"):
            host = f"{record_bytes // n_layers}"
        elif k == "numpy path":
            host = f"{info['grad bytes'] // n_layers:,} (+ weights)"
        elif k == "norm pass":
            host = "4"
        else:
            host = "-"
        print(f"| {k:<24} | {v * 1e3:>9.2f} | {v / base:>11.2f} | {host:>18} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--no-compile", action="store_true", help="skip the torch compile=True row (inductor)")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads of torch and XLA (default 1: on a shared machine more threads measure "
                        "scheduling, not work)")
    args = p.parse_args()
    if args.threads == 1:  # before JAX starts
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
                                   " intra_op_parallelism_threads=1").strip()
    import torch

    torch.set_num_threads(args.threads)

    print(f"CPU threads: torch {torch.get_num_threads()}, os.cpu_count() {os.cpu_count()}; rounds {args.rounds}")
    methods, n, nbytes, info = torch_methods(not args.no_compile)
    report("PyTorch " + torch.__version__, measure(methods, args.rounds), n, nbytes, info)
    import jax

    methods, n, nbytes, info = jax_methods()
    report("JAX " + jax.__version__, measure(methods, args.rounds), n, nbytes, info)


if __name__ == "__main__":
    main()
