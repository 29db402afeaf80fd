"""Which reuse policy holds for an env's groups (docs/replay.md): the env's own where it registered one, else the
trainer's, else none (each group served once); an env's own never reuses more than the trainer's allows. Pure: the
run's registration and the env's record in, a policy out."""

from __future__ import annotations

from api.run.state import EnvRecord
from api.wire.replay import NO_REUSE, ReusePolicy
from api.wire.schema import Registration

REPLAY_SERVED = False
"""Whether formation serves reused groups. It does not yet: served groups are not kept for reuse (the replay pool is
not stored), so `/register` and `/register-env` refuse a policy that would serve a group twice (422 naming
`reuse.max_served`, `not_served_reason`) rather than acknowledge one that would then be ignored. The checks that
hold once it does (the ledger, an env never beyond the trainer) stay in place behind it and keep their tests."""


def not_served_reason(policy: ReusePolicy | None) -> str | None:
    """Why `policy` is refused while this server serves each group once (`REPLAY_SERVED`), or None where it asks
    for nothing more than that: a policy with `max_served` above 1 would be acknowledged and then ignored."""
    if REPLAY_SERVED or policy is None or policy.max_served <= 1:
        return None
    return (
        f"max_served {policy.max_served}: replay is not served yet, this server serves each group once "
        "(leave reuse out, or set max_served 1)"
    )


def beyond_trainer(trainer: ReusePolicy | None, own: ReusePolicy) -> tuple[str, str] | None:
    """Where an env's own policy would reuse more than the trainer's allows: the field and why, or None. Reuse is
    the trainer's to allow (it trains the same data again): an env may reuse less, or opt out, never more, so a
    producer's key cannot make a trainer that asked for no reuse train its groups twice."""
    if not own.reuses:
        return None  # an opt-out is always allowed
    allowed = trainer or NO_REUSE
    if not allowed.reuses:
        return "max_served", f"max_served {own.max_served}: the trainer registered no reuse (max_served 1)"
    if own.max_served > allowed.max_served:
        return "max_served", f"max_served {own.max_served} exceeds the trainer's {allowed.max_served}"
    if own.max_reused_share > allowed.max_reused_share:
        return (
            "max_reused_share",
            f"max_reused_share {own.max_reused_share:g} exceeds the trainer's {allowed.max_reused_share:g}",
        )
    if allowed.max_age is not None and (own.max_age is None or own.max_age > allowed.max_age):
        return "max_age", f"max_age {own.max_age} exceeds the trainer's {allowed.max_age}"
    return None


def policy_for(registration: Registration | None, env: EnvRecord | None) -> ReusePolicy:
    """The policy for `env`'s groups: an env's own policy wins over the trainer's (so `{"max_served": 1}` opts it
    out), unless it would reuse more than the trainer's allows (`beyond_trainer`: then none); groups sent without an
    env (`env` None) follow the trainer's."""
    if env is not None and env.reuse is not None:
        own = ReusePolicy.model_validate(env.reuse)
        trainer = registration.reuse if registration is not None else None
        return own if beyond_trainer(trainer, own) is None else NO_REUSE  # refused at /register-env: never kept
    if registration is not None and registration.reuse is not None:
        return registration.reuse
    return NO_REUSE
