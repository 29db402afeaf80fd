"""`rollbuf demo`: registered in the `rollbuf.commands` entry-point group (pyproject.toml), so the service's
own `rollbuf` command (`api.cli`) finds it without importing a client; `python -m demos` runs it directly."""

from __future__ import annotations

import sys


def demo(args: list[str]) -> None:
    """the whole loop in a minute, no GPU, no internet (--learn: a small torch policy learns, on a CPU)"""
    if "--learn" in args:
        try:
            from demos.learn.loop import main as learn  # imports torch: only for this demo
        except ModuleNotFoundError as exc:
            if exc.name != "torch":
                raise
            print("rollbuf demo --learn needs torch: pip install -e '.[torch]' (or make install)", file=sys.stderr)
            raise SystemExit(2) from exc
        learn(args)
        return
    from demos.mixing import main as mixing

    mixing(args)
