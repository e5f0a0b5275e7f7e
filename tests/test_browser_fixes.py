"""What the tab shows beside the gradients, in a real browser against a real TensorBoard: a flagged layer's kind and
activation and what to do about it, and the run's loss trend, for a run whose writer recorded them
(:func:`tb_gradhealth.testing.make_sigmoid_stack`: sigmoid Dense layers, a loss that halves); none of it for a run
written without them. The server, browser and page helpers are :mod:`tests.test_browser`'s."""

from __future__ import annotations

import pytest

from tb_gradhealth import testing
from tests.test_browser import (  # noqa: F401 - fixtures used by name
    Page,
    api_json,
    browser,
    gh,
    open_plugin,
    painted_pixels,
    panel,
    select_runs,
    shot,
    tensorboard,
)

RUN = "sigmoid_stack"


@pytest.fixture(scope="module")
def logdir(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """Served by :func:`tests.test_browser.tensorboard` (which asks for a ``logdir`` by name)."""
    root = tmp_path_factory.mktemp("gh_browser_fixes")
    facts, _ = testing.make_sigmoid_stack(str(root), RUN)
    return str(root), {RUN: facts, "vanishing": testing.make_vanishing(str(root))}


@pytest.mark.browser
@pytest.mark.e2e
def test_a_flagged_layer_shows_its_kind_and_fixes_and_the_run_its_loss_trend(
        tensorboard: str, gh: Page, logdir: tuple[str, dict]) -> None:  # noqa: F811 - the imported fixtures
    _, facts = logdir
    layer = facts[RUN].vanishing[0]
    body = api_json(tensorboard, "health", run=RUN)
    served = next(lj for lj in body["layers"] if lj["layer"] == layer)
    assert served["status"] == "vanishing" and "sigmoid" in served["fixes"][0]
    page = open_plugin(gh, tensorboard)
    select_runs(page, [RUN, "vanishing"])
    p = panel(page, RUN)
    row = p.locator(f'tr[data-layer="{layer}"]')
    assert row.locator(".layer-kind-tag").inner_text() == "Dense, activation sigmoid"
    healthy = p.locator(f'tr[data-layer="{facts[RUN].healthy[0]}"]')
    assert healthy.locator(".layer-kind-tag").count() == 0  # the tag marks flagged layers only
    trend = p.locator("[data-testid=loss-trend]")
    text = trend.inner_text()
    assert text.startswith("Loss -") and "falling" in text and f"steps 0–{facts[RUN].steps[-1]}" in text
    assert painted_pixels(trend.locator("canvas")) > 20
    row.click()
    drawer = page.locator("[data-testid=detail]")
    drawer.locator("[data-testid=layer-kind]").wait_for(timeout=30000)
    assert drawer.locator("[data-testid=layer-kind]").inner_text() == "Layer: Dense, activation sigmoid"
    assert drawer.locator("[data-testid=fixes] li").all_inner_texts() == served["fixes"]
    shot(page, "20_layer_kind_and_fixes.png")
    page.keyboard.press("Escape")
    # the same gradients written without the evidence: no kind, no loss line
    plain = panel(page, "vanishing")
    assert plain.locator(".layer-kind-tag").count() == 0 and plain.locator("[data-testid=loss-trend]").count() == 0
    plain.locator(f'tr[data-layer="{facts["vanishing"].vanishing[0]}"]').click()
    drawer.locator("[data-testid=fixes]").wait_for(timeout=30000)
    assert drawer.locator("[data-testid=layer-kind]").count() == 0
    gh.assert_clean()
