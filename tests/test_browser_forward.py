"""The tab's forward depth profile, in a real browser against a real TensorBoard: for a run whose writer recorded
the layers' outputs, each output's RMS through depth at the diagnosed step with its dead fraction, the dead layer's
output marked; none for the same network written without its outputs. The run is a numpy MLP trained by hand
(:mod:`tests.mlp_numpy`) with 22 of dense_2's 32 units dead by a bias shift, measured on its outputs. The server,
browser and page helpers are :mod:`tests.test_browser`'s."""

from __future__ import annotations

import numpy as np
import pytest

from tests import test_browser
from tests.mlp_numpy import train
from tests.test_browser import (  # noqa: F401 - fixtures used by name
    Page,
    api_json,
    browser,
    gh,
    open_plugin,
    panel,
    select_runs,
    shot,
    tensorboard,
)

RUN, PLAIN = "dead_units", "dead_units_plain"
NET = {"widths": [16, 32, 32, 32], "act": "relu", "shift": {2: (22, -100.0)}, "steps": 12}


@pytest.fixture(scope="module")
def logdir(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """Served by :func:`tests.test_browser.tensorboard` (which asks for a ``logdir`` by name)."""
    root = tmp_path_factory.mktemp("gh_browser_forward")
    run = train(str(root / RUN), **NET)
    train(str(root / PLAIN), record_outputs=False, **NET)
    return str(root), {RUN: run, PLAIN: None}


@pytest.mark.browser
@pytest.mark.e2e
def test_the_forward_depth_profile_shows_each_outputs_rms_and_dead_units(
        tensorboard: str, gh: Page, logdir: tuple[str, dict]) -> None:  # noqa: F811 - the imported fixtures
    _, facts = logdir
    last = facts[RUN].outputs[-1]
    dead = float(np.mean(~np.any(last["dense_2"].astype(np.float32) != 0, axis=0)))
    body = api_json(tensorboard, "health", run=RUN)
    assert [o["output"] for o in body["forward_profile"]["outputs"]] == list(last)
    page = open_plugin(gh, tensorboard)
    select_runs(page, [RUN, PLAIN])
    p = panel(page, RUN)
    box = p.locator("[data-testid=forward-profile]")
    box.wait_for(timeout=30000)
    assert f"at step {NET['steps'] - 1}" in box.locator("summary").inner_text()
    rows = box.locator("tr.forward-row")
    assert [rows.nth(k).get_attribute("data-output") for k in range(rows.count())] == list(last)
    row = box.locator('tr[data-output="dense_2"]')
    assert row.locator(".forward-fractions").inner_text() == f"{round(dead * 100)}% dead"
    assert "forward-flagged" in row.get_attribute("class")  # the dead layer's output
    assert "forward-flagged" not in box.locator('tr[data-output="dense_1"]').get_attribute("class")
    widths = [rows.nth(k).locator(".forward-bar").bounding_box()["width"] for k in range(rows.count())]
    rms = [float(np.sqrt(np.mean(last[n].astype(np.float32).astype(np.float64) ** 2))) for n in last]
    assert np.argsort(widths).tolist() == np.argsort(rms).tolist()  # the bars order the outputs as their RMS
    shot(page, "30_forward_depth_profile.png")
    plain = panel(page, PLAIN)
    plain.locator("tr[data-layer]").first.wait_for(timeout=30000)
    assert plain.locator("[data-testid=forward-profile]").count() == 0
    gh.assert_clean()


@pytest.mark.browser
@pytest.mark.e2e
def test_the_layer_drawer_draws_its_outputs_history(tensorboard: str, gh: Page,  # noqa: F811
                                                    logdir: tuple[str, dict]) -> None:
    """A variable's drawer charts the output that shows its units over the logged steps (RMS and the dead units
    fraction, here about 22 of 32 after the bias shift); a run written without outputs has no such chart."""
    page = open_plugin(gh, tensorboard)
    select_runs(page, [RUN, PLAIN])
    for run, expected in ((RUN, True), (PLAIN, False)):
        panel(page, run).locator('tr[data-layer="dense_2/kernel"]').click()
        drawer = page.locator("[data-testid=detail]")
        drawer.locator(".heatmap-canvas").wait_for(timeout=30000)
        titles = drawer.locator(".chart-title").all_inner_texts()
        charts = [k for k, t in enumerate(titles) if t.startswith("Layer output")]
        assert (titles[charts[0]] if charts else None) == ("Layer output dense_2 (relu) (log scale)" if expected
                                                           else None), titles
        if expected:
            chart = drawer.locator(".chart", has_text="Layer output")
            assert test_browser.painted_pixels(chart.locator("canvas")) > 300
            assert "dead unit fraction" in chart.inner_text()
            shot(page, "31_layer_drawer_outputs.png")
        drawer.locator(".drawer-close").click()
    gh.assert_clean()
