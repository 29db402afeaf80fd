"""api.wire.schema, the wire schema shared by the service and both clients: what it coerces, what it refuses."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from api.wire.rules import integral_floats
from api.wire.schema import (
    ENV_EXAMPLE,
    GROUP_EXAMPLE,
    REGISTRATION_EXAMPLE,
    RegisterEnv,
    Registration,
    ScoredData,
    lenient_group,
)

nested_numbers: st.SearchStrategy[Any] = st.recursive(
    st.integers(-(2**40), 2**40) | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4),
    max_leaves=20,
)


@given(nested_numbers)
def test_integral_floats_become_ints_and_nothing_else_changes(value: Any) -> None:
    """JSON Schema counts 8.0 as an integer: integral floats become ints at any depth, other values stay."""
    out = integral_floats(value)
    assert out == value  # numerically the same everywhere

    def ints_where_integral(a: Any, b: Any) -> bool:
        if isinstance(a, list):
            return all(ints_where_integral(x, y) for x, y in zip(a, b, strict=True))
        return type(b) is int if type(a) is float and a.is_integer() else type(b) is type(a)

    assert ints_where_integral(value, out)


def test_the_documented_examples_are_valid() -> None:
    """The OpenAPI examples Swagger UI sends must pass the schema they illustrate."""
    assert Registration.model_validate(REGISTRATION_EXAMPLE).batch_size == 8
    assert RegisterEnv.model_validate(ENV_EXAMPLE).group_size == 2
    assert ScoredData.model_validate(GROUP_EXAMPLE).group_id == "example-0"


def test_requests_are_strict_but_take_integral_floats() -> None:
    """A string where a number belongs is a 422 (never coerced); `8.0` for an integer is 8."""
    assert Registration.model_validate({**REGISTRATION_EXAMPLE, "batch_size": 8.0}).batch_size == 8
    with pytest.raises(ValidationError, match="batch_size"):
        Registration.model_validate({**REGISTRATION_EXAMPLE, "batch_size": "8"})
    with pytest.raises(ValidationError, match="batch_size"):
        Registration.model_validate({**REGISTRATION_EXAMPLE, "batch_size": 8.5})


def test_unknown_fields_are_ignored_as_atropos_does() -> None:
    reg = Registration.model_validate({**REGISTRATION_EXAMPLE, "a_field_from_a_newer_client": 1})
    assert not hasattr(reg, "a_field_from_a_newer_client")


def test_lenient_group_takes_the_lax_forms_real_clients_send() -> None:
    """verl's Atropos recipe sends boolean masks; some clients send integral floats for token ids."""
    sent = {
        **GROUP_EXAMPLE,
        "masks": [[False, False, True, True], [False, False, True, True]],
        "tokens": [[1.0, 2.0, 3.0, 4.0], [1, 2, 3, 5]],
    }
    group = ScoredData.model_validate(lenient_group(sent))
    assert group.masks == [[0, 0, 1, 1], [0, 0, 1, 1]] and group.tokens[0] == [1, 2, 3, 4]
    assert all(type(t) is int for t in group.tokens[0])


@pytest.mark.parametrize(
    ("field", "value"),
    [("group_id", ""), ("group_id", "x" * 201), ("policy_step", -1), ("messages", [[{"role": "user"}]])],
)
def test_scored_data_refuses_what_could_never_be_right(field: str, value: Any) -> None:
    with pytest.raises(ValidationError, match=field):
        ScoredData.model_validate({**GROUP_EXAMPLE, field: value})
