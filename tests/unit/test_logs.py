"""Log formatting and the refusal rate limiter."""

from __future__ import annotations

import io
import json
import logging
import logging.config
import re

from api.logs import RateLimiter, field_of, log_config, request_id


def test_rate_limiter_one_line_per_key_per_interval_and_counts_what_it_held() -> None:
    rl = RateLimiter(interval=10.0, burst=3)
    assert rl.allow(("a",), now=100.0) == 0
    assert rl.allow(("a",), now=101.0) is None
    assert rl.allow(("a",), now=105.0) is None
    assert rl.allow(("b",), now=105.0) == 2  # another key passes and reports the two held back
    assert rl.allow(("a",), now=110.5) == 0  # the interval passed
    for k in "cde":
        rl.allow((k,), now=111.0)
    assert rl.allow(("f",), now=111.0) is None  # burst: 3 lines per window over all keys


def test_field_of_drops_indices_and_the_body_prefix() -> None:
    assert field_of(("body", 3, "tokens", 17)) == "tokens"
    assert field_of(("query", "env_id")) == "env_id"
    assert field_of(("body",)) == "body"


def _emit(fmt: str) -> str:
    config = log_config("info", fmt)  # type: ignore[arg-type]
    stream = io.StringIO()
    config["handlers"]["default"]["stream"] = stream
    logging.config.dictConfig(config)
    try:
        token = request_id.set("r-1")
        logging.getLogger("rollbuf").info("batch step=%d", 7)
        request_id.reset(token)
        logging.getLogger("uvicorn.error").info("Started server process [1]")
    finally:
        logging.config.dictConfig({"version": 1, "disable_existing_loggers": False})
        for name in ("rollbuf", "uvicorn", "uvicorn.access"):
            logger = logging.getLogger(name)
            logger.handlers.clear()
            logger.propagate = True
            logger.setLevel(logging.NOTSET)
    return stream.getvalue()


def test_text_lines_carry_a_timestamp() -> None:
    lines = _emit("text").splitlines()
    assert len(lines) == 2
    stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3} "
    assert re.match(stamp + r"INFO \[\d+\] rollbuf: batch step=7$", lines[0])
    assert re.match(stamp + r"INFO \[\d+\] uvicorn.error: Started server process \[1\]$", lines[1])


def test_json_lines() -> None:
    first, second = (json.loads(line) for line in _emit("json").splitlines())
    assert first["message"] == "batch step=7" and first["level"] == "INFO" and first["logger"] == "rollbuf"
    assert first["request_id"] == "r-1" and second["request_id"] == "-" and first["pid"] > 0
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", first["time"])
