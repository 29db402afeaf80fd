"""Server logging: timestamps on every line, plain text or JSON lines, request ids, and a rate-limited line
per refused request (docs/observability.md)."""

from __future__ import annotations

import logging
import threading
import time
from contextvars import ContextVar
from typing import Any, Literal

from api.errors import InvalidData, RollbufError

log = logging.getLogger("rollbuf")

LogFormat = Literal["text", "json"]
TEXT_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s [%(process)d] %(name)s: %(message)s"
"""The process id tells `--workers N` processes apart."""
DATE_FORMAT = "%Y-%m-%dT%H:%M:%S"

request_id: ContextVar[str | None] = ContextVar("rollbuf_request_id", default=None)
"""The current request's id (X-Request-ID), for lines logged while serving it."""
request_env: ContextVar[str | None] = ContextVar("rollbuf_request_env", default=None)
"""The env the current request's data belongs to, once the service knows it (for refusal lines)."""


class RequestIdFilter(logging.Filter):
    """Adds `request_id` to every record (`-` outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get() or "-"
        return True


def log_config(level: str, fmt: LogFormat) -> dict[str, Any]:
    """A `logging.config.dictConfig` for rollbuf and uvicorn (uvicorn applies it in every worker)."""
    if fmt == "json":
        formatter: dict[str, Any] = {
            "()": "pythonjsonlogger.json.JsonFormatter",
            "fmt": "%(levelname)s %(name)s %(process)d %(message)s %(request_id)s",
            "rename_fields": {"levelname": "level", "name": "logger", "process": "pid"},
            "timestamp": "time",  # ISO 8601, UTC
        }
    else:
        formatter = {"()": "api.logs.EscapingFormatter", "fmt": TEXT_FORMAT, "datefmt": DATE_FORMAT}
    level = level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"request_id": {"()": "api.logs.RequestIdFilter"}},
        "formatters": {"default": formatter},
        "handlers": {
            "default": {
                "class": "logging.StreamHandler",
                "formatter": "default",
                "filters": ["request_id"],
                "stream": "ext://sys.stderr",
            }
        },
        "loggers": {
            "rollbuf": {"handlers": ["default"], "level": level, "propagate": False},
            "uvicorn": {"handlers": ["default"], "level": level, "propagate": False},
            "uvicorn.error": {"level": level},
            "uvicorn.access": {"handlers": ["default"], "level": level, "propagate": False},
        },
    }


_CONTROL = {c: f"\\x{c:02x}" for c in [*range(32), 127] if c not in (9,)}
_CONTROL[10], _CONTROL[13] = "\\n", "\\r"


class EscapingFormatter(logging.Formatter):
    """Text lines whose message cannot hold a line break or other control characters: a client's string (an
    env name, a path) cannot forge a log line. Tracebacks, which follow the line, keep theirs."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = record.message.translate(_CONTROL)
        return super().formatMessage(record)


class RateLimiter:
    """At most one line per key per `interval` seconds, and `burst` lines over all keys per interval; what
    it holds back is counted and reported with the next line that passes."""

    def __init__(self, interval: float = 10.0, burst: int = 20) -> None:
        self.interval = interval
        self.burst = burst
        self._last: dict[tuple[str, ...], float] = {}
        self._window_start = 0.0
        self._in_window = 0
        self._held = 0
        self._lock = threading.Lock()

    def allow(self, key: tuple[str, ...], now: float | None = None) -> int | None:
        """None: hold this line back. Else the number of lines held back since the last one let through."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if now - self._window_start >= self.interval:
                self._window_start, self._in_window = now, 0
                if len(self._last) > 10_000:
                    self._last = {k: t for k, t in self._last.items() if now - t < self.interval}
            last = self._last.get(key)
            if (last is not None and now - last < self.interval) or self._in_window >= self.burst:
                self._held += 1
                return None
            self._last[key] = now
            self._in_window += 1
            held, self._held = self._held, 0
            return held


REFUSALS = RateLimiter()


def field_of(loc: tuple[str | int, ...]) -> str:
    """`body.tokens.3.17` -> `tokens`: the field, without list indices and the `body` prefix."""
    parts = [str(p) for p in loc if not isinstance(p, int) and p not in ("body", "query")]
    return ".".join(parts) or ".".join(map(str, loc)) or "-"


def log_refusal(method: str, path: str, status: int, env: str | None, field: str, rule: str) -> None:
    """One line per refused request, rate-limited per (env, field, rule) so a broken handler cannot flood the log."""
    env = env or request_env.get() or "-"
    held = REFUSALS.allow((env, path, field, rule[:60]))
    if held is None:
        return
    more = f" ({held} similar lines held back)" if held else ""
    log.warning("refused %s %s %d env=%s field=%s rule=%s%s", method, path, status, env, field, rule, more)


GONE = RateLimiter(interval=10.0, burst=1)


def log_client_gone(method: str, path: str) -> None:
    """A client that went away in the middle of sending its body: one line (no traceback), rate-limited, for
    a client cutting uploads off cannot flood the log."""
    held = GONE.allow(("gone",))
    if held is not None:
        more = f" ({held} more since the last such line)" if held else ""
        log.info("client went away while sending its body: %s %s%s", method, path, more)


def log_error(method: str, path: str, exc: RollbufError) -> None:
    """The refusal line for one of the service's own errors."""
    if isinstance(exc, InvalidData):
        log_refusal(method, path, exc.status_code, None, field_of(exc.loc), exc.msg)
    elif exc.status_code < 500 or exc.status_code == 503:
        log_refusal(method, path, exc.status_code, None, "-", str(exc.detail))


def log_validation_errors(method: str, path: str, errors: list[dict[str, Any]]) -> None:
    """The refusal line for a request FastAPI's own validation refused (the first error names the rule)."""
    if errors:
        first = errors[0]
        log_refusal(method, path, 422, None, field_of(tuple(first.get("loc", ()))), str(first.get("msg", "")))
