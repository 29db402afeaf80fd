"""`rollout_client.runner.coalescing.Coalescer` alone, against a scripted server in place of the HTTP client: groups
finishing together go in one list (at the count and byte bounds at once), a lone group goes alone, each
caller gets its own group's reply (duplicates named by index), a refused list is sent again group by group,
an unsendable one fails for each caller, and a cancelled caller breaks none of the others."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from api.wire.schema import ScoredData, ScoredListReply, ScoredReply
from rollout_client.errors import Rejected, RetriesExhausted, Unavailable
from rollout_client.runner.coalescing import Coalescer, approx_bytes, replies_of

pytestmark = pytest.mark.anyio

FOREVER = 3600.0
"""A linger no test waits out: what goes, goes by a bound, a flush or aclose."""


def group(gid: str, tokens: int = 3) -> ScoredData:
    return ScoredData(tokens=[[1] * tokens], masks=[[1] * tokens], scores=[1.0], group_id=gid)


class Server:
    """What the server would do with each request, recorded: a group id in `bad` makes its request a 422 (a
    list is refused whole), one in `stored` is a duplicate, `fail` makes every list request fail as given,
    and while `gate` is clear list requests wait for it."""

    def __init__(self, bad: Sequence[str] = (), stored: Sequence[str] = ()) -> None:
        self.bad = set(bad)
        self.stored: list[str] = list(stored)
        self.calls: list[tuple[int, list[str]]] = []
        self.fail: Exception | None = None
        self.gate = asyncio.Event()
        self.gate.set()
        self.entered = asyncio.Event()
        self.abandoned = 0

    def _store(self, ids: list[str]) -> list[bool]:
        if bad := self.bad.intersection(ids):
            where = [ids.index(b) for b in bad]
            raise Rejected(422, [{"loc": ["body", min(where), "tokens"], "msg": "bad group"}])
        duplicate = [gid in self.stored for gid in ids]
        self.stored += [gid for gid, dup in zip(ids, duplicate, strict=True) if not dup]
        return duplicate

    async def one(self, key: int, g: ScoredData) -> ScoredReply:
        assert g.group_id is not None
        self.calls.append((key, [g.group_id]))
        await asyncio.sleep(0)
        [dup] = self._store([g.group_id])
        return ScoredReply(status="received", duplicate=dup or None)

    async def many(self, key: int, groups: Sequence[ScoredData]) -> ScoredListReply:
        assert len(groups) >= 2, "a lone group goes to /scored_data"
        ids = [g.group_id or "" for g in groups]
        self.calls.append((key, ids))
        self.entered.set()
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.abandoned += 1
            raise
        if self.fail is not None:
            raise self.fail
        dups = [k for k, dup in enumerate(self._store(ids)) if dup]
        return ScoredListReply(groups_processed=len(ids), duplicates=len(dups) or None, duplicate_at=dups or None)


def coalescer(server: Server, **kw: Any) -> Coalescer:
    return Coalescer(server.one, server.many, **kw)


async def test_groups_finishing_together_go_in_one_list_and_each_gets_its_reply() -> None:
    server = Server(stored=["b", "d"])
    c = coalescer(server, linger=0.01)
    replies = await asyncio.gather(*(c.submit(0, group(gid)) for gid in "abcde"))
    assert server.calls == [(0, list("abcde"))]
    assert [r.duplicate for r in replies] == [None, True, None, True, None]
    assert {r.status for r in replies} == {"received"} and (c.lists, c.listed) == (1, 5)


async def test_a_lone_group_goes_alone_to_scored_data() -> None:
    server = Server()
    c = coalescer(server, linger=0.001)
    reply = await c.submit(0, group("a"))
    assert server.calls == [(0, ["a"])] and reply == ScoredReply(status="received")
    assert c.lists == 0


async def test_envs_are_never_mixed_in_a_list() -> None:
    server = Server()
    c = coalescer(server, linger=0.01)
    await asyncio.gather(*(c.submit(k % 2, group(f"g{k}")) for k in range(6)))
    assert sorted(server.calls) == [(0, ["g0", "g2", "g4"]), (1, ["g1", "g3", "g5"])]


async def test_a_full_list_goes_at_once_without_waiting_out_the_linger() -> None:
    server = Server()
    c = coalescer(server, linger=FOREVER, max_groups=3)
    replies = await asyncio.gather(*(c.submit(0, group(gid)) for gid in "abcdef"))
    assert server.calls == [(0, ["a", "b", "c"]), (0, ["d", "e", "f"])] and len(replies) == 6


async def test_the_byte_bound_closes_a_list_before_it_is_passed() -> None:
    server = Server()
    c = Coalescer(server.one, server.many, linger=FOREVER, max_bytes=25, size=lambda g: 10)
    first = [asyncio.ensure_future(c.submit(0, group(gid))) for gid in "abc"]
    await asyncio.gather(*first[:2])  # a and b filled 20 of 25: c's 10 would pass it, so they went without c
    assert server.calls == [(0, ["a", "b"])] and not first[2].done()
    await c.aclose()  # c goes now, alone
    assert server.calls[1:] == [(0, ["c"])] and first[2].result().status == "received"


async def test_a_refused_list_is_sent_again_group_by_group_so_only_the_bad_one_is_refused() -> None:
    server = Server(bad=["c"], stored=["b"])
    c = coalescer(server, linger=0.01)
    results = await asyncio.gather(*(c.submit(0, group(gid)) for gid in "abcd"), return_exceptions=True)
    assert server.calls[0] == (0, list("abcd")) and sorted(server.calls[1:]) == [(0, [x]) for x in "abcd"]
    assert isinstance(results[2], Rejected)
    assert [r.duplicate for r in results if isinstance(r, ScoredReply)] == [None, True, None]
    assert server.stored == ["b", "a", "d"], "each good group stored once"


async def test_a_list_the_queue_has_no_room_for_is_sent_group_by_group() -> None:
    """A 503 for the whole list: the groups that fit are stored alone, as single submits would be."""
    server = Server()
    server.fail = Unavailable(503, "the queue is full", "queue_full", 1.0)
    c = coalescer(server, linger=0.01)
    replies = await asyncio.gather(*(c.submit(0, group(gid)) for gid in "abc"))
    assert server.calls[0] == (0, list("abc")) and sorted(server.calls[1:]) == [(0, [x]) for x in "abc"]
    assert [r.status for r in replies] == ["received"] * 3 and sorted(server.stored) == list("abc")


async def test_a_list_that_cannot_be_sent_fails_for_each_caller() -> None:
    server = Server()
    server.fail = RetriesExhausted("POST /scored_data_list: still failing after retrying")
    c = coalescer(server, linger=0.01)
    results = await asyncio.gather(*(c.submit(0, group(gid)) for gid in "abc"), return_exceptions=True)
    assert all(r is server.fail for r in results) and server.calls == [(0, list("abc"))]


async def test_a_caller_cancelled_while_its_list_is_sent_breaks_none_of_the_others() -> None:
    server = Server()
    server.gate.clear()
    c = coalescer(server, linger=FOREVER, max_groups=3)
    tasks = [asyncio.ensure_future(c.submit(0, group(gid))) for gid in "abc"]
    await server.entered.wait()
    tasks[1].cancel()
    server.gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[1], asyncio.CancelledError)
    assert [type(r) for r in (results[0], results[2])] == [ScoredReply, ScoredReply]
    assert server.stored == ["a", "b", "c"], "a group already sent stays sent"


async def test_a_caller_cancelled_before_its_list_goes_is_left_out_of_it() -> None:
    server = Server()
    c = coalescer(server, linger=FOREVER, max_groups=3)
    a = asyncio.ensure_future(c.submit(0, group("a")))
    b = asyncio.ensure_future(c.submit(0, group("b")))
    await asyncio.sleep(0)
    a.cancel()
    replies = await asyncio.gather(b, c.submit(0, group("c")))  # c makes 3 (a counted): the list goes, without a
    assert server.calls == [(0, ["b", "c"])] and server.stored == ["b", "c"] and len(replies) == 2


async def test_a_list_whose_callers_all_went_is_abandoned() -> None:
    server = Server()
    server.gate.clear()
    c = coalescer(server, linger=FOREVER, max_groups=2)
    tasks = [asyncio.ensure_future(c.submit(0, group(gid))) for gid in "ab"]
    await server.entered.wait()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await c.aclose(timeout=FOREVER)  # returns: nothing is left to send
    assert server.abandoned == 1 and server.stored == []


@pytest.mark.parametrize("timeout", [0.0, 0.05])
async def test_aclose_sends_what_waits_and_abandons_what_outlasts_its_timeout(timeout: float) -> None:
    """Abandoned even before its first step (timeout 0), a list's callers are told: none waits for ever."""
    server = Server()
    c = coalescer(server, linger=FOREVER)
    waiting = [asyncio.ensure_future(c.submit(0, group(gid))) for gid in "ab"]
    await asyncio.sleep(0)
    server.gate.clear()
    await c.aclose(timeout=timeout)
    results = await asyncio.wait_for(asyncio.gather(*waiting, return_exceptions=True), FOREVER)
    assert all(isinstance(r, asyncio.CancelledError) for r in results) and server.stored == []
    if timeout:
        assert server.calls == [(0, ["a", "b"])] and server.abandoned == 1


async def test_linger_zero_sends_each_group_alone_at_once() -> None:
    server = Server()
    c = coalescer(server, linger=0.0)
    await asyncio.gather(*(c.submit(0, group(gid)) for gid in "abc"))
    assert sorted(server.calls) == [(0, ["a"]), (0, ["b"]), (0, ["c"])]


def test_replies_of_a_list() -> None:
    mixed = ScoredListReply(groups_processed=3, buffered=1, last_buffer_size=4, duplicates=1, duplicate_at=[2])
    assert replies_of(mixed, 3) == [
        ScoredReply(status="received"),
        ScoredReply(status="received"),
        ScoredReply(status="received", duplicate=True),
    ]
    held = ScoredListReply(groups_processed=2, buffered=2, last_buffer_size=6)
    assert replies_of(held, 2) == [ScoredReply(status="buffered"), ScoredReply(status="buffered", buffer_size=6)]


def test_approx_bytes_grows_with_tokens_fields_and_text() -> None:
    small, long = group("a", 10), group("a", 1000)
    assert approx_bytes(long) > 50 * approx_bytes(small) // 2
    more = long.model_copy(update={"inference_logprobs": [[0.0] * 1000]})
    chat = long.model_copy(update={"messages": [[{"role": "user", "content": "x" * 10_000}]]})
    assert approx_bytes(more) > approx_bytes(long) and approx_bytes(chat) >= approx_bytes(long) + 10_000


def test_bounds_are_checked() -> None:
    server = Server.__new__(Server)
    for bad in (
        {"linger": -1.0},
        {"linger": float("inf")},
        {"linger": float("nan")},
        {"max_groups": 0},
        {"max_bytes": 0},
    ):
        with pytest.raises(ValueError):
            Coalescer(server.one, server.many, **bad)


submissions = st.lists(
    st.tuples(st.integers(0, 2), st.booleans(), st.booleans(), st.integers(0, 2)),  # env, bad, stored, yields
    min_size=1,
    max_size=40,
)


@hyp_settings(max_examples=60, deadline=None)
@given(submissions, st.integers(1, 6), st.integers(1, 8))
def test_every_group_is_stored_at_most_once_and_every_caller_gets_its_own_answer(
    subs: list[tuple[int, bool, bool, int]], max_groups: int, max_in_bytes: int
) -> None:
    """Whatever the interleaving and the bounds: a good group is stored exactly once and its caller told
    whether it was a duplicate; a bad one is refused to its caller alone; no request mixes envs or passes
    the bounds, and a list holds two groups or more."""
    ids = [f"g{k}" for k in range(len(subs))]

    async def main() -> list[ScoredReply | BaseException]:
        server = Server(
            bad=[i for i, s in zip(ids, subs, strict=True) if s[1]],
            stored=[i for i, s in zip(ids, subs, strict=True) if s[2] and not s[1]],
        )
        c = Coalescer(
            server.one, server.many, linger=0.001, max_groups=max_groups, max_bytes=max_in_bytes, size=lambda g: 1
        )
        tasks = []
        for gid, (env, _, _, yields) in zip(ids, subs, strict=True):
            tasks.append(asyncio.ensure_future(c.submit(env, group(gid))))
            for _ in range(yields):
                await asyncio.sleep(0)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        env_of = {gid: s[0] for gid, s in zip(ids, subs, strict=True)}
        for key, sent in server.calls:
            assert {env_of[g] for g in sent} == {key} and 1 <= len(sent) <= min(max_groups, max_in_bytes)
        assert sorted(server.stored) == sorted(i for i, s in zip(ids, subs, strict=True) if not s[1])
        return results

    results = asyncio.run(main())
    for (_, bad, stored, _), result in zip(subs, results, strict=True):
        if bad:
            assert isinstance(result, Rejected)
        else:
            assert isinstance(result, ScoredReply) and bool(result.duplicate) == stored
