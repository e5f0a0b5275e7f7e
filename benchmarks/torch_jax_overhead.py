"""Cost per training step of the device-side records (tb_gradhealth.torch / tb_gradhealth.jax) beside one plain
norm pass, the plain training step and what PyTorch users log today, on an MLP, a ResNet-18 (small images) and a
small GPT (CPU).

    python benchmarks/torch_jax_overhead.py [--rounds 10] [--models mlp,resnet18,gpt] [--compile mlp] [--no-jax]
                                            [--tree CHECKOUT]

Every method runs once per round, rounds interleaved (so machine load hits all alike); medians. Rows:

* ``norm pass``: every gradient's L2 norm (``torch._foreach_norm`` / ``jnp.linalg.norm`` per leaf in one jit),
  stacked, copied to the host: the cheapest per-layer statistic;
* ``record``: every layer's full record (gradient and weight) and its one host copy; eager torch, torch
  ``compile=True`` (inductor; first compile timed), ``jax.jit`` (``record_floor.py`` holds their goals, against
  one read of the same tensors);
* ``train step``: forward, backward, SGD step; ``train step, again`` the same step timed as a second method: its
  ratio to the first is the run's noise floor; ``StepRecorder`` rows are that step with the recorder: logging
  every step, and at the default cadence (first 10 steps, then every 100th: (99 unlogged + 1 logged) / 100);
* a logged step by part: the calls ``StepRecorder(every=1)`` makes, each timed on its own (the records of the
  gradients and weights with the weights' copy, the optimizer step, the update and its record, the write), beside
  what the every-step goal allows and what the gradients' record alone costs at its own goal (6x the norm pass);
* peers, each on the same model and batch, added to the train step: ``wandb.watch(model, log="gradients",
  log_freq=1)`` offline, ``SummaryWriter.add_histogram`` of every gradient, Lightning's ``grad_norm`` logged as
  scalars; bytes per layer-step are what each leaves on disk, divided by the steps and layers it logged.

The goals (``StepRecorder`` every step <= 1.25x the train step, at the default cadence <= 1.01x) accept the run's
noise (a goal times 1 + noise); the script exits 1 when one is not met.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _tree() -> Path:
    """The checkout whose ``tb_gradhealth`` runs: ``--tree PATH`` (another checkout, e.g. ``git worktree add
    /tmp/before main``: the baseline's figures from the same script), else this one (not an installed one)."""
    if "--tree" in sys.argv[:-1]:
        return Path(sys.argv[sys.argv.index("--tree") + 1]).resolve()
    return Path(__file__).resolve().parent.parent


sys.path.insert(0, str(_tree()))

WIDTHS = (512, 1024, 1024, 1024, 1024, 10)
BATCH = 64
#: ``StepRecorder``'s goals, in train steps (times 1 + the run's noise).
GOALS = {"StepRecorder, every step": 1.25, "StepRecorder, default cadence": 1.01}


def _median_times(methods: dict, rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in methods}
    for f in methods.values():
        f()  # warm-up
    for _ in range(rounds):
        for k, f in methods.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return {k: float(np.median(v)) for k, v in times.items()}


def _dir_bytes(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


# --- torch models ----------------------------------------------------------------------------------------------


def _resnet18(torch):
    """torchvision's ``resnet18(num_classes=10)`` when torchvision imports, else the same architecture in torch.nn
    (torchvision's PyPI wheel does not load beside the CPU build of torch this machine has)."""
    try:
        import torchvision

        return torchvision.models.resnet18(num_classes=10), "torchvision resnet18"
    except Exception:  # noqa: BLE001 - ImportError, or the wheel's missing operators (RuntimeError)
        pass
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.down = None if stride == 1 and cin == cout else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            y = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
            return torch.relu(y + (x if self.down is None else self.down(x)))

    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 10)]
    return nn.Sequential(*layers), "ResNet-18 (torchvision's architecture in torch.nn)"


def _gpt(torch, vocab=8192, dim=256, blocks=4, seq=64):
    nn = torch.nn

    class Gpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, dim)
            self.pos = nn.Parameter(torch.zeros(seq, dim))
            self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True,
                                                                   norm_first=True) for _ in range(blocks))
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq))

        def forward(self, ids):
            h = self.tok(ids) + self.pos
            for b in self.blocks:
                h = b(h, src_mask=self.mask, is_causal=True)
            return self.head(self.norm(h))

    return Gpt(), f"GPT ({blocks} blocks, width {dim}, vocabulary {vocab}, context {seq})"


def torch_model(name: str):
    import torch

    torch.manual_seed(0)
    if name == "mlp":
        layers = []
        for a, b in zip(WIDTHS[:-1], WIDTHS[1:], strict=True):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        model, title = torch.nn.Sequential(*layers[:-1]), "MLP " + "-".join(map(str, WIDTHS))
        x, y = torch.randn(BATCH, WIDTHS[0]), torch.randint(0, WIDTHS[-1], (BATCH,))
        return model, title + f", batch {BATCH}", x, y, torch.nn.functional.cross_entropy
    if name == "resnet18":
        model, title = _resnet18(torch)
        x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
        return model, title + ", 16 images 32x32", x, y, torch.nn.functional.cross_entropy
    model, title = _gpt(torch)
    x = torch.randint(0, 8192, (8, 64))
    y = torch.randint(0, 8192, (8, 64))
    return model, title + ", batch 8", x, y, lambda out, t: torch.nn.functional.cross_entropy(out.flatten(0, 1),
                                                                                                t.flatten())


def torch_methods(name: str, compile_: bool, tmp: str, peers: bool) -> tuple[dict, dict]:
    import torch

    import tb_gradhealth.torch as tgh

    model, title, x, y, loss_fn = torch_model(name)

    def trainer(m):
        opt = torch.optim.SGD(m.parameters(), lr=1e-4)

        def step_fwd_bwd():
            opt.zero_grad()
            loss_fn(m(x), y).backward()
            return opt

        return opt, step_fwd_bwd

    opt, fwd_bwd = trainer(model)
    fwd_bwd()
    opt.step()
    params = list(model.parameters())
    grads = [p.grad for p in params]
    info = {"title": title, "params": sum(p.numel() for p in params), "layers": len(params), "bytes": {}}
    methods = {
        "norm pass": lambda: torch.stack(torch._foreach_norm(grads)).cpu().numpy(),
        "record (eager)": lambda: tgh.to_memory(tgh.compute(model, True, seed=1)),
        "train step": lambda: (fwd_bwd(), opt.step()),
        "train step, again": lambda: (fwd_bwd(), opt.step()),
    }
    if compile_:
        t = time.perf_counter()
        tgh.to_memory(tgh.compute(model, True, seed=1, compile=True))
        info["first compile (s)"] = time.perf_counter() - t
        methods["record (compile=True)"] = lambda: tgh.to_memory(tgh.compute(model, True, seed=2, compile=True))

    methods.update(_recorder_methods(name, model, opt, fwd_bwd, tmp, info))
    if peers:
        methods.update(_peer_methods(name, model, trainer, tmp, info))
    return methods, info


def _recorder_methods(name: str, model, opt, fwd_bwd, tmp: str, info: dict) -> dict:
    """The train step with ``StepRecorder`` logging every step, and with one at the default cadence, unlogged."""
    import tb_gradhealth.torch as tgh
    from tb_gradhealth import Writer

    writer = Writer(os.path.join(tmp, f"{name}-record"))
    every = tgh.StepRecorder(writer, model, opt, every=1)
    default = tgh.StepRecorder(None, model, opt)  # at step 50: not logged (the default cadence's common case)
    counter = {"every": 0}

    def recorder_every():
        fwd_bwd()
        every.step(counter["every"])
        counter["every"] += 1

    info["finish"] = lambda: (writer.close(), info["bytes"].__setitem__(
        "StepRecorder, every step", _dir_bytes(os.path.join(tmp, f"{name}-record")) / counter["every"]))
    return {"StepRecorder, every step": recorder_every,
            "StepRecorder, unlogged step": lambda: (fwd_bwd(), default.step(50)),
            "logged step, by part": _parts_method(name, model, opt, fwd_bwd, tmp, info)}


#: The parts of a logged step that :func:`torch_report` prints, in ``StepRecorder``'s order.
PARTS = ("records of the gradients and weights, weights copied", "optimizer step",
         "update (copy - weights) and its record", "write")


def _parts_method(name: str, model, opt, fwd_bwd, tmp: str, info: dict):
    """A logged step as ``StepRecorder(every=1)`` runs it (the functions it calls, its reused float32 copy of the
    weights), each part timed on its own into ``info["parts"]``: where the recorder's time goes."""
    import torch

    import tb_gradhealth.torch as tgh
    from tb_gradhealth import Writer

    writer = Writer(os.path.join(tmp, f"{name}-parts"))
    params = list(model.named_parameters())
    names = [n for n, _ in params]
    buffers = [torch.empty_like(p.detach()) for _, p in params]
    times: dict[str, list[float]] = {k: [] for k in PARTS}
    info["parts"] = times
    info["finish parts"] = writer.close
    counter = {"step": 0}

    def run():
        fwd_bwd()
        marks = [time.perf_counter()]
        pending = tgh.before_step(params, counter["step"], writer.hist_sample, True, buffers)
        marks.append(time.perf_counter())
        opt.step()
        marks.append(time.perf_counter())
        rows = tgh.after_step(pending, params, in_place=True)
        marks.append(time.perf_counter())
        writer.add_records(counter["step"], names, rows)
        marks.append(time.perf_counter())
        for k, a, b in zip(PARTS, marks[:-1], marks[1:], strict=True):
            times[k].append(b - a)
        counter["step"] += 1

    return run


def _peer_methods(name: str, model, trainer, tmp: str, info: dict) -> dict:
    """What PyTorch users log today, each on its own copy of the model (wandb's hooks stay on their copy)."""
    methods = {}
    n_layers = info["layers"]
    try:
        import wandb

        m = copy.deepcopy(model)
        opt, fwd_bwd = trainer(m)
        run_dir = os.path.join(tmp, f"{name}-wandb")
        os.makedirs(run_dir)
        run = wandb.init(mode="offline", dir=run_dir, project="overhead", settings=wandb.Settings(silent=True))
        wandb.watch(m, log="gradients", log_freq=1)
        calls = {"n": 0}

        def wandb_step():
            fwd_bwd()
            opt.step()
            run.log({"loss": 0.0})
            calls["n"] += 1

        methods["wandb.watch(log_freq=1)"] = wandb_step

        def finish_wandb():
            run.finish()
            info["bytes"]["wandb.watch(log_freq=1)"] = _dir_bytes(run_dir) / calls["n"]

        info["finish_wandb"] = finish_wandb
    except ImportError:
        pass
    def histograms(sw, m, step):
        for n, p in m.named_parameters():
            sw.add_histogram(n, p.grad, step)

    def lightning_norms(sw, m, step):
        from lightning.pytorch.utilities import grad_norm

        for k, v in grad_norm(m, norm_type=2).items():
            sw.add_scalar(k, v, step)

    try:
        import lightning.pytorch  # noqa: F401
    except ImportError:
        lightning_norms = None
    for label, log in (("SummaryWriter.add_histogram", histograms), ("Lightning grad_norm", lightning_norms)):
        if log is not None:
            methods[label] = _summary_writer_peer(label, log, copy.deepcopy(model), trainer,
                                                  os.path.join(tmp, f"{name}-{len(methods)}"), info)
    info["bytes_layers"] = n_layers
    return methods


def _summary_writer_peer(label: str, log, m, trainer, log_dir: str, info: dict):
    """A train step of ``m`` that logs with ``log(SummaryWriter, model, step)`` after the backward pass."""
    from torch.utils.tensorboard import SummaryWriter

    opt, fwd_bwd = trainer(m)
    sw = SummaryWriter(log_dir)
    calls = {"n": 0}

    def step():
        fwd_bwd()
        log(sw, m, calls["n"])
        opt.step()
        calls["n"] += 1

    info[f"finish {label}"] = lambda: (sw.close(), info["bytes"].__setitem__(label, _dir_bytes(log_dir) / calls["n"]))
    return step


def torch_report(name: str, med: dict[str, float], info: dict) -> bool:
    """Print the model's table; whether its goals are met."""
    for k in [k for k in info if k.startswith("finish")]:
        info[k]()
    n = info["layers"]
    base, step = med["norm pass"], med["train step"]
    noise = abs(med["train step, again"] / step - 1.0)
    met = True
    unlogged, logged = med["StepRecorder, unlogged step"], med["StepRecorder, every step"]
    rows = dict(med)
    rows["StepRecorder, default cadence"] = (99 * unlogged + logged) / 100
    first = f", first compile {info['first compile (s)']:.1f} s" if "first compile (s)" in info else ""
    print(f"\n{info['title']}: {info['params']:,} parameters in {n} tensors{first}")
    print(f"| {'per step':<32} | {'median ms':>9} | {'x norm pass':>11} | {'x train step':>12} | "
          f"{'bytes / layer-step':>18} | {'goal':>10} |")
    print(f"|{'-' * 34}|{'-' * 10}:|{'-' * 12}:|{'-' * 13}:|{'-' * 19}:|{'-' * 11}:|")
    for k, v in rows.items():
        if k in ("StepRecorder, unlogged step", "logged step, by part"):
            continue
        b = info["bytes"].get(k)
        vs_step = v / step if k not in ("norm pass",) and not k.startswith("record") else float("nan")
        goal = GOALS.get(k)
        mark = f"noise {noise:.1%}" if k == "train step, again" else ""
        if goal is not None:
            ok = vs_step <= goal * (1.0 + noise)
            met &= ok
            mark = f"<= {goal:g}x (+{noise:.1%}) " + ("met" if ok else "NOT met")
        print(f"| {k:<32} | {v * 1e3:>9.2f} | {v / base:>11.2f} | {vs_step:>12.3f} | "
              f"{'-' if b is None else f'{b / n:,.0f}':>18} | {mark:>10} |")
    _print_parts(info["parts"], base, step)
    return met


def _print_parts(parts: dict[str, list[float]], base: float, step: float) -> None:
    """Where a logged step's recorder time goes, beside what the every-step goal allows it (the goal's fraction of
    the train step) and the gradients' record at its own goal (``record_floor.py``'s 6x the norm pass)."""
    med = {k: float(np.median(v)) for k, v in parts.items()}
    recorder = sum(v for k, v in med.items() if k != "optimizer step")
    allowed = (GOALS["StepRecorder, every step"] - 1.0) * step
    print(f"\nA logged step by part (StepRecorder(every=1)'s calls, timed one by one; the optimizer step is the "
          f"train step's own): the recorder's parts {recorder * 1e3:.2f} ms, {recorder / base:.1f}x the norm "
          f"pass; the every-step goal allows {allowed * 1e3:.2f} ms, and the gradients' record alone at its goal "
          f"of 6x the norm pass takes {6 * base * 1e3:.2f} ms")
    print(f"| {'part':<52} | {'median ms':>9} | {'x norm pass':>11} | {'x train step':>12} |")
    print(f"|{'-' * 54}|{'-' * 10}:|{'-' * 12}:|{'-' * 13}:|")
    for k, v in med.items():
        print(f"| {k:<52} | {v * 1e3:>9.2f} | {v / base:>11.2f} | {v / step:>12.3f} |")


# --- JAX -------------------------------------------------------------------------------------------------------


def jax_methods() -> tuple[dict, dict]:
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
    t = time.perf_counter()
    jax.block_until_ready(rec(grads, params))
    first = time.perf_counter() - t

    def train_step():
        state["p"], g = step(state["p"])
        return jax.block_until_ready(g)

    methods = {
        "norm pass": lambda: np.asarray(jax.device_get(norms(grads))),
        "record (jit)": lambda: jgh.to_memory(rec(grads, params)),
        "train step": train_step,
    }
    leaves = jax.tree_util.tree_leaves(grads)
    return methods, {"params": sum(int(v.size) for v in leaves), "layers": len(leaves), "first": first}


def jax_report(med: dict[str, float], info: dict) -> None:
    import jax

    base = med["norm pass"]
    print(f"\nJAX {jax.__version__} MLP: {info['params']:,} parameters in {info['layers']} tensors, batch {BATCH}; "
          f"first jit of the record {info['first']:.1f} s")
    print(f"| {'per step':<32} | {'median ms':>9} | {'x norm pass':>11} |")
    print(f"|{'-' * 34}|{'-' * 10}:|{'-' * 12}:|")
    for k, v in med.items():
        print(f"| {k:<32} | {v * 1e3:>9.2f} | {v / base:>11.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--models", default="mlp,resnet18,gpt")
    p.add_argument("--compile", default="mlp", help="models whose record also runs with compile=True (inductor)")
    p.add_argument("--no-peers", action="store_true", help="skip wandb / add_histogram / grad_norm")
    p.add_argument("--no-jax", action="store_true")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads of torch and XLA (default 1: on a shared machine more threads measure "
                        "scheduling, not work)")
    p.add_argument("--tree", type=Path, default=_tree(),
                   help="the checkout whose tb_gradhealth is measured (default: this one)")
    args = p.parse_args()
    if args.threads == 1:  # before JAX starts
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
                                   " intra_op_parallelism_threads=1").strip()
    os.environ.setdefault("WANDB_SILENT", "true")
    # torch.utils.tensorboard imports TensorFlow when it is installed, and TensorFlow then torch._dynamo crashes
    # with some torch releases: a PyTorch user's process has no TensorFlow, so TensorBoard uses its own stub here.
    sys.modules["tensorflow"] = None
    import torch

    torch.set_num_threads(args.threads)
    print(f"PyTorch {torch.__version__}, CPU threads {torch.get_num_threads()}, os.cpu_count() {os.cpu_count()}; "
          f"rounds {args.rounds}")
    print(f"tb_gradhealth of {args.tree}")
    print(f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    met = True
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            methods, info = torch_methods(name, name in args.compile.split(","), tmp, not args.no_peers)
            met &= torch_report(name, _median_times(methods, args.rounds), info)
    if not args.no_jax:
        methods, info = jax_methods()
        jax_report(_median_times(methods, args.rounds), info)
    print(f"\nload average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    sys.exit(0 if met else 1)


if __name__ == "__main__":
    main()
