"""The plugin's HTTP routes over a real data provider (TensorBoard's data server on a demo-like logdir), both on the
plugin's own WSGI apps and through TensorBoard's application (``/data/plugin/gradhealth/...``): answers, and every
bad input a 4xx naming the parameter, never a 500."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend import application
from tensorboard.plugins import base_plugin
from werkzeug.test import Client

from tb_gradhealth import _payloads, cli, health, plugin, reader, record
from tb_gradhealth import testing as gl


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("demo")
    facts = gl.make_demo_logdir(str(logdir))
    gl.make_scale_logdir(str(logdir), 2, 1200, run="long")
    facts["long"] = gl.RunFacts(["block_0000/kernel", "block_0000/bias"], list(range(1200)))
    ingester = gl.data_server(str(logdir), {"gradhealth": 0}, last_steps=gl.last_steps(facts))
    return logdir, facts, ingester.data_provider


class PluginApp:
    """A minimal host for ``get_plugin_apps()``: exact routes first, then the trailing-wildcard static route."""

    def __init__(self, apps):
        self.apps = apps

    def __call__(self, environ, start_response):
        path = environ["PATH_INFO"]
        app = self.apps.get(path) or self.apps["/*"]
        return app(environ, start_response)


@pytest.fixture(scope="module")
def client(demo):
    _, _, provider = demo
    p = plugin.GradHealthPlugin(base_plugin.TBContext(data_provider=provider, sampling_hints={"gradhealth": 0}))
    return Client(PluginApp(p.get_plugin_apps()))


@pytest.fixture(scope="module")
def tb_client(demo):
    """TensorBoard's own WSGI app (as `tensorboard` builds it) with the plugin loaded through its loader."""
    logdir, _, provider = demo
    flags = argparse.Namespace(logdir=str(logdir), samples_per_plugin={"gradhealth": 0}, window_title="",
                               path_prefix="", generic_data="true")
    app = application.TensorBoardWSGIApp(flags, [plugin.GradHealthLoader], data_provider=provider)
    return Client(app)


def get_json(c, url, status=200):
    r = c.get(url)
    assert r.status_code == status, (url, r.status_code, r.get_data(as_text=True)[:500])
    assert r.headers["Content-Type"].startswith("application/json")
    return json.loads(r.get_data(as_text=True))


@pytest.mark.e2e
def test_runs_lists_every_run_with_layers_and_steps(client, demo):
    _, facts, _ = demo
    body = get_json(client, "/runs")
    assert body["problems"] == []
    runs = {r["run"]: r for r in body["runs"]}
    assert runs.keys() == facts.keys()
    for name, f in facts.items():
        r = runs[name]
        assert r["layers"] == f.layers
        assert (r["first_step"], r["last_step"], r["num_steps"]) == (f.steps[0], f.steps[-1], len(f.steps))
        assert r["sample_limit"] is None and r["maybe_downsampled"] is False and r["problems"] == []
        assert len(r["tags"]) == 1 and r["tags"][0].startswith("gradhealth/gradients/")
    assert runs["xss"]["layers"][0] == gl.XSS_LAYER


@pytest.mark.e2e
def test_health_ranks_the_vanishing_layers_first(client, demo):
    _, facts, _ = demo
    body = get_json(client, "/health?run=vanishing")
    f = facts["vanishing"]
    assert body["run"] == "vanishing" and body["step"] == f.steps[-1]
    top = body["layers"][: len(f.vanishing)]
    assert {x["layer"] for x in top} == set(f.vanishing)
    assert all(x["status"] == "vanishing" and x["first_step"] == 0 and x["reasons"] for x in top)
    assert all(x["status"] == "healthy" for x in body["layers"][len(f.vanishing) :])
    assert body["summary"]["counts"]["vanishing"] == len(f.vanishing)
    assert body["thresholds"] == health.Thresholds().to_dict()
    assert [s["name"] for s in body["threshold_spec"]] == list(health.Thresholds().to_dict())
    # Sparkline history: <= 64 steps ending at the diagnosed step, one value per step per layer.
    assert body["history_steps"][-1] == f.steps[-1] and len(body["history_steps"]) <= _payloads.HISTORY_POINTS
    for x in body["layers"]:
        assert len(x["rms_history"]) == len(body["history_steps"])
        assert x["rms_history"][-1] == pytest.approx(x["rms"])


@pytest.mark.e2e
def test_health_names_the_first_nonfinite_layer_and_step(client, demo):
    _, facts, _ = demo
    f = facts["exploding"]
    body = get_json(client, "/health?run=exploding")
    assert body["layers"][0]["layer"] == f.first_nan_layer and body["layers"][0]["status"] == "nonfinite"
    top = body["layers"][0]
    # Since when: the layer's chain of episodes starts where its growth began (x2 per step from step 10), NaN/Inf
    # is its current status since the injected step.
    assert 10 <= top["first_step"] < f.nan_step and top["status_since"] == f.nan_step
    assert body["summary"]["first_bad"] == {"layer": f.first_nan_layer, "status": "nonfinite",
                                            "step": top["first_step"]}
    assert top["episodes"][0]["status"] == "exploding" and top["episodes"][-1]["status"] == "nonfinite"
    assert top["episodes"][-1]["from"] == f.nan_step
    before = get_json(client, f"/health?run=exploding&step={f.nan_step - 1}")
    assert before["step"] == f.nan_step - 1
    assert before["summary"]["counts"]["nonfinite"] == 0 and before["summary"]["counts"]["exploding"] > 0
    assert before["history_steps"][-1] == f.nan_step - 1


@pytest.mark.e2e
def test_thresholds_in_the_query_change_the_flags(client):
    default = get_json(client, "/health?run=vanishing")["summary"]["counts"]["vanishing"]
    loose = get_json(client, "/health?run=vanishing&vanish_decades=10&vanish_rms_below=0")
    assert default == 3 and loose["summary"]["counts"]["vanishing"] == 0
    assert loose["thresholds"]["vanish_decades"] == 10.0 and loose["thresholds"]["vanish_rms_below"] == 0.0
    strict = get_json(client, "/health?run=healthy&explode_rms_above=1e-6")
    assert strict["summary"]["counts"]["exploding"] == len(strict["layers"])
    assert strict["layers"][0]["status"] == "exploding" and strict["layers"][0]["reasons"]


@pytest.mark.e2e
def test_series_returns_derived_fields_for_one_layer(client, demo):
    _, facts, _ = demo
    f = facts["healthy"]
    body = get_json(client, "/series?run=healthy&layer=dense_1/kernel")
    assert body["steps"] == f.steps and body["total_steps"] == len(f.steps) and body["downsampled"] is False
    assert set(body["fields"]) == set(_payloads.SERIES_FIELDS)
    for values in body["fields"].values():
        assert len(values) == len(f.steps)
    rms = np.array(body["fields"]["rms"])
    assert np.all((rms > 1e-4) & (rms < 1e-1))
    assert body["thresholds"] == health.Thresholds().to_dict()
    assert body["fields"]["update_to_weight"] == [None] * len(f.steps)  # not recorded: null, not NaN
    assert all(v is not None and v > 0 for v in body["fields"]["grad_to_weight"])


@pytest.mark.e2e
def test_series_merges_windows_keeping_the_last_step_alone(client):
    body = get_json(client, "/series?run=long&layer=block_0000/bias")
    assert body["total_steps"] == 1200 and body["merged"] is True and body["downsampled"] is False
    assert len(body["steps"]) <= _payloads.MAX_POINTS and body["steps"][-1] == 1199 and body["steps"][0] == 0
    assert body["window_last"][-1] == 1199 and body["window_steps"][-1] == 1 and sum(body["window_steps"]) == 1200
    assert body["steps"] == sorted(set(body["steps"]))


@pytest.mark.unit
def test_series_keeps_the_first_nonfinite_step_when_downsampling():
    rows = gl.synthetic_records(np.full((2000, 1), 1e-3))
    rows[1001, 0, record.INDEX["nan"]] = 3
    series = reader.RunSeries("r", ("a",), np.arange(2000, dtype=np.int64), rows)
    body = _payloads.series_payload(series, "a", health.Thresholds())
    assert 1001 in body["steps"] and len(body["steps"]) <= _payloads.MAX_POINTS
    assert body["fields"]["nan"][body["steps"].index(1001)] == 3


@pytest.mark.e2e
def test_histograms_are_trimmed_decades_per_step(client, demo):
    _, facts, _ = demo
    body = get_json(client, "/histograms?run=vanishing&layer=sigmoid_0/kernel")
    f = facts["vanishing"]
    assert body["steps"] == f.steps
    decades = body["decades"]
    assert decades == list(range(decades[0], decades[0] + len(decades)))
    assert -15 <= decades[0] and decades[-1] <= -8  # Gaussian gradients of RMS 1e-9
    assert len(body["counts"]) == len(f.steps) and all(len(c) == len(decades) for c in body["counts"])
    # Exact histograms: the bins hold every finite nonzero element (128 per record here).
    assert all(sum(c) == 128 for c in body["counts"])
    assert body["exact"] == [True] * len(f.steps) and body["zero"] == [0] * len(f.steps)
    nan_body = get_json(client, "/histograms?run=exploding&layer=linear_7/kernel")
    assert nan_body["nonfinite"][facts["exploding"].nan_step] > 0


@pytest.mark.e2e
def test_profile_is_in_network_order_with_bands(client, demo):
    _, facts, _ = demo
    f = facts["vanishing"]
    body = get_json(client, "/profile?run=vanishing&step=12")
    assert body["step"] == 12 and body["steps"] == f.steps
    assert [x["layer"] for x in body["layers"]] == f.layers
    assert [x["index"] for x in body["layers"]] == list(range(len(f.layers)))
    assert [x["status"] for x in body["layers"][:3]] == ["vanishing"] * 3
    bands = body["bands"]
    assert bands["vanishing_below"] < bands["median_rms"] < bands["exploding_above"]
    assert all(x["rms"] < bands["vanishing_below"] for x in body["layers"][:3])
    # A step between logged steps uses the latest logged step before it; no step: the last.
    assert get_json(client, "/profile?run=healthy&step=25")["step"] == 20
    assert get_json(client, "/profile?run=healthy")["step"] == facts["healthy"].steps[-1]


BAD_REQUESTS = [
    ("/health", 400, "run"),
    ("/health?run=", 400, "run"),
    ("/health?run=nope", 404, "run"),
    ("/health?run=vanishing&step=-1", 400, "step"),
    ("/health?run=vanishing&step=abc", 400, "step"),
    ("/health?run=vanishing&step=1.5", 400, "step"),
    ("/health?run=healthy&step=5", 400, "step"),  # before the first logged step (10)
    ("/health?run=vanishing&vanish_decades=lots", 400, "vanish_decades"),
    ("/health?run=vanishing&vanish_decades=nan", 400, "vanish_decades"),
    ("/health?run=vanishing&vanish_decades=-3", 400, "vanish_decades"),
    ("/health?run=vanishing&growth_window=2.5", 400, "growth_window"),
    ("/health?run=vanishing&no_such_knob=1", 400, "no_such_knob"),
    ("/health?run=vanishing&vanish_decades=4&no_such_knob=1", 400, "no_such_knob"),
    ("/health?run=vanishing&vanish_decades=4&sustain_steps=0", 400, "sustain_steps"),
    ("/series?run=vanishing", 400, "layer"),
    ("/series?layer=a", 400, "run"),
    ("/series?run=vanishing&layer=nope", 404, "layer"),
    ("/series?run=nope&layer=nope", 404, "run"),
    ("/series?run=vanishing&layer=sigmoid_0/kernel&bogus=1", 400, "bogus"),
    ("/histograms?run=vanishing&layer=nope", 404, "layer"),
    ("/histograms?run=vanishing", 400, "layer"),
    ("/histograms?run=vanishing&layer=sigmoid_0/kernel&step=3", 400, "step"),
    ("/profile?run=vanishing&step=x", 400, "step"),
    ("/profile?run=nope", 404, "run"),
    ("/profile?run=vanishing&explode_decades=0", 400, "explode_decades"),
    ("/runs?run=x", 400, "run"),
]


@pytest.mark.e2e
@pytest.mark.parametrize("url,status,parameter", BAD_REQUESTS)
def test_bad_requests_are_4xx_naming_the_parameter(client, tb_client, url, status, parameter):
    for c, prefix in ((client, ""), (tb_client, "/data/plugin/gradhealth")):
        body = get_json(c, prefix + url, status)
        assert body["parameter"] == parameter
        assert parameter in body["error"]


@pytest.mark.e2e
def test_static_files_are_served_from_the_frontend_dir_only(client):
    static = plugin._static_dir()
    assert static is not None and Path(static, "index.js").is_file()
    r = client.get("/index.js")
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/javascript")
    assert r.get_data() == Path(static, "index.js").read_bytes()
    css = next(Path(static).rglob("*.css"), None)
    if css is not None:
        r = client.get("/" + css.relative_to(static).as_posix())
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/css")
    for bad in ("/../plugin.py", "/..%2Fplugin.py", "/%2e%2e/plugin.py", "/views/../../tb_gradhealth/plugin.py",
                "/nope.js", "/", "/.hidden.js", "//etc/passwd", "/index.js%00.png", "/plugin.py"):
        r = client.get(bad)
        assert r.status_code == 404, bad
        assert "error" in json.loads(r.get_data(as_text=True))


@pytest.mark.unit
def test_resolve_static_rejects_escapes(tmp_path):
    (tmp_path / "index.js").write_text("export function render() {}")
    (tmp_path / "secret.py").write_text("x")
    outside = tmp_path.parent / "outside.js"
    outside.write_text("x")
    (tmp_path / "link.js").symlink_to(outside)
    assert plugin._resolve_static(str(tmp_path), "index.js") == str((tmp_path / "index.js").resolve())
    for rel in ("../outside.js", "link.js", "secret.py", "", "a//b.js", "./index.js", "x\\..\\index.js"):
        assert plugin._resolve_static(str(tmp_path), rel) is None, rel


@pytest.mark.e2e
def test_through_tensorboard_app_listing_and_routes(tb_client, demo):
    _, facts, _ = demo
    listing = get_json(tb_client, "/data/plugins_listing")
    entry = listing["gradhealth"]
    assert entry["enabled"] is True and entry["tab_name"] == "Gradient Health"
    assert entry["loading_mechanism"] == {"type": "IFRAME", "module_path": "/data/plugin/gradhealth/index.js"}
    r = tb_client.get("/data/plugin/gradhealth/index.js")
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/javascript")
    runs = get_json(tb_client, "/data/plugin/gradhealth/runs")
    assert {r["run"] for r in runs["runs"]} == facts.keys()
    body = get_json(tb_client, "/data/plugin/gradhealth/health?run=xss")
    assert body["layers"][0]["layer"] in facts["xss"].layers
    assert gl.XSS_LAYER in {x["layer"] for x in body["layers"]}
    # The experiment-scoped path TensorBoard's frontend may use reaches the same routes.
    assert get_json(tb_client, "/experiment/0/data/plugin/gradhealth/runs")["runs"] == runs["runs"]


@pytest.mark.e2e
def test_frontend_metadata_and_activity(demo):
    _, _, provider = demo
    p = plugin.GradHealthPlugin(base_plugin.TBContext(data_provider=provider, sampling_hints={}))
    md = p.frontend_metadata()
    assert md.es_module_path == "/index.js" and md.tab_name == "Gradient Health"
    assert p.plugin_name == "gradhealth" and p.is_active() is True
    empty = plugin.GradHealthPlugin(base_plugin.TBContext(data_provider=None))
    assert empty.is_active() is False


@pytest.mark.e2e
def test_default_sampling_is_reported_in_runs(demo):
    _, _, provider = demo
    p = plugin.GradHealthPlugin(base_plugin.TBContext(data_provider=provider, sampling_hints={}))
    body = get_json(Client(PluginApp(p.get_plugin_apps())), "/runs")
    long = next(r for r in body["runs"] if r["run"] == "long")
    assert long["sample_limit"] == reader.RUST_LOADER_DEFAULT and long["maybe_downsampled"] is True


@pytest.mark.e2e
def test_warm_health_is_cached_and_consistent(demo, monkeypatch):
    """A repeated request is answered from the cache (no second diagnosis); other thresholds or steps are not."""
    _, _, provider = demo
    calls = []
    real = plugin.diagnose
    monkeypatch.setattr(plugin, "diagnose", lambda *a, **k: calls.append(a[1:]) or real(*a, **k))
    p = plugin.GradHealthPlugin(base_plugin.TBContext(data_provider=provider, sampling_hints={"gradhealth": 0}))
    fresh = Client(PluginApp(p.get_plugin_apps()))
    a = fresh.get("/health?run=long").get_data()
    b = fresh.get("/health?run=long").get_data()
    assert a == b and len(calls) == 1
    other = fresh.get("/health?run=long&step=600").get_data()
    assert json.loads(other)["step"] == 600 and len(calls) == 2
    fresh.get("/health?run=long&vanish_decades=2")
    assert len(calls) == 3
    assert fresh.get("/health?run=long").get_data() == a and len(calls) == 3


@pytest.mark.e2e
def test_cli_json_is_the_health_route(client, demo, capsys):
    """The CLI (event files, no server) and the plugin (data server) give the same diagnosis, and that diagnosis
    is the one the generated runs are known to hold."""
    logdir, facts, _ = demo
    assert cli.main(["report", str(logdir), "--json", "--run", "vanishing", "--run", "exploding",
                     "--fail-on", "none"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(body["run"] for body in out["runs"]) == ["exploding", "vanishing"]
    for body in out["runs"]:
        run = body.pop("run")
        served = get_json(client, f"/health?run={run}")
        served.pop("run")
        assert body.pop("problems") == [] and body.pop("notes") == []
        assert body.pop("nan_origin") == get_json(client, f"/nan_origin?run={run}")["origin"]  # none stored here
        assert body == served
        statuses = {x["layer"]: x["status"] for x in body["layers"]}
        if run == "vanishing":
            assert {n for n, s in statuses.items() if s == "vanishing"} == set(facts[run].vanishing)
        else:
            assert body["summary"]["first_bad"]["layer"] == facts[run].first_nan_layer
            assert statuses[facts[run].first_nan_layer] == "nonfinite"


@pytest.mark.e2e
def test_a_failing_data_provider_is_503_or_a_problem_never_500(tmp_path):
    """When TensorBoard's data server goes away, data routes answer 503 naming the failure, `runs` reports it."""
    import time

    facts = {"xss": gl.make_xss(str(tmp_path))}
    ingester = gl.data_server(str(tmp_path), {"gradhealth": 0}, last_steps=gl.last_steps(facts))
    p = plugin.GradHealthPlugin(base_plugin.TBContext(data_provider=ingester.data_provider,
                                                      sampling_hints={"gradhealth": 0}))
    c = Client(PluginApp(p.get_plugin_apps()))
    assert get_json(c, "/health?run=xss")["run"] == "xss"
    ingester._stdin_handle.close()  # the server runs with --die-after-stdin: this stops it
    deadline = time.monotonic() + 20
    while c.get("/health?run=xss").status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    body = get_json(c, "/health?run=xss", 503)
    assert "data provider" in body["error"]
    for url in ("/series?run=xss&layer=dense/bias", "/histograms?run=xss&layer=dense/bias", "/profile?run=xss"):
        assert "data provider" in get_json(c, url, 503)["error"]
    runs = get_json(c, "/runs")
    assert runs["runs"] == [] and "data provider" in runs["problems"][0]
    assert p.is_active() is False


@pytest.mark.e2e
def test_reading_the_files_answers_every_route_as_the_data_provider(client, demo):
    """Plain ``tensorboard --logdir`` (no ``--samples_per_plugin``): the loader makes the plugin read the event files
    and the data server keep one record per tag; every route answers as through the data provider."""
    logdir, facts, _ = demo
    flags = argparse.Namespace(logdir=str(logdir), samples_per_plugin={}, window_title="", path_prefix="",
                               generic_data="true")
    plugin.GradHealthLoader().fix_flags(flags)
    assert flags.samples_per_plugin == {"gradhealth": 1} and getattr(flags, plugin.READ_FILES)
    kept_one = gl.data_server(str(logdir), flags.samples_per_plugin, last_steps=dict.fromkeys(facts, 0))
    files = Client(application.TensorBoardWSGIApp(flags, [plugin.GradHealthLoader],
                                                  data_provider=kept_one.data_provider))
    base = "/data/plugin/gradhealth"
    assert get_json(files, "/data/plugins_listing")["gradhealth"]["enabled"] is True
    assert get_json(files, f"{base}/runs") == get_json(client, "/runs")
    for run, f in facts.items():
        layer = f.layers[-1]
        for route in (f"health?run={run}", f"health?run={run}&vanish_decades=2.5", f"series?run={run}&layer={layer}",
                      f"histograms?run={run}&layer={layer}", f"profile?run={run}&step={f.steps[len(f.steps) // 2]}"):
            assert get_json(files, f"{base}/{route}") == get_json(client, f"/{route}"), route


@pytest.mark.e2e
def test_concurrent_requests_let_no_warning_reach_the_terminal(demo):
    """TensorBoard serves requests on threads; Python's warning filters are process-wide, so a backend that
    silenced its warnings with ``warnings.catch_warnings()`` leaked them to the terminal under load. Every route,
    12 threads at once, on runs that end in NaN, against a fresh plugin (nothing cached): no warning at all."""
    import threading
    import warnings

    _, facts, provider = demo
    p = plugin.GradHealthPlugin(base_plugin.TBContext(data_provider=provider, sampling_hints={"gradhealth": 0}))
    app = PluginApp(p.get_plugin_apps())
    urls = [u for run, f in facts.items() for u in (
        f"/health?run={run}", f"/profile?run={run}", f"/health?run={run}&step={f.steps[len(f.steps) // 2]}",
        f"/series?run={run}&layer={f.layers[-1]}", f"/nan_origin?run={run}")]
    failures: list[str] = []

    def serve(offset: int) -> None:
        c = Client(app)
        fresh = [f"/health?run={run}&vanish_decades={2 + offset / 8 + k / 64}" for k in range(4) for run in facts]
        for url in fresh + urls[offset:] + urls[:offset]:  # distinct thresholds: diagnoses computed side by side
            r = c.get(url)
            if r.status_code != 200:
                failures.append(f"{url}: {r.status_code}")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=serve, args=(k,)) for k in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not failures, failures
    assert [f"{w.filename}:{w.lineno}: {w.message}" for w in caught] == []
