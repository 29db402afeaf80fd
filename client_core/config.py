"""The defaults both clients start from, in one place (as httpx's `_config.py`)."""

from __future__ import annotations

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"
"""Where `rollbuf serve` listens on its defaults."""
DEFAULT_TIMEOUT = httpx.Timeout(30.0, connect=5.0)
"""Per request: generous reads (a submission waits for a durable commit queued behind other writers; a
trainer's /batch read timeout is sized to the batch instead), quick connects (a dead host fails fast)."""


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The bearer header rollbuf's `--api-key` checks (nothing without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
