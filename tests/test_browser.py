"""The Gradient Health dashboard in a real browser, served by a real TensorBoard process.

A ``tensorboard`` process (``tensorboard.program.TensorBoard`` with the default plugins plus ``gradhealth``: through
the package's ``tensorboard_plugins`` entry point when it is installed, else added explicitly) serves a demo-like
logdir written by ``tb_gradhealth.testing`` (healthy, vanishing, exploding→NaN, an XSS-named layer, and 1,000
layers) plus a run with an all-NaN layer and one with an inert (round-off only) bias, and
Debian Chromium, driven by playwright, loads the tab inside TensorBoard's page and the plugin page itself.

The launcher hides TensorFlow from TensorBoard (``sys.modules["tensorflow"] = None``): TensorBoard then uses its
own TF stub, exactly as on a machine without TensorFlow. That changes nothing the plugin sees (it never imports TF)
and starts the server in ~3 s instead of ~30 s on a busy two-core machine.

Screenshots of every view go to ``test-artifacts/`` (gitignored); the README's image is of the demo's runs
(``demo/screenshot.py``). Nothing here reads state the page keeps for itself: tests see what a user
sees (the DOM, the requests).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from tb_gradhealth import (
    origin,
    record,
    testing,
)
from tb_gradhealth.health import STATUSES

#: Every test drives a real browser against a real TensorBoard process.
pytestmark = [pytest.mark.browser, pytest.mark.e2e]

REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
SCALE_RUN = "scale1000"
ALL_NAN_RUN = "allnan"
ALL_NAN_LAYER = "dense_1/kernel"
INERT_RUN = "biasbn"
INERT_LAYER = "dense_0/bias"
#: The stored answer of a replay for ALL_NAN_RUN; its code line would run as HTML if it were not text.
NAN_ORIGIN = origin.NanOrigin(step=12, found=True, framework="tensorflow", op="Log", layer="loss_head",
                              direction="forward", file="/src/train.py", line=41,
                              code='tf.math.log(p) # <img src=x onerror="alert(1)">')
SCALE_LAYERS = 1000
SCALE_STEPS = 30
STARTUP_TIMEOUT_S = 120.0
# the status colours and glyphs of frontend/status.js (Okabe-Ito palette), as the page draws them
STATUS_RGB = {"nonfinite": (0, 0, 0), "exploding": (213, 94, 0), "vanishing": (0, 114, 178), "dead": (204, 121, 167),
              "missing": (240, 228, 66), "inert": (189, 189, 189), "healthy": (0, 158, 115)}


sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (python) is not installed")
if not (os.path.exists(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
    pytest.skip(f"Debian chromium not found at {CHROMIUM}", allow_module_level=True)

LAUNCHER = """
import sys
sys.modules["tensorflow"] = None  # TensorBoard falls back to its TF stub (see the test module's docstring)
from importlib import metadata
from tensorboard import default, program
plugins = default.get_plugins()
if not any(ep.name == "gradhealth" for ep in metadata.entry_points().select(group="tensorboard_plugins")):
    from tb_gradhealth.plugin import GradHealthLoader
    plugins.append(GradHealthLoader())
tb = program.TensorBoard(plugins=plugins)
tb.configure(argv=[None, *sys.argv[1:]])
tb.main()
"""



def _get_json(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
        return None


def _four_layer_run(logdir: str, run: str, scale: Callable[[int, str], float], steps: int = 20) -> list[str]:
    """A run of two dense layers (kernel, bias) whose gradient at (step, layer) is Gaussian times ``scale(step,
    layer)`` (NaN: every element NaN), with weights of RMS 0.05; returns the layer names."""
    rng = np.random.default_rng(4)
    layers = ["dense_0/kernel", "dense_0/bias", "dense_1/kernel", "dense_1/bias"]
    sizes = [64, 8, 64, 8]
    recs = np.empty((steps, len(layers), record.NUM_FIELDS))
    for s in range(steps):
        for j, n in enumerate(sizes):
            g = rng.normal(0.0, 1.0, size=n) * scale(s, layers[j])
            recs[s, j] = record.compute(g, weight=rng.normal(0.0, 0.05, size=n), hist_sample=None)
    testing.write_records(os.path.join(logdir, run), layers, list(range(steps)), recs)
    return layers


def make_all_nan(logdir: str, nan_from: int = 12) -> testing.RunFacts:
    """Healthy layers, except that from ``nan_from`` on every element of ``ALL_NAN_LAYER``'s gradient is NaN:
    no statistic of it is known there."""
    layers = _four_layer_run(logdir, ALL_NAN_RUN,
                             lambda s, layer: np.nan if layer == ALL_NAN_LAYER and s >= nan_from else 1e-3)
    return testing.RunFacts(layers, list(range(20)), nan_step=nan_from, first_nan_layer=ALL_NAN_LAYER)


def make_inert(logdir: str) -> testing.RunFacts:
    """Healthy layers, except ``INERT_LAYER``: a bias whose gradient is round-off (7 decades below its kernel's,
    as for a bias right before a BatchNormalization)."""
    layers = _four_layer_run(logdir, INERT_RUN, lambda s, layer: 1e-10 if layer == INERT_LAYER else 1e-3)
    return testing.RunFacts(layers, list(range(20)), healthy=[name for name in layers if name != INERT_LAYER])


@pytest.fixture(scope="module")
def logdir(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    root = tmp_path_factory.mktemp("gh_browser_logdir")
    facts = testing.make_demo_logdir(str(root))
    facts[SCALE_RUN] = testing.make_scale_logdir(str(root), SCALE_LAYERS, SCALE_STEPS, run=SCALE_RUN)
    facts[ALL_NAN_RUN] = make_all_nan(str(root))
    facts[INERT_RUN] = make_inert(str(root))
    origin.write(os.path.join(str(root), ALL_NAN_RUN), NAN_ORIGIN)  # where its NaN was made (a replay's answer)
    return str(root), facts


@pytest.fixture(scope="module")
def tensorboard(logdir: tuple[str, dict], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL of a TensorBoard process serving the logdir, once every run is listed by the plugin."""
    path, facts = logdir
    port = testing.free_port()
    log_path = tmp_path_factory.mktemp("gh_browser_tb") / "tensorboard.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-c", LAUNCHER, "--logdir", path, "--host", "127.0.0.1", "--port", str(port),
           "--samples_per_plugin=gradhealth=0", "--load_fast=false", "--reload_interval=0"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            body = _get_json(f"{base}/data/plugin/gradhealth/runs")
            if body and {r["run"] for r in body.get("runs", [])} >= set(facts):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"tensorboard did not list the runs (exit {proc.poll()}):\n{log_path.read_text()[-3000:]}")
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


class Page:
    """A browser page that records console errors, page errors and dialogs (an XSS would open one)."""

    def __init__(self, browser: object, width: int = 1400, height: int = 1000) -> None:
        self.context = browser.new_context(viewport={"width": width, "height": height})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.on("dialog", self._dialog)

    def _console(self, msg: object) -> None:
        if msg.type != "error":
            return
        where = (msg.location or {}).get("url", "")
        if where.endswith("/favicon.ico"):  # the bare plugin page has no favicon; not ours
            return
        self.errors.append(f"console {msg.type}: {msg.text} @ {where}")

    def _dialog(self, dialog: object) -> None:
        self.dialogs.append(dialog.message)
        dialog.dismiss()

    def assert_clean(self) -> None:
        assert self.errors == [], self.errors
        assert self.dialogs == [], self.dialogs

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def gh(browser: object) -> Iterator[Page]:
    page = Page(browser)
    yield page
    page.close()


def plugin_url(base: str) -> str:
    return f"{base}/data/plugin_entry.html?name=gradhealth"


def open_plugin(gh: Page, base: str) -> object:
    """The plugin page itself (what TensorBoard puts in the tab's iframe); waits for the first table row."""
    gh.page.goto(plugin_url(base))
    gh.page.wait_for_selector("section.run-panel tr[data-layer]", timeout=30000)
    return gh.page


def panel(frame: object, run: str) -> object:
    return frame.locator(f'section.run-panel[data-run="{run}"]')


def rows(frame: object, run: str) -> list[tuple[str, str]]:
    """(layer, status) of the rows shown in a run's table, top to bottom."""
    p = panel(frame, run)
    p.locator("tbody tr[data-layer]").first.wait_for(timeout=30000)
    found = p.locator("tbody tr[data-layer]").evaluate_all(
        "trs => trs.map(tr => [tr.dataset.layer, tr.querySelector('.badge').dataset.status])")
    return [tuple(r) for r in found]


def select_runs(frame: object, runs: list[str]) -> None:
    """Tick exactly these runs in the run selector."""
    frame.locator(".run-bar button", has_text="none").click()
    for run in runs:
        frame.locator(f'input[data-run="{run}"]').check()
    for run in runs:
        panel(frame, run).locator("tbody tr[data-layer]").first.wait_for(timeout=30000)


def open_runs(gh: Page, base: str, runs: list[str]) -> object:
    """The plugin page (:func:`open_plugin`) with exactly ``runs`` ticked and their tables shown."""
    page = open_plugin(gh, base)
    select_runs(page, runs)
    return page


def painted_pixels(locator: object) -> int:
    """Pixels of a canvas that are neither transparent nor near-white: > 0 means something was drawn."""
    return locator.evaluate("""c => {
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0;
        for (let i = 0; i < d.length; i += 4) if (d[i + 3] > 0 && (d[i] < 200 || d[i + 1] < 200 || d[i + 2] < 200)) n++;
        return n;
    }""")


def shot(target: object, name: str, **kwargs: object) -> Path:
    path = ARTIFACTS / name
    target.screenshot(path=str(path), **kwargs)
    return path


# --- tests --------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tab_loads_inside_tensorboard(tensorboard: str, browser: object) -> None:
    gh = Page(browser, height=1300)
    try:
        _tab_loads_inside_tensorboard(tensorboard, gh)
    finally:
        gh.close()


def _tab_loads_inside_tensorboard(tensorboard: str, gh: Page) -> None:
    gh.page.goto(f"{tensorboard}/#gradhealth")
    deadline = time.monotonic() + 30
    frame = None
    while frame is None and time.monotonic() < deadline:
        frame = next((f for f in gh.page.frames if "plugin_entry.html?name=gradhealth" in f.url), None)
        if frame is None:
            gh.page.wait_for_timeout(200)
    assert frame is not None, [f.url for f in gh.page.frames]
    frame.wait_for_selector("section.run-panel tr[data-layer]", timeout=30000)
    assert gh.page.get_by_text("Gradient Health", exact=False).first.is_visible()
    select_runs(frame, ["vanishing", "exploding"])
    assert frame.locator("section.run-panel").count() == 2
    frame.locator("section.run-panel canvas.profile-canvas").first.wait_for()
    # the overview shows the exploding run's profile just before the NaN: bars growing towards the output
    slider = panel(frame, "exploding").locator(".step-slider")
    slider.evaluate("s => { s.value = String(Number(s.max) - 10); s.dispatchEvent(new Event('input')); }")
    frame.wait_for_function(
        """() => document.querySelector('section[data-run="exploding"] .step-label').textContent === '29'
                 && document.querySelector('section[data-run="exploding"] .profile-canvas')""")
    gh.page.wait_for_timeout(500)
    shot(gh.page, "00_overview_in_tensorboard.png")
    gh.assert_clean()


@pytest.mark.slow
def test_ranked_table_puts_sick_layers_first(tensorboard: str, gh: Page, logdir: tuple[str, dict]) -> None:
    _, facts = logdir
    page = open_runs(gh, tensorboard, ["vanishing", "exploding"])

    van = rows(page, "vanishing")
    n_bad = len(facts["vanishing"].vanishing)
    assert {layer for layer, _ in van[:n_bad]} == set(facts["vanishing"].vanishing)
    assert [status for _, status in van[:n_bad]] == ["vanishing"] * n_bad
    assert {status for _, status in van[n_bad:]} == {"healthy"}

    exp = rows(page, "exploding")
    assert exp[0] == (facts["exploding"].first_nan_layer, "nonfinite")
    assert {layer for layer, _ in exp} == set(facts["exploding"].exploding)
    assert {status for _, status in exp} <= {"nonfinite", "exploding"}
    # badges carry the word as well as the colour
    first_badge = panel(page, "exploding").locator("tbody tr .badge").first
    assert "nonfinite" in first_badge.inner_text()

    spark = panel(page, "exploding").locator("tbody tr canvas.sparkline").first
    page.wait_for_function("() => document.querySelector('canvas.sparkline[data-drawn]')")
    assert painted_pixels(spark) > 20

    summary = panel(page, "exploding").locator("[data-testid=summary]").inner_text()
    assert facts["exploding"].first_nan_layer in summary
    assert f"nonfinite from {facts['exploding'].nan_step}" in summary  # the timeline's NaN entry
    strip = page.locator("[data-testid=compare]")  # several runs selected: the compare strip lists each
    assert strip.locator("tbody tr").count() == 2
    assert facts["exploding"].first_nan_layer in strip.locator('tr[data-run="exploding"]').inner_text()
    summary_v = panel(page, "vanishing").locator("[data-testid=summary]").inner_text()
    assert f"{n_bad} vanishing" in summary_v.replace("\n", " ")
    shot(page, "01_ranked_tables.png", full_page=True)
    gh.assert_clean()


@pytest.mark.slow
def test_sort_and_filter(tensorboard: str, gh: Page, logdir: tuple[str, dict]) -> None:
    _, facts = logdir
    page = open_runs(gh, tensorboard, ["vanishing"])
    page.locator('th[data-key="layer"]').first.click()
    assert [layer for layer, _ in rows(page, "vanishing")] == sorted(facts["vanishing"].layers)
    page.locator('th[data-key="layer"]').first.click()
    assert [layer for layer, _ in rows(page, "vanishing")] == sorted(facts["vanishing"].layers, reverse=True)
    page.locator('th[data-key="rank"]').first.click()
    page.locator('.filter-bar input[data-status="healthy"]').check()
    page.wait_for_function("() => document.querySelectorAll('tbody tr[data-layer]').length === 7")
    assert {s for _, s in rows(page, "vanishing")} == {"healthy"}
    page.locator(".filter-bar button", has_text="clear filters").click()
    page.locator("[data-testid=name-filter]").fill("sigmoid_1/")
    page.wait_for_function("() => document.querySelectorAll('tbody tr[data-layer]').length === 1")
    assert rows(page, "vanishing") == [("sigmoid_1/kernel", "vanishing")]
    gh.assert_clean()


@pytest.mark.slow
def test_threshold_change_changes_flags(tensorboard: str, gh: Page) -> None:
    page = open_runs(gh, tensorboard, ["vanishing"])
    before = dict(rows(page, "vanishing"))
    assert before["sigmoid_2/kernel"] == "vanishing"  # 3.8 decades below the median: flagged at the default 3
    page.locator(".thresholds-panel > summary").click()
    box = page.locator('input[data-threshold="vanish_decades"]')
    assert float(box.input_value()) == 3.0
    box.fill("5")
    page.wait_for_function(
        """() => { const tr = document.querySelector('section[data-run="vanishing"] tr[data-layer="sigmoid_2/kernel"]');
                   return tr && tr.querySelector('.badge').dataset.status === 'healthy'; }""", timeout=30000)
    after = dict(rows(page, "vanishing"))
    assert after["sigmoid_0/kernel"] == "vanishing"  # 5.9 decades below: still flagged
    assert sum(s == "vanishing" for s in after.values()) < sum(s == "vanishing" for s in before.values())
    assert "changed" in page.locator(".thresholds-panel > summary").inner_text()
    shot(page, "02_thresholds_changed.png")
    box.fill("1000")  # outside the threshold's range: the server's 400 names it, and no stale table stays up
    error = panel(page, "vanishing").locator(".summary-box .notice-error")
    error.wait_for(timeout=30000)
    assert "vanish_decades" in error.inner_text()
    assert panel(page, "vanishing").locator(".table-wrap").is_hidden()
    # the browser logs the deliberate 400 answers as failed resources: expected here, and only those
    gh.errors = [e for e in gh.errors if "status of 400" not in e]
    page.locator("[data-testid=reset-thresholds]").click()
    page.wait_for_function(
        """() => { const tr = document.querySelector('section[data-run="vanishing"] tr[data-layer="sigmoid_2/kernel"]');
                   return tr && tr.querySelector('.badge').dataset.status === 'vanishing'; }""", timeout=30000)
    assert float(box.input_value()) == 3.0
    assert dict(rows(page, "vanishing")) == before
    gh.assert_clean()


@pytest.mark.slow
def test_layer_detail_draws_charts(tensorboard: str, gh: Page, logdir: tuple[str, dict]) -> None:
    _, facts = logdir
    page = open_runs(gh, tensorboard, ["exploding"])
    layer = facts["exploding"].first_nan_layer
    panel(page, "exploding").locator(f'tr[data-layer="{layer}"]').click()
    drawer = page.locator("[data-testid=detail]")
    drawer.locator(".heatmap-canvas").wait_for(timeout=30000)
    assert drawer.locator(".detail-layer").inner_text() == layer
    assert "nonfinite" in drawer.locator(".badge").first.inner_text()
    body = api_json(tensorboard, "health", run="exploding")
    fixes = next(lj["fixes"] for lj in body["layers"] if lj["layer"] == layer)
    assert fixes and drawer.locator("[data-testid=fixes] li").all_inner_texts() == fixes  # what to do, shown
    titles = drawer.locator(".chart-title").all_inner_texts()
    assert any("magnitude" in t for t in titles) and any("NaN" in t for t in titles), titles
    canvases = drawer.locator("canvas")
    assert canvases.count() >= 3
    for i in range(canvases.count()):
        assert painted_pixels(canvases.nth(i)) > 300, f"chart {i} ({titles}) is empty"
    # hover read-outs
    heat = drawer.locator(".heatmap-canvas")
    box = heat.bounding_box()
    heat.hover(position={"x": box["width"] * 0.5, "y": box["height"] * 0.5})
    assert "step" in drawer.locator(".chart-readout").last.inner_text()
    shot(page, "03b_layer_detail_histogram.png")
    line = canvases.first
    lb = line.bounding_box()
    line.hover(position={"x": lb["width"] * 0.7, "y": lb["height"] * 0.5})
    readout = drawer.locator(".chart-readout").first.inner_text()
    assert "step" in readout and "RMS" in readout
    drawer.evaluate("d => d.scrollTo(0, 0)")
    shot(page, "03_layer_detail.png")
    page.keyboard.press("Escape")
    assert drawer.is_hidden()
    gh.assert_clean()


@pytest.mark.slow
def test_depth_profile_and_step_slider(tensorboard: str, gh: Page, logdir: tuple[str, dict]) -> None:
    _, facts = logdir
    page = open_runs(gh, tensorboard, ["vanishing"])
    prof = panel(page, "vanishing").locator("[data-testid=profile]")
    prof.locator(".chart").wait_for()
    assert prof.locator(".chart").get_attribute("data-bars") == str(len(facts["vanishing"].layers))
    assert painted_pixels(prof.locator("canvas")) > 1000
    last = str(facts["vanishing"].steps[-1])
    assert panel(page, "vanishing").locator(".step-label").inner_text() == last
    slider = panel(page, "vanishing").locator(".step-slider")
    with page.expect_response(lambda r: "/profile?" in r.url and "step=0" in r.url):
        slider.evaluate("s => { s.value = '0'; s.dispatchEvent(new Event('input')); }")
    page.wait_for_function(
        """() => document.querySelector('section[data-run="vanishing"] .step-label').textContent === '0'""")
    shot(panel(page, "vanishing"), "04_depth_profile.png")
    gh.assert_clean()


@pytest.mark.slow
def test_xss_layer_name_is_text(tensorboard: str, gh: Page) -> None:
    page = open_runs(gh, tensorboard, ["xss"])
    names = [layer for layer, _ in rows(page, "xss")]
    assert testing.XSS_LAYER in names
    cell = panel(page, "xss").locator("tbody tr .layer-name").filter(has_text="onerror")
    assert cell.inner_text() == testing.XSS_LAYER
    assert page.locator("img").count() == 0
    cell.click()
    page.locator("[data-testid=detail] canvas").first.wait_for(timeout=30000)
    assert page.locator("[data-testid=detail] .detail-layer").inner_text() == testing.XSS_LAYER
    assert page.locator("img").count() == 0
    page.wait_for_timeout(300)
    shot(page, "05_xss_name_as_text.png")
    gh.assert_clean()


@pytest.mark.slow
def test_empty_and_downsampled_states(tensorboard: str, gh: Page) -> None:
    gh.page.route("**/data/plugin/gradhealth/runs", lambda route: route.fulfill(json={"runs": [], "problems": []}))
    gh.page.goto(plugin_url(tensorboard))
    empty = gh.page.locator("[data-testid=empty-state]")
    empty.wait_for(timeout=30000)
    assert "Writer" in empty.inner_text() and "add_gradients" in empty.inner_text()
    shot(gh.page, "06_empty_state.png")
    gh.page.unroute("**/data/plugin/gradhealth/runs")

    def downsampled(route: object) -> None:
        body = route.fetch().json()
        for r in body["runs"]:
            if r["run"] == "vanishing":
                r.update(maybe_downsampled=True, sample_limit=10, num_steps=10)
        route.fulfill(json=body)

    gh.page.route("**/data/plugin/gradhealth/runs", downsampled)
    gh.page.goto(plugin_url(tensorboard))
    notice = panel(gh.page, "vanishing").locator("[data-testid=downsampled]")
    notice.wait_for(timeout=30000)
    assert "--samples_per_plugin=gradhealth=0" in notice.inner_text()
    assert panel(gh.page, "exploding").locator("[data-testid=downsampled]").count() == 0
    shot(notice, "07_downsampled_notice.png")
    gh.assert_clean()


@pytest.mark.slow
def test_refresh_reloads_runs_that_moved(tensorboard: str, gh: Page) -> None:
    """A run whose last step moved (still training) is re-diagnosed on refresh and marked as training."""
    calls = {"n": 0}

    def runs(route: object) -> None:
        body = route.fetch().json()
        calls["n"] += 1
        if calls["n"] > 1:
            for r in body["runs"]:
                if r["run"] == "vanishing":
                    r["last_step"] += 1
        route.fulfill(json=body)

    gh.page.route("**/data/plugin/gradhealth/runs", runs)
    page = open_runs(gh, tensorboard, ["vanishing", "exploding"])
    with page.expect_request(lambda r: "/health?" in r.url and "run=vanishing" in r.url):
        page.locator("[data-testid=refresh]").click()
    page.locator(".run-item", has_text="vanishing").locator(".training").wait_for()
    assert page.locator(".run-item", has_text="exploding").locator(".training").count() == 0
    gh.assert_clean()


def _shown_numbers(texts: list[str]) -> list[float]:
    """The numbers of a table column as the page prints them (``—`` for none is left out)."""
    return [float(t.replace("+inf", "inf")) for t in texts if t.strip() not in ("", "—")]


def _sort_by(page: Page, key: str) -> str:
    """Click a column header and wait until the table says it is sorted by it; returns the direction."""
    head = page.locator(f'th[data-key="{key}"]')
    head.click()
    page.wait_for_function(f"""() => {{
        const th = document.querySelector('th[data-key="{key}"]');
        return th && th.getAttribute('aria-sort') !== 'none';
    }}""")
    return head.get_attribute("aria-sort")


@pytest.mark.slow
def test_1000_layers_are_listed_sorted_and_shown_in_full(tensorboard: str, gh: Page) -> None:
    """Only the 1,000-layer run is listed: its table counts every layer, a sort orders the shown rows by the
    clicked column, "show all" draws all 1,000 rows and a sort still orders all of them. (How long this takes is
    measured by benchmarks, not asserted here.)"""

    def only_scale(route: object) -> None:
        body = route.fetch().json()
        body["runs"] = [r for r in body["runs"] if r["run"] == SCALE_RUN]
        route.fulfill(json=body)

    gh.page.route("**/data/plugin/gradhealth/runs", only_scale)
    page = gh.page
    page.goto(plugin_url(tensorboard))
    table = panel(page, SCALE_RUN).locator("table.layer-table")
    table.locator("tbody tr[data-layer]").first.wait_for(timeout=60000)
    assert table.get_attribute("data-matching") == str(SCALE_LAYERS)
    rms_column = table.locator("tbody tr[data-layer] td.num:nth-child(6)")
    direction = _sort_by(page, "rms")
    shown = _shown_numbers(rms_column.all_inner_texts())
    assert len(shown) > 10
    assert shown == sorted(shown, reverse=direction == "descending")
    page.locator("[data-testid=show-all]").click()
    page.wait_for_function(f"() => document.querySelectorAll('table.layer-table tbody tr[data-layer]').length"
                           f" === {SCALE_LAYERS}")
    direction = _sort_by(page, "max_abs")
    shown = _shown_numbers(table.locator("tbody tr[data-layer] td.num:nth-child(7)").all_inner_texts())
    assert len(shown) == SCALE_LAYERS
    assert shown == sorted(shown, reverse=direction == "descending")
    page.locator('th[data-key="rank"]').click()
    shot(page, "08_1000_layers.png")
    gh.assert_clean()


# --- since when, honest numbers, sickest first, the weakest bar ---------------------------------------------------


def api_json(base: str, route: str, **params: str) -> dict:
    """A route's JSON answer fetched over HTTP (what the page is given), for independent expectations."""
    body = _get_json(f"{base}/data/plugin/gradhealth/{route}?{urllib.parse.urlencode(params)}")
    assert body is not None, (route, params)
    return body


def sickness(health_body: dict) -> tuple[float, int, int]:
    """The documented run order (docs/DASHBOARD.md): worst flagged status, then more layers in it, then more
    flagged layers; ``inert`` and ``healthy`` are not flagged."""
    counts = health_body["summary"]["counts"]
    flagged = [s for s in STATUSES if s not in ("inert", "healthy") and counts.get(s)]
    if not flagged:
        return (STATUSES.index("inert") if "inert" in STATUSES else len(STATUSES) - 1, 0, 0)
    return (STATUSES.index(flagged[0]), -counts[flagged[0]], -sum(counts[s] for s in flagged))


def test_sickest_runs_are_ticked_first(tensorboard: str, gh: Page, logdir: tuple[str, dict]) -> None:
    _, facts = logdir
    page = open_plugin(gh, tensorboard)
    runs = sorted(facts)
    keyed = sorted(runs, key=lambda r: (sickness(api_json(tensorboard, "health", run=r)), r))
    expected = keyed[:4]
    page.wait_for_function(f"() => document.querySelectorAll('section.run-panel').length === {len(expected)}")
    shown = page.locator("section.run-panel").evaluate_all("ps => ps.map(p => p.dataset.run)")
    ticked = page.locator(".run-bar input[data-run]:checked").evaluate_all("bs => bs.map(b => b.dataset.run)")
    assert shown == expected
    assert sorted(ticked) == sorted(expected)
    worst = api_json(tensorboard, "health", run=shown[0])["summary"]["counts"]
    assert worst["nonfinite"] > 0  # a NaN run opens first
    # the alphabetical first four would hide the vanishing run; sickest-first shows it
    assert "vanishing" in ticked and "vanishing" not in runs[:4]
    gh.assert_clean()


def episode_label(ep: dict) -> str:
    return f"{ep['status']} {ep['from']}" if ep["from"] == ep["to"] else f"{ep['status']} {ep['from']}–{ep['to']}"


def test_since_column_shows_both_onsets_and_the_summary_tells_the_story(
        tensorboard: str, gh: Page, logdir: tuple[str, dict]) -> None:
    _, facts = logdir
    body = api_json(tensorboard, "health", run="exploding")
    page = open_runs(gh, tensorboard, ["exploding"])
    p = panel(page, "exploding")
    cells = p.locator("tbody tr[data-layer]").evaluate_all("""trs => trs.map(tr => {
        const td = tr.querySelector('td.since');
        const glyphs = td.querySelectorAll('.episode-chain > span').length;
        const text = (id) => {
            const e = td.querySelector(`[data-testid=${id}]`);
            return e ? e.lastChild.textContent : null;
        };
        return [tr.dataset.layer, text('status-since'), text('trouble-since'), td.title, glyphs];
    })""")
    by_layer = {lj["layer"]: lj for lj in body["layers"]}
    for layer, status_since, trouble, title, glyphs in cells:
        lj = by_layer[layer]
        assert lj["status"] not in ("healthy", "inert")  # every layer of this run is flagged
        assert status_since == f"{lj['status']} since {lj['status_since']}", layer
        assert trouble == f"trouble since {lj['first_step']}", layer
        assert title == " → ".join(episode_label(ep) for ep in lj["episodes"]), layer
        assert glyphs == (len(lj["episodes"]) if len(lj["episodes"]) > 1 else 0), layer
    top = by_layer[facts["exploding"].first_nan_layer]
    # gradients grow x2 per step from step 10 and turn NaN at nan_step: the chain starts before the NaN
    assert top["first_step"] < facts["exploding"].nan_step <= top["status_since"]
    assert [ep["status"] for ep in top["episodes"]][-1] == "nonfinite"
    # One answer, cause first: the headline prints it, and it is the table's first row.
    answer = body["summary"]["answer"]
    assert p.locator("[data-testid=headline] .headline-text").inner_text() == answer["headline"]
    top_row = p.locator("tbody tr[data-layer]").first.get_attribute("data-layer")
    assert answer["layer"] == body["layers"][0]["layer"] == top_row
    timeline = [t for t in body["summary"]["timeline"] if t["status"] not in ("inert", "healthy")]
    marks = p.locator("[data-testid=timeline] .status-mark").all_inner_texts()
    assert len(marks) == len(timeline) >= 2
    for mark, entry in zip(marks, timeline, strict=True):
        assert f"{entry['status']} from {entry['step']} — {entry['label']}: {entry['layer']}" in mark
    shot(p, "09_since_and_timeline.png")
    gh.assert_clean()


def test_detail_shades_the_episodes(tensorboard: str, gh: Page, logdir: tuple[str, dict]) -> None:
    _, facts = logdir
    layer = facts["exploding"].first_nan_layer
    episodes = next(lj for lj in api_json(tensorboard, "health", run="exploding")["layers"]
                    if lj["layer"] == layer)["episodes"]
    labels = [episode_label(ep) for ep in episodes]
    page = open_runs(gh, tensorboard, ["exploding"])
    panel(page, "exploding").locator(f'tr[data-layer="{layer}"]').click()
    drawer = page.locator("[data-testid=detail]")
    drawer.locator(".heatmap-canvas").wait_for(timeout=30000)
    marks = drawer.locator("[data-testid=episodes] .status-mark").all_inner_texts()
    assert len(marks) == len(labels)
    for mark, label in zip(marks, labels, strict=True):
        assert label in mark
    magnitude = drawer.locator(".chart").first
    assert magnitude.get_attribute("data-episodes") == str(len(episodes))
    assert magnitude.locator(".legend-episode").all_inner_texts() == labels
    # sweep the chart with the pointer: the read-out names every band, each where its steps are
    seen = magnitude.locator("canvas").evaluate("""c => {
        const r = c.getBoundingClientRect();
        const readout = c.closest('.chart').querySelector('.chart-readout');
        const out = {};
        for (let x = r.left; x < r.right; x += 2) {
            c.dispatchEvent(new MouseEvent('mousemove', { clientX: x, clientY: r.top + r.height / 2, bubbles: true }));
            const step = Number(readout.querySelector('b').textContent.replace('step ', ''));
            const ep = readout.querySelector('.readout-episode');
            out[step] = ep ? ep.textContent.replace('in episode: ', '') : null;
        }
        return out;
    }""")
    for step, label in seen.items():
        want = next((episode_label(ep) for ep in episodes if ep["from"] <= int(step) <= ep["to"]), None)
        assert label == want, step
    assert {lab for lab in seen.values() if lab} == set(labels)
    shot(page, "10_detail_episodes.png")
    gh.assert_clean()


def test_all_nan_layer_shows_its_last_finite_values_not_zeros(tensorboard: str, gh: Page) -> None:
    body = api_json(tensorboard, "health", run=ALL_NAN_RUN)
    lj = next(lj for lj in body["layers"] if lj["layer"] == ALL_NAN_LAYER)
    assert lj["status"] == "nonfinite" and lj["rms"] is None and lj["norm"] is None and lj["max_abs"] is None
    # every element NaN from step 12 on (make_all_nan): its last finite record is step 11's, as the series has it
    last = lj["last_finite"]
    series = api_json(tensorboard, "series", run=ALL_NAN_RUN, layer=ALL_NAN_LAYER)
    at = series["steps"].index(11)
    assert last["step"] == 11
    for key in ("rms", "max_abs", "norm"):
        assert last[key] == pytest.approx(series["fields"][key][at], rel=1e-6), key
    page = open_runs(gh, tensorboard, [ALL_NAN_RUN])
    row = panel(page, ALL_NAN_RUN).locator(f'tr[data-layer="{ALL_NAN_LAYER}"]')
    headers = panel(page, ALL_NAN_RUN).locator("thead th").evaluate_all("ths => ths.map(th => th.dataset.key)")
    cells = row.locator("td")
    for key in ("rms", "max_abs", "norm"):
        cell = cells.nth(headers.index(key))
        assert cell.locator(".last-finite-value").inner_text() == f"{last[key]:.3g}", key
        assert cell.locator(".cell-note").inner_text() == "last finite (step 11)", key
    row.click()
    drawer = page.locator("[data-testid=detail]")
    drawer.locator(".stat-grid").wait_for(timeout=30000)
    grid = drawer.locator(".stat-grid")
    stats = dict(zip(grid.locator("dt").all_inner_texts(), grid.locator("dd").all_inner_texts(), strict=True))
    assert stats["RMS, last finite (step 11)"] == f"{last['rms']:.3g}"
    assert stats["mean"] == "—"  # unknown, never 0: the last finite record is shown for the magnitudes only
    assert stats["NaN count"] == "64" == str(lj["nan"])  # every element of the 64-element kernel
    gh.assert_clean()


def test_depth_profile_draws_the_weakest_layer_as_a_bar(tensorboard: str, gh: Page) -> None:
    steps = api_json(tensorboard, "profile", run="vanishing")["steps"]

    def weakest(step: int) -> dict:
        layers = api_json(tensorboard, "profile", run="vanishing", step=str(step))["layers"]
        return min((lj for lj in layers if lj["rms"]), key=lambda lj: lj["rms"])

    # the hardest step: the weakest RMS just above a power of ten, where a decade-aligned floor leaves a sliver
    k, low = min(enumerate(weakest(s) for s in steps), key=lambda kl: np.log10(kl[1]["rms"]) % 1.0)
    colour = STATUS_RGB[low["status"]]
    page = open_runs(gh, tensorboard, ["vanishing"])
    p = panel(page, "vanishing")
    p.locator(".step-slider").evaluate(f"s => {{ s.value = '{k}'; s.dispatchEvent(new Event('input')); }}")
    canvas = p.locator(f'[data-testid=profile][data-step="{steps[k]}"] canvas.profile-canvas')
    # find the weakest layer's bar as a user would (hover until the read-out names it), then measure it
    height = canvas.evaluate("""async (c, [index, rgb]) => {
        await new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(done)));  // drawn
        const r = c.getBoundingClientRect();
        const readout = c.closest('.chart').querySelector('.chart-readout');
        const xs = [];
        for (let x = r.left; x < r.right; x += 1) {
            c.dispatchEvent(new MouseEvent('mousemove', { clientX: x, clientY: r.top + r.height / 2, bubbles: true }));
            if (readout.textContent.startsWith(`#${index} `)) xs.push(x - r.left);
        }
        c.dispatchEvent(new MouseEvent('mouseleave'));
        const scale = c.width / r.width;
        // rows (bottom up) where the middle half of the bar's columns all have its colour: a solid bar, not a
        // label or a dashed line crossing it, nor the hollow box of a layer with no value
        const x0 = Math.round((xs[0] + (xs[xs.length - 1] - xs[0]) / 4) * scale);
        const wide = Math.max(1, Math.round(((xs[xs.length - 1] - xs[0]) / 2) * scale));
        const d = c.getContext('2d').getImageData(x0, 0, wide, c.height).data;
        // opaque pixels only: the band shading is the same hue at 10% alpha on a transparent canvas
        const near = (i) => d[i + 3] > 240
            && Math.abs(d[i] - rgb[0]) + Math.abs(d[i + 1] - rgb[1]) + Math.abs(d[i + 2] - rgb[2]) < 30;
        let best = 0;
        let run = 0;
        for (let y = c.height - 1; y >= 0; y -= 1) {
            let full = true;
            for (let x = 0; x < wide && full; x += 1) full = near((y * wide + x) * 4);
            run = full ? run + 1 : 0;
            best = Math.max(best, run);
        }
        return best / scale;
    }""", [low["index"], colour])
    # a solid bar at least MIN_BAR_PX (6 px) tall: neither a sliver nor the hollow box of a layer with no value
    assert height >= 6, (height, low)
    shot(p, "11_profile_weakest_bar.png")
    gh.assert_clean()


def test_inert_layer_is_muted_and_not_flagged(tensorboard: str, gh: Page) -> None:
    body = api_json(tensorboard, "health", run=INERT_RUN)
    statuses = {lj["layer"]: lj["status"] for lj in body["layers"]}
    assert statuses[INERT_LAYER] == "inert" and set(statuses.values()) == {"inert", "healthy"}
    page = open_runs(gh, tensorboard, [INERT_RUN])
    p = panel(page, INERT_RUN)
    badge = p.locator(f'tr[data-layer="{INERT_LAYER}"] .badge')
    assert badge.get_attribute("data-status") == "inert" and "inert" in badge.inner_text()
    assert badge.evaluate("b => getComputedStyle(b).backgroundColor") == "rgb({}, {}, {})".format(*STATUS_RGB["inert"])
    summary = p.locator("[data-testid=summary]").inner_text()
    assert "No layer flagged" in summary and "1 inert" in summary.replace("\n", " ")
    assert p.locator("[data-testid=timeline]").count() == 0 and p.locator("[data-testid=headline]").count() == 0
    page.locator('.filter-bar input[data-status="inert"]').check()
    page.wait_for_function(f"""() => document.querySelectorAll('section[data-run="{INERT_RUN}"] tbody tr[data-layer]')
                                .length === 1""")
    assert rows(page, INERT_RUN) == [(INERT_LAYER, "inert")]
    gh.assert_clean()


def test_run_headline_says_where_the_nan_was_made(tensorboard: str, gh: Page) -> None:
    page = open_runs(gh, tensorboard, [ALL_NAN_RUN, INERT_RUN])
    line = panel(page, ALL_NAN_RUN).locator("[data-testid=nan-origin]")
    line.wait_for(timeout=30000)
    text = line.inner_text()
    assert text.startswith(f"NaN/Inf made at step {NAN_ORIGIN.step} in loss_head (Log, forward) — train.py:41")
    assert NAN_ORIGIN.code in text  # shown as text, not markup
    assert panel(page, INERT_RUN).locator("[data-testid=nan-origin]").count() == 0
    shot(panel(page, ALL_NAN_RUN), "15_nan_origin.png")
    # the detail of the layer whose gradient went NaN says where it was made; a healthy layer's does not
    drawer = page.locator("[data-testid=detail]")
    panel(page, ALL_NAN_RUN).locator(f'tr[data-layer="{ALL_NAN_LAYER}"]').click()
    drawer.locator("[data-testid=nan-origin]").wait_for(timeout=30000)
    assert drawer.locator("[data-testid=nan-origin]").inner_text() == text
    page.keyboard.press("Escape")  # close the drawer: it covers the table
    with page.expect_response(lambda r: "/nan_origin?" in r.url):
        panel(page, ALL_NAN_RUN).locator('tr[data-layer="dense_0/kernel"]').click()
    drawer.locator(".stat-grid").wait_for(timeout=30000)
    page.evaluate("() => new Promise((done) => setTimeout(done, 0))")  # the answer's handler has run
    assert drawer.locator("[data-testid=nan-origin]").count() == 0
    gh.assert_clean()
