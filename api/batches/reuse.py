"""Which reuse policy holds for an env's groups (docs/replay.md): the env's own where it registered one, else the
trainer's, else none (each group served once). Pure: the run's registration and the env's record in, a policy out."""

from __future__ import annotations

from api.run.state import EnvRecord
from api.wire.replay import NO_REUSE, ReusePolicy
from api.wire.schema import Registration


def policy_for(registration: Registration | None, env: EnvRecord | None) -> ReusePolicy:
    """The policy for `env`'s groups: an env's own policy wins over the trainer's (so `{"max_served": 1}` opts it
    out); groups sent without an env (`env` None) follow the trainer's."""
    if env is not None and env.reuse is not None:
        return ReusePolicy.model_validate(env.reuse)
    if registration is not None and registration.reuse is not None:
        return registration.reuse
    return NO_REUSE
