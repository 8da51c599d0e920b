"""The dashboard as a person sees it: Debian's chromium, headless, driven by selenium.

The ``browser`` fixture (registered for every test through ``tests/conftest.py``) starts one
Chromium per test module through Debian's ``chromedriver`` (both from the distribution, so their
versions match and nothing is downloaded), with the flags this offline, sandbox-less machine
needs and a fresh profile. ``read_page`` reads everything the page shows in one go; ``wait_page``
polls it until a condition holds (the page polls the coordinator by itself).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.chrome.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
#: What this offline, sandbox-less machine needs; a fresh profile is added per session.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,900",
)
#: Safety net for any wait on the page; a healthy tiny run needs a small fraction of it.
PAGE_WAIT_S = 120.0

#: Everything a person sees on the page, read in one go (innerText is the rendered text).
_READ_PAGE = """
const q = (sel, root) => [...(root || document).querySelectorAll(sel)];
const text = (id) => document.getElementById(id).innerText.trim();
return {
  updates: Number(document.body.dataset.updates || 0),
  counter: text("round-counter"),
  state: text("run-state"),
  note: text("run-note"),
  run_id: text("run-id"),
  run_config: text("run-config"),
  connection: text("connection"),
  members: q("#members tbody tr").map((tr) => [...tr.cells].map((td) => td.innerText.trim())),
  members_empty: text("members-empty"),
  rounds: q("#rounds tbody tr").map((tr) => [...tr.cells].map((td) => td.innerText.trim())),
  gathers: q("#rounds tbody tr").map((tr) => q(".gather .chip", tr).map((c) => c.innerText)),
  rounds_empty: text("rounds-empty"),
  points: q("#loss-chart svg circle.point").map((c) => [c.dataset.round, c.dataset.loss]),
  chart_text: text("loss-chart"),
  planned: q("#loss-chart svg circle.planned").map((c) => c.dataset.round),
  loss_summary: text("loss-summary"),
  checkpoint: text("checkpoint"),
  images: document.images.length,
  scripts: document.scripts.length,
  owned: window.__owned === undefined ? null : String(window.__owned),
};
"""
#: The cells of a row of the rounds table.
ROUND, STATE, GATHER, EXCLUDED, UP, DOWN, FINGERPRINTS, LOSS, TOOK = range(9)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDriver]:
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        why = "needs Debian's chromium and chromium-driver (apt-get install both)"
        if os.environ.get("CI"):
            pytest.fail(why)  # CI installs them (.ci/run): never skip there
        pytest.skip(why)
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    try:
        yield driver
    finally:
        driver.quit()


def read_page(driver: WebDriver) -> dict[str, Any]:
    page = driver.execute_script(_READ_PAGE)
    assert isinstance(page, dict)
    return page


def wait_page(
    driver: WebDriver, what: str, predicate: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    """The page as read once ``predicate`` holds for it (it polls the coordinator by itself)."""
    seen: list[dict[str, Any]] = []

    def ready(d: WebDriver) -> dict[str, Any] | Literal[False]:
        page = read_page(d)
        seen.append(page)
        return page if predicate(page) else False

    try:
        result: dict[str, Any] = WebDriverWait(driver, PAGE_WAIT_S, 0.1).until(ready)
    except Exception as exc:
        raise AssertionError(f"the page never showed {what}; last read: {seen[-1:]}") from exc
    return result


def closed_rows(page: dict[str, Any]) -> list[list[str]]:
    return [row for row in page["rounds"] if row[STATE] == "closed"]


def console_errors(driver: WebDriver) -> list[str]:
    """Console errors since the last call (a missing favicon is not the page's)."""
    logs = driver.get_log("browser")
    return [
        e["message"] for e in logs if e["level"] == "SEVERE" and "favicon.ico" not in e["message"]
    ]


def save_screenshot(driver: WebDriver, path: Path) -> None:
    """The whole page at a desktop width (a viewport as tall as the page, then back)."""
    height = int(driver.execute_script("return document.documentElement.scrollHeight"))
    metrics = {"width": 1280, "height": height, "deviceScaleFactor": 1, "mobile": False}
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
    driver.execute_script("document.documentElement.style.overflow = 'hidden'")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(path))
    finally:
        driver.execute_script("document.documentElement.style.overflow = ''")
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
