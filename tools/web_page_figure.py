"""Draw docs/figures/web-page.png: the web page of `aiayn serve` in headless Chromium, with the
demo model's translation of one sentence and its attention, one output row hovered.

    .venv/bin/python tools/web_page_figure.py -m demo_run/run/model -o docs/figures/web-page.png

`make docs` runs it. It needs Chromium and chromedriver (`make browser-deps` on Debian); where
they are missing it says so and leaves the figure as it is.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

SENTENCE = "four thousand, three hundred and twenty-one"
WINDOW = (1200, 900)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", required=True, help="model directory to serve")
    parser.add_argument("-o", "--output", required=True, help="PNG to write")
    parser.add_argument("--sentence", default=SENTENCE, help="what to translate")
    parser.add_argument("--hover", default="einund", help="output piece whose row to hover")
    args = parser.parse_args(argv)

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    chromedriver = shutil.which("chromedriver")
    if chromium is None or chromedriver is None:
        print(
            f"{args.output} not redrawn: it needs Chromium and chromedriver "
            "(make browser-deps on Debian)",
            file=sys.stderr,
        )
        return 0

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from aiayn.decode.translator import Translator
    from aiayn.serve import ServerSettings, create_app, serve_in_background

    app = create_app(Translator(args.model), ServerSettings())
    with serve_in_background(app) as url, tempfile.TemporaryDirectory() as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = chromium
        for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"):
            options.add_argument(flag)
        options.add_argument(f"--window-size={WINDOW[0]},{WINDOW[1]}")
        options.add_argument(f"--user-data-dir={profile}")
        driver = webdriver.Chrome(service=Service(executable_path=chromedriver), options=options)
        try:
            driver.get(url + "/")
            wait = WebDriverWait(driver, 60, poll_frequency=0.05)
            wait.until(lambda d: d.find_element(By.ID, "model-info").text)
            box = driver.find_element(By.ID, "source")
            box.clear()
            box.send_keys(args.sentence)
            driver.find_element(By.ID, "translate").click()
            wait.until(lambda d: "sentence" in d.find_element(By.ID, "status").text)
            rows = driver.find_elements(By.CSS_SELECTOR, "#heatmap tbody tr")
            labels = [r.find_element(By.CSS_SELECTOR, "th.tgt").text.strip("▁_ ") for r in rows]
            if args.hover not in labels:
                print(f"no output piece {args.hover!r} to hover; pieces: {labels}", file=sys.stderr)
                return 1
            ActionChains(driver).move_to_element(rows[labels.index(args.hover)]).perform()
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(args.output)
        finally:
            driver.quit()
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
