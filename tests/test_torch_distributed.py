"""Distributed PyTorch on CPU (gloo, real processes): sharded gradients' records merged with collectives equal the
float64 reference over the gathered full gradient, field by field; under DDP only rank 0 writes."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest

from tb_gradhealth import reader, record
from tb_gradhealth.writer import Writer
from tests.record_close import assert_records_close, extreme_cases
from tests.test_torch import with_histogram_of

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
tgh = pytest.importorskip("tb_gradhealth.torch")

pytestmark = [pytest.mark.torch, pytest.mark.e2e]

STEP = 7


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def full_layers() -> dict[str, np.ndarray]:
    """The full gradients every rank shards (same seed everywhere)."""
    layers = {n: g for n, g in extreme_cases(np.random.default_rng(3)).items()}
    layers["two_elements"] = np.array([1e-20, -5.0], np.float32)  # some ranks hold an empty shard
    layers["big_sampled"] = np.random.default_rng(4).normal(size=9000).astype(np.float32) * 1e-3
    layers["big_sampled"][::13] = np.nan
    return layers


def _sharded_worker(rank: int, world: int, port: int, outdir: str) -> None:
    _init(rank, world, port)
    layers = full_layers()
    shards = {n: torch.from_numpy(np.array_split(g.reshape(-1), world)[rank].copy()) for n, g in layers.items()}
    weights = {n: 1.0 - 2 * s for n, s in shards.items()}
    shards["missing"], weights["missing"] = None, torch.ones(np.array_split(np.zeros(10), world)[rank].size)
    gathered = [None] * world
    dist.all_gather_object(gathered, {n: (None if s is None else s.numpy()) for n, s in shards.items()})
    writer = Writer(os.path.join(outdir, "logs"), hist_sample=0) if rank == 0 else None
    exact = tgh.add_gradients(writer, STEP, shards, weights, sharded=True, hist_sample=0)
    sampled = tgh.add_gradients(None, STEP, shards, weights, sharded=True, hist_sample=512)
    if rank == 0:
        writer.close()
        full = {n: None if parts[0] is None else np.concatenate(parts)
                for n, parts in ((n, [g[n] for g in gathered]) for n in shards)}
        np.savez(os.path.join(outdir, "out.npz"), exact=exact, sampled=sampled, names=np.array(list(shards)),
                 **{f"full/{n}": v for n, v in full.items() if v is not None})
    else:
        assert exact is None and sampled is None
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.slow
def test_sharded_records_merge_to_the_full_gradients_record(tmp_path, world):
    torch.multiprocessing.spawn(_sharded_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world)
    out = np.load(tmp_path / "out.npz")
    names = [str(n) for n in out["names"]]
    layers = full_layers()
    for n in layers:  # the shards the ranks held are the full gradient
        np.testing.assert_array_equal(out[f"full/{n}"], layers[n].reshape(-1))
    ref = np.stack([
        record.compute(None, np.ones(10), hist_sample=None) if n == "missing"
        else record.compute(out[f"full/{n}"], 1.0 - 2 * out[f"full/{n}"], hist_sample=None)
        for n in names
    ])
    assert_records_close(ref, out["exact"], names)
    # with sampling the histogram is each shard's scaled sample, summed: still the exact finite nonzero count
    assert_records_close(with_histogram_of(ref, out["sampled"]), out["sampled"], names)
    np.testing.assert_allclose(out["sampled"][:, record.HIST_START:].sum(1), ref[:, record.HIST_START:].sum(1),
                               rtol=1e-5)
    big = names.index("big_sampled")
    assert out["sampled"][big, record.INDEX["hist_sample"]] <= 512 * world
    run = reader.read_logdir(str(tmp_path / "logs")).runs[0]
    assert list(run.layers) == names and list(run.steps) == [STEP]
    assert_records_close(ref, run.records[0], names)


def _ddp_worker(rank: int, world: int, port: int, outdir: str) -> None:
    _init(rank, world, port)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(12, 6), torch.nn.ReLU(), torch.nn.Linear(6, 1)))
    torch.manual_seed(rank)  # each rank its own batch: DDP averages the gradients
    model(torch.randn(5, 12)).square().mean().backward()
    logdir = os.path.join(outdir, f"rank{rank}")
    with Writer(logdir, hist_sample=0) as w:
        rows = tgh.add_gradients(w, STEP, model.module)
    grads = {n: p.grad.numpy() for n, p in model.module.named_parameters()}
    weights = {n: p.detach().numpy() for n, p in model.module.named_parameters()}
    np.savez(os.path.join(outdir, f"rank{rank}.npz"), rows=np.zeros(0) if rows is None else rows,
             **{f"g/{n}": g for n, g in grads.items()}, **{f"w/{n}": v for n, v in weights.items()})
    dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_rank_zero_writes_the_identical_gradients(tmp_path):
    torch.multiprocessing.spawn(_ddp_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2)
    r0, r1 = (np.load(tmp_path / f"rank{r}.npz") for r in (0, 1))
    names = sorted({k[2:] for k in r0.files if k.startswith("g/")}, key=[k[2:] for k in r0.files].index)
    for n in names:
        np.testing.assert_array_equal(r0[f"g/{n}"], r1[f"g/{n}"])  # DDP: every rank holds the same gradient
    ref = np.stack([record.compute(r0[f"g/{n}"], r0[f"w/{n}"], hist_sample=None) for n in names])
    assert_records_close(ref, r0["rows"], names)
    assert r1["rows"].size == 0
    assert reader.read_logdir(str(tmp_path / "rank0")).runs
    assert not reader.read_logdir(str(tmp_path / "rank1")).runs


#: Full weights and gradients the ranks shard: a live parameter, one frozen by ``requires_grad=False`` (holding a
#: leftover gradient never to be read) and one outside the optimizer.
FROZEN_SIZES = {"live": 41, "frozen": 30, "outside": 17}


def _frozen_full() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(5)
    return {n: (rng.normal(size=k).astype(np.float32), (rng.normal(size=k) * 1e-2).astype(np.float32))
            for n, k in FROZEN_SIZES.items()}


def _frozen_sharded_worker(rank: int, world: int, port: int, outdir: str) -> None:
    _init(rank, world, port)
    params = [(n, torch.nn.Parameter(torch.from_numpy(np.array_split(w, world)[rank].copy()),
                                     requires_grad=n != "frozen")) for n, (w, _) in _frozen_full().items()]
    opt = torch.optim.SGD([p for n, p in params if n == "live"], lr=0.5)
    writers = [Writer(os.path.join(outdir, k), hist_sample=0) if rank == 0 else None for k in ("add", "rec")]
    rec = tgh.StepRecorder(writers[1], params, opt, sharded=True, every=1)
    for n, p in params:  # this step's gradient shards (the frozen one's: a leftover)
        p.grad = torch.from_numpy(np.array_split(_frozen_full()[n][1], world)[rank].copy())
    tgh.add_gradients(writers[0], STEP, params, sharded=True, optimizer=opt, hist_sample=0)
    rec.step(STEP)
    after = [None] * world
    dist.all_gather_object(after, {n: p.detach().numpy() for n, p in params})
    if rank == 0:
        for w in writers:
            w.close()
        np.savez(os.path.join(outdir, "after.npz"), **{n: np.concatenate([a[n] for a in after]) for n in after[0]})
    dist.destroy_process_group()


@pytest.mark.slow
def test_sharded_merge_keeps_frozen_rows_frozen_with_the_full_size(tmp_path):
    torch.multiprocessing.spawn(_frozen_sharded_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2)
    full, after = _frozen_full(), np.load(tmp_path / "after.npz")
    w, g = full["live"]
    for n in ("frozen", "outside"):  # measured: never moved
        np.testing.assert_array_equal(after[n], full[n][0])
    names = list(FROZEN_SIZES)
    frozen = [record.frozen(FROZEN_SIZES[n]) for n in names[1:]]
    for logdir, update in (("add", None), ("rec", w - after["live"])):
        run = reader.read_logdir(str(tmp_path / logdir)).runs[0]
        assert list(run.layers) == names and list(run.steps) == [STEP]
        ref = np.stack([record.compute(g, w, update, hist_sample=None), *frozen])
        assert_records_close(ref, run.records[0], names)
