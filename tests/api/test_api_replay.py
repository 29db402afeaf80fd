"""The reuse policy over HTTP on every store: the trainer's at /register and an env's own at /register-env are
validated (422 naming the field), and a policy that reuses is refused while replay is not served (409 naming
`reuse.max_served`: it would be acknowledged and then ignored). The checks that hold once replay is served run here
with `replay_served` (`api.batches.reuse.REPLAY_SERVED` on): kept with the run (a restart reads them back),
compared on a second registration (409 naming `reuse`), refused by a server without the ledger (409: every reuse
is a ledger row). The default policy serves exactly the batches a registration without one does."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from api.app import create_app
from api.batches import reuse
from api.batches.reuse import policy_for
from api.config.settings import Settings
from api.run.state import RunState
from api.service import Service
from api.wire.records import MSGPACK
from api.wire.replay import NO_REUSE, ReusePolicy
from tests.factories import env, group, registration

pytestmark = pytest.mark.anyio

REUSE = {"max_served": 3, "max_age": 4, "max_reused_share": 0.25, "order": "advantage"}


@pytest.fixture
def replay_served(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registration checks as they hold once formation serves reuse (`REPLAY_SERVED`)."""
    monkeypatch.setattr(reuse, "REPLAY_SERVED", True)


@asynccontextmanager
async def serving(settings: Settings, **update: Any) -> AsyncIterator[tuple[httpx.AsyncClient, Service]]:
    app = create_app(settings.model_copy(update=update))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            yield c, app.state.service


async def start(c: httpx.AsyncClient, trainer: dict[str, Any] | None, **env_fields: Any) -> None:
    body = registration(batch_size=8) if trainer is None else registration(batch_size=8, reuse=trainer)
    assert (await c.post("/register", json=body)).status_code == 200
    await c.get("/batch", params={"step": 0})
    reply = await c.post("/register-env", json=env("math", group_size=4, **env_fields))
    assert reply.status_code == 200, reply.text


@pytest.mark.usefixtures("replay_served")
async def test_the_policies_are_kept_with_the_run_across_a_restart(settings: Settings) -> None:
    def check(run: RunState) -> None:
        math, code = run.envs
        assert policy_for(run.registration, math) == ReusePolicy.model_validate(REUSE)  # the trainer's
        assert policy_for(run.registration, code) == NO_REUSE  # opted out

    async with serving(settings) as (c, service):
        await start(c, REUSE)
        reply = await c.post("/register-env", json=env("code", group_size=4, reuse={"max_served": 1}))
        assert reply.status_code == 200
        check(await service.run_state())
    if not settings.store.startswith("memory"):  # a restart on the same store reads them back
        async with serving(settings) as (c, service):
            check(await service.run_state())


@pytest.mark.usefixtures("replay_served")
async def test_registering_again_with_another_policy_is_a_conflict_naming_it(client: httpx.AsyncClient) -> None:
    await start(client, REUSE)
    assert (await client.post("/register", json=registration(batch_size=8, reuse=REUSE))).status_code == 200
    reply = await client.post("/register", json=registration(batch_size=8, reuse={**REUSE, "max_served": 2}))
    assert reply.status_code == 409
    assert reply.json()["errors"][0]["loc"] == ["body", "reuse"] and "(reuse)" in reply.json()["message"]
    reply = await client.post("/register", json=registration(batch_size=8))
    assert reply.status_code == 409 and reply.json()["errors"][0]["loc"] == ["body", "reuse"]


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/register", "max_served", 0),
        ("/register", "max_served", 65),
        ("/register", "max_served", "\u0663"),  # Unicode digits are not a number
        ("/register", "order", "random"),
        ("/register-env", "max_reused_share", 2.0),
        ("/register-env", "max_age", -1),
    ],
)
async def test_a_bad_policy_is_422_naming_the_field(
    client: httpx.AsyncClient, path: str, field: str, value: Any
) -> None:
    if path == "/register-env":
        await start(client, None)
        body = env("code", group_size=4, reuse={field: value})
    else:
        body = registration(batch_size=8, reuse={field: value})
    reply = await client.post(path, json=body)
    assert reply.status_code == 422
    assert [e["loc"] for e in reply.json()["errors"]] == [["body", "reuse", field]]
    assert (await client.get("/status")).json()["current_step"] == 0  # nothing stored


@pytest.mark.usefixtures("replay_served")
async def test_without_the_ledger_a_policy_that_reuses_is_refused(settings: Settings) -> None:
    async with serving(settings, ledger=False) as (c, service):
        reply = await c.post("/register", json=registration(batch_size=8, reuse=REUSE))
        assert reply.status_code == 409, reply.text
        assert reply.json()["errors"][0]["loc"] == ["body", "reuse", "max_served"]
        assert "ledger off" in reply.json()["message"]
        assert (await service.run_state()).registration is None  # nothing half-applied
        await start(c, {"max_served": 1})  # a policy that never reuses needs no ledger
        reply = await c.post("/register-env", json=env("code", group_size=4, reuse={"max_served": 2}))
        assert reply.status_code == 409 and reply.json()["errors"][0]["loc"] == ["body", "reuse", "max_served"]
        assert len((await service.run_state()).envs) == 1


@pytest.mark.usefixtures("replay_served")
async def test_a_restart_with_the_ledger_off_refuses_the_runs_reuse_policy_when_it_registers_again(
    settings: Settings,
) -> None:
    """An operator restarts a run that reuses with `ledger: false`: the trainer's registration, sent again as it
    was, is refused (409 naming the policy and why), not taken as if the run could go on reusing unrecorded."""
    if settings.store.startswith("memory"):
        pytest.skip("a restart keeps nothing on the memory store")
    async with serving(settings) as (c, _):
        await start(c, REUSE)
    async with serving(settings, ledger=False) as (c, service):
        reply = await c.post("/register", json=registration(batch_size=8, reuse=REUSE))
        assert reply.status_code == 409 and reply.json()["errors"][0]["loc"] == ["body", "reuse", "max_served"]
        assert "ledger off" in reply.json()["message"]
        run = await service.run_state()
        assert run.registration is not None and run.registration.reuse == ReusePolicy.model_validate(REUSE)


@pytest.mark.parametrize(
    ("trainer", "own", "field"),
    [
        (None, {"max_served": 2}, "max_served"),  # the trainer asked for no reuse
        ({"max_served": 3}, {"max_served": 4}, "max_served"),
        ({"max_served": 3, "max_reused_share": 0.25}, {"max_served": 2, "max_reused_share": 0.5}, "max_reused_share"),
        ({"max_served": 3, "max_age": 2}, {"max_served": 2}, "max_age"),  # null: no age limit, longer than 2
        ({"max_served": 3, "max_age": 2}, {"max_served": 2, "max_age": 3}, "max_age"),
    ],
)
@pytest.mark.usefixtures("replay_served")
async def test_an_env_cannot_reuse_more_than_the_trainer_allows(
    settings: Settings, trainer: dict[str, Any] | None, own: dict[str, Any], field: str
) -> None:
    """A producer's key cannot make the trainer train its groups more often, for longer or in a larger share than
    the trainer registered: 409 naming the field, and the env is not registered."""
    async with serving(settings) as (c, service):
        await start(c, trainer)
        reply = await c.post("/register-env", json=env("code", group_size=4, reuse=own))
        assert reply.status_code == 409, reply.text
        assert reply.json()["errors"][0]["loc"] == ["body", "reuse", field]
        assert [e.desired_name for e in (await service.run_state()).envs] == ["math"]
        less = {"max_served": 1} if trainer is None else {**trainer, "max_served": 2}
        assert (await c.post("/register-env", json=env("code", group_size=4, reuse=less))).status_code == 200


@pytest.mark.parametrize("ledger", [True, False])
async def test_a_policy_that_reuses_is_refused_while_replay_is_not_served(settings: Settings, ledger: bool) -> None:
    """A trainer that asks for `max_served: 3`, or an env for its own `max_served: 2`, is told the policy is not
    served (409 naming `reuse.max_served`), ledger or not, and nothing is stored; `max_served: 1` is served as
    asked and accepted."""
    async with serving(settings, ledger=ledger) as (c, service):
        for policy in (REUSE, {"max_served": 2, "max_reused_share": 0.0}):
            reply = await c.post("/register", json=registration(batch_size=8, reuse=policy))
            assert reply.status_code == 409, reply.text
            assert reply.json()["errors"][0]["loc"] == ["body", "reuse", "max_served"]
            assert "replay is not served yet" in reply.json()["errors"][0]["msg"]
            assert (await service.run_state()).registration is None
        await start(c, {"max_served": 1, "order": "spread"})
        reply = await c.post("/register-env", json=env("code", group_size=4, reuse={"max_served": 2}))
        assert reply.status_code == 409 and reply.json()["errors"][0]["loc"] == ["body", "reuse", "max_served"]
        assert [e.desired_name for e in (await service.run_state()).envs] == ["math"]


async def batches(c: httpx.AsyncClient, n: int) -> list[bytes]:
    await c.post("/scored_data_list", json=[group(4, seed=i, group_id=f"g{i}") for i in range(4 * n + 2)])
    return [(await c.get("/batch", params={"step": s}, headers={"Accept": MSGPACK})).content for s in range(n)]


async def test_the_default_policy_forms_the_batches_of_a_registration_without_one(settings: Settings) -> None:
    """`max_served: 1` (also an env's) is today's formation, byte for byte."""
    async with serving(settings) as (c, _):
        await start(c, None)
        plain = await batches(c, 3)
        await c.get("/reset_data")
        await start(c, {"max_served": 1, "order": "recent"}, reuse={"max_served": 1})
        assert await batches(c, 3) == plain
    assert len(plain) == 3 and all(plain)
