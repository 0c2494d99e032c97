"""The web page of `aiayn serve` in a real browser: headless Chromium, driven by Selenium
through Debian's chromedriver, against a live server on 127.0.0.1.

It types sentences, clicks Translate, and checks what a user sees against what the JSON API
answers for the same request: the translation, and an attention heatmap with one row per output
token and one column per source token, labelled with their pieces; that the layer and head
controls redraw it; that hovering a row marks the source token it attends to most; and that
errors are shown. Skipped, saying why, where Chromium or its driver is not installed
(`make browser-deps` installs them on Debian).
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from aiayn.decode.translator import Translator
from aiayn.serve import Decoding, ServerSettings, create_app, serve_in_background
from model_dirs import EN_DE, tiny_model_dir

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip(
        "the browser test needs Chromium and chromedriver (Debian: apt-get install chromium "
        "chromium-driver, or `make browser-deps`)",
        allow_module_level=True,
    )
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

CORPUS = [
    "the cat sat on the mat",
    "a dog barked at the moon",
    "die katze sass auf der matte",
    "ein hund bellte den mond an",
]
SETTINGS = ServerSettings(decoding=Decoding(beam_size=2, max_len_a=0.0, max_len_b=5))
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1000",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory = tmp_path_factory.mktemp("browser")
    model_dir = tiny_model_dir(directory, CORPUS, max_positions=32, metadata=EN_DE)
    with serve_in_background(create_app(Translator(model_dir), SETTINGS)) as url:
        yield url


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver path: Selenium Manager, which would download drivers, never runs.
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def api(url: str, texts: list[str]) -> list[dict[str, Any]]:
    """What the JSON API answers for the request the page makes."""
    body = {
        "texts": texts,
        "beam_size": 2,
        "n_best": 1,
        "return_attention": True,
        "full_attention": True,
    }
    request = urllib.request.Request(
        url + "/translate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["translations"]


def wait(driver: Any, condition: Any, timeout: float = 60) -> Any:
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(condition)


def text_of(element: Any) -> str:
    return element.get_attribute("textContent")


def translate_on_page(driver: Any, url: str, source: str) -> None:
    driver.get(url + "/")
    wait(driver, lambda d: "English → German" in d.find_element(By.ID, "model-info").text)
    box = driver.find_element(By.ID, "source")
    box.clear()
    box.send_keys(source)
    driver.find_element(By.ID, "translate").click()
    wait(driver, lambda d: "sentence" in d.find_element(By.ID, "status").text)


def heatmap(driver: Any) -> tuple[list[str], list[str], list[Any]]:
    """(column labels, row labels, rows) of the drawn heatmap."""
    table = driver.find_element(By.CSS_SELECTOR, "#heatmap table")
    columns = [text_of(th) for th in table.find_elements(By.CSS_SELECTOR, "thead th.src")]
    rows = table.find_elements(By.CSS_SELECTOR, "tbody tr")
    labels = [text_of(row.find_element(By.CSS_SELECTOR, "th.tgt")) for row in rows]
    return columns, labels, rows


def cell_weights(rows: list[Any]) -> list[list[float]]:
    """The weight each cell shows in its tooltip ('piece → piece: 0.123')."""
    weights = []
    for row in rows:
        titles = [td.get_attribute("title") for td in row.find_elements(By.TAG_NAME, "td")]
        weights.append([float(title.rsplit(": ", 1)[1]) for title in titles])
    return weights


def mean_over_heads(cross: list, layer: int) -> torch.Tensor:
    return torch.tensor(cross[layer], dtype=torch.float64).mean(dim=0)  # (T, S)


def test_translation_and_heatmap_match_the_api(browser: Any, server: str) -> None:
    sentence = "the cat sat on the mat"
    translate_on_page(browser, server, sentence)
    [expected] = api(server, [sentence])
    shown = browser.find_elements(By.CSS_SELECTOR, "#translations > li .text")
    assert [text_of(s) for s in shown] == [expected["text"] or "(empty)"]

    columns, labels, rows = heatmap(browser)
    attention = expected["attention"]
    assert columns == attention["src_tokens"]
    assert labels == attention["tgt_tokens"]
    assert len(rows) == len(attention["tgt_tokens"]) > 1
    assert all(len(row.find_elements(By.TAG_NAME, "td")) == len(columns) for row in rows)
    last = len(attention["cross"]) - 1  # default view: last layer, mean over heads
    drawn = torch.tensor(cell_weights(rows), dtype=torch.float64)
    torch.testing.assert_close(drawn, mean_over_heads(attention["cross"], last), atol=6e-4, rtol=0)
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == []


def test_layer_and_head_controls_redraw_the_map(browser: Any, server: str) -> None:
    sentence = "a dog barked at the moon"
    translate_on_page(browser, server, sentence)
    [expected] = api(server, [sentence])
    cross = expected["attention"]["cross"]  # (L, H, T, S)
    layer_choices = Select(browser.find_element(By.ID, "layer")).options
    head_choices = Select(browser.find_element(By.ID, "head")).options
    assert len(layer_choices) == len(cross)
    assert len(head_choices) == len(cross[0]) + 1  # the mean, then each head

    Select(browser.find_element(By.ID, "layer")).select_by_value("0")
    Select(browser.find_element(By.ID, "head")).select_by_value("1")
    _, labels, rows = heatmap(browser)
    assert len(labels) == len(expected["attention"]["tgt_tokens"])
    drawn = torch.tensor(cell_weights(rows), dtype=torch.float64)
    head = torch.tensor(cross[0][1], dtype=torch.float64)
    torch.testing.assert_close(drawn, head, atol=6e-4, rtol=0)


def test_hovering_a_row_marks_its_most_attended_source_token(browser: Any, server: str) -> None:
    sentence = "the cat sat on the mat"
    translate_on_page(browser, server, sentence)
    [expected] = api(server, [sentence])
    weights = mean_over_heads(expected["attention"]["cross"], -1)
    _, _, rows = heatmap(browser)
    for t in (0, len(rows) - 1):
        label = rows[t].find_element(By.CSS_SELECTOR, "th.tgt")
        ActionChains(browser).move_to_element(label).perform()
        wait(browser, lambda d, t=t: "active" in heatmap(d)[2][t].get_attribute("class"))
        columns = browser.find_elements(By.CSS_SELECTOR, "#heatmap thead th.src")
        marked = [s for s, th in enumerate(columns) if "aligned" in th.get_attribute("class")]
        assert marked == [int(weights[t].argmax())]
        active = browser.find_elements(By.CSS_SELECTOR, "#heatmap tbody tr.active")
        assert len(active) == 1


def test_several_lines_give_several_translations_and_a_map_each(browser: Any, server: str) -> None:
    lines = ["the cat sat", "a dog barked at the moon all night long"]
    translate_on_page(browser, server, "\n".join(lines))
    expected = api(server, lines)
    shown = browser.find_elements(By.CSS_SELECTOR, "#translations > li .text")
    assert [text_of(s) for s in shown] == [e["text"] or "(empty)" for e in expected]
    browser.find_elements(By.CSS_SELECTOR, "#translations > li")[1].click()
    columns, labels, _ = heatmap(browser)
    assert columns == expected[1]["attention"]["src_tokens"]
    assert labels == expected[1]["attention"]["tgt_tokens"]


def test_errors_are_shown_on_the_page(browser: Any, server: str) -> None:
    browser.get(server + "/")
    browser.find_element(By.ID, "translate").click()
    status = browser.find_element(By.ID, "status")
    assert status.text == "Type a sentence first." and "error" in status.get_attribute("class")
    browser.find_element(By.ID, "source").send_keys("the cat")
    browser.find_element(By.ID, "translate").click()
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#translations > li"))
    assert browser.find_element(By.ID, "attention").is_displayed()
    beam = browser.find_element(By.ID, "beam-size")
    browser.execute_script("arguments[0].value = '99'", beam)  # past the max attribute
    browser.find_element(By.ID, "translate").click()
    wait(browser, lambda d: "--max-beam-size" in d.find_element(By.ID, "status").text)
    assert "error" in browser.find_element(By.ID, "status").get_attribute("class")
    # the translation of the request before is gone: it is not the answer to this one
    assert browser.find_elements(By.CSS_SELECTOR, "#translations > li") == []
    assert browser.find_elements(By.CSS_SELECTOR, "#heatmap table") == []
    assert not browser.find_element(By.ID, "attention").is_displayed()


def test_the_page_loads_nothing_from_elsewhere(browser: Any, server: str) -> None:
    browser.get(server + "/")
    wait(browser, lambda d: "English" in d.find_element(By.ID, "model-info").text)
    entries = browser.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)"
    )
    assert entries and all(name.startswith(server + "/") for name in entries), entries
    assert Path(CHROMIUM).exists()
