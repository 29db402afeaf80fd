"""api.wire.replay, the reuse policy on the wire: its defaults serve each group once, its bounds are refused
with the field named, and whatever JSON a client sends either parses or is refused (never an exception of
another kind)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from api.wire.replay import MAX_SERVED_LIMIT, NO_REUSE, ReusePolicy
from api.wire.schema import REGISTRATION_EXAMPLE, RegisterEnv, Registration


def test_the_default_policy_serves_each_group_once() -> None:
    assert NO_REUSE == ReusePolicy.model_validate({})
    assert NO_REUSE.max_served == 1 and not NO_REUSE.reuses
    assert Registration.model_validate(REGISTRATION_EXAMPLE).reuse is None  # Atropos trainers send none


def test_a_policy_reuses_only_with_more_than_one_serve_and_a_share_for_it() -> None:
    assert ReusePolicy(max_served=2).reuses
    assert not ReusePolicy(max_served=2, max_reused_share=0.0).reuses  # no room in any batch: never reused
    assert not ReusePolicy(max_served=1, max_reused_share=1.0).reuses


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_served", 0),
        ("max_served", MAX_SERVED_LIMIT + 1),
        ("max_served", "2"),  # strict: a string is not a number
        ("max_served", 2.5),
        ("max_served", True),
        ("max_age", -1),
        ("max_reused_share", 1.5),
        ("max_reused_share", -0.1),
        ("max_reused_share", float("nan")),
        ("order", "random"),
        ("order", "OLDEST"),
    ],
)
def test_out_of_bounds_fields_are_refused_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValidationError) as exc:
        Registration.model_validate({**REGISTRATION_EXAMPLE, "reuse": {field: value}})
    assert [e["loc"] for e in exc.value.errors()] == [("reuse", field)]


def test_integral_floats_are_integers_and_unicode_digits_are_not() -> None:
    """JSON's 3.0 is 3 (as for every integer field); a string of Unicode digits is not a number."""
    assert ReusePolicy.model_validate({"max_served": 3.0, "max_age": 4.0}).max_served == 3
    with pytest.raises(ValidationError, match="max_served"):
        ReusePolicy.model_validate({"max_served": "\u0663"})  # ARABIC-INDIC DIGIT THREE


def test_an_env_carries_its_own_policy() -> None:
    env = RegisterEnv.model_validate(
        {"max_token_length": 8, "desired_name": "m", "group_size": 2, "reuse": {"max_served": 1}}
    )
    assert env.reuse == NO_REUSE


@given(
    st.dictionaries(
        st.sampled_from(["max_served", "max_age", "max_reused_share", "order", "other"]),
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5) | st.lists(st.integers()),
    )
)
def test_any_json_object_parses_or_is_refused(body: dict[str, Any]) -> None:
    """Total: a policy is parsed or refused with a ValidationError (a 422), whatever the values."""
    try:
        policy = ReusePolicy.model_validate(body)
    except ValidationError:
        return
    assert 1 <= policy.max_served <= MAX_SERVED_LIMIT and 0.0 <= policy.max_reused_share <= 1.0
