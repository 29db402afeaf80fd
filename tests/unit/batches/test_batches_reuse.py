"""api.batches.reuse: which policy holds for an env's groups (the env's own, else the trainer's, else none), and
which policies are refused while replay is not served."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.batches import reuse
from api.batches.reuse import beyond_trainer, not_served_reason, policy_for
from api.run.state import EnvRecord
from api.wire.replay import NO_REUSE, ReusePolicy
from api.wire.schema import REGISTRATION_EXAMPLE, Registration

policies = st.builds(
    ReusePolicy,
    max_served=st.integers(1, 64),
    max_age=st.none() | st.integers(0, 100),
    max_reused_share=st.floats(0.0, 1.0),
    order=st.sampled_from(["oldest", "advantage", "spread", "recent"]),
)


def env(reuse: ReusePolicy | None) -> EnvRecord:
    return EnvRecord(0, "m", "m_0", 1.0, 4, 64, None, reuse=None if reuse is None else reuse.model_dump())


def registration(reuse: ReusePolicy | None) -> Registration:
    return Registration.model_validate({**REGISTRATION_EXAMPLE, "reuse": reuse})


@given(st.none() | policies, st.none() | policies)
def test_an_envs_own_policy_wins_then_the_trainers_then_none(
    trainer: ReusePolicy | None, own: ReusePolicy | None
) -> None:
    if own is not None:
        expected = own if beyond_trainer(trainer, own) is None else NO_REUSE
    else:
        expected = trainer if trainer is not None else NO_REUSE
    assert policy_for(registration(trainer), env(own)) == expected
    assert policy_for(registration(trainer), None) == (trainer or NO_REUSE)  # groups sent without an env


def test_an_env_opts_out_of_the_trainers_reuse() -> None:
    reg = registration(ReusePolicy(max_served=4, max_reused_share=0.5))
    assert policy_for(reg, env(ReusePolicy(max_served=1))) == NO_REUSE
    assert policy_for(reg, env(None)).max_served == 4


def test_before_a_trainer_registers_nothing_is_reused() -> None:
    assert policy_for(None, env(None)) == NO_REUSE


@given(st.none() | policies, policies)
def test_an_env_never_reuses_more_than_the_trainer_allows(trainer: ReusePolicy | None, own: ReusePolicy) -> None:
    """Whatever an env registers, the policy in force for it reuses no more, for no longer, and takes no larger
    share than the trainer's; an env's own policy is refused exactly where it would."""
    allowed = trainer or NO_REUSE
    got = policy_for(registration(trainer), env(own))
    if got.reuses:
        assert got.max_served <= allowed.max_served and got.max_reused_share <= allowed.max_reused_share
        assert allowed.max_age is None or (got.max_age is not None and got.max_age <= allowed.max_age)
    beyond = beyond_trainer(trainer, own)
    within = (
        not own.reuses
        or allowed.reuses
        and own.max_served <= allowed.max_served
        and own.max_reused_share <= allowed.max_reused_share
        and (allowed.max_age is None or (own.max_age is not None and own.max_age <= allowed.max_age))
    )
    assert (beyond is None) == within
    if beyond is not None:
        field, why = beyond
        assert field in ReusePolicy.model_fields and why.startswith(field)


@given(st.none() | policies)
def test_while_replay_is_not_served_exactly_the_policies_that_would_serve_a_group_twice_are_refused(
    policy: ReusePolicy | None,
) -> None:
    why = not_served_reason(policy)
    if policy is not None and policy.max_served > 1:
        assert why is not None and why.startswith(f"max_served {policy.max_served}: replay is not served yet")
    else:
        assert why is None


def test_once_replay_is_served_no_policy_is_refused_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reuse, "REPLAY_SERVED", True)
    assert not_served_reason(ReusePolicy(max_served=64)) is None
