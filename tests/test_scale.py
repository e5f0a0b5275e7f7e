"""Runs of any length: step-block tags, reads in bounded answers, field-by-field records, merged chart windows.

The largest sizes (10 million layer-steps, 100 runs) are in ``benchmarks/backend_scale.py``; these tests check the
mechanisms on small runs with small budgets, against independent references and TensorBoard's own data server.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from tb_gradhealth import Writer, _payloads, health, metadata, reader, record
from tb_gradhealth import testing as gl


def _records(n_steps: int, n_layers: int, seed: int = 0) -> np.ndarray:
    """Memory-form records of small Gaussian gradients of varied scale, computed from the values."""
    rng = np.random.default_rng(seed)
    out = np.empty((n_steps, n_layers, record.NUM_FIELDS))
    for s in range(n_steps):
        for j in range(n_layers):
            out[s, j] = record.compute(rng.normal(0.0, 10.0 ** rng.uniform(-5, -1), size=16),
                                       weight=rng.normal(size=16), hist_sample=None)
    return out


# --- step-block tags -----------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_block_steps_bound_a_tag_to_the_layer_step_budget():
    for n in (1, 3, 200, 1000, 5000, metadata.BLOCK_LAYER_STEPS, 10 * metadata.BLOCK_LAYER_STEPS):
        b = metadata.block_steps(n)
        assert b >= 1 and b & (b - 1) == 0  # a power of two
        assert n * b <= metadata.BLOCK_LAYER_STEPS or b == 1
        assert n * 2 * b > metadata.BLOCK_LAYER_STEPS  # the largest such
    layers = [f"l{i}" for i in range(1000)]
    assert metadata.tag_for(layers, step=255) == metadata.tag_for(layers) + ".0"
    assert metadata.tag_for(layers, step=256) == metadata.tag_for(layers) + ".1"
    assert metadata.tag_block(metadata.tag_for(layers, step=1000)) == 3
    assert metadata.tag_block(metadata.tag_for(layers)) is None
    # Readers of every version group tags into streams by the name before the hash: the block keeps it.
    assert reader.stream_of(metadata.tag_for(layers, "probe", step=9999)) == "probe"


@pytest.mark.unit
def test_writer_splits_a_run_into_step_block_tags_read_back_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(metadata, "BLOCK_LAYER_STEPS", 16)  # 4 layers -> 4 steps a tag
    rows = _records(11, 4)
    names = ["a", "b", "c", "d"]
    with Writer(tmp_path / "run") as w:
        tags = [w.add_records(s, names, rows[s]) for s in range(11)]
    assert len(set(tags)) == 3 and [metadata.tag_block(t) for t in tags] == [s // 4 for s in range(11)]
    (run,) = reader.read_logdir(str(tmp_path)).runs
    assert run.layers == tuple(names) and run.steps.tolist() == list(range(11)) and not run.problems
    np.testing.assert_array_equal(run.records, np.stack([record.from_disk(record.to_disk(r)) for r in rows]))


# --- records stored field by field ---------------------------------------------------------------------------------


@pytest.mark.unit
def test_records_are_stored_field_by_field_and_decode_like_from_disk():
    recs = reader.new_records(5, 3)
    assert recs.shape == (5, 3, record.NUM_FIELDS) and recs.dtype == np.float64
    assert recs[..., 0].flags["C_CONTIGUOUS"]  # one field: a contiguous [S, L] plane
    rows = _records(1, 3)[0]
    disk = record.to_disk(rows)
    record.from_disk_into(disk, recs[2], slice(0, 3))
    record.from_disk_into(disk[::-1], recs[4], np.array([2, 1, 0]))
    np.testing.assert_array_equal(recs[2], record.from_disk(disk))
    np.testing.assert_array_equal(recs[4], record.from_disk(disk))
    assert not recs[[0, 1, 3]].any()


# --- merged chart windows ------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_series_windows_keep_exact_counts_extremes_and_norms():
    n = 2000
    rows = _records(n, 1, seed=3)
    spike = 1337
    rows[spike, 0, record.INDEX["posinf"]] = 1  # a single Inf element at one step
    rows[spike, 0, record.INDEX["size"]] += 1
    big = 777
    rows[big, 0, record.INDEX["max"]] = 1e3  # one huge value
    series = reader.RunSeries("r", ("a",), np.arange(n, dtype=np.int64) * 10, rows)
    body = _payloads.series_payload(series, "a", health.Thresholds())
    first = np.array(body["steps"]) // 10
    count = np.array(body["window_steps"])
    assert body["merged"] and len(first) <= _payloads.MAX_POINTS and count.sum() == n
    assert body["total_steps"] == n and body["window_last"][-1] == (n - 1) * 10 and count[-1] == 1
    np.testing.assert_array_equal(first[1:], first[:-1] + count[:-1])  # consecutive windows cover every step

    # Independent float64 references over each window's steps.
    per_step_max = np.maximum(-rows[:, 0, record.INDEX["min"]], rows[:, 0, record.INDEX["max"]])
    per_step_norm = per_step_max * np.sqrt(rows[:, 0, record.INDEX["ssq_rel"]])
    for i, (a, c) in enumerate(zip(first, count, strict=True)):
        w = slice(a, a + c)
        assert body["fields"]["inf"][i] == rows[w, 0, record.INDEX["posinf"]].sum()
        assert body["fields"]["nan"][i] == 0
        np.testing.assert_allclose(body["fields"]["max_abs"][i], per_step_max[w].max(), rtol=1e-12)
        np.testing.assert_allclose(body["fields"]["norm"][i], np.sqrt(np.mean(per_step_norm[w] ** 2)), rtol=1e-9)
    # The Inf step starts its own window: the chart's point there is the exact onset.
    assert spike in first.tolist() and body["fields"]["inf"][first.tolist().index(spike)] == 1
    assert sum(v for v in body["fields"]["inf"]) == 1
    assert max(body["fields"]["max_abs"]) == 1e3


@pytest.mark.unit
def test_histogram_windows_average_bins_and_total_the_exact_counts():
    n = 1203
    rows = _records(n, 1, seed=5)
    rows[600, 0, record.INDEX["nan"]] = 4
    series = reader.RunSeries("r", ("a",), np.arange(n, dtype=np.int64), rows)
    body = _payloads.histograms_payload(series, "a")
    first, count = np.array(body["steps"]), np.array(body["window_steps"])
    assert len(first) <= _payloads.MAX_POINTS and count.sum() == n and 600 in first.tolist()
    lo = body["decades"][0] - int(record.HIST_BIN_LOG10_LO[0])
    for i, (a, c) in enumerate(zip(first, count, strict=True)):
        hist = rows[a : a + c, 0, record.HIST_START + lo : record.HIST_START + lo + len(body["decades"])]
        np.testing.assert_allclose(body["counts"][i], hist.mean(axis=0), rtol=1e-12, atol=0)
        assert body["nonfinite"][i] == rows[a : a + c, 0, record.INDEX["nan"]].sum()
        assert body["zero"][i] == rows[a : a + c, 0, record.INDEX["zero"]].sum()


@pytest.mark.unit
def test_a_run_that_fits_is_shown_step_by_step():
    rows = _records(40, 2)
    series = reader.RunSeries("r", ("a", "b"), np.arange(40, dtype=np.int64), rows)
    body = _payloads.series_payload(series, "b", health.Thresholds())
    assert body["steps"] == list(range(40)) and body["window_steps"] == [1] * 40 and not body["merged"]
    expected = record.derived(rows[:, 1])
    np.testing.assert_allclose(body["fields"]["norm"], expected["norm"], rtol=1e-12)


# --- reads through TensorBoard's data server in bounded answers ----------------------------------------------------


class MessageTooLarge(grpc.RpcError):
    """What a gRPC call raises when the answer exceeds the channel's message limit (the data server's reads)."""

    def __init__(self, details: str):
        super().__init__(details)
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def details(self) -> str:
        return self._details


class CountingProvider:
    """A data provider that forwards to TensorBoard's and records each read's tags and answer size; ``limit``
    makes a read fail like the data server's gRPC message limit when its answer holds more layer-rows."""

    def __init__(self, provider, limit: int | None = None):
        self._provider = provider
        self.limit = limit
        self.reads: list[tuple[list[str], int, int]] = []  # (tags, downsample, layer-rows answered)

    def __getattr__(self, name):
        return getattr(self._provider, name)

    def read_tensors(self, ctx, *, experiment_id, plugin_name, downsample, run_tag_filter):
        data = self._provider.read_tensors(ctx, experiment_id=experiment_id, plugin_name=plugin_name,
                                           downsample=downsample, run_tag_filter=run_tag_filter)
        rows = sum(d.numpy.shape[0] for run in data.values() for ts in run.values() for d in ts)
        self.reads.append((sorted(run_tag_filter.tags), downsample, rows))
        if self.limit is not None and rows > self.limit:
            raise MessageTooLarge(f"Received message larger than max ({rows} vs. {self.limit})")
        return data


@pytest.mark.e2e
def test_a_run_of_many_step_blocks_is_read_in_answers_under_the_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(metadata, "BLOCK_LAYER_STEPS", 64)  # 8 layers -> 8 steps a tag
    gl.make_scale_logdir(str(tmp_path), 8, 100, run="long")
    ingester = gl.data_server(str(tmp_path), {"gradhealth": 0}, last_steps={"long": 99})
    budget = 3 * 8 * 8 * reader.WORST_ROW_BYTES  # three full tags per read
    provider = CountingProvider(ingester.data_provider, limit=3 * 8 * 8)
    series = reader.ProviderReader(provider, 0, read_budget=budget).run(None, "", "long")
    assert series.num_steps == 100 and not series.problems and not series.maybe_downsampled
    assert len(provider.reads) == 5 and all(len(tags) <= 3 for tags, _, _ in provider.reads)
    assert sorted(t for tags, _, _ in provider.reads for t in tags) == sorted(series.tags)
    direct = reader.read_logdir(str(tmp_path)).runs[0]
    np.testing.assert_array_equal(series.steps, direct.steps)
    np.testing.assert_array_equal(series.records, direct.records)


@pytest.mark.e2e
def test_one_tag_too_large_for_an_answer_is_shown_evenly_sampled_with_a_problem(tmp_path):
    layers = [f"l{i}" for i in range(4)]
    rows = _records(60, 4)
    gl.write_records(str(tmp_path / "old"), layers, list(range(60)), rows)  # one tag of every step
    ingester = gl.data_server(str(tmp_path), {"gradhealth": 0}, last_steps={"old": 59})
    provider = CountingProvider(ingester.data_provider, limit=4 * 25)
    pr = reader.ProviderReader(provider, 0, read_budget=4 * 20 * reader.WORST_ROW_BYTES)
    series = pr.run(None, "", "old")
    assert 1 <= series.num_steps <= 25 and series.last_step == 59 and series.maybe_downsampled
    assert any("too large for one answer" in p for p in series.problems), series.problems
    assert provider.reads[0][1] == reader.SAMPLE_ALL and provider.reads[-1][1] <= 25


@pytest.mark.e2e
def test_a_restart_replaces_later_steps_in_every_block_for_the_cli_and_the_tab(tmp_path, monkeypatch):
    monkeypatch.setattr(metadata, "BLOCK_LAYER_STEPS", 8)  # 2 layers -> 4 steps a tag
    names = ["a", "b"]
    first, second = _records(12, 2, seed=1), _records(3, 2, seed=2)
    with Writer(tmp_path / "run") as w:  # a job that reached step 11, then restarted from a checkpoint at 5
        for s in range(12):
            w.add_records(s, names, first[s], wall_time=1000.0 + s)
    with Writer(tmp_path / "run") as w:
        for k, s in enumerate(range(5, 8)):
            w.add_records(s, names, second[k], wall_time=2000.0 + s)
    direct = reader.read_logdir(str(tmp_path)).runs[0]
    ingester = gl.data_server(str(tmp_path), {"gradhealth": 0}, last_steps={"run": 7})
    served = reader.ProviderReader(ingester.data_provider, 0).run(None, "", "run")
    for series in (direct, served):
        assert series.steps.tolist() == list(range(8)), series.steps
        np.testing.assert_array_equal(series.records[5:8], np.stack([record.from_disk(record.to_disk(r))
                                                                     for r in second]))


@pytest.mark.e2e
def test_listing_many_runs_reads_each_once_even_when_the_cache_lets_records_go(tmp_path):
    for i in range(3):
        gl.make_scale_logdir(str(tmp_path), 4, 20, run=f"run_{i}", seed=i)
    ingester = gl.data_server(str(tmp_path), {"gradhealth": 0}, last_steps={f"run_{i}": 19 for i in range(3)})
    provider = CountingProvider(ingester.data_provider)
    pr = reader.ProviderReader(provider, 0, cache_bytes=1, listing_ttl=3600)  # keeps one decoded run at most
    first = pr.summaries(None, "")
    assert [s["run"] for s in first] == ["run_0", "run_1", "run_2"] and all(s["num_steps"] == 20 for s in first)
    assert first == [s.summary() for s in reader.read_logdir(str(tmp_path)).runs]
    reads = len(provider.reads)
    assert pr.summaries(None, "") == first and len(provider.reads) == reads  # no run read again


@pytest.mark.tf
def test_the_tf_summary_op_writes_step_block_tags_too(tmp_path, monkeypatch):
    tf = pytest.importorskip("tensorflow")
    from tb_gradhealth import summary

    monkeypatch.setattr(metadata, "BLOCK_LAYER_STEPS", 8)  # 2 layers -> 4 steps a tag
    grads = [tf.constant(np.linspace(-1e-3, 1e-3, 12, dtype=np.float32)), tf.constant(np.ones(3, np.float32))]
    names = ["dense/kernel", "dense/bias"]
    step = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def log():
        return summary.write(summary.compute(grads), names, step=step)

    with tf.summary.create_file_writer(str(tmp_path / "run")).as_default():
        for s in range(10):
            step.assign(s)
            log()
    (run,) = reader.read_logdir(str(tmp_path)).runs
    assert run.steps.tolist() == list(range(10)) and run.layers == tuple(names) and not run.problems
    assert sorted(run.tags) == [metadata.tag_for(names, step=s) for s in (0, 4, 8)]
