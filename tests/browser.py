"""Headless Chromium for the tests that look at a page as a person would (Debian's chromium
and chromium-driver, installed by ./run.sh test)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service

from tests.conftest import _unavailable

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")


@contextmanager
def chromium(width: int, height: int) -> Iterator[webdriver.Chrome]:
    """A headless browser window; skipped locally and failed in CI when Chromium is absent."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not path.exists():
            _unavailable("Chromium", FileNotFoundError(f"{path} is missing"))
    options = Options()
    options.binary_location = str(CHROMIUM)
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={width},{height}",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()
