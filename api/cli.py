"""The service's command: `rollbuf serve [--host H] [--port P] [--store URL] ...` (flags override `ROLLBUF_*`).

The `rollbuf` console script is `demos.cli`, which runs the demos itself and hands everything else here;
`python -m api serve` reaches this directly.

A configuration error (a bad flag or value, an unsafe combination, a store that cannot be opened) is one
line on stderr and exit code 2, never a traceback: it is the operator's input that is wrong, not rollbuf.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import shutil
import sys
import tempfile
from typing import Any, NoReturn

import uvicorn
from pydantic import ValidationError
from pydantic_settings import CliApp, CliSettingsSource, SettingsError

from api.logs import log_config
from api.metrics import MULTIPROC_ENV
from api.settings import Settings, to_environ

USAGE = """usage: rollbuf COMMAND [flags]

commands:
  serve    run the buffer service (rollbuf serve --help lists every setting)
"""

PROG = "rollbuf serve"
EXIT_CONFIG = 2
"""argparse's exit code for a usage error; rollbuf uses it for every configuration error."""

METAVARS = {
    "host": "HOST",
    "port": "PORT",
    "store": "URL",
    "log_level": "LEVEL",
    "api_key": "KEY",
    "max_body_bytes": "BYTES",
    "max_decompressed_bytes": "BYTES",
    "retry_after": "SECONDS",
    "max_batch_wait": "SECONDS",
}
"""What a flag's value is, for `--help`; other flags get N for integers and VALUE otherwise. pydantic-settings
would show the Python type (`{SecretStr,null}`), which says nothing to an operator."""


def fail(message: str) -> NoReturn:
    """One line on stderr, exit code 2 (a driver's multi-line message is joined into it)."""
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
    raise SystemExit(EXIT_CONFIG)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        fail(f"{message} (see {PROG} --help)")


def _add_argument(container: Any, *names: str, **kwargs: Any) -> Any:
    if "metavar" in kwargs and kwargs.get("dest"):
        derived = str(kwargs["metavar"])
        kwargs["metavar"] = METAVARS.get(kwargs["dest"], "N" if derived in ("int", "{int,null}") else "VALUE")
    return container.add_argument(*names, **kwargs)


class Serve(Settings):
    """Run the rollbuf service. Every flag is also a ROLLBUF_* environment variable (flags win);
    `null` unsets an optional limit."""

    def cli_cmd(self) -> None:
        settings = Settings.model_validate(self.model_dump())
        check_store(settings.store)
        logging = log_config(settings.log_level, settings.log_format)
        if settings.workers == 1:
            from api.app import create_app

            uvicorn.run(
                create_app(settings),
                host=settings.host,
                port=settings.port,
                log_level=settings.log_level,
                log_config=logging,
            )
            return
        # Worker processes import the app factory and read their settings from the environment; their
        # Prometheus timings go to files in one directory, summed by whichever worker is scraped.
        os.environ.update(to_environ(settings))
        own_dir = None
        if not os.environ.get(MULTIPROC_ENV):
            own_dir = os.environ[MULTIPROC_ENV] = tempfile.mkdtemp(prefix="rollbuf-metrics-")
        try:
            uvicorn.run(
                "api.app:create_app",
                factory=True,
                host=settings.host,
                port=settings.port,
                workers=settings.workers,
                log_level=settings.log_level,
                log_config=logging,
            )
        finally:
            if own_dir:
                shutil.rmtree(own_dir, ignore_errors=True)


def check_store(url: str) -> None:
    """Open and close the store before listening, so that a store that cannot be used (a path that cannot be
    created, a SQLite file holding another application's tables, an unknown scheme) is one line and exit 2
    instead of a traceback from the server's startup."""
    from api.store import make_store, redacted, without_password

    async def open_close() -> None:
        store = make_store(url)
        await store.close()

    try:
        asyncio.run(open_close())
    except Exception as exc:  # any failure to open is the operator's to fix; its message names the cause
        fail(f"--store {redacted(url)}: {without_password(str(exc), url)}")


def serve(args: list[str]) -> None:
    source: CliSettingsSource[Serve] = CliSettingsSource(
        Serve,
        cli_prog_name=PROG,
        root_parser=_Parser(
            prog=PROG,
            description=inspect.cleandoc(Serve.__doc__ or ""),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        ),
        add_argument_method=_add_argument,
    )
    try:
        CliApp.run(Serve, cli_args=args, cli_settings_source=source)
    except ValidationError as exc:
        fail("; ".join(_describe(err) for err in exc.errors(include_url=False)))
    except SettingsError as exc:
        fail(str(exc))


def _describe(err: Any) -> str:
    """`--flag: message` for a field's error, the message alone for a rule over several settings."""
    msg = str(err["msg"]).removeprefix("Value error, ")
    if not err["loc"]:
        return msg
    return f"--{str(err['loc'][0]).replace('_', '-')}: {msg}"


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return
    command, rest = args[0], args[1:]
    if command == "serve":
        serve(rest)
        return
    print(f"rollbuf: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    raise SystemExit(EXIT_CONFIG)
