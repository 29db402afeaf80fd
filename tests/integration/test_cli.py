"""`rollbuf serve` as an operator meets it, run as a real process: a help text in the operator's terms, and
each configuration error as one line on stderr with exit code 2, never a traceback."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import free_port

pytestmark = pytest.mark.integration


def rollbuf(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "api", *args], capture_output=True, text=True, timeout=60, env=env, check=False
    )


def test_rollbuf_lists_serve_and_the_commands_installed_packages_register() -> None:
    """`serve` and `export` are the service's own; `demo` and the four-process layout's commands live in the demos
    (clients of the service) and reach `rollbuf` through the `rollbuf.commands` entry-point group, so the service's
    command lists them without importing them."""
    out = rollbuf("--help")
    assert out.returncode == 0, out.stderr
    commands = [line.split()[0] for line in out.stdout.splitlines() if line.startswith("  ")]
    assert commands == ["serve", "export", "demo", "example-producer", "example-trainer", "standin-inference"]
    unknown = rollbuf("frobnicate")
    assert unknown.returncode == 2
    assert "unknown command 'frobnicate'" in unknown.stderr


def test_serve_help_names_the_command_and_describes_every_flag() -> None:
    out = rollbuf("serve", "--help")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith("usage: rollbuf serve [-h]")
    assert "--api-key KEY" in text and "--store URL" in text and "--log-level LEVEL" in text
    assert "SecretStr" not in text and "{int,null}" not in text
    # Every flag's help line says something beyond its default.
    options = text.split("options:", 1)[1]
    flags = [line.split()[0] for line in options.splitlines() if line.startswith("  --")]
    assert len(flags) >= 17
    for block in options.split("\n  --")[1:]:
        help_text = " ".join(block.split()[1:])
        assert help_text.replace("(default:", "").strip(" )").split(), f"no help for --{block.split()[0]}"
        assert not help_text.startswith("(default:"), f"no help for --{block.split()[0]}"


def test_log_level_help_lists_the_levels() -> None:
    assert "critical, error, warning, info" in rollbuf("serve", "--help").stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--host", "0.0.0.0"], "no api_key is set: set --api-key"),
        (["--host", "0.0.0.0", "--api-keys", "# todo"], "api_keys holds no key"),  # keys fail closed
        (["--host", "0.0.0.0", "--api-keys", ";"], "api_keys holds no key"),
        (["--host", "0.0.0.0", "--api-key", "x" * 16, "--api-keys", f"admin env {'y' * 16}"], "'admin' is used twice"),
        (["--store", "mysql://db/rollbuf"], "store 'mysql://db/rollbuf'"),
        (["--port", "0"], "--port: Input should be greater than or equal to 1"),
        (["--port", "eighty"], "--port: Input should be a valid integer"),
        (["--log-level", "loud"], "--log-level: Input should be 'critical'"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--store", "memory://", "--workers", "2"], "workers=2 needs a store the processes share"),
        (["--store", "postgresql://postgres@127.0.0.1:1/rollbuf_none"], "--store postgresql://"),  # refused
    ],
)
def test_a_configuration_error_is_one_line_and_exit_code_2(args: list[str], message: str) -> None:
    out = rollbuf("serve", *args)
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("rollbuf serve: error: ")
    assert message in lines[0]


def test_a_foreign_sqlite_database_is_one_line_and_exit_code_2(tmp_path: Path) -> None:
    """A SQLite file that belongs to another application is refused before the server starts listening."""
    path = tmp_path / "other-app.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE users (id INTEGER)")
    out = rollbuf("serve", "--store", f"sqlite:///{path}", "--port", str(free_port()))
    assert out.returncode == 2
    [line] = out.stderr.splitlines()
    assert line.startswith(f"rollbuf serve: error: --store sqlite:///{path}: ")
    assert "not rollbuf's (users)" in line


def test_an_environment_variable_error_names_the_flag(tmp_path: Path) -> None:
    env = {**os.environ, "ROLLBUF_MAX_QUEUE_GROUPS": "-1"}
    out = rollbuf("serve", env=env)
    assert out.returncode == 2
    [line] = out.stderr.splitlines()
    assert line.startswith("rollbuf serve: error: --max-queue-groups: ")


def test_unknown_command_exits_2() -> None:
    out = rollbuf("serv")
    assert out.returncode == 2
    assert "unknown command 'serv'" in out.stderr


@pytest.mark.parametrize(
    "store",
    [
        "postgresql://rollbuf:s3cr3t-pw@127.0.0.1:FREE_PORT/db",  # nothing listens there (a port found when run,
        # not at collection: pytest-xdist workers must collect the same test ids)
        "postgresql://postgres:s3cr3t-pw@127.0.0.1:5432/rollbuf_no_such_database",
        "postgresql://rollbuf:s3cr3t-pw@127.0.0.1:5432/db?schema=Not-An-Identifier",
        "mysql://rollbuf:s3cr3t-pw@db.internal/db",
    ],
)
def test_a_store_url_password_never_shows_in_an_error(store: str) -> None:
    out = rollbuf("serve", "--store", store.replace("FREE_PORT", str(free_port())))
    assert out.returncode == 2, out.stderr
    assert "s3cr3t-pw" not in out.stderr + out.stdout
    assert ":***@" in out.stderr, out.stderr
