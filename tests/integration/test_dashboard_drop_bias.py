"""The dashboard's drop-bias card in a real headless browser: an env whose groups all go stale shows as starved,
live, next to one that trains."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from selenium import webdriver

from tests.factories import env, group, registration
from tests.integration.test_dashboard import browser, text, until
from tests.servers import running_server

pytestmark = pytest.mark.integration
__all__ = ["browser"]  # the fixture, used by name


def test_the_drop_bias_card_shows_a_starved_env(tmp_path: Path, browser: webdriver.Chrome) -> None:
    with (
        running_server("memory://", tmp_path / "server.log", "--drop-bias-starve-steps", "3") as server,
        httpx.Client(base_url=server.url) as c,
    ):
        browser.get(server.url + "/dashboard")
        c.post("/register", json=registration(batch_size=8, max_staleness=0)).raise_for_status()
        c.get("/batch")
        c.post("/register-env", json=env("math", 4)).raise_for_status()
        c.post("/register-env", json=env("slow", 4)).raise_for_status()
        for step in range(5):
            late = group(4, env_id=1, seed=100 + step, policy_step=max(0, step - 1))
            fresh = [group(4, env_id=0, seed=2 * step + k, policy_step=step) for k in range(2)]
            c.post("/scored_data_list", json=fresh if step == 0 else [late, *fresh]).raise_for_status()
            assert c.get("/batch").json()["batch"]
        until(browser, 'tr[data-bias-env="slow_0"] td.flags', "starved")
        until(browser, 'tr[data-bias-env="math_0"] td.flags', "none")
        until(browser, "#bias-title", "DROP BIAS (LAST 5 BATCHES)")  # as drawn (the card titles are upper case)
        row = text(browser, 'tr[data-bias-env="slow_0"]') or ""
        assert "0% / 25% / 50%" in row and "stale 4" in row, row
