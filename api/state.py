"""Run state as stored: the trainer's configuration, the envs, counters. Plain data with JSON round trips."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from api.schema import Registration
from api.store.base import Txn

log = logging.getLogger("rollbuf")

RUN_KEY = "run"
STEP_KEY = "step"
ENVS_KEY = "envs"
CREDITS_KEY = "credits"
DROPPED_KEY = "dropped"
BLOCKED_KEY = "blocked"
ANON_NAME = "(no env_id)"
"""How views and counters name groups sent without an env_id."""


@dataclass(slots=True)
class EnvRecord:
    env_id: int
    desired_name: str
    wandb_name: str
    weight: float
    group_size: int
    max_token_length: int
    min_batch_allocation: float | None
    connected: bool = True


@dataclass(slots=True)
class RunState:
    """What a transaction reads before deciding anything."""

    registration: Registration | None
    step: int
    started: bool
    envs: list[EnvRecord] = field(default_factory=list)

    def env(self, env_id: int) -> EnvRecord | None:
        return self.envs[env_id] if 0 <= env_id < len(self.envs) else None

    def env_name(self, env_id: int | None) -> str:
        """The env's W&B name, as views and counters show it (ANON_NAME without an env)."""
        env = None if env_id is None else self.env(env_id)
        return env.wandb_name if env else ANON_NAME


def _get(txn: Txn, key: str, default: Any) -> Any:
    raw = txn.get_value(key)
    return default if raw is None else orjson.loads(raw)


def _put(txn: Txn, key: str, value: Any) -> None:
    txn.set_value(key, orjson.dumps(value).decode())


def load(txn: Txn) -> RunState:
    run = _get(txn, RUN_KEY, None)
    return RunState(
        registration=None if run is None else Registration.model_validate(run["registration"]),
        step=_get(txn, STEP_KEY, 0),
        started=bool(run and run.get("started")),
        envs=[EnvRecord(**e) for e in _get(txn, ENVS_KEY, [])],
    )


def save_run(txn: Txn, registration: Registration, started: bool) -> None:
    _put(txn, RUN_KEY, {"registration": registration.model_dump(), "started": started})


def save_step(txn: Txn, step: int) -> None:
    _put(txn, STEP_KEY, step)


def save_envs(txn: Txn, envs: list[EnvRecord]) -> None:
    _put(txn, ENVS_KEY, [asdict(e) for e in envs])


def load_credits(txn: Txn) -> dict[int, float]:
    return {int(k): float(v) for k, v in _get(txn, CREDITS_KEY, {}).items()}


def save_credits(txn: Txn, credits: dict[int, float]) -> None:
    _put(txn, CREDITS_KEY, {str(k): v for k, v in credits.items()})


def load_dropped(txn: Txn) -> dict[str, dict[str, int]]:
    return _get(txn, DROPPED_KEY, {})  # type: ignore[no-any-return]


def count_dropped(txn: Txn, env_name: str, reason: str, n: int = 1) -> None:
    if n <= 0:
        return
    dropped = load_dropped(txn)
    per_env = dropped.setdefault(env_name, {})
    per_env[reason] = per_env.get(reason, 0) + n
    _put(txn, DROPPED_KEY, dropped)


def load_blocked(txn: Txn) -> str | None:
    return _get(txn, BLOCKED_KEY, None)  # type: ignore[no-any-return]


def save_blocked(txn: Txn, reason: str | None) -> None:
    if reason != load_blocked(txn):
        _put(txn, BLOCKED_KEY, reason)
        if reason:
            log.warning("no batch can be formed: %s", reason)
        else:
            log.info("batches can be formed again")
