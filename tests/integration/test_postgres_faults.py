"""Two real `rollbuf serve` replicas on one PostgreSQL database, under load, while things break: a replica
killed with kill -9, the database server stopped immediately, a connection cut mid-transaction and right
after COMMIT was sent. Nothing acknowledged is lost, nothing is served twice, every batch is exact, steps
have no gaps, and the service answers 503 (never 500) while it cannot be sure."""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests import pg
from tests.factories import env, group, registration
from tests.relay import Relay, hang_up
from tests.servers import ServerProcess, start_server

pytestmark = pytest.mark.integration

BATCH = 8
GROUP = 4
PROGRESS_TIMEOUT_S = 120.0
POLL_S = 0.05
"""Polling interval while waiting for the load to make progress (never a wait for a result itself)."""


@pytest.fixture
def dbname() -> Iterator[str]:
    with pg.database() as name:
        yield name


def wait_for(condition: object, what: str, timeout: float = PROGRESS_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(POLL_S)


@dataclass
class Load:
    """Envs posting through every replica and a trainer reading `?step=N` through every replica. A request
    that fails (503, connection refused or reset) is sent again to the next replica, with the same group id
    or step: the retry a real client makes."""

    urls: list[str]
    env_ids: list[int]
    step: int
    acked: set[str] = field(default_factory=set)
    attempted: set[str] = field(default_factory=set)
    batches: dict[int, list[str]] = field(default_factory=dict)
    sizes: dict[int, int] = field(default_factory=dict)
    codes: Counter[str] = field(default_factory=Counter)
    bad: list[str] = field(default_factory=list)
    """Answers that must never happen: a 500, a 4xx to a valid request, a batch for the wrong step."""
    ok_by_url: Counter[str] = field(default_factory=Counter)
    ok_times: list[tuple[float, str]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self, producers: int = 4) -> None:
        self.threads = [threading.Thread(target=self._produce, args=(w,)) for w in range(producers)]
        self.threads.append(threading.Thread(target=self._train))
        for t in self.threads:
            t.start()

    def finish(self, timeout: float = PROGRESS_TIMEOUT_S) -> None:
        """Stop producing; the trainer drains the queue, then stops too."""
        self.stop.set()
        for t in self.threads:
            t.join(timeout)
            assert not t.is_alive(), "a load thread did not finish"

    def _note(self, url: str, code: str) -> None:
        with self.lock:
            self.codes[code] += 1
            if code == "200":
                self.ok_by_url[url] += 1
                self.ok_times.append((time.monotonic(), url))

    def _send(self, clients: list[httpx.Client], k: int, method: str, path: str, **kw: object) -> httpx.Response:
        """Send until a replica answers something other than 503 / a transport error; rotate replicas."""
        while True:
            c = clients[k % len(clients)]
            k += 1
            try:
                r = c.request(method, path, **kw)  # type: ignore[arg-type]
            except httpx.TransportError as exc:
                self._note(str(c.base_url), type(exc).__name__)
            else:
                self._note(str(c.base_url), str(r.status_code))
                if r.status_code != 503:
                    return r
            if self.stop.is_set() and method == "POST":
                raise _Stopped
            time.sleep(POLL_S)  # back off before the retry, as clients do

    def _produce(self, worker: int) -> None:
        clients = [httpx.Client(base_url=u, timeout=10) for u in self.urls]
        try:
            for i in range(10**6):
                if self.stop.is_set():
                    return
                gid = f"w{worker}-{i}"
                with self.lock:
                    self.attempted.add(gid)
                body = group(GROUP, env_id=self.env_ids[(worker + i) % len(self.env_ids)], seed=i, group_id=gid)
                try:
                    r = self._send(clients, worker + i, "POST", "/scored_data", json=body)
                except _Stopped:
                    return
                if r.status_code == 200:
                    with self.lock:
                        self.acked.add(gid)
                else:
                    self.bad.append(f"POST {gid}: {r.status_code} {r.text[:200]}")
        finally:
            for c in clients:
                c.close()

    def _train(self) -> None:
        clients = [httpx.Client(base_url=u, timeout=10) for u in self.urls]
        filler = 0
        try:
            while True:
                r = self._send(clients, self.step, "GET", "/batch", params={"step": self.step, "wait": 0.5})
                if r.status_code != 200:
                    self.bad.append(f"GET /batch?step={self.step}: {r.status_code} {r.text[:200]}")
                    return
                batch = r.json()["batch"]
                if not batch:
                    if self.stop.is_set() and all(not t.is_alive() for t in self.threads[:-1]):
                        status = self._send(clients, 0, "GET", "/status").json()
                        if status["queue_size"] == 0:
                            return
                        # Half a batch left: a filler group completes it.
                        filler += 1
                        body = group(GROUP, env_id=self.env_ids[0], seed=10**6 + filler, group_id=f"filler-{filler}")
                        self._send(clients, filler, "POST", "/scored_data", json=body)
                    continue
                if r.headers.get("X-Rollbuf-Step") != str(self.step):
                    self.bad.append(f"asked for step {self.step}, got {r.headers.get('X-Rollbuf-Step')}")
                self.batches[self.step] = [g["group_id"] for g in batch]
                self.sizes[self.step] = sum(len(g["tokens"]) for g in batch)
                self.step += 1
        finally:
            for c in clients:
                c.close()

    def check(self, first_step: int) -> None:
        """What every fault must leave true."""
        assert not self.bad, self.bad[:5]
        assert sorted(self.batches) == list(range(first_step, self.step)), "steps have gaps"
        assert set(self.sizes.values()) == {BATCH}, f"batch sizes {Counter(self.sizes.values())}"
        served = [g for gids in self.batches.values() for g in gids if not g.startswith("filler-")]
        twice = [g for g, n in Counter(served).items() if n > 1]
        assert not twice, f"groups served twice: {twice[:5]}"
        lost = self.acked - set(served)
        assert not lost, f"acknowledged groups never served: {sorted(lost)[:5]}"
        assert set(served) <= self.attempted, "a group nobody sent was served"
        assert self.codes["500"] == 0


class _Stopped(Exception):
    pass


def setup_run(url: str) -> tuple[list[int], int]:
    with httpx.Client(base_url=url, timeout=10) as c:
        assert c.post("/register", json=registration(batch_size=BATCH)).status_code == 200
        assert c.get("/batch", params={"step": 0}).status_code == 200
        env_ids = [c.post("/register-env", json=env(f"e{i}", group_size=GROUP)).json()["env_id"] for i in range(2)]
    return env_ids, 0


def replicas(dbname: str, tmp_path: Path, n: int = 2, **params: str) -> list[ServerProcess]:
    url = pg.url_of(dbname, **params)
    return [start_server(url, tmp_path / f"replica-{i}.log") for i in range(n)]


def test_kill_9_of_one_replica_under_load(dbname: str, tmp_path: Path) -> None:
    servers = replicas(dbname, tmp_path)
    try:
        env_ids, step = setup_run(servers[0].url)
        load = Load([s.url for s in servers], env_ids, step)
        load.start()
        wait_for(lambda: len(load.acked) >= 100 and load.step >= 5, "load through both replicas")
        assert all(load.ok_by_url[s.url + "/"] or load.ok_by_url[s.url] for s in servers)
        victim = servers[1]
        victim.kill()  # SIGKILL to its process group, in the middle of requests
        before = len(load.acked)
        wait_for(lambda: len(load.acked) >= before + 100, "the survivor serving alone")
        servers[1] = start_server(victim.store, victim.log, victim.port)  # the same address: clients rejoin it
        with load.lock:
            rejoined_from = sum(n for u, n in load.ok_by_url.items() if str(victim.port) in u)
        wait_for(
            lambda: sum(n for u, n in load.ok_by_url.items() if str(victim.port) in u) >= rejoined_from + 20,
            "the restarted replica serving again",
        )
        load.finish()
        load.check(step)
    finally:
        for s in servers:
            s.kill()


@pytest.fixture
def cluster_restarted() -> Iterator[None]:
    """Whatever happens in the test, the cluster is running again afterwards."""
    if not pg.CLUSTER_TESTS:
        pytest.skip(
            "stops the machine's PostgreSQL cluster, which other developers' tests on this machine use: runs in "
            "CI (CI=true), or locally with ROLLBUF_TEST_PG_CLUSTER=1"
        )
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        pytest.fail(
            "stops the machine's PostgreSQL, which tests on the other pytest-xdist workers use: run it alone, "
            "`pytest -m pg_cluster` (make test does, after the parallel run)",
            pytrace=False,
        )
    try:
        yield
    finally:
        pg.start_cluster()


@pytest.mark.pg_cluster
def test_database_stopped_immediately_under_load(dbname: str, tmp_path: Path, cluster_restarted: None) -> None:
    servers = replicas(dbname, tmp_path, pool_timeout="1")  # a 503 after 1 s without a connection: a short outage
    try:
        env_ids, step = setup_run(servers[0].url)
        load = Load([s.url for s in servers], env_ids, step)
        load.start()
        wait_for(lambda: len(load.acked) >= 100 and load.step >= 5, "load through both replicas")
        try:
            stopped = time.monotonic()
            pg.stop_cluster_immediately()
            with load.lock:
                unavailable = load.codes["503"]
            wait_for(lambda: load.codes["503"] >= unavailable + 2, "503s while the database is down", 30)
            restarting = time.monotonic()
        finally:
            pg.start_cluster()
        started = time.monotonic()
        with load.lock:
            acked, ok = len(load.acked), dict(load.ok_by_url)
        # Replicas recover by themselves: both serve again, without a restart.
        wait_for(lambda: len(load.acked) >= acked + 100, "ingest after the database came back")
        wait_for(lambda: all(load.ok_by_url[u] > ok.get(u, 0) + 10 for u in ok), "both replicas serving again")
        assert all(s.proc.poll() is None for s in servers), "a replica died with the database"
        load.finish()
        load.check(step)
        assert load.codes["503"] > 0
        recovered = [min(t for t, u in load.ok_times if u == url and t > started) - started for url in ok]
        print(
            f"database down {started - stopped:.1f} s (starting it: {started - restarting:.1f} s); "
            f"answers {dict(load.codes)}; {len(load.acked)} groups acked, "
            f"{load.step - step} batches; first 200 per replica {[round(t, 2) for t in recovered]} s after restart"
        )
    finally:
        for s in servers:
            s.kill()


# ------------------------------------------------------------------------------------------ a TCP proxy


class CuttingProxy(Relay):
    """Forwards TCP between a replica and PostgreSQL. Armed with a marker, it cuts the connection of the
    transaction that sends the marker (a group id travels as a parameter; b"" matches any), at its COMMIT:
    "before_commit" drops the COMMIT (the server rolls back what the transaction did), "after_commit"
    forwards it and swallows the server's answer until the COMMIT is done, so the client never hears that it
    committed."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.armed: tuple[str, bytes] | None = None
        self.cuts = 0
        self.lock = threading.Lock()
        super().__init__(upstream)

    def arm(self, mode: str, marker: bytes = b"") -> None:
        with self.lock:
            self.armed = (mode, marker)

    def serve(self, client: socket.socket, server: socket.socket) -> None:
        """Client to server on this thread, server to client on another; a cut closes both."""
        swallow = threading.Event()
        committed = threading.Event()

        def back() -> None:
            tail = b""
            try:
                while data := server.recv(65536):
                    if not swallow.is_set():
                        client.sendall(data)
                        continue
                    window = tail + data  # the tag may sit anywhere in a chunk, or be split between two
                    if b"COMMIT\x00" in window:  # CommandComplete of the COMMIT: the transaction is durable
                        return
                    tail = window[-64:]
            except OSError:
                pass
            finally:
                committed.set()

        threading.Thread(target=back, daemon=True).start()
        tail = b""  # the end of the previous chunk: a marker split between two reads is still seen
        marked = False
        try:
            while data := client.recv(65536):
                window, tail = tail + data, data[-256:]
                commit = b"COMMIT" in window
                if commit:
                    tail = b""  # seen once
                with self.lock:
                    armed = self.armed
                    if armed is not None and not marked and armed[1] in window:
                        marked = True
                    if armed is None or not marked or not commit:
                        armed = None
                    else:
                        self.armed = None
                        self.cuts += 1
                if armed is None:
                    server.sendall(data)
                    continue
                if armed[0] == "after_commit":
                    swallow.set()
                    server.sendall(data)
                    # The driver may send the Sync that makes the server run the COMMIT in a later chunk: keep
                    # forwarding until the server has answered the COMMIT, or it never runs.
                    client.settimeout(0.05)
                    while not committed.is_set():
                        try:
                            more = client.recv(65536)
                        except TimeoutError:
                            continue
                        if not more:
                            break
                        server.sendall(more)
                    committed.wait(30)
                return  # before_commit: the COMMIT never reaches the server
        except OSError:
            pass
        finally:
            hang_up(client, server, close=True)


def test_connection_cut_mid_transaction_and_after_commit(dbname: str, tmp_path: Path) -> None:
    proxy = CuttingProxy(("127.0.0.1", 5432))
    host_url = pg.url_of(dbname)
    through_proxy = host_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    assert through_proxy != host_url
    server = start_server(through_proxy, tmp_path / "replica.log")
    try:
        env_ids, step = setup_run(server.url)
        with httpx.Client(base_url=server.url, timeout=30) as c:

            def status() -> dict[str, object]:
                return dict(c.get("/status").json())

            # Ingest, cut when COMMIT is due: 503 either way; stored only if the COMMIT got through, and then
            # the client's retry is a duplicate.
            for mode, gid in (("before_commit", "cut-before"), ("after_commit", "cut-after")):
                before = status()
                proxy.arm(mode, gid.encode())
                body = group(GROUP, env_id=env_ids[0], seed=random.randrange(10**6), group_id=gid)
                r = c.post("/scored_data", json=body)
                assert r.status_code == 503 and "Retry-After" in r.headers, (mode, r.status_code, r.text)
                stored = 1 if mode == "after_commit" else 0
                assert status()["queue_size"] == before["queue_size"] + stored, mode  # type: ignore[operator]
                again = c.post("/scored_data", json=body)  # the client's retry
                assert again.status_code == 200
                assert again.json().get("duplicate", False) == (mode == "after_commit"), mode
                assert status()["queue_size"] == before["queue_size"] + 1, f"{mode}: stored once"  # type: ignore[operator]

            # Batch formation cut before its COMMIT, after it popped the items and stored the batch on the server:
            # the queue and the step are as they were, and the retry forms the batch.
            before = status()
            proxy.arm("before_commit")
            r = c.get("/batch", params={"step": step})
            assert r.status_code == 503, r.text
            assert status() == before, "nothing of the formation applied"
            batch = c.get("/batch", params={"step": step}).json()["batch"]
            assert sorted(g["group_id"] for g in batch) == ["cut-after", "cut-before"]
            # Formed and committed, the answer lost: the retry gets the batch that was committed, not another.
            for i in range(4):
                body = group(GROUP, env_id=env_ids[1], seed=i, group_id=f"next-{i}")
                assert c.post("/scored_data", json=body).status_code == 200
            proxy.arm("after_commit")
            assert c.get("/batch", params={"step": step + 1}).status_code == 503
            assert status()["current_step"] == step + 2, "batch step+1 was formed"
            retry = c.get("/batch", params={"step": step + 1})
            assert sorted(g["group_id"] for g in retry.json()["batch"]) == ["next-0", "next-1"]
            assert status()["queue_size"] == 2
        assert proxy.cuts == 4
    finally:
        server.kill()
        proxy.close()
