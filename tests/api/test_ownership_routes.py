"""Every route, walked with two env keys (and the trainer and admin roles): what a key's request does to another
key's resources is decided by the route's declaration (`api.routes.spec.route(..., acts=...)`, `api.owners`),
and this test checks each declared route against it, so a route added later is covered by being declared.

For every route that acts on an owned resource, env-1 builds a world (an env, a sealed dataset with a task
leased, an open group with a rollout in, a producer heartbeating) and env-2 replays env-1's own request, naming
env-1's resources. It must get exactly the answer it gets naming resources that do not exist (no existence
leak), or, where the route takes a name another key holds, a 409 naming the field; and env-1's world must read
the same afterwards. Trainer and admin keys act as the declaration lets them."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from api.config.settings import Settings
from api.owners import REFUSALS
from api.routes.table import ACTS, DESCRIPTION_PAGES
from tests.asgi import serving
from tests.factories import env, group, registration

pytestmark = pytest.mark.anyio
SECRETS = {
    "env-1": "env-one-secret-0123456789",
    "env-2": "env-two-secret-0123456789",
    "trainer": "trainer-secret-0123456789",
    "admin": "admin-secret-0123456789",
}
KEYS = "; ".join(f"{name} {name.split('-')[0]} {secret}" for name, secret in SECRETS.items())


@dataclass(frozen=True)
class Names:
    """The resources a request names: env-1's, or ones that do not exist."""

    env_id: int
    dataset: str
    token: str
    group_id: str
    producer_id: str
    other_env: int = 0
    """env-2's own env."""


UNKNOWN = Names(
    env_id=7, dataset="no-set", token="task:no-set:0:0:1." + "0" * 24, group_id="no-group", producer_id="p-1"
)
"""Resources that do not exist (the producer id is env-1's: a producer id names no resource until heartbeated,
and the heartbeat route is a name route)."""

Request = tuple[str, dict[str, Any]]
"""(method-less) path with query, and the JSON body (or {})."""


def _rollout(n: Names) -> dict[str, Any]:
    return {"group_id": n.group_id, "slot": 1, "producer_id": "p-1", "tokens": [5, 6], "masks": [-100, 6], "score": 0.5}


OWNED: dict[tuple[str, str], Callable[[Names], Request]] = {
    ("POST", "/disconnect-env"): lambda n: ("/disconnect-env", {"env_id": n.env_id}),
    ("GET", "/status-env"): lambda n: (f"/status-env?env_id={n.env_id}", {}),
    ("POST", "/scored_data"): lambda n: ("/scored_data", group(2, env_id=n.env_id, seed=3)),
    ("POST", "/scored_data_list"): lambda n: ("/scored_data_list", [group(2, env_id=n.env_id, seed=4)]),  # type: ignore[dict-item]
    ("POST", "/tasks/pages"): lambda n: ("/tasks/pages", {"dataset": n.dataset, "first": 2, "tasks": [9]}),
    ("POST", "/tasks/lease"): lambda n: ("/tasks/lease", {"dataset": n.dataset, "producer_id": "p-2", "n": 5}),
    ("POST", "/tasks/heartbeat"): lambda n: ("/tasks/heartbeat", {"tokens": [n.token]}),
    ("POST", "/tasks/fail"): lambda n: ("/tasks/fail", {"token": n.token, "reason": "x"}),
    ("GET", "/tasks"): lambda n: ("/tasks", {}),
    ("GET", "/tasks/rows"): lambda n: (f"/tasks/rows?dataset={n.dataset}", {}),
    ("POST", "/rollouts/post"): lambda n: ("/rollouts/post", _rollout(n)),
    ("POST", "/rollouts/seal"): lambda n: ("/rollouts/seal", {"group_id": n.group_id, "producer_id": "p-1"}),
    ("POST", "/rollouts/lease"): lambda n: ("/rollouts/lease", {"producer_id": "p-2", "n": 10}),
    ("POST", "/rollouts/heartbeat"): lambda n: (
        "/rollouts/heartbeat",
        {"producer_id": "p-1", "group_ids": [n.group_id]},
    ),
    ("GET", "/rollouts/group"): lambda n: (f"/rollouts/group?group_id={n.group_id}", {}),
    ("POST", "/rollouts/turn"): lambda n: (
        "/rollouts/turn",
        {"group_id": n.group_id, "slot": 1, "producer_id": "p-1", "turn": 0, "tokens": [5], "masks": [5]},
    ),
    ("GET", "/rollouts/turns"): lambda n: (f"/rollouts/turns?group_id={n.group_id}&slot=1", {}),
}
"""A request env-1 makes on its own resources, for each route that acts on owned ones."""
GROUP_SCORED_WITH_TASK = "a group under env-1's lease token: owned twice (the env and the lease)"
NAMED: dict[tuple[str, str], Callable[[Names], Request]] = {
    ("POST", "/tasks/datasets"): lambda n: ("/tasks/datasets", {"name": n.dataset, "tasks": [1, 2]}),
    ("POST", "/rollouts/open"): lambda n: (
        "/rollouts/open",
        {"group_id": n.group_id, "group_size": 2, "producer_id": "p-2", "deadline_s": 60},
    ),
    ("POST", "/producers/heartbeat"): lambda n: ("/producers/heartbeat", {"producer_id": n.producer_id}),
}
"""Routes that take a name another key may hold: a 409 naming the field, the other key's resource untouched."""
NAMED_FIELD = {"/tasks/datasets": "name", "/rollouts/open": "group_id", "/producers/heartbeat": "producer_id"}


def headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {SECRETS[key]}"}


async def send(c: httpx.AsyncClient, key: str, method: str, request: Request) -> httpx.Response:
    path, body = request
    if method == "GET":
        return await c.get(path, headers=headers(key))
    return await c.post(path, content=json.dumps(body), headers={**headers(key), "content-type": "application/json"})


async def world(c: httpx.AsyncClient) -> Names:
    """env-1's resources: an env, a dataset with a task leased, an open group with slot 0 in, a live producer."""
    assert (await c.post("/register", json=registration(batch_size=64), headers=headers("trainer"))).is_success
    assert (await c.get("/batch", headers=headers("trainer"))).is_success
    reply = await c.post("/register-env", json=env("math", group_size=2), headers=headers("env-1"))
    env_id = reply.json()["env_id"]
    other = await c.post("/register-env", json=env("math", group_size=2), headers=headers("env-2"))  # its own
    one = headers("env-1")
    assert (
        await c.post("/tasks/datasets", json={"name": "d-1", "tasks": [0, 1], "last": False}, headers=one)
    ).is_success
    leased = await c.post("/tasks/lease", json={"dataset": "d-1", "producer_id": "p-1"}, headers=one)
    [lease] = leased.json()["leases"]
    spec = {"group_id": "g-1", "env_id": env_id, "group_size": 2, "producer_id": "p-1", "deadline_s": 600}
    assert (await c.post("/rollouts/open", json=spec, headers=one)).is_success
    first = {**_rollout(Names(env_id, "d-1", lease["token"], "g-1", "p-1")), "slot": 0}
    assert (await c.post("/rollouts/post", json=first, headers=one)).is_success
    beat = {"producer_id": "p-1", "env_ids": [env_id], "host": "h-1"}
    assert (await c.post("/producers/heartbeat", json=beat, headers=one)).is_success
    return Names(env_id, "d-1", lease["token"], "g-1", "p-1", other.json()["env_id"])


async def snapshot(c: httpx.AsyncClient, n: Names) -> list[Any]:
    """What env-1's resources read as, to the trainer (which reads everything)."""
    t = headers("trainer")
    paths = [
        "/tasks",
        f"/tasks/rows?dataset={n.dataset}",
        f"/rollouts/group?group_id={n.group_id}",
        f"/status-env?env_id={n.env_id}",
    ]
    out = [(await c.get(path, headers=t)).json() for path in paths]
    producers = (await c.get("/producers", headers=t)).json()
    out.append([{k: v for k, v in p.items() if k not in ("last_seen", "last_seen_s")} for p in producers])
    return out


def masked(text: str, n: Names) -> str:
    """An answer with the names it holds replaced by placeholders: env-1's and the unknown ones read the same."""
    for a, b in (
        (n.token, "<token>"),
        (UNKNOWN.token, "<token>"),
        (n.group_id, "<group>"),
        (UNKNOWN.group_id, "<group>"),
        (n.dataset, "<dataset>"),
        (UNKNOWN.dataset, "<dataset>"),
    ):
        text = text.replace(f"'{a}'", b).replace(f'"{a}"', b)
    for env_id in (n.env_id, UNKNOWN.env_id):
        text = text.replace(f"env_id {env_id}", "env_id <env>").replace(f"env {env_id}", "env <env>")
    return text


def test_every_route_is_declared_and_walked() -> None:
    """The walk's tables and the app's routes agree: a route that acts on owned resources is in OWNED or NAMED,
    and one that does not is a run-wide route (its role rule is the front door's, tested in test_front_door)."""
    owned = {key for key, acts in ACTS.items() if acts.on and key not in DESCRIPTION_PAGES}
    assert owned == set(OWNED) | set(NAMED), "a route acting on owned resources without a walk here, or the reverse"


@pytest.fixture
def settings() -> Settings:
    return Settings(store="memory://", api_keys=KEYS, max_batch_wait=0)


@pytest.mark.parametrize("route", sorted(OWNED), ids="{0[0]} {0[1]}".format)
async def test_another_keys_resource_answers_as_an_unknown_one(route: tuple[str, str], settings: Settings) -> None:
    method, path = route
    async with serving(settings) as c:
        mine = await world(c)
        before = await snapshot(c, mine)
        refused_before = sum(REFUSALS.counts.values())
        theirs = await send(c, "env-2", method, OWNED[route](mine))
        unknown = await send(c, "env-2", method, OWNED[route](UNKNOWN))
        assert theirs.status_code == unknown.status_code, (theirs.text, unknown.text)
        assert masked(theirs.text, mine) == masked(unknown.text, mine), "another key's resource told apart"
        if OWNED[route](mine) == OWNED[route](UNKNOWN):  # a view naming nothing: env-1's resources are not in it
            assert f'"{mine.dataset}"' not in theirs.text and f'"{mine.group_id}"' not in theirs.text, theirs.text
        if theirs.status_code == 200 and path.startswith("/scored_data"):
            pytest.fail("env-2 stored a group in env-1's env")
        assert await snapshot(c, mine) == before, f"env-2's {method} {path} changed env-1's resources"
        if theirs.status_code != 200 or path in ("/tasks/heartbeat", "/tasks/fail", "/rollouts/heartbeat"):
            assert sum(REFUSALS.counts.values()) > refused_before or path in ("/tasks", "/rollouts/lease"), (
                "a refusal not counted"
            )
        own = await send(c, "env-1", method, OWNED[route](mine))
        assert own.status_code < 400 or own.status_code == 409, (route, own.text)  # the owner may (409: its state)
        for role in ("trainer", "admin"):  # they act on any key's resource where the route lets them
            others = ACTS[route].others
            if role in others:
                answer = await send(c, role, method, OWNED[route](mine))
                assert answer.status_code != 404, (role, route, answer.text)


@pytest.mark.parametrize("route", sorted(NAMED), ids="{0[0]} {0[1]}".format)
async def test_a_name_another_key_holds_is_a_409(route: tuple[str, str], settings: Settings) -> None:
    method, path = route
    async with serving(settings) as c:
        mine = await world(c)
        before = await snapshot(c, mine)
        theirs = await send(c, "env-2", method, NAMED[route](mine))
        assert theirs.status_code == 409, theirs.text
        assert theirs.json()["errors"][0]["loc"] == ["body", NAMED_FIELD[path]], theirs.text
        assert await snapshot(c, mine) == before
        free = Names(env_id=7, dataset="free", token=UNKNOWN.token, group_id="free", producer_id="free")
        taken = await send(c, "env-2", method, NAMED[route](free))
        assert taken.status_code == 200, taken.text  # a free name is taken


async def test_a_group_under_another_keys_lease_is_refused_as_an_unknown_lease(settings: Settings) -> None:
    """/scored_data names two owned things: the env (refused in the walk) and a lease token. env-2 sends its
    own group, in its own env, under env-1's token."""
    async with serving(settings) as c:
        mine = await world(c)
        env2 = mine.other_env
        theirs = await c.post(
            "/scored_data", json=group(2, env_id=env2, seed=8, group_id=mine.token), headers=headers("env-2")
        )
        unknown = await c.post(
            "/scored_data", json=group(2, env_id=env2, seed=8, group_id=UNKNOWN.token), headers=headers("env-2")
        )
        assert theirs.status_code == unknown.status_code == 404, theirs.text
        assert masked(theirs.text, mine) == masked(unknown.text, mine)
