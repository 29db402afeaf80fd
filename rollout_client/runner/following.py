"""Following the trainer across processes: the weights it announces, and this producer's heartbeat.

The trainer tells rollbuf which weights are live (POST /weights); every /status-env the runner already reads
carries that step (`weights_step`). `Follower` turns it into the runner's policy step: groups started from then
on are stamped with it, and `max_staleness` is judged against it, so a producer in another process needs no
pause/resume calls and never stalls while the trainer announces. Groups in flight when new weights arrive meet
them by their env's `on_new_weights` policy:

- `continue` (default): they go on; their episodes span several weight versions. The group is stamped with the
  oldest (`policy_step`, which staleness counts from) and carries `generation_params["weight_versions"] = [min,
  max]`, the range it spanned (PipelineRL's in-flight updates, verifiers' per-token `weight_versions`).
- `restart`: they are cancelled and their tasks started again at once with the new weights: every episode is
  on-policy for one version, at the cost of the work thrown away.
- `drain`: no episode spans a sync and nothing is thrown away, but production of the env stops while its
  episodes in flight finish. The trainer begins the sync (POST /weights/pending, `TrainerClient.weight_sync`);
  the pending step reaches the runner in /status-env (`weights_pending`); it starts no new group of a drain env,
  and once none of theirs is generating it says `drained_for` in its heartbeat (at once, not at the next
  interval). The trainer waits for every live drain producer, pushes the weights and announces them (POST
  /weights); the runner then starts groups again, stamped with them. In one process, `RolloutRunner.pause()` /
  `resume()` around the sync does the same for every env.

Which weights sampled each turn: a weights version changes at the inference server when the trainer pushes,
which the runner learns of only from a later status read. So on a pending sync every runner, whatever its envs'
policies, also shuts its generation gate once its drain envs' episodes are over, waits until no request is at
the inference server and only then reports `drained_for` (`rollout_client.runner.watch`); the trainer pushes after
that, and the runner opens the gate once it has read the announcement, with the gate's `weights` set to the new
version. Each turn records the version it passed the gate with (`turns[k]["weights"]`), and the group's
`weight_versions` and `policy_step` are taken from its turns. They are exact (`weight_versions_exact: true`)
when every version its turns name ended, or runs now, under that handshake; a version that ended without it (a
trainer that only announces, a sync whose wait ran past its timeout, one before this producer took part) may have
served some of its turns with the next weights, so a group holding such a turn says `weight_versions_exact:
false`: its versions are this producer's estimate (never newer than the truth: the runner learns of a push
only after it).

`Beats` tells rollbuf that this producer is alive, every `gone_after / 6` s (the server's setting, from its
reply): its envs, in flight, groups/s, failures, weights, what holds it back. It logs, rate-limited, while the
server is unreachable and while this producer waits for the trainer: a heartbeat unanswered after `reply_within`
(a stopped or hung server, a silenced connection) is told then, not at the request's read timeout, and its
answer, if it comes, tells the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from api.wire.producers import Heartbeat, HeartbeatReply
from api.wire.schema import EnvStatus, ScoredData
from client_core.errors import ClientError, RetriesExhausted, TransportError
from rollout_client.runner.pacing import AHEAD, DRAINING, QUEUE_FULL

if TYPE_CHECKING:
    from rollout_client.client import RolloutClient
    from rollout_client.env import Environment, Task
    from rollout_client.runner.inflight import InFlight
    from rollout_client.runner.stats import RunnerStats

log = logging.getLogger("rollout_client.runner")

OnNewWeights = Literal["continue", "restart", "drain"]

RESTARTED = "restarted"
"""`skipped` reason of a group cancelled by new weights (`restart`); its task runs again."""
BEAT_S = 1.0
"""Heartbeat interval until the server's first reply says `gone_after`."""
BEAT_MIN_S, BEAT_MAX_S = 0.1, 10.0
REPLY_S = 5.0
"""Default bound on a heartbeat's answer before the server is reported unresponsive (`Timeouts.server_reply`):
a heartbeat is one small write, answered in milliseconds by a server at work; one slower than this is a server
stopped, hung or cut off, not a slow reply."""
LOG_EVERY_S = 30.0
"""Rate limit of the 'waiting for the trainer' and 'server unreachable' log lines."""
RATE_WINDOW_S = 60.0
"""groups/s in the heartbeat is over about this long."""


@dataclass(slots=True)
class Follower:
    """The weights announced, as the runner follows them: stamps, spans and restarts. Pure state over the runner's
    in-flight table; the runner calls `observed` after each status read."""

    envs: Sequence[Environment]
    weights_step: int | None = None
    """The last weights step announced, or None: then the runner's own policy step (resume()) rules."""
    pending: int | None = None
    """The step of a weight sync the trainer has begun and not announced yet (drain envs hold), or None."""
    quiesced: int | None = None
    """The pending sync's step this runner's generation is held for, once no request is in flight (the watch)."""
    handshake: bool = False
    """The last announcement came after this runner held its generation for it: the version generating now ends
    only once it holds again (while the trainer syncs through `weight_sync`)."""
    acked: set[int] = field(default_factory=set)
    """Versions that ended under the handshake: every turn served while they ran was served by them."""
    _spans: dict[str, int] = field(default_factory=dict)
    """Group id -> the newest weights step seen while its rollouts ran (for groups whose turns name no version)."""
    _restarts: list[list[Task]] = field(default_factory=list)
    _restarting: set[str] = field(default_factory=set)
    _tasks: dict[str, tuple[int, Task]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._restarts = [[] for _ in self.envs]

    def launched(self, group_id: str, i: int, task: Task) -> None:
        self._tasks[group_id] = (i, task)

    def ended(self, group_id: str) -> bool:
        """The group is over; True when it was cancelled to run again (its task is not discarded)."""
        self._spans.pop(group_id, None)
        self._tasks.pop(group_id, None)
        if group_id in self._restarting:
            self._restarting.discard(group_id)
            return True
        return False

    def observed(self, statuses: Sequence[EnvStatus], in_flight: InFlight) -> int | None:
        """Take in the weights step the statuses show; returns it when it is new (the runner stamps it from then
        on), after marking the spans of groups in flight and cancelling those whose env restarts."""
        pending = [st.weights_pending for st in statuses if st.weights_pending is not None]
        self.pending = max(pending) if pending else None
        seen = [st.weights_step for st in statuses if st.weights_step is not None]
        if not seen or (self.weights_step is not None and max(seen) <= self.weights_step):
            return None
        step = max(seen)
        self.handshake = self.quiesced is not None and self.quiesced >= step
        if self.handshake and self.weights_step is not None:
            self.acked.add(self.weights_step)
        self.weights_step = step
        for group_id, g in list(in_flight.groups.items()):
            if g.submitting or g.policy_step >= step:
                continue
            if self.envs[g.env].on_new_weights == "restart" and group_id in self._tasks and not g.cancelled:
                i, task = self._tasks[group_id]
                self._restarting.add(group_id)
                self._restarts[i].append(task)
                in_flight.cancel(g, RESTARTED)
            else:
                self._spans[group_id] = step
        return step

    @property
    def drains(self) -> bool:
        """A pending sync waits for this producer: every runner holds its generation for one (drain envs their
        episodes too), so that each turn's weights version is known."""
        return bool(self.envs)

    def syncing(self) -> int | None:
        """The step of a pending weight sync to newer weights than those announced, or None."""
        pending = self.pending
        if pending is None or (self.weights_step is not None and pending <= self.weights_step):
            return None
        return pending

    def holds(self, i: int) -> bool:
        """Env `i` starts no group now: it drains and a sync to newer weights is pending."""
        return self.envs[i].on_new_weights == "drain" and self.syncing() is not None

    def episodes_over(self, in_flight: InFlight) -> bool:
        """No group of a drain env is generating (one submitting sampled its tokens already)."""
        groups = in_flight.groups.values()
        return not any(self.envs[g.env].on_new_weights == "drain" and not g.submitting for g in groups)

    def drained_for(self, in_flight: InFlight) -> int | None:
        """The pending sync's step once no group of a drain env is generating and the runner's generation is
        held for it with no request in flight (`quiesced`), else None."""
        step = self.syncing()
        if step is None or self.quiesced != step or not self.episodes_over(in_flight):
            return None
        return step

    def exact(self, versions: set[int]) -> bool:
        """Whether turns served under these versions were served by them (see the module's docstring)."""
        return all(v in self.acked or (v == self.weights_step and self.handshake) for v in versions)

    def restart(self, i: int) -> Task | None:
        """A task of env `i` to run again (cancelled by new weights), before any new one."""
        return self._restarts[i].pop(0) if self._restarts[i] else None

    def drop_restarts(self) -> list[tuple[int, Task]]:
        """The tasks still waiting to run again (the run stops): the runner tells their sources they are discarded."""
        out = [(i, t) for i, tasks in enumerate(self._restarts) for t in tasks]
        self._restarts = [[] for _ in self.envs]
        return out

    def stamp(self, group_id: str, group: ScoredData, step: int) -> ScoredData:
        """With announced weights: the range of weight versions the group's turns were sampled with, `[min, max]`,
        in its `generation_params`, with `weight_versions_exact`; `policy_step` is the oldest (what staleness
        counts from). A group whose turns name no version (sequences recorded outside the session) gets the
        range it was in flight over, from `step`, as an estimate."""
        if self.weights_step is None:
            return group
        versions = turn_versions(group.overrides)
        update: dict[str, object] = {}
        if versions:
            lo, hi, exact = min(versions), max(versions), self.exact(versions)
            update["policy_step"] = lo
            per_token = token_versions(group) if group.token_weight_versions is None else None
            if per_token is not None:
                update["token_weight_versions"] = per_token
        else:
            lo, hi, exact = step, max(step, self._spans.get(group_id, step)), False
        update["generation_params"] = {
            **(group.generation_params or {}),
            "weight_versions": [lo, hi],
            "weight_versions_exact": exact,
        }
        return group.model_copy(update=update)


def turn_versions(overrides: Sequence[dict[str, object]] | None) -> set[int]:
    """The weights versions a group's turns were sampled with (`turns[k]["weights"]`, as sessions record them);
    empty when any sequence's turns do not all name one (then nothing is known of that sequence)."""
    versions: set[int] = set()
    for record in overrides or ():
        turns = record.get("turns")
        if not isinstance(turns, list) or not turns:
            return set()
        for turn in turns:
            weights = turn.get("weights") if isinstance(turn, dict) else None
            if not isinstance(weights, int):
                return set()
            versions.add(weights)
    return versions


def token_versions(group: ScoredData) -> list[list[int]] | None:
    """Per token, the weights version of the turn that sampled it (`token_weight_versions`), from each sequence's
    turns: turn k's completion is the `completion_tokens` after its first `prompt_tokens`. A position no turn
    sampled (the prompt, a tool's output) carries the version of the next turn, which read it, or of the last turn
    after the last one: such positions are not trained on, and their version is the one that saw them. None when a
    sequence's turns do not all name a version, or do not lie within its tokens (nothing is known of it then)."""
    if group.overrides is None or len(group.overrides) != len(group.tokens):
        return None
    out: list[list[int]] = []
    for tokens, record in zip(group.tokens, group.overrides, strict=True):
        turns = record.get("turns")
        if not isinstance(turns, list) or not turns:
            return None
        row: list[int] = []
        last = 0
        for turn in turns:
            if not isinstance(turn, dict):
                return None
            weights, start, length = turn.get("weights"), turn.get("prompt_tokens"), turn.get("completion_tokens")
            if not (isinstance(weights, int) and isinstance(start, int) and isinstance(length, int)):
                return None
            if start < len(row) or start + length > len(tokens):
                return None
            last = weights
            row += [last] * (start + length - len(row))  # what it read since the last turn, and its completion
        row += [last] * (len(tokens) - len(row))
        out.append(row)
    return out


def producer_id() -> str:
    """This process's producer id: host, pid and a random part (a restart is a new producer)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(slots=True)
class Beats:
    """Beats for the runner until cancelled; never raises (a server that cannot be reached is logged)."""

    clients: Sequence[RolloutClient]
    names: Sequence[str]
    """The envs' names, in the clients' order (what `stats.paused` is keyed by)."""
    stats: RunnerStats
    policy_step: Callable[[], int]
    drain: Callable[[], tuple[bool, int | None]] = lambda: (False, None)
    """Whether this producer drains on syncs, and the pending sync's step it has drained for (or None)."""
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    """Set to beat now (the runner drained for a pending sync: the trainer waits for that beat)."""
    producer_id: str = field(default_factory=producer_id)
    host: str = field(default_factory=socket.gethostname)
    interval: float = BEAT_S
    gone_after: float | None = None
    sibling_envs: list[str] | None = None
    """The env names whose missing slots this producer takes from other producers' groups (its per-rollout
    envs), or None: each reply then says when there are some (`on_siblings`)."""
    on_siblings: Callable[[float | None], None] = lambda due_in: None
    """Told each reply's `siblings_due_in` (`rollout_client.siblings.SiblingSlots.heard`)."""
    reply_within: float | None = REPLY_S
    """A heartbeat the server has not answered within this is reported at once (the client's `outage`: a log
    line, and `stats.server_reachable`) while it goes on waiting for the answer, which ends the outage: a stopped
    server or a silenced connection is told within one beat interval and this, not at the request's read timeout
    (30 s). None: only a heartbeat that fails is reported."""
    _window: list[tuple[float, int]] = field(default_factory=list)
    _logged: dict[str, float] = field(default_factory=dict)

    def beat_body(self, now: float) -> Heartbeat:
        s = self.stats
        self._window = [(t, n) for t, n in self._window if now - t <= RATE_WINDOW_S] + [(now, s.accepted)]
        t0, n0 = self._window[0]
        rate = (s.accepted - n0) / (now - t0) if now > t0 else 0.0
        drains, drained_for = self.drain()
        return Heartbeat(
            producer_id=self.producer_id,
            host=self.host,
            env_ids=[c.env_id for c in self.clients if c.env_id is not None],
            in_flight=s.in_flight,
            groups_per_s=max(0.0, rate),
            accepted=s.accepted,
            failures=s.failed_total,
            weights_step=self.policy_step(),
            held=self.held(),
            waiting_for=self.waiting_for(),
            drains=drains,
            drained_for=drained_for,
            trainer_step=s.trainer_step,
            sibling_envs=self.sibling_envs,
        )

    def held(self) -> dict[str, str]:
        """Why each registered env starts no group now, by its registered (wandb) name, as the server names it."""
        out = {}
        for c, name in zip(self.clients, self.names, strict=True):
            why = self.stats.paused.get(name)
            if why is not None and c.registration is not None:
                out[c.registration.wandb_name] = why
        return out

    def waiting_for(self) -> str | None:
        """What this producer waits for, in words, when every env is held back."""
        held = self.stats.paused
        if not self.names or not all(n in held for n in self.names):
            return None
        reasons = set(held.values())
        if reasons <= {QUEUE_FULL}:
            return "the trainer to take batches: every env's queue is full"
        if reasons <= {DRAINING, QUEUE_FULL}:
            return f"the trainer to announce the weights of step {self.drain()[1]} (drained for its sync)"
        if AHEAD in reasons:
            return (
                f"new weights: generating with step {self.policy_step()}, the trainer is at step "
                f"{self.stats.trainer_step}; more would arrive stale (the trainer announces weights with "
                "POST /weights after each sync)"
            )
        return f"the trainer: {', '.join(sorted(reasons))}"

    async def _beat(self, client: RolloutClient, sent: float) -> HeartbeatReply:
        """One heartbeat, sent at `sent`. One unanswered after `reply_within` is reported then, and still waited
        for: a server that wakes up (SIGCONT) answers it, and the answer ends the outage at once."""
        beat = asyncio.ensure_future(client.heartbeat(self.beat_body(sent)))
        try:
            if self.reply_within is not None:
                done, _ = await asyncio.wait({beat}, timeout=self.reply_within)
                answered = client.outage.answered_at
                if not done and (answered is None or answered < sent):  # (its retries got answers: not silence)
                    why = f"POST /producers/heartbeat: no answer after {self.reply_within:g} s"
                    client.outage.unanswered(why, sent)
                    self.stats.server_reachable = False
            return await beat
        finally:
            beat.cancel()  # (done already, unless this task is cancelled meanwhile)

    def _failed(self, client: RolloutClient, sent: float, exc: ClientError) -> None:
        """A heartbeat that failed: unreachable once its retries (HEARTBEAT_DEADLINE_S) are over, told at once;
        an answer that refuses it (a 4xx, a 503 until the deadline) is not an outage, and is logged as it is."""
        cause = exc.__cause__ if isinstance(exc, RetriesExhausted) else exc
        if isinstance(cause, TransportError):
            client.outage.unanswered(f"POST /producers/heartbeat: {exc}; still producing", sent)
        else:
            self._log("refused", sent, "the rollbuf server refused a heartbeat: %s", exc)

    def _log(self, kind: str, now: float, msg: str, *args: object) -> None:
        if now - self._logged.get(kind, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[kind] = now
            log.warning(msg, *args)

    async def run(self) -> None:
        client = self.clients[0]
        while True:
            now = time.monotonic()
            try:
                reply = await self._beat(client, now)
            except ClientError as exc:
                self._failed(client, now, exc)
            else:
                self.gone_after = reply.gone_after
                self.interval = min(BEAT_MAX_S, max(BEAT_MIN_S, reply.gone_after / 6))
                if self.sibling_envs is not None:
                    self.on_siblings(reply.siblings_due_in)
            self.stats.server_reachable = not client.outage.told
            waiting = self.waiting_for()
            if waiting is not None and not set(self.stats.paused.values()) <= {DRAINING, QUEUE_FULL}:
                # (a drain for a sync is the handshake at work: the trainer logs whom it waits for)
                self._log("wait", now, "waiting for %s", waiting)
            else:
                self._logged.pop("wait", None)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), self.interval)
            self.wake.clear()
