"""client_core.outage: a server outage is logged once it lasts, then at a bounded rate, and its end once."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from client_core.outage import AFTER_S, EVERY_S, Outage


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_blip_is_silent_an_outage_is_told_and_so_is_its_end(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    outage = Outage("rollbuf server http://x", logging.getLogger("t"), clock)
    with caplog.at_level(logging.WARNING, "t"):
        outage.failed("refused")
        clock.now = AFTER_S / 2
        outage.answered()
        assert caplog.records == [], "a blip that one retry covers is not logged"
        for t in range(0, 95):
            clock.now = 100.0 + t
            outage.failed("refused")
        outage.answered()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("rollbuf server http://x unreachable for 5 s, retrying: refused")
    assert len([m for m in lines if "unreachable" in m]) == 3  # at 5 s, 35 s, 65 s of a 94 s outage
    assert lines[-1] == "rollbuf server http://x reachable again after 94 s"


@given(st.lists(st.floats(0.0, 10.0), min_size=1, max_size=200))
def test_never_more_than_one_line_per_every_s(gaps: list[float]) -> None:
    clock = Clock()
    records: list[float] = []

    class Times(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(clock.now)

    log = logging.getLogger("test_client_core_outage")
    log.propagate = False
    handler = Times()
    log.addHandler(handler)
    outage = Outage("s", log, clock)
    for gap in gaps:
        clock.now += gap
        outage.failed("x")
    log.removeHandler(handler)
    assert all(b - a >= EVERY_S for a, b in zip(records, records[1:], strict=False))
    assert not records or records[0] >= AFTER_S
