"""The ledger's replies (GET /ledger/steps/{step}, GET /ledger/groups/{group_id}; docs/ledger.md): a rollbuf
view for operators, apart from the Atropos protocol's schema (`api.wire.schema`) that both clients share."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, get_type_hints

from pydantic import Field, create_model
from pydantic_core import PydanticUndefined

from api.store.ledger_contract import GROUP_RECORD, LedgerGroup
from api.wire.rules import _Wire
from api.wire.schema import BatchGroup


def _group_fields() -> dict[str, Any]:
    """The reply's fields from the ledger's declaration (`LedgerGroup`), in its order: columns copied as they
    are (`Column.reply`), and those the reply says in its own way, in their place."""
    hints = get_type_hints(LedgerGroup)
    own: dict[str, dict[str, Any]] = {
        "env_id": {
            "env_id": (int | None, Field(description="Null for groups posted with `env_id: null`.")),
            "env": (str, Field(description="The env's name in views and counters (`wandb_name`).")),
        },
        "fate": {
            "fate": (
                Literal["queued", "held", "served", "dropped"],
                Field(
                    description='What became of it: queued, "held" in its env\'s side buffer, served in a batch, '
                    "or dropped."
                ),
            ),
        },
        "kept": {
            "committed": (
                bool | None,
                Field(description="Served: whether its batch is acknowledged (trained); null otherwise."),
            ),
        },
    }
    out: dict[str, Any] = {}
    for c in GROUP_RECORD:
        out.update(own.get(c.name, {}))
        if c.reply is not None:
            default = None if c.added else PydanticUndefined  # added later: optional, for clients written before
            out[c.name] = (hints[c.name], Field(default, description=c.reply))
    return out


if TYPE_CHECKING:
    _GroupFields = _Wire
else:
    _GroupFields = create_model("_GroupFields", __base__=_Wire, **_group_fields())


# The ledger's columns (api/store/ledger_contract.py `LedgerGroup`, in its order: `_group_fields`), then its payload.
class LedgerGroupReply(_GroupFields):
    """One acknowledged group's ledger row (docs/ledger.md)."""

    data: BatchGroup | None = None
    """With `?data=true` and a retained payload: the group as GET /batch serves it."""
    data_lost: bool | None = None
    """With `?data=true`: true when the group's payload was retained but its bytes were lost (a SQLite payload
    segment after a power loss, docs/stores.md), so `data` is null."""


GROUP_FIELDS = tuple(LedgerGroupReply.model_fields)
"""The reply's fields, in the order GET /ledger writes them (`api.ledger.rules.group_view`)."""


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
