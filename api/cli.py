"""The service's command: `rollbuf serve [--host H] [--port P] [--store URL] ...` (flags override `ROLLBUF_*`).

The `rollbuf` console script is `demos.cli`, which runs the demos itself and hands everything else here;
`python -m api serve` reaches this directly."""

from __future__ import annotations

import os
import sys

import uvicorn
from pydantic_settings import CliApp

from api.settings import Settings, to_environ

USAGE = """usage: rollbuf COMMAND [flags]

commands:
  serve    run the buffer service (rollbuf serve --help lists every setting)
"""


class Serve(Settings):
    """Run the rollbuf service."""

    def cli_cmd(self) -> None:
        from api.app import create_app

        settings = Settings.model_validate(self.model_dump())
        if settings.workers == 1:
            uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level)
            return
        # Worker processes import the app factory and read their settings from the environment.
        os.environ.update(to_environ(settings))
        uvicorn.run(
            "api.app:create_app",
            factory=True,
            host=settings.host,
            port=settings.port,
            workers=settings.workers,
            log_level=settings.log_level,
        )


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return
    command, rest = args[0], args[1:]
    if command == "serve":
        CliApp.run(Serve, cli_args=rest)
        return
    print(f"rollbuf: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    raise SystemExit(2)
