"""api.export.cli's progress bar: redrawn in place on a terminal, one line per table elsewhere."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from api.export import cli


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_sees_the_bar_fill_then_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "REDRAW_S", 0.0)  # every advance redraws
    out = Terminal()
    bar = cli.Bar("sequences", 200, "groups", out)
    bar.advance(50, 1_000_000)
    bar.advance(300, 1_000_000)  # the total is an estimate: the bar stops at 100%
    bar.close(Path("d/sequences.parquet"), 1400)
    frames = out.getvalue().split("\r")[1:]
    assert "[########------" in frames[0] and " 25% 50/200 groups" in frames[0]
    assert "[" + "#" * cli.BAR_WIDTH + "]" in frames[1] and "100% 350/200 groups" in frames[1]
    assert frames[2].startswith("sequences 1400 rows, 2.0 MB in ") and frames[2].endswith("-> d/sequences.parquet\n")


def test_elsewhere_only_the_last_line() -> None:
    out = io.StringIO()
    bar = cli.Bar("groups", None, "groups", out)
    for _ in range(100):
        bar.advance(10, 100)
    bar.close(Path("d/groups.parquet"), 1000)
    assert out.getvalue().count("\n") == 1 and out.getvalue().startswith("groups    1000 rows, 0.0 MB in ")
