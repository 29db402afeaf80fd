"""Nothing lost, nothing served twice: served + queued + dropped = submitted, over generated runs."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from api.batches.outcomes import FormedBatch
from api.service import Service
from api.store.memory import MemoryStore
from api.wire.records import decode_batch
from api.wire.schema import RegisterEnv, Registration
from tests.factories import group, registration

Op = tuple[str, Any]


def ops() -> st.SearchStrategy[list[Op]]:
    submit = st.tuples(
        st.just("submit"),
        st.tuples(st.integers(0, 2), st.sampled_from([1, 2, 3, 4]), st.integers(0, 12), st.booleans()),
    )
    take = st.tuples(st.just("batch"), st.none())
    return st.lists(st.one_of(submit, take), max_size=40)


async def run(ops: list[Op], max_staleness: int | None, drop_zero_variance: bool) -> None:
    service = Service(MemoryStore())
    reg = Registration.model_validate(
        registration(
            batch_size=8, max_staleness=max_staleness, drop_zero_variance=drop_zero_variance, no_exact_fill="wait"
        )
    )  # "wait": every batch exactly 8 (the default serves fewer when nothing queued adds up)
    await service.register_trainer(reg)
    await service.batches.next_batch()
    for name, gs in [("a", 4), ("b", 2), ("c", 3)]:
        await service.register_env(RegisterEnv(max_token_length=512, desired_name=name, weight=1.0, group_size=gs))
    sizes = {0: 4, 1: 2, 2: 3}
    submitted: set[str] = set()
    served: list[str] = []
    for i, (kind, arg) in enumerate(ops):
        if kind == "submit":
            env_id, _, lag, same_scores = arg
            gid = f"g{i}"
            run_state = await service.run_state()
            policy_step = max(0, run_state.step - lag)  # a group never comes from weights not produced yet
            body = group(
                sizes[env_id],
                length=4,
                env_id=env_id,
                seed=i,
                group_id=gid,
                policy_step=policy_step,
                scores=[1.0] * sizes[env_id] if same_scores else None,
            )
            await service.ingest.submit(orjson.dumps(body), "application/json", many=False)
            submitted.add(gid)
        else:
            result = await service.batches.next_batch()
            if isinstance(result, FormedBatch):
                recs = decode_batch(result.records)
                assert sum(r.seqs for r in recs) == 8
                if max_staleness is not None:
                    assert all(r.policy_step >= result.step - max_staleness for r in recs)
                served.extend(r.group_id for r in recs if r.group_id)
    status = await service.status()
    dropped = sum(n for per_env in status.dropped.values() for n in per_env.values())
    assert len(served) == len(set(served)), "a group was served twice"
    assert set(served) <= submitted
    assert len(served) + status.queue_size + dropped == len(submitted)
    # the counters the operator's views read (api.run.stats) tell the same story
    snap = await service.snapshot()
    assert sum(e.received for e in snap.envs) == len(submitted)
    assert sum(e.served_groups for e in snap.envs) == len(served) == sum(snap.staleness.values())
    assert sum(sum(e.dropped.values()) for e in snap.envs) == dropped
    assert sum(e.queue.groups for e in snap.envs) == status.queue_size
    if max_staleness is not None:
        assert max(snap.staleness, default=0) <= max_staleness


@settings(max_examples=60, deadline=None)
@given(ops(), st.one_of(st.none(), st.integers(0, 3)), st.booleans())
def test_served_plus_queued_plus_dropped_is_submitted(
    ops: list[Op], max_staleness: int | None, drop_zero_variance: bool
) -> None:
    asyncio.run(run(ops, max_staleness, drop_zero_variance))
