"""deploy/ as an operator runs it, without Docker: what `docker compose -f deploy/docker-compose.yml up` starts,
started here as processes from the same files, and what those files' comments and docs/deployment.md say of them
checked against what the processes do. The files are what an operator copies; nothing else runs them.

There is no Docker daemon on these machines (the image itself is built and run with podman in tests/image), so
each service becomes what its container runs:

- `postgres`: the machine's PostgreSQL, a database of the test's own (tests/pg.py). The service's `command` flags
  are read by PostgreSQL's own binary of the image's major version (`postgres -C`: a misspelt name or a value it
  refuses fails the test), and those that a database can hold are set on the test's database;
- each replica: the Dockerfile's CMD with its final stage's ENV and the service's `environment` over it (compose's
  `${...}` interpolation included), run from this repository's virtualenv in place of the image's; the store URL
  points at the test's database in place of the `postgres` host, and ROLLBUF_PORT at a free port (in compose each
  replica has port 8000 of its own container);
- `lb`: nginx (Debian's; `make test` installs it as root) with deploy/nginx.conf, its upstream servers and
  `listen` port rewritten to those ports, and its pid file, logs and temporary files in the test's directory.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import psycopg
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests import pg
from tests.factories import env, group, registration
from tests.servers import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "docker-compose.yml"
NGINX_CONF = ROOT / "deploy" / "nginx.conf"
DOCKERFILE = ROOT / "Dockerfile"
GUARD_S = 60.0
"""Hang guard for anything awaited (a process ready, a long-poll answered); never a speed check."""
POLL_S = 0.05
"""Polling interval while waiting for a condition (never a wait for a result itself)."""
WAITING = "rollbuf_waiting_long_polls"
NGINX_UPSTREAM_KEEPALIVE_DEFAULT_S = 60.0
"""nginx's `keepalive_timeout` in an `upstream` block when the conf sets none."""


# --- compose -----------------------------------------------------------------------------------------------------


class ComposeRefused(Exception):
    """What `docker compose` refuses before starting anything: a required variable not set."""


_VARIABLE = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def interpolate(text: str, environ: Mapping[str, str]) -> str:
    """Compose's interpolation of one value: `$$`, `$V`, `${V}`, `${V:-default}`, `${V-default}`,
    `${V:?error}`, `${V?error}`, `${V:+other}`, `${V+other}`."""

    def one(m: re.Match[str]) -> str:
        if m[1]:
            return "$"
        name = m[2] or m[5]
        op, arg = m[3], m[4] or ""
        value = environ.get(name)
        if op is None:
            return value if value is not None else ""
        missing = value is None or (op.startswith(":") and value == "")
        if op.endswith("-"):
            return arg if missing or value is None else value
        if op.endswith("?"):
            if missing or value is None:
                raise ComposeRefused(f"required variable {name} is missing a value: {arg}")
            return value
        return "" if missing else arg

    return _VARIABLE.sub(one, text)


def _interpolated(node: Any, environ: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, environ)
    if isinstance(node, list):
        return [_interpolated(item, environ) for item in node]
    if isinstance(node, dict):
        return {key: _interpolated(value, environ) for key, value in node.items()}
    return node


@dataclass(frozen=True)
class Compose:
    services: dict[str, dict[str, Any]]
    text: str

    @property
    def replicas(self) -> dict[str, dict[str, Any]]:
        """The services built from the Dockerfile."""
        return {name: service for name, service in self.services.items() if "build" in service}

    def comment_number(self, pattern: str) -> int:
        """A number a comment of the file states (the comments are what an operator reads)."""
        match = re.search(pattern, self.text)
        assert match, f"deploy/docker-compose.yml no longer says /{pattern}/: update this test with it"
        return int(match[1])


def read_compose() -> Compose:
    """The compose file as `docker compose up` reads it: with no variables set, or, where the file requires
    the API key, with a random one, as its header tells the operator to make."""
    text = COMPOSE.read_text()
    raw = yaml.safe_load(text)
    environ: dict[str, str] = {}
    try:
        services = _interpolated(raw["services"], environ)
    except ComposeRefused as exc:
        assert "ROLLBUF_API_KEY" in str(exc), exc
        environ = {"ROLLBUF_API_KEY": secrets.token_hex(24)}
        services = _interpolated(raw["services"], environ)
    return Compose(services, text)


def duration_s(text: str) -> float:
    """A compose duration (`15s`, `1m30s`, `500ms`) in seconds."""
    units = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    parts = re.findall(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a compose duration: {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


# --- the Dockerfile ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Image:
    env: dict[str, str]
    """The final stage's ENV, with the image's virtualenv replaced by the one running this test."""
    command: list[str]
    workdir: str


def read_dockerfile() -> Image:
    """The final stage's ENV, ENTRYPOINT + CMD and WORKDIR, as this machine runs them: the image's virtualenv
    (the build stage's `python -m venv DIR`, copied whole) is this repository's."""
    joined = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]
    venv = next((m[1] for line in lines if (m := re.match(r"RUN\s+python\s+-m\s+venv\s+(\S+)", line))), None)
    assert venv, "the Dockerfile no longer makes its virtualenv with `python -m venv DIR`: update this test"
    final = lines[max(i for i, line in enumerate(lines) if line.upper().startswith("FROM ")) + 1 :]
    environ = {"PATH": os.environ["PATH"]}  # the base image's, in place of python:3.11-slim's
    entrypoint: list[str] = []
    command: list[str] = []
    workdir = "/"
    for line in final:
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "ENV":
            for item in shlex.split(rest):
                key, eq, value = item.partition("=")
                assert eq, f"ENV {rest}: only the KEY=VALUE form is read here"
                value = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: environ.get(m[1], ""), value)
                environ[key] = value.replace(venv, sys.prefix)
        elif instruction in ("CMD", "ENTRYPOINT"):
            assert rest.startswith("["), f"{instruction} {rest}: only the exec (JSON) form is read here"
            argv = json.loads(rest)
            if instruction == "CMD":
                command = argv
            else:
                entrypoint = argv
        elif instruction == "WORKDIR":
            workdir = rest.strip()
    return Image(environ, [*entrypoint, *command], workdir)


@cache
def serve_help() -> str:
    """`rollbuf serve --help`'s options, in one line: where each setting's default is written."""
    rollbuf = Path(sys.prefix) / "bin" / "rollbuf"
    out = subprocess.run([rollbuf, "serve", "--help"], capture_output=True, text=True, check=True, timeout=GUARD_S)
    return " ".join(out.stdout.partition("options:")[2].split())


def setting(environment: Mapping[str, str], name: str) -> str:
    """A replica's setting: its ROLLBUF_* variable, else `rollbuf serve --help`'s default."""
    variable = f"ROLLBUF_{name.upper()}"
    if variable in environment:
        return environment[variable]
    flag = "--" + name.replace("_", "-")
    match = re.search(re.escape(flag) + r" [A-Z]+ .*?\(default: ([^)]*)\)", serve_help())
    assert match, f"`rollbuf serve --help` shows no default for {flag}"
    return match[1]


# --- nginx -------------------------------------------------------------------------------------------------------


def nginx_time_s(text: str) -> float:
    units = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
    match = re.fullmatch(r"(\d+)(ms|s|m|h|d)?", text)
    assert match, f"not an nginx time: {text!r}"
    return int(match[1]) * units[match[2] or "s"]


def nginx_size(text: str) -> int:
    match = re.fullmatch(r"(\d+)([kKmMgG])?", text)
    assert match, f"not an nginx size: {text!r}"
    return int(match[1]) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[(match[2] or "").lower()]


def directive(text: str, name: str) -> str | None:
    """The argument of a one-argument directive (the conf sets each once), None if the conf does not set it."""
    found = re.findall(rf"^\s*{name}\s+([^;\s]+)\s*;", text, re.M)
    assert len(found) <= 1, f"{name} is set {len(found)} times: this test reads one"
    return found[0] if found else None


def upstream_block(text: str) -> str:
    match = re.search(r"upstream\s+\S+\s*\{([^}]*)\}", text)
    assert match, "deploy/nginx.conf has no upstream block"
    return match[1]


UPSTREAM_SERVER = re.compile(r"^(\s*server\s+)([A-Za-z0-9_.-]+):(\d+)\b", re.M)
LISTEN = re.compile(r"^(\s*listen\s+)(\d+)\s*;", re.M)


def nginx_conf_here(text: str, ports: Mapping[str, int], listen_port: int, run_dir: Path) -> str:
    """deploy/nginx.conf with each upstream `server NAME:PORT` at 127.0.0.1 and the replica's port here, `listen`
    on a free loopback port, and its access log and temporary files in `run_dir` (the pid file and the error log
    are given on nginx's command line)."""
    text, n = UPSTREAM_SERVER.subn(lambda m: f"{m[1]}127.0.0.1:{ports[m[2]]}", text)
    assert n == len(ports)
    text, n = LISTEN.subn(lambda m: f"{m[1]}127.0.0.1:{listen_port};", text)
    assert n == 1
    paths = "".join(
        f"\n  {kind}_temp_path {run_dir / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    text, n = re.subn(
        r"^(\s*http\s*\{)",
        lambda m: f"{m[1]}\n  access_log {run_dir / 'access.log'};{paths}",
        text,
        count=1,
        flags=re.M,
    )
    assert n == 1
    return text


def nginx_binary() -> str:
    """nginx, installed by `make test` as root (Makefile: nginx). Missing: a failure in CI and as root, a skip
    otherwise (a developer without root), as the image test does with podman."""
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        message = "nginx is not installed: the deploy/ test needs it (apt-get install nginx; make test does, as root)"
        if os.environ.get("CI") or os.geteuid() == 0:
            pytest.fail(message)
        pytest.skip(message)
    return found


# --- processes ---------------------------------------------------------------------------------------------------


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(POLL_S)


def answers(url: str, status: int = 200) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == status
    except httpx.TransportError:
        return False


@dataclass
class Replica:
    name: str
    port: int
    environment: dict[str, str]
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def waiting_long_polls(self, key: str) -> float:
        with httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=10) as c:
            text = c.get("/metrics").text
        samples = (s for family in text_string_to_metric_families(text) for s in family.samples)
        return sum(sample.value for sample in samples if sample.name == WAITING)


@contextmanager
def replicas(compose: Compose, image: Image, store: str, tmp_path: Path) -> Iterator[dict[str, Replica]]:
    """Every replica service started as its container would start it, ready (`/readyz` answers 200); each killed
    through its process group at the end, whatever the test did to it."""
    started: dict[str, Replica] = {}
    try:
        for name, service in compose.replicas.items():
            environment = {**os.environ, **image.env}
            for key, value in service.get("environment", {}).items():
                assert isinstance(value, str), f"{name}: {key} is not a string (quote it in the compose file)"
                environment[key] = value
            environment["ROLLBUF_STORE"] = store
            environment["ROLLBUF_PORT"] = str(port := free_port())
            argv = list(image.command)
            executable = shutil.which(argv[0], path=environment["PATH"])
            assert executable and executable.startswith(sys.prefix), f"{argv[0]} is not this virtualenv's"
            workdir = tmp_path / name / image.workdir.lstrip("/")
            workdir.mkdir(parents=True)
            log = tmp_path / f"{name}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    [executable, *argv[1:]],
                    cwd=workdir,
                    env=environment,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            started[name] = Replica(name, port, environment, proc, log)
        for replica in started.values():

            def ready(replica: Replica = replica) -> bool:
                assert replica.alive(), f"{replica.name} exited {replica.proc.returncode}:\n{replica.log_tail()}"
                return answers(replica.url + "/readyz")

            wait_for(ready, f"{replica.name} ready")
        yield started
    finally:
        for replica in started.values():
            if replica.alive():
                os.killpg(replica.proc.pid, signal.SIGKILL)
            replica.proc.wait(timeout=GUARD_S)


@contextmanager
def nginx(conf: str, run_dir: Path, port: int) -> Iterator[str]:
    """nginx on `conf` in the foreground, as the nginx image runs it; ready when it proxies `/readyz`."""
    binary = nginx_binary()
    conf_path = run_dir / "nginx.conf"
    conf_path.write_text(conf)
    command = [
        binary,
        "-p",
        f"{run_dir}/",
        "-c",
        str(conf_path),
        "-g",
        f"daemon off; pid {run_dir / 'nginx.pid'}; error_log {run_dir / 'error.log'};",
    ]
    checked = subprocess.run([*command, "-t"], capture_output=True, text=True, timeout=GUARD_S)
    assert checked.returncode == 0, f"nginx -t refuses deploy/nginx.conf:\n{checked.stderr}"
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert proc.poll() is None, f"nginx exited {proc.returncode}:\n{(run_dir / 'error.log').read_text()}"
            return answers(url + "/readyz")

        wait_for(ready, "nginx proxying /readyz")
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # nginx's fast shutdown
        try:
            proc.wait(timeout=GUARD_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=GUARD_S)


@dataclass
class LongPoll:
    """`GET /batch?wait=` in a thread of its own, with a client of its own."""

    url: str
    key: str
    wait: float = GUARD_S - 10
    response: list[httpx.Response] = field(default_factory=list)
    error: list[BaseException] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        headers = {"Authorization": f"Bearer {self.key}"}
        try:
            with httpx.Client(base_url=self.url, headers=headers, timeout=GUARD_S) as c:
                self.response.append(c.get("/batch", params={"wait": self.wait}))
        except BaseException as exc:  # reported by result()
            self.error.append(exc)

    def result(self) -> httpx.Response:
        self.thread.join(timeout=GUARD_S)
        assert not self.thread.is_alive(), "the long-poll was never answered"
        assert not self.error, f"the long-poll failed: {self.error[0]!r}"
        return self.response[0]


def healthcheck(service: Mapping[str, Any], port: int, container_port: int, environment: Mapping[str, str]) -> int:
    """The service's `healthcheck.test` run here (`CMD` form), aimed at `port` in place of the container's port;
    its exit status."""
    test = list(service["healthcheck"]["test"])
    assert test[0] == "CMD", f"healthcheck {test}: only the CMD form is run here"
    argv = [arg.replace(f":{container_port}/", f":{port}/") for arg in test[1:]]
    assert argv != test[1:], f"the healthcheck does not name port {container_port}: {test}"
    executable = shutil.which(argv[0], path=environment["PATH"])
    assert executable, f"{argv[0]} is not on the image's PATH"
    done = subprocess.run([executable, *argv[1:]], env=dict(environment), capture_output=True, timeout=GUARD_S)
    return done.returncode


def connections(dbname: str) -> int:
    with pg.admin() as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (dbname,)).fetchone()
    assert row is not None
    return int(str(row[0]))


def store_url_here(compose_url: str, dbname: str) -> str:
    """The replicas' ROLLBUF_STORE with the test's database (its server, user, name) in place of the `postgres`
    service's, its query parameters kept."""
    url, local = urlsplit(compose_url), urlsplit(pg.url_of(dbname))
    return urlunsplit((url.scheme, local.netloc, local.path, url.query, url.fragment))


# --- PostgreSQL's flags ------------------------------------------------------------------------------------------


def postgres_flags(compose: Compose) -> list[tuple[str, str]]:
    command = list(compose.services["postgres"]["command"])
    assert command[0] == "postgres", command
    pairs = command[1:]
    assert len(pairs) % 2 == 0 and all(flag == "-c" for flag in pairs[::2]), f"only `-c NAME=VALUE`: {command}"
    flags = [setting_.partition("=") for setting_ in pairs[1::2]]
    assert all(eq for _, eq, _ in flags), command
    return [(name, value) for name, _, value in flags]


def postgres_binary(compose: Compose) -> Path:
    """The `postgres` binary of the image's major version (`postgres:15` -> PostgreSQL 15's, Debian's layout)."""
    image = compose.services["postgres"]["image"]
    match = re.fullmatch(r"postgres:(\d+)\b.*", image)
    assert match, f"the postgres service's image {image!r} names no major version"
    binary = Path(f"/usr/lib/postgresql/{match[1]}/bin/postgres")
    if not binary.exists():
        pytest.fail(
            f"{binary} is missing: the flags of {image} are checked by PostgreSQL {match[1]}'s own binary "
            f"(apt-get install postgresql-{match[1]})"
        )
    return binary


def apply_database_flags(compose: Compose, dbname: str) -> list[str]:
    """The flags a database can hold (pg_settings' context `user` or `superuser`), set on `dbname`; their names.
    A name the server does not know fails here too."""
    applied = []
    with pg.admin() as conn:
        for name, value in postgres_flags(compose):
            row = conn.execute("SELECT context FROM pg_settings WHERE name = %s", (name,)).fetchone()
            assert row is not None, f"the postgres service's -c {name}={value}: PostgreSQL has no such setting"
            if row[0] in ("user", "superuser"):
                conn.execute(f'ALTER DATABASE "{dbname}" SET "{name}" = {psql_literal(value)}')
                applied.append(name)
    return applied


def psql_literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


# --- the tests ---------------------------------------------------------------------------------------------------


def test_postgres_flags_are_settings_postgres_takes(tmp_path: Path) -> None:
    """Each `-c` of the postgres service read by PostgreSQL itself, all together, as the container passes them:
    a misspelt name or a value out of its range or enum stops the server, so it fails here. Those a database
    can hold are set on one and read back from a new session there."""
    compose = read_compose()
    binary = postgres_binary(compose)
    data = tmp_path / "pgdata"  # `postgres -C` reads the configuration files, nothing else of a data directory
    data.mkdir()
    (data / "postgresql.conf").touch()
    (data / "postgresql.auto.conf").touch()
    flags = postgres_flags(compose)
    given = [arg for name, value in flags for arg in ("-c", f"{name}={value}")]
    read = subprocess.run(
        [binary, "-C", flags[0][0], "-D", data, *given], capture_output=True, text=True, timeout=GUARD_S
    )
    assert read.returncode == 0, f"PostgreSQL refuses the postgres service's {' '.join(given)}:\n{read.stderr}"
    with pg.database() as dbname:
        applied = apply_database_flags(compose, dbname)
        with psycopg.connect(pg.url_of(dbname), autocommit=True) as conn:
            for name in applied:
                row = conn.execute(f'SHOW "{name}"').fetchone()
                assert row is not None and row[0] == dict(flags)[name], (name, row)


def test_settings_agree() -> None:
    """What the files say of each other: the numbers in their comments, and the values they must keep above or
    below the replicas' settings (read from the replicas' environment, else `rollbuf serve --help`'s defaults)."""
    compose = read_compose()
    image = read_dockerfile()
    conf = NGINX_CONF.read_text()
    postgres = compose.services["postgres"]["environment"]
    flags = dict(postgres_flags(compose))
    workers_total = 0
    for name, service in compose.replicas.items():
        environment = {**image.env, **service["environment"]}
        # docker stop waits this long after SIGTERM, then kills; the server's own wait must end before.
        grace = duration_s(service["stop_grace_period"])
        shutdown = float(setting(environment, "shutdown_timeout"))
        assert grace > shutdown, f"{name}: stop_grace_period {grace} s is not above shutdown_timeout {shutdown} s"
        assert compose.comment_number(r"stop_grace_period:.*#\s*above shutdown_timeout \((\d+) s\)") == shutdown
        # The store: the database the postgres service makes, on its host.
        store = urlsplit(environment["ROLLBUF_STORE"])
        assert (store.hostname, store.port or 5432) == ("postgres", 5432), store
        assert (store.username, store.password) == (postgres["POSTGRES_USER"], postgres["POSTGRES_PASSWORD"])
        assert store.path == "/" + postgres["POSTGRES_DB"], store
        # nginx: the longest long-poll ends before nginx's read timeout; rollbuf, not nginx, answers 413.
        longest = float(setting(environment, "max_batch_wait"))
        read_timeout = nginx_time_s(directive(conf, "proxy_read_timeout") or "60s")
        assert read_timeout > longest, f"proxy_read_timeout {read_timeout} s <= max_batch_wait {longest} s"
        body = int(setting(environment, "max_body_bytes"))
        assert nginx_size(directive(conf, "client_max_body_size") or "1m") >= body
        # nginx closes an idle upstream connection before the replica does: a request nginx sends on one the
        # replica is closing would fail, and a POST that was sent is not resent.
        idle = float(setting(environment, "keepalive_timeout"))
        upstream_idle = directive(upstream_block(conf), "keepalive_timeout")
        kept = nginx_time_s(upstream_idle) if upstream_idle else NGINX_UPSTREAM_KEEPALIVE_DEFAULT_S
        assert kept < idle, f"nginx keeps idle upstream connections {kept} s, {name} closes them after {idle} s"
        workers_total += int(setting(environment, "workers"))
    # nginx sends to every replica service, on the port the image listens on; it listens where lb publishes.
    container_port = int(image.env["ROLLBUF_PORT"])
    upstream = UPSTREAM_SERVER.findall(upstream_block(conf))
    assert sorted(host for _, host, _ in upstream) == sorted(compose.replicas), upstream
    assert {int(port) for _, _, port in upstream} == {container_port}, upstream
    lb = compose.services["lb"]
    assert [v.split(":")[1] for v in lb["volumes"]] == ["/etc/nginx/nginx.conf"], lb["volumes"]
    assert lb["volumes"][0].split(":")[0] == "./nginx.conf", "lb mounts another file than deploy/nginx.conf"
    # The replicas see the name the client asked for, which allowed_hosts checks (docs/security.md).
    assert re.search(r"^\s*proxy_set_header\s+Host\s+\$(host|http_host)\s*;", conf, re.M), "Host is not passed on"
    listen = LISTEN.findall(conf)
    assert [port for _, port in listen] == [lb["ports"][0].split(":")[-1]], (listen, lb["ports"])
    # Connections: what the comments say each process holds; max_connections above them all.
    per_process = compose.comment_number(r"ROLLBUF_WORKERS:.*#.*?(\d+) connections each")
    assert compose.comment_number(r"max_connections=\d+\s*#\s*(\d+) per rollbuf process") == per_process
    assert int(flags["max_connections"]) > workers_total * per_process


def test_compose_deployment(tmp_path: Path) -> None:
    """The deployment running: two replicas on one database behind nginx, used through nginx with the key;
    a long-poll outlasting the replicas' own idle timeouts; a replica killed mid-long-poll, which nginx resends
    to the other; POSTs while that replica is down; a replica stopped as docker stop does, within its grace."""
    compose = read_compose()
    image = read_dockerfile()
    container_port = int(image.env["ROLLBUF_PORT"])
    (name_a, service_a), (name_b, service_b) = compose.replicas.items()
    with ExitStack() as stack:
        dbname = stack.enter_context(pg.database())
        apply_database_flags(compose, dbname)
        store = store_url_here(service_a["environment"]["ROLLBUF_STORE"], dbname)
        assert store_url_here(service_b["environment"]["ROLLBUF_STORE"], dbname) == store
        running = stack.enter_context(replicas(compose, image, store, tmp_path))
        key = running[name_a].environment["ROLLBUF_API_KEY"]
        for name, replica in running.items():
            status = healthcheck(compose.replicas[name], replica.port, container_port, replica.environment)
            assert status == 0, f"{name}'s healthcheck failed on a ready replica:\n{replica.log_tail()}"
        pg_ready = compose.services["postgres"]["healthcheck"]["test"]
        assert pg_ready[0] == "CMD-SHELL", pg_ready
        where = urlsplit(pg.ADMIN_URL)
        pg_env = {**os.environ, "PGHOST": where.hostname or "127.0.0.1", "PGPORT": str(where.port or 5432)}
        ready = subprocess.run(["sh", "-c", pg_ready[1]], env=pg_env, capture_output=True, timeout=GUARD_S)
        assert ready.returncode == 0, f"the postgres service's healthcheck fails: {ready.stdout!r} {ready.stderr!r}"

        run_dir = tmp_path / "nginx"
        run_dir.mkdir()
        listen = free_port()
        conf = nginx_conf_here(NGINX_CONF.read_text(), {n: r.port for n, r in running.items()}, listen, run_dir)
        lb = stack.enter_context(nginx(conf, run_dir, listen))
        c = stack.enter_context(httpx.Client(base_url=lb, headers={"Authorization": f"Bearer {key}"}, timeout=GUARD_S))

        # Through nginx, round robin: each request may land on either replica.
        assert httpx.get(lb + "/status", timeout=GUARD_S).status_code == 401
        assert c.post("/register", json=registration(batch_size=4)).status_code == 200
        assert c.get("/batch").json()["batch"] is None  # the trainer has started: envs may register (Atropos)
        registered = c.post("/register-env", json=env(group_size=4))
        assert registered.status_code == 200, registered.text
        assert "env_id" in registered.json(), registered.text
        env_id = registered.json()["env_id"]
        for i in range(2):
            r = c.post("/scored_data", json=group(4, env_id=env_id, seed=i, group_id=f"first-{i}"))
            assert r.status_code == 200, r.text
        served = [c.get("/batch") for _ in range(2)]
        assert [[g["group_id"] for g in r.json()["batch"]] for r in served] == [["first-0"], ["first-1"]]
        # nginx's $request_id (32 hex digits) reached the replica, which echoes it (its own ids have 16).
        assert all(re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"]) for r in served), served[0].headers
        # A long-poll that outlasts the replicas' keep-alive timeout and nginx's upstream one, answered through
        # nginx when its wait ends (meanwhile, the checks below).
        idle = float(setting(running[name_a].environment, "keepalive_timeout"))
        poll = LongPoll(lb, key, wait=idle + 1)

        # A body over the replicas' max_body_bytes but under nginx's limit: the replica's 413 (JSON), not nginx's.
        over = int(setting(running[name_a].environment, "max_body_bytes")) + 1
        status, headers = declared_body(listen, key, over)
        assert status == 413 and "application/json" in headers.get("content-type", ""), (status, headers)

        # Each process holds what the comments say.
        processes = sum(int(setting(r.environment, "workers")) for r in running.values())
        per_process = compose.comment_number(r"ROLLBUF_WORKERS:.*#.*?(\d+) connections each")
        wait_for(lambda: connections(dbname) == processes * per_process, f"{per_process} connections per process")

        waited = poll.result()
        assert waited.status_code == 200 and waited.json()["batch"] is None, waited.text

        # A replica killed (SIGKILL, the whole container) while it holds a long-poll: nginx resends the GET to the
        # other, whose long-poll a group then wakes.
        poll = LongPoll(lb, key)
        wait_for(lambda: any(r.waiting_long_polls(key) == 1 for r in running.values()), "the long-poll waiting")
        victim = next(r for r in running.values() if r.waiting_long_polls(key) == 1)
        survivor = next(r for r in running.values() if r is not victim)
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(timeout=GUARD_S)
        wait_for(lambda: survivor.waiting_long_polls(key) == 1, "the long-poll resent to the other replica")
        # POSTs while a replica is down: nginx resends those it could not connect for.
        for i in range(4):
            r = c.post("/scored_data", json=group(4, env_id=env_id, seed=10 + i, group_id=f"after-{i}"))
            assert r.status_code == 200, r.text
        woken = poll.result()
        assert woken.status_code == 200, woken.text
        got = [g["group_id"] for g in woken.json()["batch"]]
        got += [g["group_id"] for _ in range(3) for g in c.get("/batch").json()["batch"]]
        assert sorted(got) == [f"after-{i}" for i in range(4)], got
        victim_service = compose.replicas[victim.name]
        assert healthcheck(victim_service, victim.port, container_port, victim.environment) != 0

        # docker stop: SIGTERM to the container's first process, a kill after stop_grace_period. A long-poll in
        # flight is answered and the server exits, cleanly, within it.
        poll = LongPoll(lb, key)
        wait_for(lambda: survivor.waiting_long_polls(key) == 1, "the long-poll waiting on the survivor")
        survivor.proc.send_signal(signal.SIGTERM)
        grace = duration_s(compose.replicas[survivor.name]["stop_grace_period"])
        try:
            code = survivor.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{survivor.name} was still running {grace} s after SIGTERM:\n{survivor.log_tail()}")
        assert code == 0, survivor.log_tail()
        ended = poll.result()
        assert ended.status_code == 200 and ended.json()["batch"] is None, ended.text


def declared_body(port: int, key: str, length: int) -> tuple[int, dict[str, str]]:
    """POST /scored_data declaring a `length`-byte body and sending one byte of it: the answer's status and
    headers."""
    head = (
        f"POST /scored_data HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n{{"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=GUARD_S) as s:
        s.sendall(head)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            assert chunk, f"connection closed before an answer: {data!r}"
            data += chunk
    lines = data.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return status, headers
