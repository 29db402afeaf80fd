"""What one key can make the server hold, against a real `rollbuf serve` (docs/security.md, "Bounds per key"):
datasets, task bytes, lease replies, producers and open groups are bounded per key, so that one key filling its
share holds no other key back; the run-wide views list a bounded number of datasets and producers however many
there are; a file registration retried while its file is being read stores each task once; and a request the
schema accepts is refused for the server's state with 404 (unknown) or 409 (a conflict), never 422.

The bounds are set through `ROLLBUF_*` variables (a server that does not know one ignores it) at a small scale:
the attacks they stop are the same at any scale."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.factories import env, registration
from tests.servers import ServerProcess, running_server

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("key_bounds")]
KiB = 1024
ROLES = {
    "env-1": "env",
    "env-2": "env",
    "env-3": "env",
    "env-4": "env",
    "files": "env",
    "ops": "admin",
    "trainer": "trainer",
}
SECRETS = {name: f"{name}-secret-0123456789" for name in ROLES}
BOUNDS = {
    "ROLLBUF_TASK_MAX_DATASETS_PER_KEY": "4",
    "ROLLBUF_TASK_MAX_BYTES_PER_KEY": str(6144 * KiB),
    "ROLLBUF_TASK_LEASE_MAX_BYTES": str(256 * KiB),
    "ROLLBUF_MAX_PRODUCERS": "24",
    "ROLLBUF_MAX_PRODUCERS_PER_KEY": "6",
    "ROLLBUF_ROLLOUT_MAX_OPEN_GROUPS_PER_KEY": "5",
    "ROLLBUF_VIEWS_MAX_DATASETS": "3",
    "ROLLBUF_VIEWS_MAX_PRODUCERS": "3",
}
TASK_60K = {"blob": "x" * (60 * KiB)}
LINES = 20_000
"""Lines of the dataset file the server reads (a page of 20 tasks per transaction)."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("key_bounds")
    keys = tmp / "keys"
    keys.write_text("".join(f"{name} {ROLES[name]} {secret}\n" for name, secret in SECRETS.items()))
    (tmp / "files").mkdir()
    (tmp / "files" / "lines.jsonl").write_text("".join(f'{{"i":{i}}}\n' for i in range(LINES)))
    flags = (
        "--api-keys-file",
        str(keys),
        "--max-batch-wait",
        "0",
        "--task-files-dir",
        str(tmp / "files"),
        "--task-page-size",
        "20",
    )
    with running_server(f"sqlite:///{tmp / 'rollbuf.db'}", tmp / "server.log", *flags, env=BOUNDS) as server:
        with client(server, "trainer") as trainer:
            assert trainer.post("/register", json=registration(batch_size=64)).status_code == 200
            assert trainer.get("/batch").status_code == 200  # envs may register now
        yield server


def client(server: ServerProcess, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {SECRETS[key]}"}, timeout=30)


def dataset(c: httpx.Client, name: str, tasks: list[Any], **extra: Any) -> httpx.Response:
    return c.post("/tasks/datasets", json={"name": name, "tasks": tasks, **extra})


def error(reply: httpx.Response) -> tuple[int, list[Any], str]:
    first = reply.json()["errors"][0]
    return reply.status_code, first["loc"], first["msg"]


def test_datasets_are_bounded_per_key(server: ServerProcess) -> None:
    """5,000 one-task datasets of one key made /metrics 6.45 MB and /status 2.2 MB."""
    with client(server, "env-1") as one, client(server, "env-2") as two:
        for i in range(4):
            assert dataset(one, f"one-{i}", [{"q": i}]).status_code == 200
        status, loc, msg = error(dataset(one, "one-4", [{"q": 4}]))
        assert (status, loc) == (409, ["body", "name"]) and "task_max_datasets_per_key" in msg, msg
        assert dataset(one, "one-0", [{"q": 0}]).status_code == 200, "a retry of a registration is no new dataset"
        assert dataset(two, "two-0", [{"q": 0}]).status_code == 200, "a key at its bound held another back"


def test_task_bytes_are_bounded_per_key(server: ServerProcess) -> None:
    """The same tasks under 20 names grew the store by 260 MB: bytes a key stores are bounded whatever the names."""
    with client(server, "env-3") as three, client(server, "env-2") as two:
        page = [TASK_60K] * 4
        assert dataset(three, "heavy-0", page, last=False).status_code == 200
        stored, refused = 4, None
        for _ in range(30):
            reply = three.post("/tasks/pages", json={"dataset": "heavy-0", "first": stored, "tasks": page})
            if reply.status_code != 200:
                refused = reply
                break
            stored += 4
        assert refused is not None, "a key stored past task_max_bytes_per_key"
        status, loc, msg = error(refused)
        assert (status, loc) == (409, ["body", "tasks"]) and "task_max_bytes_per_key" in msg, msg
        assert stored * len(json.dumps(TASK_60K)) <= 6144 * KiB
        other = dataset(three, "heavy-1", page)
        assert error(other)[0] == 409 and "task_max_bytes_per_key" in error(other)[2], "another name, same bound"
        assert dataset(two, "light", page).status_code == 200, "a key at its bound held another back"


def test_a_lease_reply_is_bounded_in_bytes(server: ServerProcess) -> None:
    """One lease of 1,000 tasks of 256 KB answered 250 MB (RSS 175 -> 665 MB, /healthz stalled 5.7 s)."""
    with client(server, "ops") as ops:
        assert dataset(ops, "wide", [TASK_60K] * 12).status_code == 200
        seen: list[int] = []
        while len(seen) < 12:
            reply = ops.post("/tasks/lease", json={"dataset": "wide", "producer_id": "p-wide", "n": 12})
            assert reply.status_code == 200, reply.text
            leases = reply.json()["leases"]
            assert 1 <= len(leases) <= 4, f"{len(leases)} tasks of 60 KiB in one reply (task_lease_max_bytes)"
            assert len(reply.content) < 300 * KiB
            seen += [x["index"] for x in leases]
        assert sorted(seen) == list(range(12)), "a task left out of its lease reply was lost or leased twice"


def test_producers_are_bounded_per_key(server: ServerProcess) -> None:
    """One key heartbeating new producer ids filled the table (1,024): every other key's new producer got 503."""
    with client(server, "env-1") as one, client(server, "env-2") as two:
        for i in range(6):
            assert one.post("/producers/heartbeat", json={"producer_id": f"flood-{i}"}).status_code == 200
        refused = one.post("/producers/heartbeat", json={"producer_id": "flood-6"})
        assert refused.status_code == 503 and "Retry-After" in refused.headers, refused.text
        assert "max_producers_per_key" in refused.text
        assert one.post("/producers/heartbeat", json={"producer_id": "flood-0"}).status_code == 200, "a known one"
        assert two.post("/producers/heartbeat", json={"producer_id": "honest-0"}).status_code == 200


def test_a_producers_held_names_its_own_envs_only(server: ServerProcess) -> None:
    """17 KB of `held` per producer made /status 8 MB."""
    with client(server, "env-4") as four:
        registered = four.post("/register-env", json=env("held-env")).json()
        name = registered["wandb_name"]  # as views name the env, and as producers name it in `held`
        held = {f"junk-{i:04d}-" + "x" * 40: "ahead_of_trainer" for i in range(300)} | {name: "queue_full"}
        beat = {"producer_id": "held-1", "env_ids": [registered["env_id"]], "held": held}
        assert four.post("/producers/heartbeat", json=beat).status_code == 200
        long_reason = four.post("/producers/heartbeat", json={**beat, "held": {name: "y" * 65}})
        assert error(long_reason)[:2] == (422, ["body", "held", name]), long_reason.text
        mine = four.get("/producers", params={"after": "held-0", "limit": 1}).json()
        assert [(p["producer_id"], p["held"]) for p in mine] == [("held-1", {name: "queue_full"})]


def test_open_groups_are_bounded_per_key(server: ServerProcess) -> None:
    """Open groups were bounded per env only: one key's env-less groups left none for another key's."""
    with client(server, "env-1") as one, client(server, "env-2") as two:
        spec = {"group_size": 2, "producer_id": "p", "deadline_s": 600}
        for i in range(4):
            assert one.post("/rollouts/open", json={**spec, "group_id": f"open-{i}"}).status_code == 200
        assert one.post("/rollouts/open", json={**spec, "group_id": "short", "deadline_s": 2}).status_code == 200
        refused = one.post("/rollouts/open", json={**spec, "group_id": "open-5"})
        assert refused.status_code == 503 and "rollout_max_open_groups_per_key" in refused.text, refused.text
        assert two.post("/rollouts/open", json={**spec, "group_id": "other-0"}).status_code == 200
        deadline = time.monotonic() + 60  # a hang guard: the short group expires at its deadline, by the sweep
        while (again := one.post("/rollouts/open", json={**spec, "group_id": "open-5"})).status_code == 503:
            assert time.monotonic() < deadline, again.text
            time.sleep(0.05)  # polling interval while the group expires
        assert again.status_code == 200, "a group decided no longer counts against its key"


def test_views_list_a_bounded_number_of_datasets_and_producers(server: ServerProcess) -> None:
    """/status, /metrics, /dashboard/data, GET /tasks and GET /producers grew with every dataset and producer."""
    with client(server, "env-4") as four:
        for i in range(4):
            assert dataset(four, f"view-{i}", [{"q": i}]).status_code == 200
            assert four.post("/producers/heartbeat", json={"producer_id": f"view-{i}"}).status_code == 200
    with client(server, "trainer") as trainer:
        names = pages(trainer, "/tasks", "name")
        producers = pages(trainer, "/producers", "producer_id")
        assert {f"view-{i}" for i in range(4)} <= set(names) and len(names) == len(set(names))
        assert {f"view-{i}" for i in range(4)} <= set(producers) and len(producers) == len(set(producers))
        status = trainer.get("/status").json()
        assert len(status["tasks"]) == 3 and status["tasks_total"] == len(names)
        assert len(status["producers"]) == 3 and status["producers_total"] == len(producers)
        data = trainer.get("/dashboard/data").json()
        assert len(data["tasks"]) == 3 and len(data["producers"]) == 3
        assert data["producers_total"] == len(producers)
        metrics = trainer.get("/metrics").text
        shown = {
            line.split('dataset="')[1].split('"')[0]
            for line in metrics.splitlines()
            if line.startswith("rollbuf_task_epoch{")
        }
        assert len(shown) == 4 and "(other datasets)" in shown, shown
        seen = [line for line in metrics.splitlines() if line.startswith("rollbuf_producer_last_seen_seconds{")]
        assert len(seen) == 3, seen


def pages(c: httpx.Client, path: str, key: str) -> list[str]:
    """Every item of a paged view, a page (at most `views_max_*`) at a time."""
    out: list[str] = []
    while True:
        params = {"after": out[-1]} if out else {}
        page = c.get(path, params=params).json()
        assert len(page) <= 3, f"{path} answered {len(page)} items in one page"
        if not page:
            return out
        out += [item[key] for item in page]


def test_state_conflicts_are_404_or_409_not_422(server: ServerProcess) -> None:
    """Schema-valid requests were answered 422 or 400 for the server's state on the rollbuf routes."""
    with client(server, "trainer") as trainer:
        for path in ("/weights", "/weights/pending"):
            assert error(trainer.post(path, json={"step": 10**6}))[:2] == (409, ["body", "step"])
    with client(server, "env-2") as two:
        assert error(two.post("/producers/heartbeat", json={"producer_id": "s", "env_ids": [10**6]}))[:2] == (
            404,
            ["body", "env_ids", 0],
        )
        from_file = two.post("/tasks/datasets", json={"name": "from-file", "path": "no-such.jsonl"})
        assert error(from_file)[:2] == (404, ["body", "path"])
        own = two.post("/tasks/datasets", json={"name": "conflicts", "tasks": [1], "last": False})
        assert own.status_code == 200, own.text  # this test's own: others' datasets may be elsewhere
        assert error(two.post("/tasks/pages", json={"dataset": "conflicts", "first": 10**6, "tasks": [1]}))[:2] == (
            409,
            ["body", "first"],
        )
        spec = {"group_id": "codes", "group_size": 2, "producer_id": "p", "deadline_s": 600}
        assert error(two.post("/rollouts/open", json={**spec, "env_id": 10**6}))[:2] == (404, ["body", "env_id"])
        assert two.post("/rollouts/open", json=spec).status_code == 200
        post = {"group_id": "codes", "slot": 2, "producer_id": "p", "tokens": [1], "masks": [1], "score": 1.0}
        assert error(two.post("/rollouts/post", json=post))[:2] == (409, ["body", "slot"])
    schema = httpx.get(server.url + "/openapi.json").json()["components"]["schemas"]
    assert schema["OpenRequest"]["properties"]["deadline_s"]["maximum"] == 24 * 3600.0
    assert schema["TaskPage"]["properties"]["tasks"]["maxItems"] == 20


def test_a_registration_sent_again_while_its_file_is_read_stores_each_task_once(server: ServerProcess) -> None:
    """A client gave up after 1 s and sent its registration again (as docs/tasks.md advises) while the server went
    on reading: a 1,000,000-line file became 1,067,000 tasks, sealed. Here the second is sent once the first is
    seen reading (its first pages stored, the file not yet sealed)."""
    with client(server, "files") as first, client(server, "files") as again, ThreadPoolExecutor(1) as pool:
        for attempt in range(3):  # a file read before the poll saw it half-stored proves nothing: another name
            body = {"name": f"lines-{attempt}", "path": "lines.jsonl", "order": "shuffled"}
            reading = pool.submit(first.post, "/tasks/datasets", json=body)
            while not reading.done():
                views = [v for v in again.get("/tasks").json() if v["name"] == body["name"]]
                if views and 0 < views[0]["size"] and not views[0]["sealed"]:
                    break
            if reading.done():
                assert reading.result().status_code == 200, reading.result().text
                continue
            sent_again = again.post("/tasks/datasets", json=body)
            assert sent_again.status_code == 200, sent_again.text
            assert reading.result().status_code == 200, reading.result().text
            [view] = [v for v in again.get("/tasks").json() if v["name"] == body["name"]]
            assert (view["size"], view["sealed"]) == (LINES, True), view
            for k in range(25):  # 500 tasks from all over the file (a shuffled order): each at its own index
                lease = {"dataset": body["name"], "producer_id": f"p-{k}", "n": 20}
                leases = again.post("/tasks/lease", json=lease).json()["leases"]
                assert [x["task"] for x in leases] == [{"i": x["index"]} for x in leases]
            return
    pytest.fail("each time, the file was read before the registration could be sent again")
