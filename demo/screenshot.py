"""The README's image: the Gradient Health tab over the demo's runs, taken with headless Chromium.

    python demo/demo.py --logdir /tmp/gradhealth-demo --serve --port 6006 &
    python demo/screenshot.py http://localhost:6006 docs/screenshot.png

Opens TensorBoard's page on the tab, waits for the first ranked table and its run's headline, optionally moves the
first run's step slider ``--back`` logged steps back from the step its depth profile opens at (the last step where
every layer is finite, so the exploding run shows its last readable step by default) and saves a 1400 x 1000
screenshot. Uses Debian's chromium (``/usr/bin/chromium``) through playwright.
"""

from __future__ import annotations

import argparse
import time

from playwright.sync_api import sync_playwright


def take(url: str, out: str, back: int, chromium: str) -> None:
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
        slider = frame.locator("section.run-panel input[type=range]").first
        if back and slider.count():
            slider.focus()
            for _ in range(back):
                slider.press("ArrowLeft")
        time.sleep(2)
        page.screenshot(path=out)
        browser.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("url", help="TensorBoard's address, e.g. http://localhost:6006")
    p.add_argument("out", help="the PNG to write")
    p.add_argument("--back", type=int, default=0,
                   help="steps to move the first run's slider back from where its profile opens (default 0)")
    p.add_argument("--chromium", default="/usr/bin/chromium")
    args = p.parse_args()
    take(args.url, args.out, args.back, args.chromium)


if __name__ == "__main__":
    main()
