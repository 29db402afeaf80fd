"""The direct JSON reader against the schema's own path: for any body, the same records or the same error."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from fastapi.exceptions import RequestValidationError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from api.errors import InvalidData
from api.http.body import parse_json
from api.ingest.json_groups import JsonGroup, _read_direct, read_groups
from api.ingest.validation import GroupLimits, pack_group
from api.wire.records import encode
from api.wire.schema import ScoredData, lenient_group
from tests.factories import group

LIMITS = GroupLimits(max_token_len=64, max_group_seqs=8)
_ONE = TypeAdapter(ScoredData)
_LIST = TypeAdapter(list[ScoredData])


def _outcome(groups: list[JsonGroup]) -> list[Any]:
    out: list[Any] = []
    for g in groups:
        try:
            rec = pack_group(g.data, env_id=g.data.env_id, current_step=3, limits=LIMITS, columns=g.columns)
        except InvalidData as exc:
            out.append(("invalid", exc.loc, exc.msg))
        else:
            out.append(encode(rec))
    return out


def direct(raw: bytes, many: bool) -> Any:
    try:
        return _outcome(read_groups(raw, many=many))
    except RequestValidationError as exc:
        return ("422", exc.errors())


def schema_path(raw: bytes, many: bool) -> Any:
    try:
        data = parse_json(_LIST, raw, lenient_group) if many else [parse_json(_ONE, raw, lenient_group)]
    except RequestValidationError as exc:
        return ("422", exc.errors())
    return _outcome([JsonGroup(sd) for sd in data])


# ----------------------------------------------------------------------------------------------- bodies

ODD_NUMBERS = st.sampled_from(
    [0, -0.0, 1.0, 1.5, 1e3, -100, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**30, True]
)
ODD_VALUES = st.one_of(ODD_NUMBERS, st.none(), st.just("7"), st.just("[1]"), st.just([]), st.just([3]), st.just({}))
TEXT = st.text(alphabet=st.sampled_from(list('ab[]{}",\\é🙂\n')), max_size=4)
JSONISH = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=False, allow_infinity=False), TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3)),
    max_leaves=8,
)


def perturb_rows(draw: st.DrawFn, rows: Any) -> Any:
    """Rows with one value, one row or the whole field made odd, or one row a value short or long."""
    rows = [list(r) for r in rows]
    kind = draw(st.sampled_from(["value", "value", "row", "field", "length"]))
    i = draw(st.integers(0, len(rows) - 1))
    if kind == "value" and rows[i]:
        rows[i][draw(st.integers(0, len(rows[i]) - 1))] = draw(ODD_VALUES)
    elif kind == "row":
        rows[i] = draw(ODD_VALUES)
    elif kind == "field":
        return draw(ODD_VALUES)
    elif kind == "length":
        rows[i] = rows[i][:-1] if draw(st.booleans()) else [*rows[i], 5]
    return rows


@st.composite
def group_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A group as an Atropos handler sends it, half the time with one thing wrong or odd about it."""
    n = draw(st.integers(1, 3))
    lengths = draw(st.lists(st.integers(1, 5), min_size=n, max_size=n))
    body = group(n, length=lengths, seed=draw(st.integers(0, 1000)), env_id=draw(st.sampled_from([None, 0, 1])))
    if draw(st.booleans()):
        body["advantages"] = [[0.5] * k for k in lengths]
    if draw(st.booleans()):
        body["token_weight_versions"] = [[draw(st.integers(0, 3))] * k for k in lengths]
    if draw(st.booleans()):
        body["messages"] = [[{"role": draw(TEXT), "content": draw(TEXT)}] for _ in range(n)]
    if draw(st.booleans()):
        body["overrides"] = draw(st.lists(st.dictionaries(TEXT, JSONISH, max_size=2), max_size=3))
    if draw(st.booleans()):
        body[draw(TEXT)] = draw(JSONISH)  # a key the schema ignores
    odd = draw(st.sampled_from(["none", "none", "none", "none", "rows", "rows", "rows", "scores", "env_id", "missing"]))
    if odd == "rows":
        name = draw(st.sampled_from(["tokens", "masks", "inference_logprobs", "advantages", "token_weight_versions"]))
        if name in body:
            body[name] = perturb_rows(draw, body[name])
    elif odd == "scores":
        body["scores"] = draw(st.lists(ODD_VALUES, max_size=3))
    elif odd == "env_id":
        body["env_id"] = draw(ODD_VALUES)
    elif odd == "missing":
        del body[draw(st.sampled_from(["tokens", "masks", "scores", "inference_logprobs"]))]
    return body


def render(value: Any, *, ascii_only: bool, duplicate: str | None = None) -> str:
    """JSON text; `duplicate` repeats that key of the top-level object with an earlier, different value."""
    if isinstance(value, dict):
        items = [
            f"{json.dumps(k, ensure_ascii=ascii_only)}:{render(v, ascii_only=ascii_only)}" for k, v in value.items()
        ]
        if duplicate is not None and duplicate in value:
            items.insert(0, f"{json.dumps(duplicate)}:[[1]]")
        return "{" + ",".join(items) + "}"
    if isinstance(value, list):
        return "[" + ",".join(render(v, ascii_only=ascii_only) for v in value) + "]"
    return json.dumps(value, ensure_ascii=ascii_only)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(group_bodies(), min_size=1, max_size=3),
    st.booleans(),
    st.booleans(),
    st.sampled_from([None, "tokens", "scores", "env_id"]),
)
def test_direct_reader_agrees_with_the_schema_path(
    bodies: list[dict[str, Any]], many: bool, ascii_only: bool, duplicate: str | None
) -> None:
    if many:
        raw = ("[" + ",".join(render(b, ascii_only=ascii_only, duplicate=duplicate) for b in bodies) + "]").encode()
    else:
        raw = render(bodies[0], ascii_only=ascii_only, duplicate=duplicate).encode()
    assert direct(raw, many) == schema_path(raw, many)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=6), st.integers(0, 1000), st.booleans())
def test_plain_groups_take_the_direct_path(lengths: list[int], seed: int, messages: bool) -> None:
    body = group(len(lengths), length=lengths, seed=seed)
    if messages:
        body["messages"] = [[{"role": "user", "content": 'say "[hi]"\n'}]] * len(lengths)
    for raw, many in [(json.dumps(body).encode(), False), (json.dumps([body, body]).encode(), True)]:
        assert _read_direct(raw, many=many) is not None
        assert direct(raw, many) == schema_path(raw, many)


@pytest.mark.parametrize(
    "tokens",
    [
        "[[[1]],[2]]",  # nesting that flattening alone would hide
        "[[1,[2]],[3,4]]",
        "[[[],2],[3,4]]",
        "[[1.0],[2]]",  # lax int: the schema path accepts it
        "[[true],[2]]",
        "[[9223372036854775808],[2]]",  # beyond int64
        "[[1],2]",
        '"[[1]]"',
    ],
)
def test_what_the_direct_path_leaves_to_the_schema(tokens: str) -> None:
    raw = f'{{"tokens":{tokens},"masks":[[-100],[-100]],"scores":[1,2]}}'.encode()
    assert _read_direct(raw, many=False) is None
    assert direct(raw, False) == schema_path(raw, False)
    # A proxy left alive into the shared parser would make it refuse the next body, silently (slow path).
    assert _read_direct(b'{"tokens":[[1]],"masks":[[1]],"scores":[1]}', many=False) is not None


def test_escapes_and_duplicates_go_to_the_schema_path() -> None:
    escaped = b'{"tokens":[[1]],"masks":[[1]],"scores":[1],"messages":[[{"role":"\\u005b","content":"x"}]]}'
    # An escaped "[" would make up for the one that nesting adds, were escapes not left to the schema.
    hidden = b'{"tokens":[[[1]]],"masks":[[1]],"scores":[1],"messages":[[{"role":"\\u005b","content":"x"}]]}'
    duplicated = b'{"tokens":[[1]],"tokens":[[2]],"masks":[[2]],"scores":[1]}'
    for raw in (escaped, hidden, duplicated):
        assert _read_direct(raw, many=False) is None
        assert direct(raw, False) == schema_path(raw, False)


def test_columns_hold_the_values() -> None:
    raw = b'{"tokens":[[1,2,3],[4]],"masks":[[-100,2,3],[4]],"scores":[0.5,1],"inference_logprobs":[[0,-1.5,2],[3]]}'
    [g] = read_groups(raw, many=False)
    assert g.columns is not None
    assert g.columns["tokens"].values.tolist() == [1, 2, 3, 4]
    assert g.columns["tokens"].lengths.tolist() == [3, 1]
    assert g.columns["inference_logprobs"].values.dtype == np.float64
    assert g.data.tokens == [] and g.data.scores == [0.5, 1.0]
