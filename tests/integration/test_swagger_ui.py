"""The Swagger UI as a person uses it, in Debian's headless chromium (no internet on this machine, so every file
the page needs comes from rollbuf): it renders every operation, and "Try it out" with the examples, in the
order the description gives, gets a 200 from /register, /batch, /register-env and /scored_data."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import ServerProcess, running_server

pytestmark = pytest.mark.integration

webdriver = pytest.importorskip("selenium.webdriver")
CHROMIUM = shutil.which("chromium")
DRIVER = shutil.which("chromedriver")
if CHROMIUM is None or DRIVER is None:  # Debian's chromium and chromium-driver packages
    pytest.skip("chromium and chromedriver are not installed", allow_module_level=True)

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support import expected_conditions  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    with running_server("memory://", tmp_path / "server.log") as server:
        yield server


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,2000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=str(DRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def try_it_out(browser: webdriver.Chrome, operation_id: str) -> str:
    """Open one operation, press Execute with its example, and return the status code the UI shows."""
    wait = WebDriverWait(browser, 20)
    block = wait.until(expected_conditions.presence_of_element_located((By.ID, f"operations-{operation_id}")))
    if "is-open" not in (block.get_attribute("class") or ""):
        block.find_element(By.CSS_SELECTOR, ".opblock-summary").click()
    execute = wait.until(lambda _: block.find_element(By.CSS_SELECTOR, "button.execute"))
    browser.execute_script("arguments[0].scrollIntoView(); arguments[0].click();", execute)
    cell = wait.until(lambda _: block.find_element(By.CSS_SELECTOR, ".live-responses-table tbody .response-col_status"))
    return str(cell.text.strip())


def test_swagger_ui_renders_offline_and_its_examples_work(server: ServerProcess, browser: webdriver.Chrome) -> None:
    browser.get(server.url + "/docs")
    wait = WebDriverWait(browser, 20)
    wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, ".opblock")) >= 13)
    assert try_it_out(browser, "trainer-register_register_post") == "200"
    assert try_it_out(browser, "trainer-batch_batch_get") == "200"
    assert try_it_out(browser, "environments-register_env_register_env_post") == "200"
    assert try_it_out(browser, "environments-scored_data_scored_data_post") == "200"
