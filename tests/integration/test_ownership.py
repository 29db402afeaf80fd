"""Ownership against a real `rollbuf serve` process (docs/security.md, "Ownership"): a hostile env key that
holds a valid key of its own tries, on another key's datasets, leases, open groups and producer id, everything
that key may do on its own. Each attack is refused as if the resource did not exist (or, for a name another
key holds, a 409 naming the rule), and the victim's run goes on as it would have without the attacker."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.factories import env, group, registration
from tests.servers import ServerProcess, running_server

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("ownership")]
SECRETS = {
    "env-1": "env-one-secret-0123456789",
    "env-2": "env-two-secret-0123456789",
    "trainer": "trainer-secret-0123456789",
}
ROLES = {"env-1": "env", "env-2": "env", "trainer": "trainer"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("ownership")
    keys = tmp / "keys"
    keys.write_text("".join(f"{name} {ROLES[name]} {secret}\n" for name, secret in SECRETS.items()))
    flags = ("--api-keys-file", str(keys), "--max-batch-wait", "0", "--task-lease-s", "60", "--rollout-lease-s", "1")
    with running_server(f"sqlite:///{tmp / 'rollbuf.db'}", tmp / "server.log", *flags) as server:
        with client(server, "trainer") as trainer:
            assert trainer.post("/register", json=registration(batch_size=64)).status_code == 200
            assert trainer.get("/batch").status_code == 200  # envs may register now
        yield server


def client(server: ServerProcess, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {SECRETS[key]}"}, timeout=30)


@pytest.fixture(scope="module")
def env_ids(server: ServerProcess) -> dict[str, int]:
    out = {}
    for key in ("env-1", "env-2"):
        with client(server, key) as c:
            reply = c.post("/register-env", json=env(f"math-{key}", group_size=4))
            assert reply.status_code == 200, reply.text
            out[key] = reply.json()["env_id"]
    return out


def dataset(c: httpx.Client, name: str, n: int, **extra: Any) -> httpx.Response:
    return c.post("/tasks/datasets", json={"name": name, "tasks": [{"q": i} for i in range(n)], **extra})


def test_another_keys_dataset_is_unknown_to_an_env_key(server: ServerProcess) -> None:
    """Attack 1: env2 added a page to env1's unsealed dataset and sealed it (env1's producer then leased the
    injected tasks), and leased all of env1's tasks."""
    with client(server, "env-1") as one, client(server, "env-2") as two:
        assert dataset(one, "paged", 3, last=False).status_code == 200
        page = two.post("/tasks/pages", json={"dataset": "paged", "first": 3, "tasks": [{"evil": 1}], "last": True})
        assert page.status_code == 404, page.text
        assert page.json()["errors"][0]["loc"] == ["body", "dataset"]
        assert "no dataset 'paged'" in page.text
        leased = two.post("/tasks/lease", json={"dataset": "paged", "producer_id": "thief", "n": 50})
        assert leased.status_code == 404, leased.text
        unknown = two.post("/tasks/lease", json={"dataset": "nothing", "producer_id": "thief", "n": 50})
        assert unknown.text == leased.text.replace("paged", "nothing"), "another key's dataset answers as no dataset"
        rows = two.get("/tasks/rows", params={"dataset": "paged"})
        assert rows.status_code == 404, "an env key reads another key's task rows"
        assert all(d["name"] != "paged" for d in two.get("/tasks").json()), "GET /tasks lists another key's dataset"
        # The owner's dataset is as it was: 3 tasks, unsealed; its own page seals it and every task is its own.
        assert one.post(
            "/tasks/pages", json={"dataset": "paged", "first": 3, "tasks": [{"q": 3}], "last": True}
        ).json()["sealed"]
        mine = one.post("/tasks/lease", json={"dataset": "paged", "producer_id": "p1", "n": 10}).json()["leases"]
        assert [t["task"] for t in mine] == [{"q": i} for i in range(4)]
        with client(server, "trainer") as trainer:  # the trainer reads the whole run
            assert trainer.get("/tasks/rows", params={"dataset": "paged"}).status_code == 200


def test_a_dataset_name_held_by_another_key_is_a_409(server: ServerProcess) -> None:
    """Attack 1: env2 registered env1's dataset name first with the same spec; env1's registration then answered
    200 and served env2's tasks."""
    with client(server, "env-1") as one, client(server, "env-2") as two:
        assert dataset(two, "squatted", 2).status_code == 200
        reply = dataset(one, "squatted", 2)
        assert reply.status_code == 409, reply.text
        assert reply.json()["errors"][0]["loc"] == ["body", "name"] and "another key's" in reply.text
        assert dataset(two, "squatted", 2).status_code == 200, "a retry of one's own registration is safe"


def test_leases_cannot_be_heartbeated_failed_or_submitted_by_another_key(
    server: ServerProcess, env_ids: dict[str, int]
) -> None:
    """Attack 1: env2 heartbeated env1's tokens (so they never expired), failed env1's leases with forged tokens
    (`task:NAME:EPOCH:INDEX:N` was guessable), and sent its own group under env1's token, which became the
    task's submission."""
    with client(server, "env-1") as one, client(server, "env-2") as two:
        assert dataset(one, "leased", 4, max_retries=3).status_code == 200
        leases = one.post("/tasks/lease", json={"dataset": "leased", "producer_id": "p1", "n": 4}).json()["leases"]
        tokens = [t["token"] for t in leases]
        assert all("." in t and len(t.rsplit(".", 1)[1]) == 24 for t in tokens), tokens  # a random part
        beat = two.post("/tasks/heartbeat", json={"tokens": tokens}).json()["expires_at"]
        assert beat == dict.fromkeys(tokens), "another key extended env1's leases"
        forged = [t.rsplit(".", 1)[0] for t in tokens] + [t.rsplit(".", 1)[0] + ".0" * 12 for t in tokens]
        for token in forged + tokens:
            failed = two.post("/tasks/fail", json={"token": token, "reason": "sabotage"})
            assert failed.status_code == 200 and failed.json() == {"accepted": False}, (token, failed.text)
        for token in forged[:4]:  # even the owner cannot use a token without its random part
            assert one.post("/tasks/fail", json={"token": token, "reason": "x"}).json() == {"accepted": False}
        stolen = two.post("/scored_data", json=group(4, env_id=env_ids["env-2"], seed=5, group_id=tokens[0]))
        assert stolen.status_code == 404, stolen.text
        assert stolen.json()["errors"][0]["loc"] == ["body", "group_id"]
        own = one.post(
            "/scored_data", json=group(4, env_id=env_ids["env-1"], seed=6, group_id=tokens[0], producer_id="p1")
        )
        assert own.status_code == 200, own.text
        rows = {r["index"]: r for r in one.get("/tasks/rows", params={"dataset": "leased"}).json()["tasks"]}
        assert rows[leases[0]["index"]]["state"] == "submitted"
        assert all(rows[t["index"]]["state"] == "leased" for t in leases[1:]), "another key's acts changed a lease"
        assert one.post("/tasks/heartbeat", json={"tokens": tokens[1:]}).json()["expires_at"][tokens[1]] is not None


def test_an_open_group_is_its_keys_alone(server: ServerProcess, env_ids: dict[str, int]) -> None:
    """Attack 2: env2 posted slot 0 of env1's open group (env1's own slot 0 was then `redone` and dropped),
    sealed it with scores of 100, heartbeated it under env1's producer id (read from GET /rollouts/group) so its
    slots were never redispatched, and leased its missing slots."""
    with client(server, "env-1") as one, client(server, "env-2") as two:
        opened = one.post(
            "/rollouts/open",
            json={
                "group_id": "g-owned",
                "env_id": env_ids["env-1"],
                "group_size": 2,
                "producer_id": "p1",
                "deadline_s": 600,
            },
        )
        assert opened.status_code == 200, opened.text
        rollout = {
            "group_id": "g-owned",
            "slot": 0,
            "producer_id": "p1",
            "tokens": [1, 2],
            "masks": [-100, 2],
            "score": 1.0,
        }
        posted = two.post("/rollouts/post", json={**rollout, "producer_id": "thief", "tokens": [6, 6]})
        assert posted.status_code == 404, posted.text
        assert one.post("/rollouts/post", json=rollout).json()["status"] == "accepted", "env1's slot 0 was taken"
        sealed = two.post("/rollouts/seal", json={"group_id": "g-owned", "producer_id": "p1", "scores": {"0": 100}})
        assert sealed.status_code == 404, sealed.text
        assert two.get("/rollouts/group", params={"group_id": "g-owned"}).status_code == 404
        beat = two.post("/rollouts/heartbeat", json={"producer_id": "p1", "group_ids": ["g-owned"]})
        assert beat.json()["expires_at"] == {"g-owned": None}
        spec = {
            "group_id": "g-owned",
            "env_id": env_ids["env-2"],
            "group_size": 2,
            "producer_id": "p2",
            "deadline_s": 600,
        }
        reopened = two.post("/rollouts/open", json=spec)
        assert reopened.status_code == 409 and "another key's" in reopened.text
        view = one.get("/rollouts/group", params={"group_id": "g-owned"}).json()
        assert (view["state"], view["done"]) == ("open", [0])


def test_another_keys_missing_slots_are_not_leased(server: ServerProcess, env_ids: dict[str, int]) -> None:
    """Attack 2: env2 leased env1's missing slots (and sat on them until the deadline)."""
    with client(server, "env-1") as one, client(server, "env-2") as two:
        spec = {
            "group_id": "g-lapse",
            "env_id": env_ids["env-1"],
            "group_size": 2,
            "producer_id": "p-gone",
            "deadline_s": 600,
        }
        assert one.post("/rollouts/open", json=spec).status_code == 200
        lapses = one.get("/rollouts/group", params={"group_id": "g-lapse"}).json()["expires_at"]
        deadline = time.monotonic() + 60  # a hang guard: the holder's lease is 1 s
        while time.time() <= lapses + 0.5:  # the server's clock is this machine's
            assert time.monotonic() < deadline
            time.sleep(0.05)  # polling the clock until the holder's lease lapsed, not a wait for it
        assert two.post("/rollouts/lease", json={"producer_id": "thief", "n": 10}).json() == {"leases": []}
        assert one.get("/rollouts/group", params={"group_id": "g-lapse"}).json()["leased"] == {}
        taken = one.post("/rollouts/lease", json={"producer_id": "sibling", "n": 10}).json()["leases"]
        assert sorted(x["slot"] for x in taken if x["group_id"] == "g-lapse") == [0, 1], "the owner's sibling"


def test_a_live_producers_id_is_its_keys(server: ServerProcess, env_ids: dict[str, int]) -> None:
    """Attack 3: any env key heartbeated under another key's producer id and overwrote its record (host, envs,
    `drained_for`: a weight sync's `waiting_on` could be faked)."""
    with client(server, "env-1") as one, client(server, "env-2") as two:
        beat = {"producer_id": "prod-1", "host": "host-1", "env_ids": [env_ids["env-1"]], "in_flight": 3}
        assert one.post("/producers/heartbeat", json=beat).status_code == 200
        forged = two.post(
            "/producers/heartbeat", json={"producer_id": "prod-1", "host": "evil", "env_ids": [], "drained_for": 99}
        )
        assert forged.status_code == 409, forged.text
        assert forged.json()["errors"][0]["loc"] == ["body", "producer_id"]
        theirs = two.post("/producers/heartbeat", json={**beat, "producer_id": "prod-2"})
        assert theirs.status_code == 404 and "no environment" in theirs.text, "another key's env in a heartbeat"
        [mine] = [p for p in one.get("/producers").json() if p["producer_id"] == "prod-1"]
        assert (mine["host"], mine["in_flight"], mine["drained_for"]) == ("host-1", 3, None)


def test_refusals_are_counted_per_key(server: ServerProcess) -> None:
    """What another key tried shows in /metrics, per key and kind of resource."""
    with client(server, "env-1") as one:
        assert dataset(one, "counted", 1).status_code == 200
    with client(server, "env-2") as two:
        assert two.post("/tasks/lease", json={"dataset": "counted", "producer_id": "thief"}).status_code == 404
        with client(server, "trainer") as trainer:
            text = trainer.get("/metrics").text
    lines = [x for x in text.splitlines() if x.startswith("rollbuf_foreign_refused_total")]
    assert any('key="env-2"' in x and 'resource="dataset"' in x for x in lines), lines
    assert "env-1" not in "".join(lines), "the victim was counted"
