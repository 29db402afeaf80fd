"""The crash matrix's episodes side: multi-turn tool episodes, their deterministic stand-in policy, and what an
uninterrupted run makes of each slot, computed in process with no server (the reference a resumed rollout is
held to).

Two envs of the same walk (rollout_client/examples.py: each generation names a move, the tool answers the new
position): `trek` resumes a slot by replaying its recorded completions against the deterministic tool
(`resumes = "replay"`), `trek_snapshot` by restoring the episode from the last turn's snapshot (`"snapshot"`).
A task `trek-N` is an episode of `turns_of(N)` steps, 6 to 10. The policy is `ScriptedPolicy(walk_script)`:
its completions depend only on the prompt and the rollout's seed, and the seed only on the group id and slot
(`rollout_client.group.rollout_seed`), so the same group id, slot, env and task make the same tokens in any
process, resumed or not.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from crash.records import digest
from rollout_client import ScriptedPolicy, Task
from rollout_client.episodes import TurnPiece
from rollout_client.examples import SnapshotWalk, Walk, WalkEpisode, walk_script
from rollout_client.group import run_rollout
from rollout_client.policy import Completion

G = 4
"""Rollouts a group."""
MIN_TURNS, MAX_TURNS = 6, 10


def turns_of(index: int) -> int:
    """The steps of task `trek-INDEX`: 6 to 10, spread by a hash of the index (producers' tasks are numbered
    from offsets that are multiples of 100)."""
    spread = int.from_bytes(hashlib.blake2b(str(index).encode(), digest_size=4).digest(), "little")
    return MIN_TURNS + spread % (MAX_TURNS - MIN_TURNS + 1)


def task(index: int) -> Task:
    return Task(f"trek-{index}", f"trek {index}")


def index_of(task_id: str) -> int:
    """The index of a task id `trek-N` (ValueError for another)."""
    head, _, tail = task_id.partition("-")
    if head != "trek" or not tail.isascii() or not tail.isdigit():
        raise ValueError(f"not an episodes task id: {task_id!r}")
    return int(tail)


class Trek(Walk):
    """The walk, `turns_of(N)` steps for task `trek-N`, resumed by replay."""

    name = "trek"
    group_size = G

    def episode(self, task: Task) -> WalkEpisode:
        return WalkEpisode(turns_of(index_of(task.id)))


class SnapshotTrek(SnapshotWalk):
    """The walk, `turns_of(N)` steps for task `trek-N`, resumed from snapshots."""

    name = "trek_snapshot"
    group_size = G

    def episode(self, task: Task) -> WalkEpisode:
        return WalkEpisode(turns_of(index_of(task.id)))


ENVS: dict[str, Callable[[], Walk]] = {"trek": Trek, "trek_snapshot": SnapshotTrek}


def policy() -> ScriptedPolicy:
    return ScriptedPolicy(walk_script)


@dataclass(frozen=True)
class Expected:
    """One slot as an uninterrupted run makes it."""

    digest: str
    """Of the rollout's tokens (`crash.records.digest`), as the trainer records each sequence it trained."""
    turns: tuple[str, ...]
    """Per turn posted (turn 0, 1, ...), the digest of its tokens, as a producer records each turn acknowledged."""
    generations: int
    """Completions the rollout holds."""


@dataclass
class _Collect:
    """A turn sink that keeps each turn (`rollout_client.episodes.TurnSink`), posting nothing."""

    pieces: list[TurnPiece] = field(default_factory=list)
    acked: int = 0
    acked_tokens: int = 0
    versions_sent: bool | None = None

    async def put(self, piece: TurnPiece) -> None:
        self.pieces.append(piece)
        self.acked += 1
        self.acked_tokens += len(piece.tokens)

    async def flush(self) -> None:
        return None

    def close(self) -> None:
        return None


class _Counting(ScriptedPolicy):
    def __init__(self) -> None:
        super().__init__(walk_script)
        self.calls = 0

    async def generate(self, prompt_ids: list[int], **kw: Any) -> Completion:
        self.calls += 1
        return await super().generate(prompt_ids, **kw)


async def _slot(env: Walk, t: Task, group_id: str, slot: int, token_limit: int | None) -> Expected:
    sink, counting = _Collect(), _Counting()
    rollout = await run_rollout(env, t, counting, slot, group_key=group_id, turn_sink=sink, token_limit=token_limit)
    return Expected(digest(rollout.tokens), tuple(digest(p.tokens) for p in sink.pieces), counting.calls)


def reference(
    group_id: str, env_name: str, task_id: str, token_limit: int | None = None, slots: Sequence[int] = range(G)
) -> list[Expected]:
    """Each slot of group `group_id` of env `env_name` on task `task_id`, as an uninterrupted run makes it within
    `token_limit` (the server's `max_token_len`, which a runner bounds its rollouts by)."""
    env = ENVS[env_name]()
    t = task(index_of(task_id))

    async def run() -> list[Expected]:
        return [await _slot(env, t, group_id, k, token_limit) for k in slots]

    return asyncio.run(run())
