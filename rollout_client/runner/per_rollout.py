"""The runner's side of per-rollout groups (docs/rollouts.md, `Environment.posts_each_rollout`): a group is opened
on the server as it starts, each rollout is posted as it ends (`Poster`: durable once acknowledged, so a producer
killed after 60 of 64 loses none of them), and the server seals the group with the G-th; the runner seals it
itself with its survivors when some failed (`verdict`). Slots of groups whose producer died come back as sibling
leases (`Holds` tracks those this runner works on). `Posting` opens and seals the runner's own groups."""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from api.wire.rollouts import GroupView
from rollout_client.env import Environment, Task
from rollout_client.errors import ClientError, Rejected, RetriesExhausted
from rollout_client.group import Rollout, needed, timings, transcript_record
from rollout_client.leases.open_groups import OpenGroups
from rollout_client.runner.accounting import Tally
from rollout_client.runner.stats import RunnerStats
from rollout_client.runner.timeouts import GROUP_S

log = logging.getLogger("rollout_client.runner")
T = TypeVar("T")

STORED = "stored"
"""The group is sealed (or being sealed: the server finishes it): acknowledged, like a stored group."""
SEAL = "seal"
"""Still open with the runner's rollouts all in: the runner seals it with them."""
REFUSED = "refused"
"""The server expired it (its sealed group was refused at ingest, or its deadline passed first)."""


@dataclass(frozen=True, slots=True)
class SlotContent:
    """What one slot holds, as the whole group's row would: `overrides` is the row's entry (`build_group`)."""

    tokens: list[int]
    masks: list[int]
    logprobs: list[float]
    score: float
    overrides: dict[str, Any]


def slot_content(rollout: Rollout) -> SlotContent:
    """What one slot holds: the rollout's transcript, or the one sequence it recorded (`Session.record_sequence`).
    A slot is one sequence: 0 or several cannot be posted alone."""
    timing = timings(rollout.elapsed, rollout.score_s)
    if rollout.external is None:
        record = {**timing, **transcript_record(rollout)}
        return SlotContent(rollout.tokens, rollout.masks, rollout.logprobs, rollout.score, record)
    if len(rollout.external) != 1:
        raise ValueError(
            f"a rollout posted alone (posts_each_rollout) must be one sequence; it recorded {len(rollout.external)}"
        )
    (seq,) = rollout.external
    return SlotContent(seq.tokens, seq.masks, seq.logprobs, float(seq.score), {**timing, **seq.overrides})


def after_turns(rollout: Rollout) -> bool:
    """Whether the final post carries only what follows the rollout's acknowledged turns (`after_turns`): some
    are acknowledged and something follows them (a post carries one token at least). Else the rollout is posted
    whole, which the server takes whatever turns it holds (docs/episodes.md)."""
    return rollout.external is None and rollout.acked_turns > 0 and len(rollout.tokens) > rollout.acked_tokens


def task_to_wire(env: str, task: Task) -> dict[str, Any]:
    """The task as the group is opened with it: what a sibling producer needs to redo a slot (must be JSON),
    with the env's name (each producer's registration has its own env_id: the name is what they share)."""
    return {"env": env, "id": task.id, "prompt": task.prompt, "answer": task.answer, "meta": task.meta}


def task_from_wire(obj: Any) -> tuple[str, Task] | None:
    """The env name and task a sibling lease carries, or None when it is not one a runner opened."""
    if not isinstance(obj, dict) or not all(isinstance(obj.get(k), str) for k in ("env", "id", "prompt")):
        return None
    meta = obj.get("meta")
    return obj["env"], Task(obj["id"], obj["prompt"], obj.get("answer"), meta if isinstance(meta, dict) else {})


def verdict(view: GroupView | None) -> str:
    """What the runner does once its rollouts of a group are over and posted, from the group's last view."""
    if view is None or view.state == "open":
        return SEAL
    return REFUSED if view.state == "expired" else STORED


def deadline_s(group_timeout: float | None, default: float) -> float:
    """A group's deadline on the server: the runner's own bound on a group (`Timeouts.group`), else `default`."""
    if group_timeout is None or not math.isfinite(group_timeout) or group_timeout <= 0:
        return default
    return group_timeout


@dataclass
class Poster:
    """Posts a group's rollouts as they end; what was acknowledged stays across the group's retries (a retry
    runs only the slots still missing: an acknowledged rollout is never redone)."""

    groups: OpenGroups
    group_id: str
    stats: RunnerStats
    policy_step: int | None = None
    """The weights' step its rollouts are generated with (the group's at dispatch; a sibling's: the runner's)."""
    done: dict[int, Rollout] = field(default_factory=dict)
    last: GroupView | None = None
    handed_over: set[int] = field(default_factory=set)
    """Slots this runner lost to another producer mid-rollout (`SlotLost`: its lease passed on while this one was
    paused or cut off): that producer continues them from their turns, so this runner neither runs them again nor
    seals the group without them."""

    async def __call__(self, slot: int, rollout: Rollout) -> None:
        c = slot_content(rollout)
        tail = after_turns(rollout)
        start = rollout.acked_tokens if tail else 0
        reply = await self.groups.post(
            self.group_id,
            slot,
            c.tokens[start:],
            c.masks[start:],
            score=c.score,
            inference_logprobs=c.logprobs[start:],
            policy_step=self.policy_step,
            overrides=c.overrides,
            after_turns=tail,
            token_weight_versions=rollout.versions[start:] if tail and rollout.versions is not None else None,
        )
        self.done[slot] = rollout
        self.last = reply.group
        if reply.status == "redone":
            self.stats.rollouts_redone += 1
        else:
            self.stats.rollouts_posted += 1


class Holds:
    """Sibling slots this runner works on, per group: the group is heartbeated while any is running."""

    def __init__(self) -> None:
        self._n: Counter[str] = Counter()

    def take(self, group_id: str) -> None:
        self._n[group_id] += 1

    def give(self, group_id: str) -> bool:
        """One slot of the group is over (posted or failed): True when it was the last this runner held."""
        self._n[group_id] -= 1
        if self._n[group_id] > 0:
            return False
        del self._n[group_id]
        return True

    def __len__(self) -> int:
        return sum(self._n.values())


@dataclass
class Posting:
    """The runner's own per-rollout groups: opened before their rollouts run, sealed once they are all posted.
    A call the server could not take, or refused, is counted as a whole group's submission is (unsent; rejected,
    which may end the run: `end`)."""

    groups: OpenGroups
    envs: Sequence[Environment]
    env_id: Callable[[int], int | None]
    """Env `i`'s id on the server (each producer's registration has its own)."""
    stats: RunnerStats
    tally: Tally
    end: Callable[[str, BaseException | None], None]
    group_timeout: float | None

    async def open(self, i: int, task: Task, group_id: str, step: int) -> Poster | None:
        """Open the group on the server (its rollouts are posted as they end); None when it cannot be (counted)."""
        env = self.envs[i]
        deadline = deadline_s(self.group_timeout, GROUP_S)
        opened = self.groups.open(
            group_id,
            env.group_size,
            env_id=self.env_id(i),
            min_group_size=needed(env),
            deadline_s=deadline,
            task=task_to_wire(env.name, task),
        )
        if await self._on_server(i, group_id, "opened", opened) is None:
            return None
        return Poster(self.groups, group_id, self.stats, step)

    async def sealed(self, i: int, group_id: str, poster: Poster) -> bool:
        """Its rollouts are all posted: sealed by the server with the last (or here, with the survivors); whether
        it is acknowledged (False: counted as unsent or rejected)."""
        view = poster.last
        carried = (
            []
            if verdict(view) != SEAL
            else sorted(poster.handed_over) or await self._missing_with_turns(i, group_id, poster)
        )
        if carried:
            log.info(
                "group %s: slot(s) %s have acknowledged turns and continue on a producer that leases them; "
                "the server seals the group with their posts",
                group_id,
                carried,
            )
            self.groups.let_go(group_id)
            return True
        if verdict(view) == SEAL:
            if (got := await self._on_server(i, group_id, "sealed", self.groups.seal(group_id))) is None:
                return False
            view = got[0]
        if verdict(view) == REFUSED:
            why = view.left_out.get("group", "expired") if view is not None else "expired"
            self._rejected(i, group_id, Rejected(422, f"group {group_id} expired on the server: {why}"))
            return False
        return True

    async def _missing_with_turns(self, i: int, group_id: str, poster: Poster) -> list[int]:
        """The slots this runner did not post whose turns the server acknowledged (a rollout that failed after
        some turns: its final post not sent, say, through an outage): sealing without them would drop what was
        acknowledged, where a producer that leases them continues them. Asked only when the runner would seal
        with survivors; none when the server cannot be asked (the group is sealed as before)."""
        missing = [k for k in range(self.envs[i].group_size) if k not in poster.done]
        out = []
        for k in missing:
            try:
                prefix = await self.groups.turns(group_id, k)
            except ClientError:
                return []
            if prefix.turns:
                out.append(k)
        return out

    async def _on_server(self, i: int, group_id: str, doing: str, call: Awaitable[T]) -> tuple[T] | None:
        """`call`'s answer (in a 1-tuple, as it may be None), or None when the server could not be reached or
        refused it (counted)."""
        try:
            return (await call,)
        except RetriesExhausted as exc:
            log.warning("group %s of %s not %s: %s", group_id, self.envs[i].name, doing, exc)
            self.stats.skipped["unsent"] += 1
        except Rejected as exc:
            self._rejected(i, group_id, exc)
        return None

    def _rejected(self, i: int, group_id: str, exc: Rejected) -> None:
        if stop := self.tally.rejected(i, group_id, exc):
            self.end(stop, exc)
