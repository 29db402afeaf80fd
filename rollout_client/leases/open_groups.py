"""Groups whose rollouts are acknowledged one by one (docs/rollouts.md), from a producer: open a group, post
each rollout as it ends (acknowledged durably: a producer killed after 60 of 64 loses nothing), seal it, and take
the missing slots of groups whose producer stopped heartbeating (`lease`), so that one group's rollouts can be
spread over producers on several hosts.

Held groups and sibling slots are heartbeated every `heartbeat_s` (a third of the lease, from the first reply)
until sealed or handed back; the server seals a group when all its slots are in (or at its deadline).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from api.wire.rollouts import (
    GroupView,
    PostReply,
    RolloutHeartbeatReply,
    SlotLease,
    SlotLeaseReply,
    SlotPrefix,
    TurnReply,
)
from client_core.config import DEFAULT_TIMEOUT, DEFAULT_URL, RETRY_DEADLINE_S, auth_headers
from client_core.retry import get_retrying, post_retrying

log = logging.getLogger("rollout_client.open_groups")


class OpenGroups:
    """One producer's side of per-rollout groups on the server at `base_url`."""

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        *,
        api_key: str | None = None,
        producer_id: str | None = None,
        heartbeat_s: float | None = None,
        retry_deadline: float = RETRY_DEADLINE_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.producer_id = producer_id or f"{socket.gethostname()}-{os.getpid()}-rollouts"
        self.heartbeat_s = heartbeat_s
        self.retry_deadline = retry_deadline
        self._http = httpx.AsyncClient(
            base_url=base_url, headers=auth_headers(api_key), timeout=DEFAULT_TIMEOUT, transport=transport
        )
        self._held: set[str] = set()
        """Groups this producer holds slots of (its own, or leased siblings): heartbeated."""
        self._beats: asyncio.Task[None] | None = None
        self.lost = 0
        """Groups the server said this producer no longer holds anything of."""

    async def _call(self, path: str, body: dict[str, Any]) -> Any:
        return await post_retrying(self._http, path, body, self.retry_deadline)

    def _hold(self, group_id: str, expires_at: float) -> None:
        self._held.add(group_id)
        if self.heartbeat_s is None:
            self.heartbeat_s = max(0.05, (expires_at - time.time()) / 3)
        if self._beats is None:
            self._beats = asyncio.create_task(self._heartbeats(), name="rollout-groups")

    async def open(
        self,
        group_id: str,
        group_size: int,
        *,
        env_id: int | None = None,
        min_group_size: int | None = None,
        deadline_s: float = 3600.0,
        scores_at_seal: bool = False,
        task: Any = None,
    ) -> GroupView:
        """Open a group (a retry of the same open is safe) and hold its missing slots while heartbeating."""
        body = {
            "group_id": group_id,
            "env_id": env_id,
            "producer_id": self.producer_id,
            "group_size": group_size,
            "min_group_size": min_group_size,
            "deadline_s": deadline_s,
            "scores_at_seal": scores_at_seal,
            "task": task,
        }
        view = GroupView.model_validate(await self._call("/rollouts/open", body))
        self._hold(group_id, view.expires_at)
        return view

    async def post(
        self,
        group_id: str,
        slot: int,
        tokens: Sequence[int],
        masks: Sequence[int],
        *,
        score: float | None = None,
        inference_logprobs: Sequence[float] | None = None,
        policy_step: int | None = None,
        overrides: Mapping[str, Any] | None = None,
        after_turns: bool = False,
        token_weight_versions: Sequence[int] | None = None,
    ) -> PostReply:
        """Post one rollout as it ends; once the reply comes it is durable. `redone`: another producer's
        rollout of this slot came first and is kept. `policy_step`: the weights it was generated with (the sealed
        group's is its oldest rollout's); `overrides`: its record, the sealed group's `overrides` entry.
        `after_turns`: the rollout is the slot's acknowledged turns (`RolloutClient.post_turn`, a lease's `prefix`)
        followed by these tokens (docs/rollouts.md, Turns)."""
        body = {
            "group_id": group_id,
            "slot": slot,
            "producer_id": self.producer_id,
            "tokens": list(tokens),
            "masks": list(masks),
            "score": score,
            "inference_logprobs": None if inference_logprobs is None else list(inference_logprobs),
            "policy_step": policy_step,
            "overrides": None if overrides is None else dict(overrides),
            **({"after_turns": True} if after_turns else {}),
            **({"token_weight_versions": list(token_weight_versions)} if token_weight_versions is not None else {}),
        }
        reply = PostReply.model_validate(await self._call("/rollouts/post", body))
        if reply.group.state != "open":
            self._held.discard(group_id)
        return reply

    async def turn(
        self,
        group_id: str,
        slot: int,
        turn: int,
        tokens: Sequence[int],
        masks: Sequence[int],
        *,
        inference_logprobs: Sequence[float] | None = None,
        token_weight_versions: Sequence[int] | None = None,
        tool_results: Sequence[Any] | None = None,
        snapshot: bytes | str | None = None,
    ) -> TurnReply:
        """Acknowledge turn `turn` of a slot this producer holds, as `RolloutClient.post_turn` does (retried: a
        retry is a `duplicate`; 409 `body.producer_id` once the slot's lease passed on)."""
        snap: dict[str, str] | None = None
        if isinstance(snapshot, bytes):
            snap = {"data": base64.b64encode(snapshot).decode()}
        elif snapshot is not None:
            snap = {"uri": snapshot}
        body = {
            "group_id": group_id,
            "slot": slot,
            "producer_id": self.producer_id,
            "turn": turn,
            "tokens": list(tokens),
            "masks": list(masks),
            "inference_logprobs": None if inference_logprobs is None else list(inference_logprobs),
            "token_weight_versions": None if token_weight_versions is None else list(token_weight_versions),
            "tool_results": None if tool_results is None else list(tool_results),
            "snapshot": snap,
        }
        return TurnReply.model_validate(await self._call("/rollouts/turn", body))

    async def turns(self, group_id: str, slot: int, start: int = 0) -> SlotPrefix:
        """A slot's acknowledged turns from `start` (GET /rollouts/turns: as many as fit one reply, `complete`
        once they reach the last), for a lease whose `prefix` was too large to carry them."""
        params = {"group_id": group_id, "slot": slot, "start": start}
        return SlotPrefix.model_validate(await get_retrying(self._http, "/rollouts/turns", params, self.retry_deadline))

    async def seal(self, group_id: str, scores: dict[int, float] | None = None) -> GroupView:
        """Seal the group now with what is in (with the group's scores, when scored as a group)."""
        body = {
            "group_id": group_id,
            "producer_id": self.producer_id,
            "scores": None if scores is None else {str(k): v for k, v in scores.items()},
        }
        self._held.discard(group_id)
        return GroupView.model_validate(await self._call("/rollouts/seal", body))

    async def lease(self, n: int = 1, envs: Sequence[str] | None = None) -> list[SlotLease]:
        """Up to `n` missing slots of groups whose producer stopped heartbeating (of the envs registered under
        these names only, if given: the envs this producer runs): roll each out and `post` it."""
        body: dict[str, Any] = {"producer_id": self.producer_id, "n": n}
        if envs is not None:
            body["envs"] = list(envs)
        reply = SlotLeaseReply.model_validate(await self._call("/rollouts/lease", body))
        for x in reply.leases:
            self._hold(x.group_id, x.expires_at)
        return reply.leases

    def let_go(self, group_id: str) -> None:
        """Stop heartbeating the group: what this producer holds of it lapses to siblings (`lease`)."""
        self._held.discard(group_id)

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s or 1.0)
            held = sorted(self._held)
            if not held:
                continue
            try:
                body = {"producer_id": self.producer_id, "group_ids": held}
                reply = RolloutHeartbeatReply.model_validate(await self._call("/rollouts/heartbeat", body))
            except Exception as exc:  # the next beat tries again; slots that lapse meanwhile go to siblings
                log.warning("rollout group heartbeat failed: %s", exc)
                continue
            for group_id, expires in reply.expires_at.items():
                if expires is None and group_id in self._held:
                    self._held.discard(group_id)
                    self.lost += 1

    async def aclose(self) -> None:
        """Stop heartbeating (what is held lapses to siblings) and close the connection."""
        if self._beats is not None:
            self._beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beats
        await self._http.aclose()
