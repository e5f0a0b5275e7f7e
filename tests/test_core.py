"""The shared core of the writers' statistics, against plain Python integers (arbitrary precision: no wrap-around,
no dtype): the sample positions, the probe hash, the stacked-record codec."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tb_gradhealth import _core, record

pytestmark = pytest.mark.unit


def _stride(n: int) -> int:
    """The integer nearest ``n / golden ratio``, raised until coprime with ``n`` (the documented rule)."""
    s = max(1, round(n * (math.sqrt(5) - 1) / 2))
    while math.gcd(s, n) != 1:
        s += 1
    return s


@pytest.mark.parametrize(("offset", "n", "k"), [(0, 10, 4), (7, 1000, 64), (2**61 + 12345, 2**31 - 1, 50),
                                               (123456789, 3 * 2**20, 4096)])
def test_sample_positions_are_the_rule_in_exact_integers(offset, n, k):
    want = [(offset + i * _stride(n)) % n for i in range(k)]
    assert _core.sample_positions(offset, n, k).tolist() == want
    assert _core.sample_positions(np.int64(offset), n, k).tolist() == want
    # What 32-bit backends get: the offset already reduced, every sum below 2n (no uint32 overflow).
    narrow = _core.sample_positions(np.uint32(offset % n), n, k, const=lambda a: a.astype(np.uint32))
    assert narrow.dtype == np.uint32 and narrow.tolist() == want


def test_sample_positions_of_many_sizes_and_of_a_shorter_length():
    ns = np.array([10, 97, 4096])
    offsets = np.array([[3], [2**40 + 5], [99]], np.int64)
    got = _core.sample_positions(offsets, ns, 8)
    assert got.tolist() == [[(int(o[0]) + i * _stride(int(n))) % int(n) for i in range(8)]
                            for o, n in zip(offsets, ns, strict=True)]
    assert _core.sample_positions(2**50 + 1, 4096, 8, length=np.int64(1000)).tolist() == [
        (2**50 + 1 + i * _stride(4096)) % 1000 for i in range(8)]


def test_probe_hash_wraps_in_the_backends_integer_type():
    bits = [0x7F800000, -12345, 0x3F800000, 987654321]
    wide = [np.int64(b) for b in bits]
    exact = bits[0] ^ (bits[1] * 31) ^ (bits[2] * 131 + bits[3])
    assert int(_core.probe_hash(wide)) == exact
    with np.errstate(over="ignore"):  # int32 wraps around, as on the devices
        narrow = _core.probe_hash([np.int32(b) for b in bits], np.bitwise_xor)
    assert narrow.dtype == np.int32 and int(narrow) == (exact + 2**31) % 2**32 - 2**31
    assert _core.probe_indices(10) == [0, 3, 5, 9]


def test_the_stacked_record_decodes_to_the_memory_form():
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(50).astype(np.float32), np.array([np.nan, np.inf, 0.0], np.float32)]
    rows = np.stack([record.compute(g, hist_sample=None) for g in grads])
    counts, values = _device(rows)
    stacked = _core.stack(counts.astype(np.int32).view(np.float32), values.astype(np.float32),
                          lambda p: np.concatenate(p, 1))
    assert stacked.shape == (2, record.NUM_FIELDS) and stacked.dtype == np.float32
    np.testing.assert_array_equal(_core.decode_stacked(stacked), record.from_device(counts, values))
    assert _core.decode_stacked(stacked)[1, _core.NONFINITE_COLUMNS].tolist() == [1, 1, 0]
    assert _core.stacked_column("update_max_abs") == record.INDEX["update_max_abs"]


def _device(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Memory-form rows in device form: the counts as integers, the values as float32."""
    return rows[:, : record.NUM_COUNTS].astype(np.int32), rows[:, record.NUM_COUNTS :].astype(np.float32)


def test_exponent_bins_are_the_histograms_bins():
    """Every binade's bottom, top and a spread of values between, each decade edge and its neighbours, zeros,
    subnormals, Inf and NaN: the table look-up gives :func:`record.hist_bin`'s bin (the finite normal values) or
    the column past the histogram (the others)."""
    rng = np.random.default_rng(0)
    bits = np.concatenate([np.arange(1, 255, dtype=np.int64) << 23, (np.arange(2, 256, dtype=np.int64) << 23) - 1,
                           rng.integers(1 << 23, 255 << 23, 20_000)]).astype(np.int32)
    edge_bits = record.HIST_EDGES.view(np.int32).astype(np.int64)
    near = np.concatenate([edge_bits - 1, edge_bits, edge_bits + 1]).astype(np.int32)
    normal = np.concatenate([bits, near]).view(np.float32)
    special = np.array([0.0, 1e-45, 1e-40, 1.1754942e-38, np.inf, np.nan], np.float32)
    special = np.concatenate([special, np.array([0x7FFFFFFF], np.int32).view(np.float32)])

    def bins(x: np.ndarray) -> np.ndarray:
        return _core.exponent_bins(x.view(np.int32) & 0x7FFFFFFF, lambda t, e: t[e], lambda v, k: v >> k)

    np.testing.assert_array_equal(bins(normal), record.hist_bin(normal))
    assert set(bins(special).tolist()) <= {record.HIST_BINS, record.HIST_BINS + 1}
