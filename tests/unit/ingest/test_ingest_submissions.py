"""api.ingest.submissions: a request's bytes to validated Submissions, the same for JSON and msgpack, with no store."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.errors import InvalidData, Unavailable
from api.ingest.queue_limits import QueueLimits
from api.ingest.submissions import decode as decode_request
from api.ingest.submissions import group_key, request_key
from api.run.state import EnvRecord, RunState
from api.wire.records import MSGPACK, decode, encode_submission, encode_submission_list
from api.wire.schema import Registration
from tests.factories import group, registration

LIMITS = QueueLimits()


def run_with(n_envs: int = 2, step: int = 3, **reg: Any) -> RunState:
    envs = [EnvRecord(i, f"e{i}", f"e{i}_0", 1.0, 4, 512, None) for i in range(n_envs)]
    return RunState(Registration.model_validate(registration(**reg)), step, True, envs)


def msgpack_body(groups: list[dict[str, Any]], many: bool) -> bytes:
    def one(g: dict[str, Any]) -> bytes:
        rest = {k: v for k, v in g.items() if k not in ("tokens", "masks", "scores")}
        return encode_submission(g["tokens"], g["masks"], g["scores"], **rest)

    return encode_submission_list([one(g) for g in groups]) if many else one(groups[0])


def submissions(groups: list[dict[str, Any]], encoding: str, many: bool, run: RunState, key: str | None = None) -> Any:
    if encoding == "json":
        raw = orjson.dumps(groups if many else groups[0])
        return decode_request(raw, "application/json", run, LIMITS, many=many, key=key)
    return decode_request(msgpack_body(groups, many), MSGPACK, run, LIMITS, many=many, key=key)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(1, 4),
            st.integers(2, 16),
            st.sampled_from([None, 0, 1]),
            st.none() | st.text(min_size=1, max_size=8),
        ),
        min_size=1,
        max_size=4,
    ),
    st.booleans(),
)
def test_json_and_msgpack_give_the_same_submissions(shapes: list[Any], many: bool) -> None:
    """The two encodings are two spellings of one request: same records, keys, digests, locations."""
    shapes = shapes if many else shapes[:1]
    groups = [
        group(n, length, env_id, seed=i, **({"group_id": gid} if gid else {}))
        for i, (n, length, env_id, gid) in enumerate(shapes)
    ]
    run = run_with()
    from_json = submissions(groups, "json", many, run)
    from_binary = submissions(groups, "msgpack", many, run)
    assert [s.key for s in from_json] == [s.key for s in from_binary]
    assert [s.digest for s in from_json] == [s.digest for s in from_binary]
    assert [s.loc for s in from_json] == [s.loc for s in from_binary]
    for a, b in zip(from_json, from_binary, strict=True):
        ra, rb = decode(a.payload), decode(b.payload)
        assert ra.seqs == rb.seqs and np.array_equal(ra.tokens, rb.tokens) and ra.group_id == rb.group_id
        assert a.record.policy_step == b.record.policy_step == run.step  # stamped with the step validated at


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_keys_come_from_group_ids_scoped_by_env_or_from_the_request(encoding: str) -> None:
    run = run_with()
    [sub] = submissions([group(4, 8, 1, group_id="g7")], encoding, False, run)
    assert sub.key == group_key(1, "g7") == "g:1:g7" and sub.digest is not None
    [sub] = submissions([group(4, 8, 1, group_id="g7")], encoding, False, run, key=request_key("retry-1"))
    assert sub.key == "k:retry-1"
    [sub] = submissions([group(4, 8, 1)], encoding, False, run)
    assert sub.key is None and sub.digest is None


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_an_invalid_group_in_a_list_is_named_and_nothing_is_returned(encoding: str) -> None:
    groups = [group(4, 8, 0), group(4, 8, 0), group(4, 8, 7)]  # env 7 is not registered
    with pytest.raises(InvalidData) as exc:
        submissions(groups, encoding, True, run_with())
    assert exc.value.loc[:2] == ("body", 2)


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_the_runs_limits_apply(encoding: str) -> None:
    """max_token_len comes from the registration: a longer sequence is refused, naming where it is."""
    with pytest.raises(InvalidData) as exc:
        submissions([group(4, 64, 0)], encoding, False, run_with(max_token_len=32))
    assert exc.value.loc[0] == "body"


def test_before_a_trainer_registers_it_is_not_now() -> None:
    """503, not 4xx: handlers retry, and the group is right once the trainer is there."""
    unregistered = RunState(None, 0, False, [])
    with pytest.raises(Unavailable):
        submissions([group(4, 8, None)], "json", False, unregistered)
