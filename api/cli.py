"""The service's command: `rollbuf serve [--host H] [--port P] [--store URL] ...` (flags override `ROLLBUF_*`).

The `rollbuf` console script is this module's `main`: `serve` is the service's own; any other command is
found in the `rollbuf.commands` entry-point group, where installed packages (the demos: `rollbuf demo`)
register theirs, so the command reaches them without the service importing a client. `python -m api ...`
is the same as `rollbuf ...`.

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
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, NoReturn

import uvicorn
from pydantic import ValidationError
from pydantic_settings import CliApp, CliSettingsSource, SettingsError

from api.config.settings import Settings, to_environ
from api.logs import log_config
from api.meters import MULTIPROC_ENV

COMMANDS_GROUP = "rollbuf.commands"
"""Entry-point group of the other `rollbuf` commands: `name = "module:function"`, the function taking the
command's arguments and its first docstring line shown in the usage."""

PROG = "rollbuf serve"
PROTOCOL = "api.http.connections:BoundedHttpToolsProtocol"
"""uvicorn's httptools protocol with head, time and connection bounds (its limits set by `create_app`)."""
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
    "max_inflight_bytes": "BYTES",
    "retry_after": "SECONDS",
    "max_batch_wait": "SECONDS",
    "shutdown_timeout": "SECONDS",
    "header_timeout": "SECONDS",
    "body_timeout": "SECONDS",
    "keepalive_timeout": "SECONDS",
    "max_header_bytes": "BYTES",
    "api_keys": "KEYS",
    "api_keys_file": "PATH",
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
        serving: dict[str, Any] = {
            "host": settings.host,
            "port": settings.port,
            "log_level": settings.log_level,
            "log_config": log_config(settings.log_level, settings.log_format),
            "timeout_graceful_shutdown": settings.shutdown_timeout,
            "http": PROTOCOL,
            "timeout_keep_alive": settings.keepalive_timeout,
        }
        if settings.workers == 1:
            from api.app import create_app

            uvicorn.run(create_app(settings), **serving)
            return
        # Worker processes import the app factory and read their settings from the environment; their
        # Prometheus timings go to files in one directory, summed by whichever worker is scraped.
        os.environ.update(to_environ(settings))
        own_dir = None
        if not os.environ.get(MULTIPROC_ENV):
            own_dir = os.environ[MULTIPROC_ENV] = tempfile.mkdtemp(prefix="rollbuf-metrics-")
        try:
            uvicorn.run("api.app:create_app", factory=True, workers=settings.workers, **serving)
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
    """run the buffer service (rollbuf serve --help lists every setting)"""
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


def export(args: list[str]) -> None:
    """write the run's ledger and kept groups as Parquet (needs rollbuf[export]; rollbuf export --help)"""
    from api.export.cli import main as export_main  # pyarrow is imported only by this command

    export_main(args)


def commands() -> dict[str, Callable[[list[str]], None]]:
    """Every `rollbuf` command: `serve` and `export`, then those registered by installed packages (loaded when
    listed)."""
    found: dict[str, Callable[[list[str]], None]] = {"serve": serve, "export": export}
    for ep in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        found.setdefault(ep.name, ep.load())
    return found


def usage(found: dict[str, Callable[[list[str]], None]]) -> str:
    width = max(8, *map(len, found))
    lines = [
        f"  {name:<{width}} {(fn.__doc__ or '').strip().splitlines()[0] if fn.__doc__ else ''}".rstrip()
        for name, fn in found.items()
    ]
    return "usage: rollbuf COMMAND [flags]\n\ncommands:\n" + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "serve":  # the service's own command: no entry-point scan on its way
        serve(args[1:])
        return
    found = commands()
    if not args or args[0] in ("-h", "--help"):
        print(usage(found), end="")
        return
    command, rest = args[0], args[1:]
    if command in found:
        found[command](rest)
        return
    print(f"rollbuf: unknown command {command!r}\n\n{usage(found)}", end="", file=sys.stderr)
    raise SystemExit(EXIT_CONFIG)
