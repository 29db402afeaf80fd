"""Run state as stored: the trainer's configuration, the envs, counters. Plain data with JSON round trips."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import orjson

from api.run.kept import Kept
from api.store.base import Txn
from api.wire.schema import Registration

log = logging.getLogger("rollbuf")

RUN_KEY = "run"
STEP_KEY = "step"
ENV_DIR_KEY = "env_dir"
"""The env list's epoch, version and length; the envs themselves are rows (`Txn.put_env`)."""
KEPT_KEY = "kept"
"""The acknowledged mark and the sizes of the batches kept past it (`api.run.kept.Kept`)."""
CREDITS_KEY = "credits"
BLOCKED_KEY = "blocked"
PASSED_KEY = "passed_over"
"""Per env: its oldest item passed over by formation and the step it was first passed over
(`api.batches.aging.age`)."""
QUIET_KEY = "quiet_shares"
"""Per env whose minimum allocation holds batches back: since when (wall clock), and whether it was released."""
ARRIVALS_KEY = "awaiting_arrivals"
"""While formation waits for arrivals to complete an exact fill: since when (wall clock), the sequences queued then
and the step (a change of either means something arrived or a batch formed, and the wait starts again)."""
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
    owner: str | None = None
    """The name of the key that registered it (servers with keys): only that key's env role may use it."""
    variable_group_size: bool = False
    """Its groups vary in size (survivors of failed rollouts, branches): each is queued whole, never held."""


@dataclass(slots=True)
class RunState:
    """What a transaction reads before deciding anything. `envs` is shared between the states of one process
    that saw the same envs (`load` with `known`): never changed in place, replaced."""

    registration: Registration | None
    step: int
    started: bool
    envs: list[EnvRecord] = field(default_factory=list)
    envs_at: EnvsVersion | None = None
    """Which change of the env list `envs` reflects (None: no env registered since the last reset)."""

    def env(self, env_id: int) -> EnvRecord | None:
        return self.envs[env_id] if 0 <= env_id < len(self.envs) else None

    def env_name(self, env_id: int | None) -> str:
        """The env's W&B name, as views and counters show it (ANON_NAME without an env)."""
        env = None if env_id is None else self.env(env_id)
        return env.wandb_name if env else ANON_NAME


@dataclass(frozen=True, slots=True)
class EnvsVersion:
    """The env list's identity: `epoch` names one list (a reset starts another), `version` counts its changes."""

    epoch: str
    version: int


def scale_shares(shares: Mapping[int, float | None]) -> dict[int, float]:
    """Minimum allocations (`EnvRecord.min_batch_allocation`) as given, scaled down proportionally when they add up
    past 1: as formation applies them and as the drop-bias watch weighs them."""
    given = {env: s for env, s in shares.items() if s}
    total = sum(given.values())
    factor = 1.0 / total if total > 1.0 else 1.0
    return {env: s * factor for env, s in given.items()}


def _get(txn: Txn, key: str, default: Any) -> Any:
    raw = txn.get_value(key)
    return default if raw is None else orjson.loads(raw)


def _put(txn: Txn, key: str, value: Any) -> None:
    txn.set_value(key, orjson.dumps(value).decode())


_last_run: tuple[str, Registration | None, bool] = ("", None, False)
"""The run's row as last read and what it says: every submission reads it, and it changes once per run."""


def _run_row(txn: Txn) -> tuple[Registration | None, bool]:
    """The trainer's registration and whether it started, parsed only when the row changed since the last read
    (a registration is validated by pydantic: most of what reading the run state cost a submission)."""
    global _last_run
    raw = txn.get_value(RUN_KEY)
    if raw is None:
        return None, False
    last = _last_run
    if raw == last[0]:
        return last[1], last[2]
    run = orjson.loads(raw)
    parsed = Registration.model_validate(run["registration"]), bool(run.get("started"))
    _last_run = (raw, *parsed)
    return parsed


def load(txn: Txn, known: RunState | None = None) -> RunState:
    """The run state. The envs are read from the store only as far as they changed since `known` (a state this
    process read in a transaction that committed: versions within an epoch only grow): a request costs the
    same with 10,000 envs as with 10."""
    registration, started = _run_row(txn)
    directory = _get(txn, ENV_DIR_KEY, None)
    at = None if directory is None else EnvsVersion(directory["epoch"], directory["version"])
    if at is None:
        envs: list[EnvRecord] = []
    elif known is not None and known.envs_at == at:
        envs = known.envs
    elif known is not None and known.envs_at is not None and known.envs_at.epoch == at.epoch:
        envs = list(known.envs)
        _apply(envs, txn.envs_since(known.envs_at.version))
    else:
        envs = []
        _apply(envs, txn.envs_since(-1))
    return RunState(
        registration=registration,
        step=_get(txn, STEP_KEY, 0),
        started=started,
        envs=envs,
        envs_at=at,
    )


def _apply(envs: list[EnvRecord], changed: list[tuple[int, str]]) -> None:
    for env_id, record in changed:
        env = EnvRecord(**orjson.loads(record))
        if env_id < len(envs):
            envs[env_id] = env
        else:
            assert env_id == len(envs), f"env {env_id} read before env {len(envs)}"
            envs.append(env)


def save_run(txn: Txn, registration: Registration, started: bool) -> None:
    _put(txn, RUN_KEY, {"registration": registration.model_dump(), "started": started})


def save_step(txn: Txn, step: int) -> None:
    _put(txn, STEP_KEY, step)


def load_kept(txn: Txn, run: RunState) -> Kept:
    """What the run keeps for serving again. A store written before this was tracked knows of no commit: the
    mark starts at the next step (what it served before stays servable as it was, by `Txn.get_batch`)."""
    raw = _get(txn, KEPT_KEY, None)
    return Kept(run.step) if raw is None else Kept.from_json(raw)


def save_kept(txn: Txn, kept: Kept) -> None:
    _put(txn, KEPT_KEY, kept.to_json())


def save_env(txn: Txn, run: RunState, env: EnvRecord) -> RunState:
    """Write one env (a new one, with the next id, or a change of one): its row and the list's version. The run
    state with it, for the process to remember once the transaction has committed."""
    at = run.envs_at or EnvsVersion(secrets.token_hex(8), 0)
    version = at.version + 1
    txn.put_env(env.env_id, env.desired_name, version, orjson.dumps(asdict(env)).decode())
    envs = list(run.envs)
    if env.env_id < len(envs):
        envs[env.env_id] = env
    else:
        envs.append(env)
    _put(txn, ENV_DIR_KEY, {"epoch": at.epoch, "version": version, "count": len(envs)})
    return replace(run, envs=envs, envs_at=EnvsVersion(at.epoch, version))


def load_credits(txn: Txn) -> dict[int, float]:
    return {int(k): float(v) for k, v in _get(txn, CREDITS_KEY, {}).items()}


def save_credits(txn: Txn, credits: dict[int, float]) -> None:
    _put(txn, CREDITS_KEY, {str(k): v for k, v in credits.items()})


DROPPED = "dropped"
"""Counter kind of dropped groups, named `<reason>:<env name>` (reasons have no colon; env names may)."""


def load_dropped(txn: Txn) -> dict[str, dict[str, int]]:
    """Groups dropped, by env name and reason."""
    out: dict[str, dict[str, int]] = {}
    for name, n in txn.get_counts(DROPPED).items():
        reason, _, env_name = name.partition(":")
        out.setdefault(env_name, {})[reason] = n
    return out


def count_dropped(txn: Txn, env_name: str, reason: str, n: int = 1) -> None:
    if n > 0:
        txn.add_counts(DROPPED, {f"{reason}:{env_name}": n})


def load_blocked(txn: Txn) -> str | None:
    return _get(txn, BLOCKED_KEY, None)  # type: ignore[no-any-return]


def save_blocked(txn: Txn, reason: str | None, *, warn: bool = True) -> None:
    """Why no batch can be formed, for /status; `warn=False` logs it at info (a bound a trainer reaches in normal
    use, such as the read-ahead bound before its next commit)."""
    if reason != load_blocked(txn):
        _put(txn, BLOCKED_KEY, reason)
        if reason:
            log.log(logging.WARNING if warn else logging.INFO, "no batch can be formed: %s", reason)
        else:
            log.info("batches can be formed again")


def load_passed(txn: Txn) -> dict[int, tuple[int, int]]:
    return {int(k): (int(v[0]), int(v[1])) for k, v in _get(txn, PASSED_KEY, {}).items()}


def save_passed(txn: Txn, passed: dict[int, tuple[int, int]]) -> None:
    _put(txn, PASSED_KEY, {str(k): list(v) for k, v in passed.items()})


def load_quiet(txn: Txn) -> dict[int, tuple[float, bool]]:
    return {int(k): (float(v[0]), bool(v[1])) for k, v in _get(txn, QUIET_KEY, {}).items()}


def save_quiet(txn: Txn, quiet: dict[int, tuple[float, bool]]) -> None:
    _put(txn, QUIET_KEY, {str(k): list(v) for k, v in quiet.items()})


def load_awaiting(txn: Txn) -> tuple[float, int, int] | None:
    got = _get(txn, ARRIVALS_KEY, None)
    if got is None or len(got) != 3:  # a record of the layout before the step was kept: the wait starts again
        return None
    return float(got[0]), int(got[1]), int(got[2])


def save_awaiting(txn: Txn, awaiting: tuple[float, int, int]) -> None:
    _put(txn, ARRIVALS_KEY, list(awaiting))
