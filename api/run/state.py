"""Run state as stored: the trainer's configuration, the envs, counters. Plain data with JSON round trips."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Generic, TypeVar

import orjson

from api.owners import Actor
from api.run.kept import Kept
from api.store.base import Txn
from api.wire.schema import Registration

log = logging.getLogger("rollbuf")

T = TypeVar("T")

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
    max_token_staleness: int | None = None
    """Trained tokens sampled by weights older than the batch's step minus this are served masked (None: never)."""
    opens_groups: bool = False
    """It has opened a per-rollout group (docs/rollouts.md): a whole group it posts under a group id is checked
    against its open groups (one read), so that none takes the id of a group whose rollouts are acknowledged slot
    by slot. Envs that never open one pay nothing for the check."""
    reuse: dict[str, Any] | None = None
    """Its own reuse policy as registered (`ReusePolicy`'s fields), where it differs from the trainer's (None: the
    trainer's applies; `api.batches.reuse.policy_for`)."""


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


@dataclass(frozen=True, slots=True)
class Key(Generic[T]):
    """A run-state value kept under one store key as JSON: how it reads (`decode`, from the JSON as stored, None
    when the key is absent) and how it is written (`encode`, to what is stored as JSON). The `load_*`/`save_*`
    functions and `Unit` both go through it, so both store the same bytes."""

    name: str
    decode: Callable[[Any], T]
    encode: Callable[[T], Any]

    def load(self, txn: Txn) -> T:
        return self.decode(_get(txn, self.name, None))

    def save(self, txn: Txn, value: T) -> None:
        _put(txn, self.name, self.encode(value))


def _awaiting(got: Any) -> tuple[float, int, int] | None:
    if got is None or len(got) != 3:  # a record of the layout before the step was kept: the wait starts again
        return None
    return float(got[0]), int(got[1]), int(got[2])


STEP: Key[int] = Key(STEP_KEY, lambda got: 0 if got is None else got, lambda step: step)
KEPT: Key[Kept | None] = Key(
    KEPT_KEY,
    lambda got: None if got is None else Kept.from_json(got),
    lambda kept: None if kept is None else kept.to_json(),
)
CREDITS: Key[dict[int, float]] = Key(
    CREDITS_KEY,
    lambda got: {int(k): float(v) for k, v in (got or {}).items()},
    lambda credits: {str(k): v for k, v in credits.items()},
)
BLOCKED: Key[str | None] = Key(BLOCKED_KEY, lambda got: got, lambda reason: reason)
PASSED: Key[dict[int, tuple[int, int]]] = Key(
    PASSED_KEY,
    lambda got: {int(k): (int(v[0]), int(v[1])) for k, v in (got or {}).items()},
    lambda passed: {str(k): list(v) for k, v in passed.items()},
)
QUIET: Key[dict[int, tuple[float, bool]]] = Key(
    QUIET_KEY,
    lambda got: {int(k): (float(v[0]), bool(v[1])) for k, v in (got or {}).items()},
    lambda quiet: {str(k): list(v) for k, v in quiet.items()},
)
AWAITING: Key[tuple[float, int, int] | None] = Key(
    ARRIVALS_KEY, _awaiting, lambda awaiting: None if awaiting is None else list(awaiting)
)


class Unit:
    """The run-state values of one transaction as a unit of work: each key read from the store at most once,
    when first asked for, changed in memory, and each key set written once, by `commit`, with the bytes
    `Key.save` writes (not at all when they are the bytes read). Formation reads and changes the same few keys
    many times over in one transaction; this makes that one read and at most one write per key. Values returned
    are shared with the unit: replaced through `set`, never changed in place. What is not committed is not
    written (a transaction that raises is rolled back on every store anyway)."""

    __slots__ = ("_dirty", "_raw", "_txn", "_values")

    def __init__(self, txn: Txn) -> None:
        self._txn = txn
        self._values: dict[str, Any] = {}
        self._raw: dict[str, str | None] = {}
        """The store's bytes for each key read or written by the unit."""
        self._dirty: dict[str, Key[Any]] = {}

    def get(self, key: Key[T]) -> T:
        if key.name not in self._values:
            raw = self._raw[key.name] = self._txn.get_value(key.name)
            self._values[key.name] = key.decode(None if raw is None else orjson.loads(raw))
        return self._values[key.name]  # type: ignore[no-any-return]

    def set(self, key: Key[T], value: T) -> None:
        self._values[key.name] = value
        self._dirty[key.name] = key

    def kept(self, run: RunState) -> Kept:
        """`load_kept`, read once."""
        return _kept_or_new(self.get(KEPT), run)

    def set_blocked(self, reason: str | None, *, warn: bool = True) -> None:
        """`save_blocked`: set, and logged, when the reason changes."""
        if reason != self.get(BLOCKED):
            self.set(BLOCKED, reason)
            _log_blocked(reason, warn)

    def commit(self) -> None:
        """Write each key set since the unit began (or since the last commit) whose bytes are not the store's."""
        for name, key in self._dirty.items():
            raw = orjson.dumps(key.encode(self._values[name])).decode()
            if self._raw.get(name) != raw:
                self._txn.set_value(name, raw)
                self._raw[name] = raw
        self._dirty.clear()


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
    STEP.save(txn, step)


def load_kept(txn: Txn, run: RunState) -> Kept:
    """What the run keeps for serving again. A store written before this was tracked knows of no commit: the
    mark starts at the next step (what it served before stays servable as it was, by `Txn.get_batch`)."""
    return _kept_or_new(KEPT.load(txn), run)


def _kept_or_new(kept: Kept | None, run: RunState) -> Kept:
    return Kept(run.step) if kept is None else kept


def save_kept(txn: Txn, kept: Kept) -> None:
    KEPT.save(txn, kept)


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
    return CREDITS.load(txn)


def save_credits(txn: Txn, credits: dict[int, float]) -> None:
    CREDITS.save(txn, credits)


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
    return BLOCKED.load(txn)


def save_blocked(txn: Txn, reason: str | None, *, warn: bool = True) -> None:
    """Why no batch can be formed, for /status; `warn=False` logs it at info (a bound a trainer reaches in normal
    use, such as the read-ahead bound before its next commit)."""
    if reason != load_blocked(txn):
        BLOCKED.save(txn, reason)
        _log_blocked(reason, warn)


def _log_blocked(reason: str | None, warn: bool) -> None:
    if reason:
        log.log(logging.WARNING if warn else logging.INFO, "no batch can be formed: %s", reason)
    else:
        log.info("batches can be formed again")


def load_passed(txn: Txn) -> dict[int, tuple[int, int]]:
    return PASSED.load(txn)


def save_passed(txn: Txn, passed: dict[int, tuple[int, int]]) -> None:
    PASSED.save(txn, passed)


def load_quiet(txn: Txn) -> dict[int, tuple[float, bool]]:
    return QUIET.load(txn)


def save_quiet(txn: Txn, quiet: dict[int, tuple[float, bool]]) -> None:
    QUIET.save(txn, quiet)


def load_awaiting(txn: Txn) -> tuple[float, int, int] | None:
    return AWAITING.load(txn)


def save_awaiting(txn: Txn, awaiting: tuple[float, int, int]) -> None:
    AWAITING.save(txn, awaiting)


def visible_env(caller: Actor, run: RunState, env_id: int) -> EnvRecord | None:
    """The env, if it exists and `caller` may act on it; None otherwise, so that another key's env answers as an
    unknown one (an env key uses only the envs it registered, bound to its name so rotating its secret keeps
    them; trainer and admin keys act on any env where the route lets them: a trainer disconnects an env that
    holds its batches back)."""
    env = run.env(env_id)
    if env is None or caller.hides(env.owner, "env"):
        return None
    return env
