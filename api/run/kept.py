"""Which served batches a run keeps for serving again, and when they are acknowledged: pure decisions over
`Kept`, which the store holds as one named value and `api/batches/formation.py` applies.

A run acknowledges batches one of two ways, chosen when the trainer registers (`Registration.acknowledge`):
- "next" (Atropos's clients and rollbuf's default): asking for batch N acknowledges every batch before N. Right
  for a trainer that asks for N+1 only once N is trained.
- "commit": a trainer acknowledges with `POST /commit {"step": K}` ("every batch before K is trained and
  saved"), like a consumer's offset commit. Batches from the last commit on are served again, byte for byte,
  however far the trainer read ahead, within `ReadAhead`'s bound. Right for a trainer that prefetches (TRL's
  data loader, a PyTorch loader with `prefetch_factor`, data-parallel ranks fetching at their own pace).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from api.config.groups import setting
from api.errors import Conflict, Unavailable

NEXT = "next"
COMMIT = "commit"


class ReadAheadFull(Unavailable):
    """503: a trainer in commit mode has as many batches served and not committed as the bound allows."""

    code = "read_ahead_full"


@dataclass(frozen=True, slots=True)
class ReadAhead:
    """How far a trainer in commit mode may read past its last commit: a batch is formed only while fewer than
    `max_batches` are served and not committed, and they hold less than `max_bytes` (so one always fits)."""

    max_batches: int = setting("max_read_ahead_batches")
    max_bytes: int | None = setting("max_read_ahead_bytes")


@dataclass(frozen=True, slots=True)
class Kept:
    """The acknowledged mark and the batches kept past it."""

    committed: int
    """Every batch before this step is acknowledged: freed, and 410 if asked for."""
    sizes: dict[int, int] = field(default_factory=dict)
    """Bytes of each batch kept for serving again, by step."""

    @property
    def bytes(self) -> int:
        return sum(self.sizes.values())

    def to_json(self) -> dict[str, object]:
        return {"committed": self.committed, "sizes": {str(k): v for k, v in sorted(self.sizes.items())}}

    @staticmethod
    def from_json(raw: dict[str, object]) -> Kept:
        sizes = raw.get("sizes", {})
        assert isinstance(sizes, dict)
        committed = raw["committed"]
        assert isinstance(committed, int)
        return Kept(committed, {int(k): int(v) for k, v in sizes.items()})

    def acknowledge(self, step: int) -> Kept:
        """Every batch before `step` acknowledged (never moves back: a late or repeated commit changes nothing)."""
        if step <= self.committed:
            return self
        return Kept(step, {s: n for s, n in self.sizes.items() if s >= step})

    def keep(self, step: int, size: int) -> Kept:
        return Kept(self.committed, {**self.sizes, step: size})


def check_commit(step: int, next_step: int) -> None:
    """A commit of `step` ("every batch before it is trained") is possible only for batches already served."""
    if step > next_step:
        raise Conflict(
            f"cannot commit step {step}: batches up to {next_step - 1} were served, so at most {next_step} can "
            "be committed (every batch before it)",
            loc=("body", "step"),
        )


def read_ahead_full(kept: Kept, next_step: int, limits: ReadAhead) -> str | None:
    """Why no further batch may be formed for a trainer in commit mode (None: one may)."""
    ahead = next_step - kept.committed
    fix = "; commit the steps trained (POST /commit) to go on"
    if ahead >= limits.max_batches:
        return (
            f"read-ahead bound: {ahead} batches (steps {kept.committed}-{next_step - 1}) are served and not "
            f"committed; the limit (max_read_ahead_batches) is {limits.max_batches}{fix}"
        )
    if limits.max_bytes is not None and kept.bytes >= limits.max_bytes:
        return (
            f"read-ahead bound: the {ahead} batches served and not committed hold {kept.bytes} bytes; the limit "
            f"(max_read_ahead_bytes) is {limits.max_bytes}{fix}"
        )
    return None
