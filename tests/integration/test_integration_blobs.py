"""The blob tier against a real server killed with kill -9 while producers post groups whose images are blobs: every
acknowledged group is served with its image (no reference without its blob), and the blobs of groups that were
never acknowledged (written before a transaction the kill cut off) are gone after the next collection."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import msgpack
import pytest

from api.store.blobs import LocalBlobs
from api.wire.blobs import digest_of, owner_tag
from tests.factories import env, group, registration
from tests.servers import start_server

pytestmark = pytest.mark.integration

SMALL_BLOBS = {"ROLLBUF_BLOB_MIN_BYTES": "1024"}
COLLECTING = {**SMALL_BLOBS, "ROLLBUF_BLOB_GRACE_S": "1", "ROLLBUF_BLOB_SWEEP_S": "0.2"}
"""After the restart: a blob nothing refers to goes within about a second (no request is slow here)."""


def image(gid: str) -> str:
    return f"{gid}:" + "x" * 3000


def blob_files(db: Path) -> list[Path]:
    root = Path(f"{db}.blobs")
    return [p for p in root.rglob("*") if p.is_file() and p.parent.name != "tmp"]


def poll(until: float, check: Callable[[], bool]) -> bool:
    while time.monotonic() < until:
        if check():
            return True
        time.sleep(0.1)  # polling interval, not a wait for the condition
    return False


def test_kill_9_between_blob_puts_and_acknowledgments(tmp_path: Path) -> None:
    db = tmp_path / "buffer.db"
    store, log = f"sqlite:///{db}", tmp_path / "server.log"
    server = start_server(store, log, env=SMALL_BLOBS)
    try:
        with httpx.Client(base_url=server.url, timeout=10) as c:
            c.post("/register", json=registration(batch_size=4))
            c.get("/batch", params={"step": 0})
            env_id = c.post("/register-env", json=env("e", group_size=4)).json()["env_id"]

        acked: list[str] = []
        lock = threading.Lock()
        enough = threading.Event()

        def produce(worker: int) -> None:
            with httpx.Client(base_url=server.url, timeout=5) as c:
                for i in range(10_000):
                    gid = f"w{worker}-{i}"
                    body = group(4, env_id=env_id, seed=i, group_id=gid, images=[image(gid)] * 4)
                    try:
                        r = c.post("/scored_data", json=body)
                    except httpx.TransportError:
                        return  # the server died under us: never acknowledged
                    if r.status_code == 200:
                        with lock:
                            acked.append(gid)
                            if len(acked) >= 100:
                                enough.set()

        workers = [threading.Thread(target=produce, args=(w,)) for w in range(4)]
        for t in workers:
            t.start()
        assert enough.wait(timeout=120), "producers made no progress"
        server.kill()  # SIGKILL, mid-load: some blobs are written whose groups were never acknowledged
        for t in workers:
            t.join(timeout=30)
        # What a kill between a put and its acknowledgment leaves, whether or not this kill hit that instant: a
        # blob written (by the key-less owner's put) and no group stored that refers to it.
        orphan = msgpack.packb(image("never-acknowledged"))
        LocalBlobs(Path(f"{db}.blobs")).put(owner_tag(""), digest_of(orphan), orphan)
        before = len(blob_files(db))

        server = start_server(store, log, env=COLLECTING)
        with httpx.Client(base_url=server.url, timeout=10) as c:
            queued = c.get("/status").json()["queue_size"]
            assert queued >= len(acked) and before > queued
            # one blob per stored group (each sent its own image to its 4 siblings), none for the others
            assert poll(time.monotonic() + 60, lambda: len(blob_files(db)) == queued), (before, queued)
            served: dict[str, str] = {}
            step = 0
            while len(served) < queued:
                r = c.get("/batch", params={"step": step})
                assert r.status_code == 200, r.text
                for g in r.json()["batch"] or []:
                    served[g["group_id"]] = g["images"][0]
                step += 1
                assert step <= queued + 1, "the queue does not drain"
            assert not set(acked) - set(served), "an acknowledged group was lost"
            assert all(img == image(gid) for gid, img in served.items())
            c.get("/batch", params={"step": step})  # every batch acknowledged: nothing refers to a blob now
            assert poll(time.monotonic() + 60, lambda: blob_files(db) == []), len(blob_files(db))
    finally:
        server.kill()
