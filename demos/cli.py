"""`rollbuf demo`, `rollbuf standin-inference`, `rollbuf example-trainer` and `rollbuf example-producer`:
registered in the `rollbuf.commands` entry-point group (pyproject.toml), so the service's own `rollbuf` command
(`api.cli`) finds them without importing a client. `python -m demos` runs the demo directly, `python -m
demos.standin_inference` (`.example_trainer`, `.example_producer`) the others."""

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


def standin_inference(args: list[str]) -> None:
    """a stand-in for vLLM in the four-process layout: its completion routes, no model (-h)"""
    from demos.standin_inference import main

    main(args)


def example_trainer(args: list[str]) -> None:
    """the four-process layout's trainer: trains on batches, syncs and announces weights (-h)"""
    from demos.example_trainer import main

    main(args)


def example_producer(args: list[str]) -> None:
    """the four-process layout's producer: a RolloutRunner leasing a dataset's tasks (-h)"""
    from demos.example_producer import main

    main(args)
