"""A replica on a host of its own (a network namespace, reaching PostgreSQL over a veth link) is cut off from
the database while envs post and a trainer reads through it and through a replica that keeps its link. The cut
replica answers 503 within seconds instead of hanging, the other serves on (the store lock the cut one may have
held comes free), the cut one serves again once the link is back, and nothing acknowledged is lost or served
twice. Needs root (network namespaces); skipped without it."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests import pg
from tests.factories import group
from tests.integration.test_postgres_faults import Load, setup_run, wait_for
from tests.relay import Relay
from tests.servers import ServerProcess, start_server

pytestmark = pytest.mark.integration

CUT_ANSWER_S = 30.0
"""A request to the cut replica is answered (503) within this, not after minutes of TCP retransmissions."""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@dataclass
class Host:
    """A network namespace joined to this one by a veth pair. The database is reached at `db_ip`, an address
    of this side of the link with a route of its own in the namespace, so that blackholing that route cuts the
    replica off from the database and nothing else: clients still reach the replica at `ip`."""

    ns: str
    ip: str
    db_ip: str

    @property
    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]

    def cut(self) -> None:
        _ip("netns", "exec", self.ns, "ip", "route", "add", "blackhole", f"{self.db_ip}/32")

    def heal(self) -> None:
        _ip("netns", "exec", self.ns, "ip", "route", "del", "blackhole", f"{self.db_ip}/32")


@pytest.fixture
def host() -> Iterator[Host]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    tag = secrets.token_hex(3)
    ns, outside, inside = f"rb{tag}", f"rbh{tag}", f"rbn{tag}"
    net = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250)}"
    try:
        _ip("netns", "add", ns)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create a network namespace here: {exc.stderr.decode().strip()}")
    try:
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", ns)
        _ip("addr", "add", f"{net}.1/29", "dev", outside)
        _ip("addr", "add", f"{net}.3/32", "dev", outside)
        _ip("link", "set", outside, "up")
        for args in (
            ("addr", "add", f"{net}.2/29", "dev", inside),
            ("link", "set", inside, "up"),
            ("link", "set", "lo", "up"),
        ):
            _ip("netns", "exec", ns, "ip", *args)
        yield Host(ns, f"{net}.2", f"{net}.3")
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)  # the veth pair goes with it
        subprocess.run(["ip", "link", "del", outside], check=False, capture_output=True)


class SilenceAware(Relay):
    """TCP from the namespace to PostgreSQL on loopback (where the machine's server listens). Its sockets toward
    the replica give up on a silent peer as PostgreSQL's own would with rollbuf's session settings
    (`api.store.postgres.SESSION_SETTINGS`), and it then closes the database side: the database sees the
    replica's session end, as it would without a relay in between."""

    def prepare(self, client: socket.socket) -> None:
        for option, value in (
            (socket.TCP_KEEPIDLE, 5),
            (socket.TCP_KEEPINTVL, 2),
            (socket.TCP_KEEPCNT, 3),
            (socket.TCP_USER_TIMEOUT, 10_000),
        ):
            client.setsockopt(socket.IPPROTO_TCP, option, value)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


def served_by(load: Load, server: ServerProcess) -> int:
    with load.lock:
        return sum(n for url, n in load.ok_by_url.items() if url.rstrip("/") == server.url)


def test_a_replica_cut_off_from_the_database(dbname: str, host: Host, tmp_path: Path) -> None:
    relay = SilenceAware(("127.0.0.1", 5432), listen=host.db_ip)
    local = pg.url_of(dbname)
    remote = local.replace("127.0.0.1:5432", f"{host.db_ip}:{relay.port}")
    servers: list[ServerProcess] = []
    try:
        cut = start_server(remote, tmp_path / "cut.log", None, host=host.ip, prefix=host.prefix)
        servers.append(cut)
        kept = start_server(local, tmp_path / "kept.log")
        servers.append(kept)
        env_ids, step = setup_run(kept.url)
        load = Load([cut.url, kept.url], env_ids, step)
        load.start()
        wait_for(
            lambda: served_by(load, cut) >= 50 and served_by(load, kept) >= 50 and load.step >= 5,
            "load through both replicas",
        )

        host.cut()
        cut_at = time.monotonic()
        with load.lock:
            load.attempted.add("probe")
        probe = group(4, env_id=env_ids[0], seed=99, group_id="probe")
        with httpx.Client(timeout=CUT_ANSWER_S + 30) as c:
            r = c.post(cut.url + "/scored_data", json=probe)
            answered = time.monotonic() - cut_at
            assert r.status_code == 503, r.text
            assert answered < CUT_ANSWER_S, f"the cut replica answered after {answered:.1f} s"
            assert "Retry-After" in r.headers
            assert c.get(cut.url + "/readyz").status_code == 503
            assert c.get(cut.url + "/healthz").status_code == 200
            # the probe goes to the other replica, as a client's retry would: stored once, whatever happened. It
            # may wait for the store lock that the cut replica's session held when the link went (a 503 after
            # lock_timeout, until the database has dropped that session).
            retry = c.post(kept.url + "/scored_data", json=probe)
            while retry.status_code == 503 and time.monotonic() - cut_at < CUT_ANSWER_S + 30:
                retry = c.post(kept.url + "/scored_data", json=probe)
            assert retry.status_code == 200, retry.text
        with load.lock:
            acked, batches = len(load.acked), load.step
        wait_for(lambda: len(load.acked) >= acked + 20 and load.step >= batches + 3, "the other replica serving on")

        host.heal()
        healed = served_by(load, cut)
        wait_for(lambda: served_by(load, cut) >= healed + 20, "the cut replica serving again, without a restart")
        load.finish()
        load.acked.add("probe")
        load.check(step)
        assert load.codes["500"] == 0
    finally:
        for s in servers:
            s.kill()
        relay.close()


@pytest.fixture
def dbname() -> Iterator[str]:
    with pg.database() as name:
        yield name
