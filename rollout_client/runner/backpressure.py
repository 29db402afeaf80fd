"""The runner's backpressure state: which envs must wait before starting another group.

A /status-env read is up to a poll interval old by the time the dispatcher looks at it, and this runner's own
production since then is not in it; so each env's last status is corrected for the sequences acknowledged
since the read and the groups in flight, and judged by `pacing.pause_reason`: its own pending sequences and
those of every env (the batch being formed takes from all of them). Pure state; the runner does the reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from api.wire.schema import EnvStatus
from rollout_client.runner.pacing import pause_reason


class Backpressure:
    """Per env (by index): its last status read and what was acknowledged since; `held[i]` is why env `i`
    waits now (queue_full, ahead_of_trainer) or None, as of the last `refresh`."""

    def __init__(self, group_sizes: Sequence[int], max_staleness: int | None) -> None:
        self.group_sizes = list(group_sizes)
        self.max_staleness = max_staleness
        self.batch_size = 0
        """The trainer's batch size (from /info), which paces how fast a queue drains."""
        n = len(self.group_sizes)
        self.held: list[str | None] = [None] * n
        self._statuses: list[EnvStatus | None] = [None] * n
        self._acked = [0] * n
        """Sequences acknowledged per env so far; minus `_base`: acked since the last status read."""
        self._base = [0] * n

    def acked(self, env: int, seqs: int) -> None:
        """The server acknowledged `seqs` sequences of env `env`."""
        self._acked[env] += seqs

    def mark(self) -> list[int]:
        """Call before a status read and hand the result to `observed`: acks from then on may be missing from
        what the read returns, so they still count as pending."""
        return list(self._acked)

    def observed(self, statuses: Sequence[EnvStatus], mark: list[int]) -> int:
        """Take in every env's status, read after `mark`; returns the trainer's step they show."""
        self._statuses, self._base = list(statuses), mark
        return max(st.current_step for st in statuses)

    def refresh(self, in_flight: Iterable[tuple[int, int]], policy_step: int) -> list[str | None]:
        """Recompute `held` given the groups in flight now, as (env, sequences) pairs, and the step of the
        weights generating now. An env not read yet keeps its verdict (None: it is not held)."""
        pending = [acked - base for acked, base in zip(self._acked, self._base, strict=True)]
        for env, size in in_flight:
            pending[env] += size
        everything = sum(pending)
        for i, st in enumerate(self._statuses):
            if st is not None:
                self.held[i] = pause_reason(
                    st,
                    batch_size=self.batch_size,
                    group_size=self.group_sizes[i],
                    policy_step=policy_step,
                    max_staleness=self.max_staleness,
                    pending_seqs=pending[i],
                    pending_all=everything,
                )
        return self.held
