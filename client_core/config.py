"""The defaults both clients start from, in one place (as httpx's `_config.py`)."""

from __future__ import annotations

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"
"""Where `rollbuf serve` listens on its defaults."""
DEFAULT_TIMEOUT = httpx.Timeout(30.0, connect=5.0)
"""Per request: generous reads (a submission waits for a durable commit queued behind other writers; a
trainer's /batch read timeout is sized to the batch instead), quick connects (a dead host fails fast)."""

RETRY_DEADLINE_S = 120.0
"""How long one request is retried (transport errors, 429, 503, other 5xx), from its first try, by both
clients: long enough to ride out a server restart, and longer than any one request's own timeout (a trainer's
/batch read timeout is sized to the batch and the long-poll: tens of seconds), so that a request timed out
at its limit is still tried again."""


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The bearer header rollbuf's `--api-key` checks (nothing without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
