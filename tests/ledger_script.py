"""A scripted run whose every group's fate is known in advance, for the ledger's tests: filters, the side
buffer's expiry and the staleness bound drop some groups, three batches serve others (two committed), one
stays queued. `first_part` and `second_part` may run against two server processes, a kill -9 between them."""

from __future__ import annotations

from typing import Any

import httpx

from tests.factories import env, group, registration

SETTINGS = ("--side-buffer-ttl-s", "0.000001")
"""A held group expires as soon as another one arrives for its env (or a sweep runs)."""
REGISTRATION = registration(batch_size=8, drop_zero_variance=True, min_score=0.2, max_staleness=1, acknowledge="commit")
GOOD = [0.0, 1.0, 0.0, 1.0]

EXPECTED: dict[str, tuple[str, str | None, int | None]] = {
    "A0": ("served", None, 0),
    "A1": ("served", None, 0),
    "A2": ("served", None, 1),
    "A3": ("served", None, 1),
    "Z": ("dropped", "zero_variance", 0),
    "R": ("dropped", "score_range", 0),
    "H1": ("dropped", "side_buffer_expired", 0),
    "S0": ("dropped", "stale", 2),
    "S1": ("dropped", "stale", 2),
    "F0": ("served", None, 2),
    "F1": ("served", None, 2),
    "Q0": ("queued", None, None),
}
"""group_id: (fate, reason, step). H2 is held, or dropped as expired if a sweep ran first."""


def post(c: httpx.Client, gid: str, n: int = 4, scores: list[float] | None = None, **extra: Any) -> None:
    seed = sum(map(ord, gid))
    reply = c.post("/scored_data", json=group(n, seed=seed, scores=scores or GOOD[:n], group_id=gid, **extra))
    assert reply.status_code == 200, reply.text


def served(c: httpx.Client, step: int) -> list[str]:
    reply = c.get("/batch", params={"step": step})
    assert reply.status_code == 200, reply.text
    return [g["group_id"] for g in reply.json()["batch"]]


def first_part(c: httpx.Client) -> dict[int, list[str]]:
    assert c.post("/register", json=REGISTRATION).status_code == 200
    c.get("/batch", params={"step": 0})  # the run starts: envs may register
    assert c.post("/register-env", json=env("math", group_size=4)).json()["env_id"] == 0
    for gid in ("A0", "A1", "A2", "A3"):
        post(c, gid)
    post(c, "Z", scores=[1.0] * 4)
    post(c, "R", scores=[0.0, 0.1, 0.0, 0.1])
    post(c, "H1", n=2)  # half a group: held, then expired when H2 arrives
    post(c, "H2", n=3)
    batches = {0: served(c, 0), 1: served(c, 1)}
    assert c.post("/commit", json={"step": 1}).status_code == 200
    return batches


def second_part(c: httpx.Client) -> dict[int, list[str]]:
    post(c, "S0", policy_step=0)  # step 2 is formed next: with max_staleness 1, too stale
    post(c, "S1", policy_step=0)
    post(c, "F0", policy_step=2)
    post(c, "F1", policy_step=2)
    batches = {2: served(c, 2)}
    assert c.post("/commit", json={"step": 2}).status_code == 200
    post(c, "Q0", policy_step=2)
    return batches


def check(c: httpx.Client, batches: dict[int, list[str]]) -> None:
    """Every group of the script has exactly one ledger row, with the fate expected; each step's row lists what
    its batch served, in order, and says whether it is committed."""
    assert batches == {0: ["A0", "A1"], 1: ["A2", "A3"], 2: ["F0", "F1"]}
    ids: dict[int, str] = {}
    for gid, (fate, reason, step) in {**EXPECTED, "H2": ("held", None, None)}.items():
        reply = c.get(f"/ledger/groups/{gid}")
        assert reply.status_code == 200, reply.text
        [row] = reply.json()["groups"]
        if gid == "H2" and row["fate"] == "dropped":
            fate, reason, step = "dropped", "side_buffer_expired", row["step"]
        assert (row["fate"], row["reason"], row["step"]) == (fate, reason, step), gid
        assert (row["env"], row["seqs"], row["group_id"]) == ("math_0", {"H1": 2, "H2": 3}.get(gid, 4), gid)
        if fate == "served":
            assert row["committed"] is (step in (0, 1)), gid
        ids[row["id"]] = gid
    assert len(ids) == len(EXPECTED) + 1, "two groups share a ledger row"
    for step, gids in batches.items():
        row = c.get(f"/ledger/steps/{step}").json()
        assert [ids[g["id"]] for g in row["groups"]] == gids
        assert (row["groups_by_env"], row["seqs_by_env"], row["seqs"]) == ({"math_0": 2}, {"math_0": 8}, 8)
        assert (row["committed_at"] is not None) is (step in (0, 1))
        assert row["staleness"] == ({"0": 2} if step != 1 else {"1": 2})
    assert c.get("/ledger/steps/3").status_code == 404
