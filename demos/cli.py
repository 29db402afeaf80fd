"""The `rollbuf` console command: `rollbuf demo ...` runs a demo here; every other command is the service's
(`api.cli`), so the service stays free of client imports while one command reaches both."""

from __future__ import annotations

import sys

USAGE = """usage: rollbuf COMMAND [flags]

commands:
  serve           run the buffer service (rollbuf serve --help lists every setting)
  demo            the whole loop in under a minute: service, 3 environments, a trainer (no GPU, no internet)
  demo --learn    a small torch policy learns a toy task through the service (CPU, no downloads; needs torch)
"""


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return
    if args[0] == "demo" and "--learn" in args[1:]:
        from demos.learn.loop import main as learn  # imports torch: only for this demo

        learn(args[1:])
        return
    if args[0] == "demo":
        from demos.mixing import main as demo

        demo(args[1:])
        return
    from api.cli import main as service

    service(args)
