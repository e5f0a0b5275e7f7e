"""The README's image: the Gradient Health tab over the demo's runs, taken with headless Chromium.

    python demo/demo.py --logdir /tmp/gradhealth-demo --serve --port 6006 &
    python demo/screenshot.py http://localhost:6006 docs/screenshot.png

Opens TensorBoard's page on the tab, waits for the first ranked table and its depth profile, moves the first run's
step slider to logged step ``--step`` (default 38: the demo's exploding run mid-explosion, every layer's bar
growing, before its layers die at 47 and go NaN at 54; ``--step -1`` keeps the step the profile opens at, the last
one where every layer is finite) and saves a 1400 x 1000 screenshot. ``--run NAME`` (e.g. ``vanishing/train``)
instead scrolls to that run's forward profile (each layer's output beside its gradients, where the run recorded
them) and its ranked table, and takes the screenshot there:

    python demo/screenshot.py http://localhost:6006 docs/screenshot-forward.png --run vanishing/train

Uses Debian's chromium (``/usr/bin/chromium``) through playwright.
"""

from __future__ import annotations

import argparse
import time

from playwright.sync_api import sync_playwright


def move_slider(frame: object, step: int) -> None:
    """Move the first run's step slider with the arrow keys until its label shows ``step`` (as a user would)."""
    slider = frame.locator("section.run-panel input[type=range]").first
    label = frame.locator("section.run-panel .step-label").first
    if not slider.count():
        return
    slider.focus()
    for _ in range(int(slider.get_attribute("max") or 0) + 1):
        shown = int(label.inner_text() or step)
        if shown == step:
            return
        slider.press("ArrowLeft" if shown > step else "ArrowRight")
    raise SystemExit(f"screenshot: the first run has no logged step {step}")


def take(url: str, out: str, step: int, chromium: str, run: str | None = None) -> None:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url.rstrip("/") + "/#gradhealth")
        frame = None
        deadline = time.monotonic() + 120
        while frame is None and time.monotonic() < deadline:
            frame = next((f for f in page.frames if f.locator("section.run-panel tr[data-layer]").count()
                          and f.locator("section.run-panel [data-testid=profile] canvas").count()), None)
            time.sleep(0.5)
        if frame is None:
            raise SystemExit("screenshot: the tab drew no table within 120 s")
        if run is not None:
            box = frame.locator(f'section.run-panel[data-run="{run}"] [data-testid=forward-profile]')
            box.wait_for(timeout=60_000)
            box.scroll_into_view_if_needed()
            box.evaluate("e => e.scrollIntoView({block: 'start'})")
        elif step >= 0:
            move_slider(frame, step)
        time.sleep(2)
        page.screenshot(path=out)
        browser.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("url", help="TensorBoard's address, e.g. http://localhost:6006")
    p.add_argument("out", help="the PNG to write")
    p.add_argument("--step", type=int, default=38,
                   help="the logged step to show the first run's depth profile at (default 38; -1: where it opens)")
    p.add_argument("--run", default=None, help="show this run's forward profile and table instead")
    p.add_argument("--chromium", default="/usr/bin/chromium")
    args = p.parse_args()
    take(args.url, args.out, args.step, args.chromium, args.run)


if __name__ == "__main__":
    main()
