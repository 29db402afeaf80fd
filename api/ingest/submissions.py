"""A submission request turned into `Submission`s: the body (JSON or msgpack, one group or a list) parsed,
each group validated and packed into its stored record, named by its idempotency key. Pure given the run
state and the limits (no store, no event loop), so the service can run it in a worker thread for a large
body, and the transaction only re-checks what may have moved (`api/ingest/submit.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from api.errors import InvalidData, Loc
from api.ingest.binary_groups import check_body
from api.ingest.idempotency import content_digest, digest_as
from api.ingest.json_groups import JsonGroup, read_groups
from api.ingest.queue_limits import QueueLimits, group_limits
from api.ingest.validation import pack_group
from api.ledger.rules import Resumes
from api.logs import request_env
from api.run.state import ANON_NAME, RunState
from api.wire.records import GroupRecord, encode, is_msgpack


@dataclass(slots=True)
class Submission:
    """One validated group on its way into the store (never changed once built; not `frozen`, as `GroupRecord`)."""

    env_id: int | None
    record: GroupRecord
    payload: bytes
    key: str | None
    """Idempotency key: the group id (scoped by env) or the request's Idempotency-Key."""
    digest: str | None = None
    """Digest of the content as sent (`api.ingest.idempotency`), with a key: a reused key with other content is a
    409."""
    loc: tuple[str | int, ...] = ("body",)
    """Where the group is in its request (`("body", 3)` in a list): errors found in the transaction name it."""
    sent_policy_step: int | None = None
    """`policy_step` as sent; None: stamped with the step the group was validated at."""
    sealed: bool = False
    """A per-rollout group's seal (`Ingest.submit`'s `sealed`): its group id is its open group's own. Never parsed
    from a body."""
    resumes: Resumes | None = None
    """A sealed per-rollout group's resumes, from the server's own lineage (`Ingest.submit`'s `resumes`): never
    parsed from a body, so no producer can claim one for its ledger row."""

    @property
    def where(self) -> str:
        """How a 409 names this group: "the group", or "body[3]" in a list."""
        return f"body[{self.loc[1]}]" if len(self.loc) > 1 else "the group"

    def digest_as(self, remembered: str) -> str:
        """This group's digest in the form of one remembered by an earlier version (`idempotency.digest_as`)."""
        return digest_as(remembered, self.record, self.sent_policy_step)

    @classmethod
    def of(
        cls, record: GroupRecord, payload: bytes, key: str | None, sent_policy_step: int | None, loc: Loc
    ) -> Submission:
        digest = None if key is None else content_digest(record, sent_policy_step, narrowed=True)  # validated
        return cls(record.env_id, record, payload, key, digest, tuple(loc), sent_policy_step)


def group_key(env_id: int | None, group_id: str | None) -> str | None:
    """The idempotency key of a group id: ids are scoped by env."""
    return f"g:{env_id}:{group_id}" if group_id else None


def request_key(idempotency_key: str | None) -> str | None:
    """The idempotency key of a request's Idempotency-Key header (kept apart from group ids)."""
    return f"k:{idempotency_key}" if idempotency_key else None


def decode(
    raw: bytes | bytearray,
    content_type: str | None,
    run: RunState,
    limits: QueueLimits,
    *,
    many: bool,
    key: str | None = None,
) -> list[Submission]:
    """A /scored_data (`many=False`) or /scored_data_list body as validated submissions, all or none: the
    first invalid group raises InvalidData naming it (`body[3].scores`). `key` (`request_key`) stands for the
    groups' own ids. The env a group names is kept in `request_env` for the request's log line."""
    if is_msgpack(content_type):
        return from_binary(raw, run, limits, many=many, key=key)
    return from_json(read_groups(raw, many=many), run, limits, many=many, key=key)


def from_binary(
    raw: bytes | bytearray, run: RunState, limits: QueueLimits, *, many: bool, key: str | None
) -> list[Submission]:
    """Groups sent as msgpack records (docs/binary-format.md), validated under the JSON path's rules."""
    checked = check_body(
        raw, many=many, env_ids=range(len(run.envs)), current_step=run.step, limits=group_limits(run, limits)
    )
    return [
        Submission.of(
            g.record,
            g.payload,
            key or group_key(g.record.env_id, g.record.group_id),
            g.sent_policy_step,
            ("body", i) if many else ("body",),
        )
        for i, g in enumerate(checked)
    ]


def from_json(
    groups: Sequence[JsonGroup], run: RunState, limits: QueueLimits, *, many: bool, key: str | None
) -> list[Submission]:
    """JSON groups, validated and packed into their stored records; `many`: they came as a list, and errors
    name their index in it (as the binary path does, a list of one included)."""
    group_limit = group_limits(run, limits)
    subs: list[Submission] = []
    for i, group in enumerate(groups):
        sd = group.data
        loc: tuple[str | int, ...] = ("body", i) if many else ("body",)
        env = None if sd.env_id is None else run.env(sd.env_id)
        request_env.set(ANON_NAME if sd.env_id is None else env.wandb_name if env else f"env_id {sd.env_id}")
        if sd.env_id is not None and env is None:
            raise InvalidData((*loc, "env_id"), f"no environment with env_id {sd.env_id} is registered")
        try:
            record = pack_group(sd, env_id=sd.env_id, current_step=run.step, limits=group_limit, columns=group.columns)
        except InvalidData as exc:
            raise exc.at(*loc) from None
        subs.append(
            Submission.of(record, encode(record), key or group_key(sd.env_id, sd.group_id), sd.policy_step, loc)
        )
    return subs
