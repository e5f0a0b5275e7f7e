"""One answer in every view, on the demo's own runs, in a real browser against a real TensorBoard.

``demo/demo.py --runs exploding,vanishing`` trains the demo's exploding tanh stack and vanishing sigmoid MLP once per
module (in a subprocess: TensorFlow stays out of this process, and TensorBoard runs without it as in
:mod:`tests.test_browser`, whose server, browser and page helpers these are). Every view must name the layer the
diagnosis answered (``summary.answer``): the headline, the timeline's first entry, the table's rank 1 and the layer
drawer; a layer whose gradient went NaN shows its last finite values; counts print exactly; the depth profile opens
at the last step where every layer is finite, with its vanishing line below its exploding line; and the NaN origin
the demo's exploding run records is named in full. A small written run (:data:`RECOVERED`) adds an episode that
ended before the cause's chain began, listed apart as earlier. Expected texts come from the JSON routes, the runs'
construction and Python's own number formatting (``f"{x:.3g}"``, ``f"{n:,}"``), never from the page's code.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tb_gradhealth import numbers
from tests.test_browser import (  # noqa: F401 - fixtures used by name
    REPO,
    Page,
    _four_layer_run,
    api_json,
    browser,
    gh,
    open_runs,
    panel,
    shot,
    tensorboard,
)

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.tf, pytest.mark.slow]

EXPLODING = "exploding"
#: A run whose first kernel is dead (all-zero gradient) at steps 2-9, then recovers, before its second kernel's
#: gradient grows x4 a step from step 14: an earlier, recovered episode before the cause's chain.
RECOVERED = "recovered"
DEAD_STEPS = (2, 9)
VANISHING = "vanishing/train"  # the Keras callback writes where keras.callbacks.TensorBoard writes: <run>/train
DEMO_TIMEOUT_S = 600
#: RGB of the band lines of frontend/charts/bars.js (Okabe-Ito blue and vermillion)
LINE_RGB = {"vanishing": (0, 114, 178), "exploding": (213, 94, 0)}

if importlib.util.find_spec("tensorflow") is None:
    pytest.skip("the demo's runs are trained with TensorFlow, which is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def logdir(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """The demo's exploding and vanishing runs, served by :func:`tests.test_browser.tensorboard`."""
    root = tmp_path_factory.mktemp("gh_browser_demo")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(REPO / "demo" / "demo.py"), "--logdir", str(root), "--runs",
                           "exploding,vanishing"], capture_output=True, text=True, timeout=DEMO_TIMEOUT_S, env=env,
                          cwd=str(REPO))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    _four_layer_run(str(root), RECOVERED, recovered_scale, steps=24)
    return str(root), {EXPLODING: None, VANISHING: None, RECOVERED: None}


def recovered_scale(step: int, layer: str) -> float:
    """The gradient scale of :data:`RECOVERED` at ``(step, layer)``."""
    if layer == "dense_0/kernel" and DEAD_STEPS[0] <= step <= DEAD_STEPS[1]:
        return 0.0
    if layer == "dense_1/kernel" and step >= 14:
        return 1e-3 * 4.0 ** (step - 13)
    return 1e-3


def answer_of(base: str, run: str) -> tuple[dict, dict]:
    """(the run's health JSON, its answer); the demo's runs are sick, so there is an answer."""
    body = api_json(base, "health", run=run)
    answer = body["summary"].get("answer")
    assert answer, (run, body["summary"])
    return body, answer


def drawer_cause(page: object, run: str, layer: str) -> str:
    """Open ``layer``'s drawer and return the layer its cause line names."""
    drawer = page.locator("[data-testid=detail]")
    page.keyboard.press("Escape")  # an open drawer covers the table
    panel(page, run).locator(f'tr[data-layer="{layer}"]').click()
    drawer.locator(f'.detail-layer:text-is("{layer}")').wait_for(timeout=30000)
    return drawer.locator("[data-testid=drawer-cause]").get_attribute("data-layer")


def test_every_view_names_the_answers_layer(tensorboard: str, gh: Page) -> None:  # noqa: F811 - the imported fixtures
    page = open_runs(gh, tensorboard, [EXPLODING, VANISHING])
    for run in (EXPLODING, VANISHING):
        body, answer = answer_of(tensorboard, run)
        p = panel(page, run)
        head = p.locator("[data-testid=headline]")
        assert head.locator(".headline-text").inner_text() == answer["headline"]
        assert head.inner_text().startswith(f"First to go wrong: {answer['headline']}")
        assert answer["fixes"][0] in p.locator("[data-testid=cause-fix]").inner_text()
        marks = p.locator("[data-testid=timeline] .status-mark")
        first = marks.first
        assert "first to go wrong" in first.inner_text()
        assert f"{answer['status']} from {answer['step']}" in first.inner_text()
        top = p.locator("tbody tr[data-layer]").first
        assert top.locator("td.rank").inner_text() == "1"
        tags = p.locator("[data-testid=cause-tag]")
        assert tags.count() == 1 and tags.is_visible()  # the rank 1 row is marked as the cause, visibly
        assert top.locator("[data-testid=cause-tag]").inner_text() == "cause"
        key = p.locator("[data-testid=table-key]")
        assert key.is_visible() and key.inner_text().startswith("Ranked: cause first, then severity")
        # the headline's onset is the rank 1 row's "trouble since"
        assert top.locator("[data-testid=trouble-since]").inner_text().endswith(f"trouble since {answer['step']}")
        compare = page.locator(f'[data-testid=compare] tr[data-run="{run}"] .compare-answer')
        other = body["layers"][-1]["layer"]  # the drawer of another layer names the same cause
        named = {
            "answer": answer["layer"],
            "headline": head.get_attribute("data-layer"),
            "timeline": first.get_attribute("data-layer"),
            "table rank 1": top.get_attribute("data-layer"),
            "compare strip": compare.get_attribute("data-layer"),
            "drawer": drawer_cause(page, run, other),
        }
        assert len(set(named.values())) == 1, (run, named)
        drawer = page.locator("[data-testid=detail]")
        assert drawer.locator("[data-testid=drawer-cause]").inner_text().endswith(answer["headline"])
        drawer.locator("[data-testid=drawer-cause] .cause-link").click()  # the cause's name opens the cause
        drawer.locator(f'.detail-layer:text-is("{answer["layer"]}")').wait_for(timeout=30000)
        assert drawer.locator("[data-testid=drawer-cause]").inner_text() == (
            f"This layer is the run's cause, first to go wrong: {answer['headline']}")
        page.keyboard.press("Escape")
        # every later timeline entry is true of the layer it names: that layer had an episode of it starting there
        episodes = {lj["layer"]: lj["episodes"] for lj in body["layers"]}
        for i in range(1, marks.count()):
            mark = marks.nth(i)
            status, layer = mark.get_attribute("data-status"), mark.get_attribute("data-layer")
            step = int(mark.get_attribute("data-step"))
            assert f"first layer to reach {status}" in mark.inner_text(), mark.inner_text()
            assert step >= answer["step"]
            assert any(ep["status"] == status and ep["from"] == step for ep in episodes[layer]), (status, layer, step)
    shot(page, "30_one_answer_everywhere.png", full_page=True)
    gh.assert_clean()


def test_nan_layers_show_since_and_their_last_finite_values(tensorboard: str, gh: Page) -> None:  # noqa: F811 - the imported fixtures
    body, _ = answer_of(tensorboard, EXPLODING)
    nan_layers = [lj for lj in body["layers"] if lj["rms"] is None and lj["nan"] + lj["inf"] > 0]
    assert nan_layers  # the demo's exploding run ends in NaN
    page = open_runs(gh, tensorboard, [EXPLODING])
    p = panel(page, EXPLODING)
    # the loss ran away to NaN: the loss line says from which step, with the last finite value the loss route holds
    blowup = body["summary"]["loss_nonfinite"]
    loss = body["loss"]
    finite = [(s, v) for s, v in zip(loss["steps"], loss["values"], strict=True) if v is not None]
    assert blowup["last_finite_step"] == finite[-1][0] and blowup["step"] > finite[-1][0]
    assert p.locator("[data-testid=loss-trend] .loss-text").inner_text().startswith(
        f"Loss NaN/Inf from step {blowup['step']} (last finite {finite[-1][1]:.3g} at step {finite[-1][0]}")
    keys = p.locator("thead th").evaluate_all("ths => ths.map(th => th.dataset.key)")
    for lj in body["layers"]:
        row = p.locator(f'tr[data-layer="{lj["layer"]}"]')
        if lj["status"] not in ("healthy", "inert"):
            since = row.locator("[data-testid=status-since]").inner_text()
            assert since == f"{lj['status']} since {lj['status_since']}", lj["layer"]
            trouble = row.locator("[data-testid=trouble-since]").inner_text()
            assert trouble.endswith(f"trouble since {lj['first_step']}"), lj["layer"]
    lj = nan_layers[0]
    last = lj["last_finite"]
    assert last and last["step"] < lj["status_since"]
    # the last finite record, read independently from the series route: all finite there, NaN/Inf at every later step
    series = api_json(tensorboard, "series", run=EXPLODING, layer=lj["layer"])
    steps, f = series["steps"], series["fields"]
    at = steps.index(last["step"])
    assert f["nan"][at] + f["inf"][at] == 0 and all(f["nan"][i] + f["inf"][i] > 0 for i in range(at + 1, len(steps)))
    assert f["rms"][at] == pytest.approx(last["rms"], rel=1e-6)
    row = p.locator(f'tr[data-layer="{lj["layer"]}"]')
    cells = row.locator(":scope > td")
    for key in ("rms", "max_abs", "norm"):
        cell = cells.nth(keys.index(key))
        assert cell.locator(".last-finite-value").inner_text() == f"{last[key]:.3g}", key
        assert cell.locator(".cell-note").inner_text() == f"last finite (step {last['step']})", key
    row.click()
    drawer = page.locator("[data-testid=detail]")
    drawer.locator("[data-testid=stats]").wait_for(timeout=30000)
    stats = drawer.locator("[data-testid=stats]")
    value = {k: stats.locator(f'dd[data-key="{k}"]').inner_text() for k in ("rms", "nan", "severity", "status_since")}
    labels = dict(zip(stats.locator("dd").evaluate_all("ds => ds.map(d => d.dataset.key)"),
                      stats.locator("dt").all_inner_texts(), strict=True))
    assert value["rms"] == f"{last['rms']:.3g}" and labels["rms"] == f"RMS, last finite (step {last['step']})"
    assert value["nan"] == f"{lj['nan']:,}" and lj["nan"] >= 1000  # exact, grouped: 1,024, never 1020
    assert value["nan"] in row.locator("td.reasons").inner_text()  # the row's reason counts the same elements
    assert value["severity"] == f"{round(lj['severity']):,}"
    assert labels["status_since"] == f"{lj['status']} since (step)" and value["status_since"] == str(lj["status_since"])
    assert drawer.locator("[data-testid=drawer-since]").inner_text() == (
        f"{lj['status']} since {lj['status_since']} · trouble since {lj['first_step']}")
    shot(page, "31_nan_layer_last_finite.png")
    gh.assert_clean()


def _line_pixels(canvas: object, y_css: float, rgb: tuple[int, int, int]) -> int:
    """Opaque pixels of colour ``rgb`` on the canvas row at ``y_css`` (CSS pixels; ±1 device row)."""
    return canvas.evaluate("""(c, [y, rgb]) => {
        const scale = c.width / c.getBoundingClientRect().width;
        let n = 0;
        for (const row of [-1, 0, 1].map((d) => Math.round(y * scale) + d)) {
            const d = c.getContext('2d').getImageData(0, row, c.width, 1).data;
            for (let i = 0; i < d.length; i += 4) {
                const off = Math.abs(d[i] - rgb[0]) + Math.abs(d[i + 1] - rgb[1]) + Math.abs(d[i + 2] - rgb[2]);
                if (d[i + 3] > 200 && off < 60) n++;
            }
        }
        return n;
    }""", [y_css, list(rgb)])


def test_depth_profile_opens_where_every_layer_is_finite_with_bands_in_order(tensorboard: str, gh: Page) -> None:  # noqa: F811 - the imported fixtures
    page = open_runs(gh, tensorboard, [EXPLODING, VANISHING])
    for run in (EXPLODING, VANISHING):
        served = api_json(tensorboard, "profile", run=run)
        finite = [lj for lj in served["layers"] if lj["rms"] is not None]
        assert len(finite) == len(served["layers"]), (run, served["step"])  # every bar drawn
        later = [s for s in served["steps"] if s > served["step"]]
        for s in later:  # and it is the last such step
            layers = api_json(tensorboard, "profile", run=run, step=str(s))["layers"]
            assert any(lj["rms"] is None for lj in layers), (run, s)
        prof = panel(page, run).locator(f'[data-testid=profile][data-step="{served["step"]}"]')
        chart = prof.locator(".chart")
        chart.wait_for(timeout=30000)
        page.wait_for_function("c => c.dataset.vanishingY && c.dataset.explodingY", arg=chart.element_handle())
        ys = {k: float(chart.get_attribute(f"data-{k}-y")) for k in ("vanishing", "exploding")}
        bands = served["bands"]
        assert bands["vanishing_below"] < bands["exploding_above"], (run, bands)
        # on screen y grows downwards: the vanishing line is below the exploding line
        assert ys["vanishing"] > ys["exploding"], (run, ys)
        canvas = chart.locator("canvas")
        for name, rgb in LINE_RGB.items():  # each line is drawn where the chart says it is
            assert _line_pixels(canvas, ys[name], rgb) > 60, (run, name, ys[name])
        if run == EXPLODING:
            shot(panel(page, run), "32_profile_bands_in_order.png")
    gh.assert_clean()


def test_nan_origin_names_op_layer_direction_and_source_line(tensorboard: str, gh: Page) -> None:  # noqa: F811 - the imported fixtures
    body = api_json(tensorboard, "nan_origin", run=EXPLODING)
    origin = body.get("origin")
    assert origin and origin["found"], body
    page = open_runs(gh, tensorboard, [EXPLODING])
    line = panel(page, EXPLODING).locator("[data-testid=nan-origin]")
    line.wait_for(timeout=30000)
    text = line.inner_text()
    # the demo's NaN is made by the loss (float32 overflow of the squared error), which belongs to no layer
    where = origin["layer"] or "code outside any layer"
    assert text.startswith(f"NaN/Inf made at step {origin['step']} in {where} ({origin['op']}, {origin['direction']}")
    assert f"{os.path.basename(origin['file'])}:{origin['line']}" in text
    if origin.get("code"):
        assert origin["code"].strip() in text
    gh.assert_clean()


def test_numbers_print_as_the_report_prints_them(tensorboard: str, gh: Page) -> None:  # noqa: F811 - the imported fixtures
    """The page's formatter against Python's own formatting, the rules `tb-gradhealth report` prints with."""
    page = open_runs(gh, tensorboard, [VANISHING])
    magnitudes = [1.2345e-5, 0.000123, 0.00099996, 0.0118, 0.1, 1.0, 3.14159, 100.0, 999.6, 1234.5, 6.02e23,
                  -3.5e-7, 4.381807995001066e22, 2.5e-308, 5e-324]
    counts = [0, 7, 999, 1000, 1020, 1024, 1234567, 2**40]
    severities = [0.0, 4449.22061630586, 6050.5, 6051.5, 6052.0, 12345.678]
    printed = page.evaluate("""async ([m, c, s]) => {
        const f = await import('/data/plugin/gradhealth/format.js');
        return [m.map((x) => f.magnitude(x)), c.map((x) => f.count(x)), s.map((x) => f.severity(x)),
                [f.magnitude(null), f.count(null), f.severity(NaN)]];
    }""", [magnitudes, counts, severities])
    assert printed[0] == [f"{x:.3g}" for x in magnitudes] == [numbers.format_magnitude(x) for x in magnitudes]
    assert printed[1] == [f"{n:,}" for n in counts] == [numbers.format_count(n) for n in counts]
    assert printed[2] == [f"{round(x):,}" for x in severities] == [numbers.format_severity(x) for x in severities]
    assert printed[3] == ["—", "—", "—"]
    changes = [0.38, -0.62, 0.0001, -0.0001, 9.0, 11.0, 7.0535602186242e19, -0.9988, -0.999999, 0.0]
    ratios = [1.03, 2.414, 0.51, 12.3, 341.0, 9999.0, 7.0535602186242e19, 1.2e-5, 0.0012]
    shown = page.evaluate("""async ([c, r]) => {
        const f = await import('/data/plugin/gradhealth/format.js');
        return [c.map((x) => f.change(x)), r.map((x) => f.ratio(x))];
    }""", [changes, ratios])
    assert shown[0] == [numbers.format_change(x) for x in changes]
    assert shown[1] == [numbers.format_ratio(x) for x in ratios]
    gh.assert_clean()


def test_an_earlier_recovered_episode_is_listed_apart_from_the_answer(tensorboard: str, gh: Page) -> None:  # noqa: F811
    body, answer = answer_of(tensorboard, RECOVERED)
    assert answer["layer"] == "dense_1/kernel" and answer["status"] == "exploding"  # the growing kernel
    page = open_runs(gh, tensorboard, [RECOVERED])
    p = panel(page, RECOVERED)
    marks = p.locator("[data-testid=timeline] .status-mark")
    assert marks.count() == 1 and marks.first.get_attribute("data-layer") == answer["layer"]
    earlier = p.locator("[data-testid=earlier] .status-mark")
    assert earlier.count() == 1
    assert earlier.first.inner_text().endswith(f"dead from {DEAD_STEPS[0]} — earlier, recovered: dense_0/kernel")
    assert p.locator("tbody tr[data-layer]").first.get_attribute("data-layer") == answer["layer"]
    dead = p.locator('tr[data-layer="dense_0/kernel"]')
    assert dead.locator(".badge").get_attribute("data-status") == "healthy"
    assert dead.locator("td.since").inner_text() == "—"  # healthy now: no onset, its past episode on hover
    assert dead.locator("td.since").get_attribute("title") == f"dead {DEAD_STEPS[0]}–{DEAD_STEPS[1]}"
    gh.assert_clean()
