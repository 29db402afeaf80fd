"""/dashboard in a real headless browser (Debian's chromium through chromium-driver, installed by `make test`):
the page loads, shows a registered env, and updates as data arrives."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.support.ui import WebDriverWait

from tests.factories import env, group, registration
from tests.servers import running_server

pytestmark = pytest.mark.integration

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WAIT_S = 60.0


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    if not (Path(CHROMIUM).exists() and shutil.which(CHROMEDRIVER)):
        pytest.fail("chromium and chromium-driver are missing: `make test` installs them (apt, as root)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def text(driver: webdriver.Chrome, css: str) -> str | None:
    """The element's rendered text, read in one script call: the page replaces its rows every second, so an
    element handle found in one call may be gone by the next."""
    found = driver.execute_script("const e = document.querySelector(arguments[0]); return e ? e.innerText : null", css)
    return None if found is None else str(found)


def until(driver: webdriver.Chrome, css: str, expected: str) -> None:
    """Poll the page until the element's text is `expected` (the page redraws every second)."""
    try:
        WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(lambda d: text(d, css) == expected)
    except Exception as exc:
        raise AssertionError(f"{css} never showed {expected!r}; page:\n{text(driver, 'body')}") from exc


def test_dashboard_shows_an_env_and_updates_live(tmp_path: Path, browser: webdriver.Chrome) -> None:
    with running_server("memory://", tmp_path / "server.log") as server, httpx.Client(base_url=server.url) as c:
        browser.get(server.url + "/dashboard")
        until(browser, "#banner", "no trainer registered yet")
        c.post("/register", json=registration(batch_size=8, drop_zero_variance=True)).raise_for_status()
        c.get("/batch")
        c.post("/register-env", json=env("math", 4, weight=3.0)).raise_for_status()
        c.post("/register-env", json=env("code", 4, weight=1.0)).raise_for_status()
        until(browser, 'tr[data-env="math_0"] td:first-child', "math_0")
        until(browser, "#step", "0")
        until(browser, 'tr[data-env="math_0"] td.queue', "0")

        for seed in range(3):
            c.post("/scored_data", json=group(4, env_id=0, seed=seed)).raise_for_status()
        c.post("/scored_data", json=group(4, env_id=1, seed=9, scores=[1.0] * 4)).raise_for_status()
        until(browser, 'tr[data-env="math_0"] td.queue', "3")
        until(browser, 'tr[data-env="math_0"] td.received', "3")
        until(browser, "#dropped", "1")
        until(browser, "#drops td:first-child", "zero_variance")

        assert c.get("/batch").json()["batch"]
        until(browser, "#step", "1")
        until(browser, 'tr[data-env="math_0"] td.queue', "1")
        until(browser, "#hist div:first-child small", "0")  # the staleness histogram has its first bar
        mix = text(browser, 'tr[data-env="math_0"] td.mix') or ""
        assert "served 100%" in mix and "weight 75%" in mix, mix
        assert int(browser.execute_script("return document.body.dataset.updates") or 0) > 3

        # groups of 3 next to one group of 4 do not make 8 yet, but one more 4 would: waiting, not blocked
        c.post("/register-env", json=env("odd", 3)).raise_for_status()
        for seed in range(3):
            c.post("/scored_data", json=group(3, env_id=2, seed=seed)).raise_for_status()
        assert c.get("/batch").json()["batch"] is None
        assert c.get("/status").json()["blocked_reason"] is None
        # an env whose minimum share has nothing queued while others have plenty: no arrival elsewhere helps
        c.post("/register-env", json=env("rare", 4, min_batch_allocation=0.5)).raise_for_status()
        assert c.get("/batch").json()["batch"] is None
        reason = c.get("/status").json()["blocked_reason"]
        assert reason and "min_batch_allocation" in reason
        until(browser, "#banner", f"No batch can be formed: {reason}")


def test_past_metrics_max_envs_the_page_shows_the_first_envs_and_sums_the_rest(
    tmp_path: Path, browser: webdriver.Chrome
) -> None:
    """10,000 envs made each poll a 9 MB body: the rows past `metrics_max_envs` come as one, and the page says so."""
    with (
        running_server("memory://", tmp_path / "server.log", "--metrics-max-envs", "2") as server,
        httpx.Client(base_url=server.url) as c,
    ):
        c.post("/register", json=registration(batch_size=8)).raise_for_status()
        c.get("/batch")
        for i in range(5):
            c.post("/register-env", json=env(f"e{i}", 4)).raise_for_status()
            c.post("/scored_data", json=group(4, env_id=i, seed=i)).raise_for_status()
        browser.get(server.url + "/dashboard")
        until(
            browser, "#envs-title", "ENVIRONMENTS: QUEUE AND MIX (THE FIRST 2 OF 5; THE REST SUMMED)"
        )  # upper-cased by CSS
        until(browser, 'tr[data-env="e1_0"] td.received', "1")
        until(browser, 'tr[data-env="(other envs)"] td.received', "3")
        until(browser, "#queued", "5")


def test_the_per_rollout_groups_card_shows_only_once_a_group_was_opened(
    tmp_path: Path, browser: webdriver.Chrome
) -> None:
    with running_server("memory://", tmp_path / "server.log") as server, httpx.Client(base_url=server.url) as c:
        c.post("/register", json=registration(batch_size=4)).raise_for_status()
        c.get("/batch")
        c.post("/register-env", json=env("math", 4)).raise_for_status()
        browser.get(server.url + "/dashboard")
        until(browser, 'tr[data-env="math_0"] td:first-child', "math_0")
        assert browser.execute_script("return document.getElementById('rollouts-card').hidden") is True
        opened = {"group_id": "g1", "env_id": 0, "producer_id": "p1", "group_size": 4, "deadline_s": 600.0}
        c.post("/rollouts/open", json=opened).raise_for_status()
        for slot in range(2):
            tokens = [slot + 1] * 4
            rollout = {
                "group_id": "g1",
                "slot": slot,
                "producer_id": "p1",
                "tokens": tokens,
                "masks": tokens,
                "score": 1.0,
            }
            c.post("/rollouts/post", json=rollout).raise_for_status()
        until(browser, 'tr[data-rollouts="open"] td:last-child', "1")
        until(browser, 'tr[data-rollouts="slots_done"] td:last-child', "2")
        until(browser, 'tr[data-rollouts="slots_leased"] td:last-child', "0")
