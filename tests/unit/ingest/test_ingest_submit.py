"""api.ingest.submit's pure checks: whether a submission validated against one run state still holds against the
state its transaction found, how a 409 names a reused key, and which queue limit refuses a submission."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.ingest import side_buffer
from api.ingest.queue_limits import QueueLimits
from api.ingest.side_buffer import SideLimits
from api.ingest.submissions import Submission, decode, group_key, request_key
from api.ingest.submit import QueueFull, check_capacity, queued_reply, reply_fields, reused_key_message, still_valid
from api.run.state import EnvRecord, RunState
from api.store.base import QueueCounts
from api.wire.schema import Registration, ScoredReply
from tests.factories import group, registration

ENVS = [EnvRecord(0, "a", "a_0", 1.0, 4, 512, None), EnvRecord(1, "b", "b_0", 1.0, 4, 512, None)]
RUN = RunState(Registration.model_validate(registration()), 3, True, ENVS)


def sub(env_id: int | None = 0, *, key: str | None = None, n: int = 4, **extra: Any) -> Submission:
    """One submission of an n x 8 token group, validated against RUN."""
    [s] = decode(
        orjson.dumps(group(n, 8, env_id, **extra)), "application/json", RUN, QueueLimits(), many=False, key=key
    )
    return s


SIZE = len(sub(0).payload)


def test_the_same_state_still_holds() -> None:
    assert still_valid([sub(0), sub(None)], RUN, RunState(RUN.registration, 3, True, list(ENVS)))


def test_a_new_registration_or_a_missing_env_does_not() -> None:
    other = Registration.model_validate(registration(batch_size=8))
    assert not still_valid([sub(0)], RUN, RunState(other, 3, True, ENVS))
    assert not still_valid([sub(1)], RUN, RunState(RUN.registration, 3, True, ENVS[:1]))
    assert still_valid([sub(0)], RUN, RunState(RUN.registration, 3, True, ENVS[:1]))  # env 1 was not named


def test_a_moved_step_matters_only_to_groups_stamped_with_it() -> None:
    moved = RunState(RUN.registration, 4, True, ENVS)
    assert not still_valid([sub(0)], RUN, moved)
    assert still_valid([sub(0, policy_step=2)], RUN, moved)


def test_reused_key_messages_name_the_key_and_where() -> None:
    msg = reused_key_message(sub(1, group_id="g7"))
    assert msg.startswith("the group: group_id 'g7' of env_id 1 was used before for a group with different content")
    assert "group_id 'g7' was used before" in reused_key_message(sub(None, group_id="g7"))
    assert "Idempotency-Key 'retry-1' was used before" in reused_key_message(sub(0, key=request_key("retry-1")))
    raw = orjson.dumps([group(4, 8, 0, seed=i, group_id="g7") for i in range(2)])
    first, later = decode(raw, "application/json", RUN, QueueLimits(), many=True)
    assert later.key == first.key == group_key(0, "g7") and later.where == "body[1]"
    assert reused_key_message(later, earlier=first.where).startswith(
        "body[1]: group_id 'g7' of env_id 0 was used by body[0] of this request for a group with different content"
    )


@given(
    st.integers(0, 20),
    st.integers(0, 20),
    st.integers(1, 4),
    st.none() | st.integers(1, 30),
    st.none() | st.integers(1, 1000),
    st.none() | st.integers(1, 20),
    st.none() | st.integers(1, 600),
    st.none() | st.integers(1, 20 * SIZE),
    st.none() | st.integers(1, 10 * SIZE),
    st.integers(0, 20),
)
def test_a_submission_is_refused_exactly_when_it_takes_a_limit_past_its_bound(
    a: int,
    b: int,
    n: int,
    max_groups: int | None,
    max_tokens: int | None,
    env_groups: int | None,
    env_tokens: int | None,
    max_bytes: int | None,
    env_bytes: int | None,
    held: int,
) -> None:
    """n groups of env 0 (32 tokens, SIZE bytes each) against a queue holding `a` groups of env 0 and `b` of
    env 1, `held` of env 0's in its side buffer (which counts against the queue limits alike)."""
    held = min(held, a)
    q = a - held
    counts = {0: QueueCounts(q, q, 4 * q, 32 * q, SIZE * q), 1: QueueCounts(b, b, 4 * b, 32 * b, SIZE * b)}
    side = {0: QueueCounts(held, held, 4 * held, 32 * held, SIZE * held)}
    limits = QueueLimits(max_groups, max_tokens, env_groups, env_tokens, max_bytes, env_bytes)
    over = [
        max_groups is not None and a + b + n > max_groups,
        max_tokens is not None and 32 * (a + b + n) > max_tokens,
        env_groups is not None and a + n > env_groups,
        env_tokens is not None and 32 * (a + n) > env_tokens,
        max_bytes is not None and SIZE * (a + b + n) > max_bytes,
        env_bytes is not None and SIZE * (a + n) > env_bytes,
    ]
    subs = [sub(0)] * n
    if any(over):
        with pytest.raises(QueueFull) as exc:
            check_capacity(limits, counts, side, subs)
        assert "queue full" in str(exc.value.detail) and exc.value.headers == {"Retry-After": "2"}
    else:
        check_capacity(limits, counts, side, subs)


@given(st.integers(0, 10), st.integers(1, 3), st.none() | st.integers(1, 12), st.none() | st.integers(1, 1200))
def test_a_side_buffer_is_full_exactly_when_one_more_group_passes_a_bound(
    held: int, n: int, max_groups: int | None, max_bytes: int | None
) -> None:
    have = QueueCounts(held, held, 2 * held, 16 * held, 100 * held)
    adding = QueueCounts(n, n, 2 * n, 16 * n, 100 * n)
    why = side_buffer.full(have, adding, SideLimits(max_groups, max_bytes, None))
    over = (max_groups is not None and held + n > max_groups) or (
        max_bytes is not None and 100 * (held + n) > max_bytes
    )
    assert (why is not None) == over


@pytest.mark.parametrize(
    "reply",
    [
        ScoredReply(status="received"),
        queued_reply(),
        ScoredReply(status="received", duplicate=True),
        ScoredReply(status="buffered", buffer_size=3),
        ScoredReply(status="buffered", buffer_size=3, duplicate=True),
    ],
)
def test_reply_fields_are_the_model_dump(reply: ScoredReply) -> None:
    """The shortcut for a queued group's reply says what pydantic would, and hands out a dict of its own."""
    fields = reply_fields(reply)
    assert fields == reply.model_dump(exclude_none=True)
    fields["status"] = "changed"
    assert reply_fields(reply)["status"] == reply.status
