"""Property-based tests (hypothesis): the record's encodings and merge algebra for arbitrary shapes, dtypes and
magnitudes, and the strict parsing of steps and thresholds (as functions and through the HTTP routes).

Exactness follows each field: counts, extremes and exact histograms compare exactly; the mean and ``ssq_rel`` to a
float64 tolerance (their merge reorders float64 sums). Examples are derandomized and no example database is kept,
so a CI run is repeatable and fast.
"""

from __future__ import annotations

import json
import math
import re
from urllib.parse import quote

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tb_gradhealth import _payloads, health, plugin, record
from tb_gradhealth import testing as gl

SETTINGS = settings(max_examples=40, derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

#: Magnitudes at every edge the record cares about: float32's extremes and subnormals, float64 beyond float32.
EDGES = [0.0, -0.0, 1e-45, 1.4e-45, 1.17e-38, 1.18e-38, 1e-38, 1e-37, 1e-20, 1.0, 3.0, 1e19, 1e20, 1e37, 1e38,
         3.4028234e38, 3.4028236e38, 3.5e38, 1e39, 1e300, 1e-300, math.inf, -math.inf, math.nan]
DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int8]


@st.composite
def tensors(draw, max_side: int = 6) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    if dtype.kind == "i":
        info = np.iinfo(dtype)
        elements = st.integers(int(info.min), int(info.max))
    else:
        edges = [e for e in EDGES if dtype.itemsize == 8 or not math.isfinite(e) or abs(e) < float(np.finfo(dtype).max)]
        scale = st.sampled_from(edges).map(lambda e: np.asarray(e, dtype=dtype).item())
        signed = st.tuples(scale, st.booleans()).map(lambda p: -p[0] if p[1] else p[0])
        elements = st.one_of(st.floats(width=8 * min(dtype.itemsize, 8), allow_nan=True), signed)
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=max_side))
    return draw(hnp.arrays(dtype, shape, elements=elements))


def _same_exact(a: np.ndarray, b: np.ndarray, fields: list[str]) -> None:
    for name in fields:
        np.testing.assert_array_equal(a[..., record.INDEX[name]], b[..., record.INDEX[name]], err_msg=name)


EXACT = list(record.COUNT_FIELDS) + ["min", "max", "missing", "hist_sample"]


def _same(a: np.ndarray, b: np.ndarray) -> None:
    """Equal as records: exact fields exactly, mean and ssq_rel to a float64 tolerance, histograms exactly."""
    _same_exact(a, b, EXACT)
    np.testing.assert_array_equal(a[..., record.HIST_START :], b[..., record.HIST_START :])
    m = np.asarray(record.max_abs(a), dtype=np.float64)
    n = record.finite_count(a)
    np.testing.assert_allclose(a[..., record.INDEX["mean"]], b[..., record.INDEX["mean"]], rtol=0,
                               atol=float(np.max(m * 1e-12, initial=0.0)) + 1e-300)
    np.testing.assert_allclose(a[..., record.INDEX["ssq_rel"]], b[..., record.INDEX["ssq_rel"]], rtol=1e-12,
                               atol=float(np.max(n * 1e-12, initial=0.0)))


@pytest.mark.unit
@SETTINGS
@given(st.lists(tensors(), min_size=1, max_size=4))
def test_disk_round_trip_is_exact_in_float32(grads):
    rows = np.stack([record.compute(g, hist_sample=None) for g in grads])
    disk = record.to_disk(rows)
    assert record.check_disk(disk)[1] == {}
    back = record.from_disk(disk)
    _same_exact(back, rows, list(record.COUNT_FIELDS))
    # Values are float32 on disk: they come back as float32 rounds them (NaN where NaN).
    np.testing.assert_array_equal(back[:, record.NUM_COUNTS :], rows[:, record.NUM_COUNTS :].astype(np.float32))
    decoded, reasons = record.decode_disk(disk)
    assert reasons == {} and np.array_equal(decoded, back, equal_nan=True)


@pytest.mark.unit
@SETTINGS
@given(tensors(), tensors())
def test_merge_of_parts_is_the_record_of_the_whole(a, b):
    whole = np.concatenate([np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)])
    # The record reads values as float32 holds them: the reference concatenates float32 views of the parts.
    with np.errstate(over="ignore"):
        whole = np.concatenate([np.ravel(a).astype(np.float32), np.ravel(b).astype(np.float32)])
    merged = record.merge(record.compute(a, hist_sample=None), record.compute(b, hist_sample=None))
    _same(merged, record.compute(whole, hist_sample=None))


@pytest.mark.unit
@SETTINGS
@given(tensors(), tensors(), tensors())
def test_merge_is_associative_and_commutative_with_empty_as_identity(a, b, c):
    ra, rb, rc = (record.compute(x, hist_sample=None) for x in (a, b, c))
    _same(record.merge(record.merge(ra, rb), rc), record.merge(ra, record.merge(rb, rc)))
    _same(record.merge(ra, rb), record.merge(rb, ra))
    assert np.array_equal(record.merge(record.empty(), ra), ra, equal_nan=True)
    assert np.array_equal(record.merge(ra, record.empty()), ra, equal_nan=True)


@pytest.mark.unit
@SETTINGS
@given(tensors(max_side=10))
def test_compute_counts_against_a_float64_reference(g):
    rec = record.compute(g, hist_sample=None)
    with np.errstate(over="ignore"):
        x = np.ravel(g).astype(np.float32).astype(np.float64)  # what float32 holds (beyond its range: +-Inf)
    x = np.where(np.abs(x) < record.FLUSH_BELOW, 0.0, x)
    fin = x[np.isfinite(x)]
    assert rec[record.INDEX["size"]] == x.size
    assert rec[record.INDEX["nan"]] == np.isnan(x).sum()
    assert rec[record.INDEX["posinf"]] == np.isposinf(x).sum() and rec[record.INDEX["neginf"]] == np.isneginf(x).sum()
    assert rec[record.INDEX["zero"]] == np.sum(fin == 0)
    if fin.size:
        assert rec[record.INDEX["min"]] == fin.min() and rec[record.INDEX["max"]] == fin.max()
        m = np.abs(fin).max()
        if m > 0:
            assert record.derived(rec)["norm"] == pytest.approx(m * math.sqrt(np.sum((fin / m) ** 2)), rel=1e-12)
    assert rec[record.HIST_START :].sum() == np.count_nonzero(fin)


# --- parsing: steps and thresholds --------------------------------------------------------------------------------

_ASCII_INT = re.compile(r"[0-9]{1,18}")
_ASCII_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]{1,3})?")
NUMBERISH = st.one_of(
    st.text(max_size=12),
    st.text(alphabet="0123456789+-.eE _\n\t５٣", max_size=10),
    st.integers(0, 10**20).map(str),
    st.floats(allow_nan=True).map(repr),
)


@pytest.mark.unit
@SETTINGS
@given(NUMBERISH)
def test_a_step_is_plain_ascii_digits_or_a_400(raw):
    if raw and _ASCII_INT.fullmatch(raw):
        assert _payloads.parse_step(raw) == int(raw)
    elif raw == "":
        assert _payloads.parse_step(raw) is None
    else:
        with pytest.raises(_payloads.RequestError) as e:
            _payloads.parse_step(raw)
        assert e.value.status == 400 and e.value.parameter == "step"


SPEC = {s["name"]: s for s in health.Thresholds.spec()}


@pytest.mark.unit
@SETTINGS
@given(st.sampled_from(sorted(SPEC)), NUMBERISH)
def test_a_threshold_is_a_plain_number_in_range_or_a_400(name, raw):
    spec = SPEC[name]
    looks_numeric = bool(_ASCII_NUMBER.fullmatch(raw))
    value = float(raw) if looks_numeric else None
    in_range = value is not None and spec["min"] <= value <= spec["max"] and (
        spec["type"] == "float" or value == int(value))
    if in_range:
        assert getattr(_payloads.parse_thresholds({name: raw}), name) == value
    else:
        with pytest.raises(_payloads.RequestError) as e:
            _payloads.parse_thresholds({name: raw})
        assert e.value.status == 400 and e.value.parameter == name


@pytest.mark.unit
@SETTINGS
@given(st.sampled_from(sorted(SPEC)), st.data())
def test_every_threshold_in_range_round_trips_through_text(name, data):
    spec = SPEC[name]
    if spec["type"] == "int":
        value = data.draw(st.integers(int(spec["min"]), min(int(spec["max"]), 10**6)))
    else:
        value = data.draw(st.floats(spec["min"], spec["max"], allow_nan=False))
    t = _payloads.parse_thresholds({name: repr(value)})
    assert getattr(t, name) == value and health.Thresholds.from_mapping(t.to_dict()) == t


# --- the routes' query parsing over HTTP ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from tensorboard.plugins import base_plugin
    from werkzeug.test import Client

    logdir = tmp_path_factory.mktemp("props")
    facts = {"xss": gl.make_xss(str(logdir))}
    ingester = gl.data_server(str(logdir), {"gradhealth": 0}, last_steps=gl.last_steps(facts))
    p = plugin.GradHealthPlugin(base_plugin.TBContext(data_provider=ingester.data_provider,
                                                      sampling_hints={"gradhealth": 0}))
    apps = p.get_plugin_apps()
    return Client(lambda environ, start: (apps.get(environ["PATH_INFO"]) or apps["/*"])(environ, start))


ROUTES = ["/health", "/profile", "/series", "/histograms"]
PARAMS = ["run", "step", "layer", "vanish_decades", "sustain_steps", "explode_rms_above", "nope"]


@pytest.mark.e2e
@settings(SETTINGS, max_examples=120)
@given(st.sampled_from(ROUTES), st.dictionaries(st.sampled_from(PARAMS), NUMBERISH | st.just("xss"), max_size=4))
def test_route_queries_answer_200_or_a_named_4xx(client, route, query):
    query = {"run": "xss", "layer": "dense/kernel", **query}
    url = route + "?" + "&".join(f"{quote(k)}={quote(v)}" for k, v in query.items())
    r = client.get(url)
    body = json.loads(r.get_data(as_text=True))
    assert r.status_code in (200, 400, 404), (url, r.status_code, body)
    if r.status_code == 400:
        assert body["parameter"] in query, (url, body)
    step = query.get("step")
    if r.status_code == 200 and step:
        assert _ASCII_INT.fullmatch(step)
