"""The reuse policy on the wire (docs/replay.md): how often a group may be trained, for how long, how much of a
batch reused groups may take and in which order they are drawn. The trainer sends one at POST /register (the
run's) and an env may send its own at POST /register-env (where it differs, or `max_served: 1` to opt out).
Imports only pydantic and the wire's rules: clients import it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from api.wire.rules import SAFE_INT_MAX, _Request

MAX_SERVED_LIMIT = 64
"""The most times a policy may let one group be served: a bound on what one registration can make the server keep
(each further serve keeps the group's payload longer), far past where reuse stops helping."""

ReuseOrder = Literal["oldest", "advantage", "spread", "recent"]
"""How reused groups are drawn: `oldest` (generated at the earliest policy step first), `advantage` (the largest
|score - the group's mean score| first: the strongest GRPO signal), `spread` (the widest range of scores first),
`recent` (the latest policy step first). Ties go to the group acknowledged first."""


class ReusePolicy(_Request):
    """A reuse policy: `max_served` 1 (the default) is the Atropos behaviour, every group trained at most once."""

    integer_fields = frozenset(["max_served", "max_age"])

    max_served: int = Field(default=1, ge=1, le=MAX_SERVED_LIMIT)
    """How many batches a group may be served in, the first serve included (1: never reused)."""
    max_age: int | None = Field(default=None, ge=0, le=SAFE_INT_MAX)
    """A group is reused only while the batch's step is at most this many steps past the policy step it was
    generated at; it replaces the trainer's `max_staleness` for a reuse (the first serve still obeys
    `max_staleness`). Null: no age limit (the replay pool's bounds still hold)."""
    max_reused_share: float = Field(default=0.5, ge=0.0, le=1.0, allow_inf_nan=False)
    """The largest share of a batch's sequences that reused groups may take; fresh groups take the rest first."""
    order: ReuseOrder = "oldest"
    """The order reused groups are drawn in (`ReuseOrder`)."""

    @property
    def reuses(self) -> bool:
        """Whether a group may be served more than once under this policy."""
        return self.max_served > 1 and self.max_reused_share > 0.0


NO_REUSE = ReusePolicy()
"""The default policy: every group trained at most once."""
