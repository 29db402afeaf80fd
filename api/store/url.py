"""Store URLs: showing one without its password, and the parameters every durable backend reads alike.

Apart from the backends (which parse the rest of their URLs themselves) and from `api/store/__init__.py`
(which picks a backend by scheme), so that a backend never imports the package that imports it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

T = TypeVar("T")
D = TypeVar("D")

DURABLE_PARAMS = frozenset({"max_replies", "reply_ttl", "commit_delay"})
"""The URL parameters of `Durable`."""
MAX_REPLIES = 1_000_000
"""Idempotency replies kept by default, newest first (~200 bytes each): far more retries than clients make."""
COMMIT_DELAY_US = 500
"""Default `commit_delay`, microseconds. Measured on SQLite with small groups (docs/benchmarks-settings.md): at
8 clients 200 us gathered groups of 5.3-7.3 from run to run, 500 us 7.4-7.7 (of 8), 1,000 us no more; the wait
ends as soon as every transaction being prepared has come, so a longer bound costs only when one never comes."""
COMMIT_DELAY_MAX_US = 100_000
"""Largest `commit_delay`: past this a wait is a stall, not a gathering."""


SECRET_PARAMS = ("password", "sslpassword")
"""Query parameters libpq reads a secret from (`postgresql://host/db?password=...`)."""


def redacted(url: str) -> str:
    """The URL without its password (in the authority or as a query parameter), for logs and errors."""
    parts = urlsplit(url)
    params = parse_qsl(parts.query, keep_blank_values=True)
    if parts.password is None and not any(k in SECRET_PARAMS for k, _ in params):
        return url
    if parts.password is not None:
        parts = parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1))
    query = [(k, "***" if k in SECRET_PARAMS else v) for k, v in params]
    return urlunsplit(parts._replace(query=urlencode(query, safe="*")))


def without_password(text: str, url: str) -> str:
    """`text` (an error message that may quote the URL) with the URL's passwords, if any, masked."""
    parts = urlsplit(url)
    secrets = [parts.password] if parts.password else []
    secrets += [v for k, v in parse_qsl(parts.query) if k in SECRET_PARAMS and v]
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


@dataclass(frozen=True, slots=True, kw_only=True)
class Durable:
    """What every durable store's URL says alike: how many idempotency replies it keeps
    (`?max_replies=N&reply_ttl=SECONDS`), and how long a group commit waits for company
    (`?commit_delay=MICROSECONDS`)."""

    max_replies: int = MAX_REPLIES
    """Replies kept, newest first."""
    reply_ttl: float | None = None
    """Replies older than this many seconds are forgotten (at the next trim). Measured against the stored
    wall-clock creation time, so a restart neither resets nor extends the window. None: no time limit."""
    commit_delay: float = COMMIT_DELAY_US / 1e6
    """Seconds a group commit waits for more transactions while other requests are being prepared in the
    process (`api.store.jobs.next_group`); a lone client never waits. 0: commit what is queued at once."""


def durable_params(params: Mapping[str, str], url: str) -> Durable:
    """The `Durable` a URL's parameters (`params`, the last value of each) say; ValueError naming the
    parameter and its rule if one is not a number or out of range."""
    where = f"store URL {redacted(url)!r}"
    max_replies = _number(params, "max_replies", int, MAX_REPLIES, f"{where}: max_replies must be an integer")
    ttl = _number(params, "reply_ttl", float, None, f"{where}: reply_ttl must be a number of seconds")
    delay_rule = f"{where}: commit_delay must be an integer from 0 to {COMMIT_DELAY_MAX_US} (microseconds)"
    delay_us = _number(params, "commit_delay", int, COMMIT_DELAY_US, delay_rule)
    if max_replies < 0:
        raise ValueError(f"{where}: max_replies must not be negative")
    if ttl is not None and not ttl >= 0:
        raise ValueError(f"{where}: reply_ttl must be a number of seconds, not negative")
    if not 0 <= delay_us <= COMMIT_DELAY_MAX_US:
        raise ValueError(delay_rule)
    return Durable(max_replies=max_replies, reply_ttl=ttl, commit_delay=delay_us / 1e6)


def _number(params: Mapping[str, str], name: str, kind: Callable[[str], T], default: D, rule: str) -> T | D:
    if name not in params:
        return default
    try:
        return kind(params[name])
    except ValueError:
        raise ValueError(rule) from None
