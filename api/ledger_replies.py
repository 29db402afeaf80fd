"""The ledger's replies (GET /ledger/steps/{step}, GET /ledger/groups/{group_id}; docs/ledger.md): a rollbuf
view for operators, apart from the Atropos protocol's schema (`api.schema`) that both clients share."""

from __future__ import annotations

from typing import Literal

from api.schema import BatchGroup
from api.wire import _Wire


class LedgerGroupReply(_Wire):
    """One acknowledged group's ledger row (docs/ledger.md)."""

    id: int
    """The ledger id (the item id the group is stored under)."""
    env_id: int | None
    """Null for groups posted with `env_id: null`."""
    env: str
    """The env's name in views and counters (`wandb_name`)."""
    group_id: str | None
    """The handler's group id, as sent."""
    handler: str | None
    """The name of the API key that sent it; null without auth."""
    producer_id: str | None = None
    """The producer that made it (the group's `producer_id`: its heartbeat id), if it sent one."""
    acked_at: float
    """Unix time it was acknowledged."""
    policy_step: int
    """The trainer step whose weights generated it (stamped at ingest when not sent)."""
    seqs: int
    """Its sequences."""
    tokens: int
    """Its tokens, over all sequences."""
    bytes: int
    """Its payload as stored: what retaining it costs."""
    score_mean: float
    """Mean of its sequences' scores."""
    score_min: float
    """Lowest score."""
    score_max: float
    """Highest score."""
    score_std: float
    """Population standard deviation of the scores."""
    fate: Literal["queued", "held", "served", "dropped"]
    """What became of it: queued, "held" in its env's side buffer, served in a batch, or dropped."""
    step: int | None
    """Served: the batch's step. Dropped: the step formed next when it was dropped. Else null."""
    reason: str | None
    """Dropped: why (`zero_variance`, `score_range`, `stale`, `side_buffer_expired`). Else null."""
    decided_at: float | None
    """Unix time it was served or dropped."""
    committed: bool | None
    """Served: whether its batch is acknowledged (trained); null otherwise."""
    kept: bool
    """Its payload is retained (`retain_steps`, `retain_bytes`)."""
    data: BatchGroup | None = None
    """With `?data=true` and a retained payload: the group as GET /batch serves it."""


class LedgerGroupsReply(_Wire):
    """GET /ledger/groups/{group_id}: the rows of every group sent under this id (one per env that used it)."""

    groups: list[LedgerGroupReply]
    """By ledger id."""


class LedgerStepReply(_Wire):
    """GET /ledger/steps/{step}: a formed batch's ledger row, and its groups' rows in the batch's order."""

    step: int
    """The batch's step."""
    formed_at: float
    """Unix time it was formed."""
    formation_s: float
    """Seconds batch formation took."""
    committed_at: float | None
    """When the batch was acknowledged (committed, or a later step asked for); null while it is not."""
    seqs: int
    """Sequences in the batch."""
    tokens: int
    """Tokens in the batch."""
    groups_by_env: dict[str, int]
    """Groups per env name."""
    seqs_by_env: dict[str, int]
    """Sequences per env name."""
    staleness: dict[str, int]
    """Groups by staleness (the step minus the group's policy step), keys as strings."""
    groups: list[LedgerGroupReply]
    """In batch order (a rank's share is `?rank=`'s cut of this order); rows pruned by `ledger_max_groups` are
    left out."""
