"""Aging: an env's oldest item passed over by formation (a newer item of its env taken) becomes due
`LookAhead.due_after` batches later, and a batch must then hold it (docs/batching.md, "Aging"). Pure functions
over plain data; the record lives in the store's values (`api.run.state`)."""

from __future__ import annotations

from api.batches.planner import Plan
from api.store.items import ItemMeta

PassedOver = dict[int, tuple[int, int]]
"""Per env: its oldest item passed over (a newer item of its env taken) and the step it was first passed over."""


def is_due(passed: PassedOver, env_id: int, head: ItemMeta | None, step: int, due_after: int) -> bool:
    """Whether the env's oldest item has been passed over for `due_after` batches: a batch must now hold it."""
    got = passed.get(env_id)
    return head is not None and got is not None and got[0] == head.item_id and step - got[1] >= due_after


def age(passed: PassedOver, plan: Plan, step: int) -> PassedOver:
    """The record after batch `step` was formed by `plan`: an env whose oldest item was taken starts afresh; one
    whose oldest item was passed over keeps the step it was first passed over (or starts counting now)."""
    out = {env: rec for env, rec in passed.items() if env not in plan.take or env in plan.passed_over}
    for env, item_id in plan.passed_over.items():
        rec = passed.get(env)
        out[env] = rec if rec is not None and rec[0] == item_id else (item_id, step)
    return out
