"""The dashboard's tasks card in a real headless browser: absent in a run without datasets, then each dataset's
fates in aggregate (leased, submitted, failed, the cursor) as producers lease tasks and send their groups."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.support.ui import WebDriverWait

from tests.factories import env, group, registration
from tests.integration.test_dashboard import WAIT_S, browser, text, until
from tests.servers import running_server

pytestmark = pytest.mark.integration
__all__ = ["browser"]  # the fixture, used by name


def test_the_tasks_card_shows_fates_only_when_the_run_uses_tasks(tmp_path: Path, browser: webdriver.Chrome) -> None:
    with running_server("memory://", tmp_path / "server.log") as server, httpx.Client(base_url=server.url) as c:
        browser.get(server.url + "/dashboard")
        c.post("/register", json=registration(batch_size=8)).raise_for_status()
        c.get("/batch")
        c.post("/register-env", json=env("math", 4)).raise_for_status()
        polls = lambda: int(browser.execute_script("return Number(document.body.dataset.updates || 0)"))  # noqa: E731
        seen = polls()
        WebDriverWait(browser, WAIT_S, poll_frequency=0.1).until(lambda _: polls() >= seen + 2)  # drawn since
        assert browser.execute_script("return document.getElementById('tasks-card').hidden") is True
        spec = {"name": "gsm8k", "env": "math", "epochs": 2, "tasks": [{"q": i} for i in range(5)]}
        c.post("/tasks/datasets", json=spec).raise_for_status()
        leased = c.post("/tasks/lease", json={"dataset": "gsm8k", "producer_id": "p", "n": 3}).json()["leases"]
        c.post("/scored_data", json=group(4, group_id=leased[0]["token"])).raise_for_status()
        c.post("/tasks/fail", json={"token": leased[1]["token"], "reason": "env crashed"}).raise_for_status()
        row = 'tr[data-dataset="gsm8k"]'
        until(browser, f"{row} td.failed", "1")
        assert browser.execute_script("return document.getElementById('tasks-card').hidden") is False
        assert (text(browser, f"{row} td.leased"), text(browser, f"{row} td.submitted")) == ("1", "1")
        cells = text(browser, row) or ""
        assert "gsm8k" in cells and "math" in cells and "1 / 2" in cells and "3 / 5" in cells, cells
