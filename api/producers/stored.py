"""Producers and the announced weights as stored: values of the store's key-value table (no schema of their own),
a value per producer, so every server process and replica sharing the store sees the same producers and weights,
and a heartbeat costs its own producer only."""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from api.config.groups import setting
from api.errors import Conflict, NotFound, Unavailable
from api.owners import ANYONE, Actor
from api.producers import live as producers
from api.producers.live import Producer
from api.run import state
from api.store.base import Txn
from api.wire.producers import Heartbeat, ProducerView, WeightSyncReply

PRODUCER = "producer:"
"""Named values, one per producer (its id after the colon): its record as its last heartbeat wrote it, so that a
heartbeat rewrites its own producer's value only."""
PRODUCER_IDS = "producer_ids"
"""A named value: the ids of the producers recorded (a JSON list), written when one is added or forgotten."""
LEGACY_PRODUCERS = "producers"
"""Where earlier releases kept every producer, as one value that each heartbeat rewrote: moved to the values
above by the first heartbeat after an upgrade, and read as producers until then."""
WEIGHTS_KEY = "weights"
PENDING_KEY = "weights_pending"
"""The step of a weight sync begun (POST /weights/pending) and not yet announced; "null" when none."""


def _ids(txn: Txn) -> list[str]:
    raw = txn.get_value(PRODUCER_IDS)
    return [] if raw is None else list(orjson.loads(raw))


def _legacy(txn: Txn) -> dict[str, Producer]:
    raw = txn.get_value(LEGACY_PRODUCERS)
    if raw is None:
        return {}
    return {pid: Producer.from_json(p) for pid, p in orjson.loads(raw).items()}


def load_producer(txn: Txn, producer_id: str) -> Producer | None:
    raw = txn.get_value(PRODUCER + producer_id)
    return None if raw is None else Producer.from_json(orjson.loads(raw))


def load_producers(txn: Txn) -> dict[str, Producer]:
    """Every producer recorded, by id (costs one value each: views and a new producer's admission read it)."""
    table = _legacy(txn)
    for pid in _ids(txn):
        if (p := load_producer(txn, pid)) is not None:
            table[pid] = p
    return table


def _save(txn: Txn, p: Producer) -> None:
    txn.set_value(PRODUCER + p.producer_id, orjson.dumps(p.to_json()).decode())


def _upgrade(txn: Txn) -> None:
    """Move the producers an earlier release kept as one value to a value each (once)."""
    legacy = _legacy(txn)
    if not legacy and txn.get_value(LEGACY_PRODUCERS) is None:
        return
    ids = _ids(txn)
    for pid, p in legacy.items():
        if pid not in ids and txn.get_value(PRODUCER + pid) is None:
            _save(txn, p)
            ids.append(pid)
    txn.set_value(PRODUCER_IDS, orjson.dumps(ids).decode())
    txn.delete_value(LEGACY_PRODUCERS)


def load_weights(txn: Txn) -> int | None:
    raw = txn.get_value(WEIGHTS_KEY)
    return None if raw is None else int(orjson.loads(raw))


def save_weights(txn: Txn, step: int) -> None:
    txn.set_value(WEIGHTS_KEY, orjson.dumps(step).decode())


def load_pending(txn: Txn) -> int | None:
    raw = txn.get_value(PENDING_KEY)
    return None if raw is None else orjson.loads(raw)


def load_weights_and_pending(txn: Txn) -> tuple[int | None, int | None]:
    return load_weights(txn), load_pending(txn)


@dataclass(frozen=True, slots=True)
class ProducerSettings:
    gone_after: float = setting("producer_gone_after")
    """Seconds without a heartbeat after which a producer is gone."""
    max_producers: int = setting("max_producers")
    max_producers_per_key: int = setting("max_producers_per_key")


def announce_txn(txn: Txn, step: int) -> int:
    """Record that the weights of `step` are live; the weights step never goes back (a retry changes nothing)."""
    _check_step(txn, step)
    pending = load_pending(txn)
    if pending is not None and pending <= step:
        txn.set_value(PENDING_KEY, "null")  # the sync is over: drain envs start groups again
    current = load_weights(txn)
    if current is not None and current >= step:
        return current
    save_weights(txn, step)
    return step


def _check_step(txn: Txn, step: int) -> state.RunState:
    run = state.load(txn)
    if run.registration is None:
        raise Conflict("no trainer is registered: POST /register first", loc=("body", "step"))
    if step > run.step:
        raise Conflict(
            f"step {step} is past the trainer's current step {run.step}: groups stamped with it would be refused",
            loc=("body", "step"),
        )
    return run


def begin_txn(txn: Txn, step: int, now: float, settings: ProducerSettings) -> WeightSyncReply:
    """A weight sync to `step` begins: drain envs stop starting groups until it is announced (POST /weights). A
    step at or below the weights announced changes nothing (a retry after the announcement); a later pending
    step replaces an earlier one."""
    _check_step(txn, step)
    current = load_weights(txn)
    pending = load_pending(txn)
    if (current is None or step > current) and (pending is None or step > pending):
        txn.set_value(PENDING_KEY, orjson.dumps(step).decode())
    return sync_txn(txn, now, settings)


def sync_txn(txn: Txn, now: float, settings: ProducerSettings) -> WeightSyncReply:
    """The pending sync and the live producers it still waits for."""
    current, pending = load_weights_and_pending(txn)
    if pending is None:
        return WeightSyncReply(weights_step=current, pending_step=None, waiting_on=[], drained=False)
    waiting = producers.undrained(load_producers(txn), pending, now, settings.gone_after)
    names = [f"{p.producer_id} on {p.host}" for p in waiting]
    return WeightSyncReply(weights_step=current, pending_step=pending, waiting_on=names, drained=not waiting)


def heartbeat_txn(
    txn: Txn, beat: Heartbeat, now: float, settings: ProducerSettings, actor: Actor = ANYONE
) -> tuple[int | None, int | None]:
    """Record a heartbeat (each env it names must exist and be `actor`'s to use: 404 otherwise; its id must not be
    another key's live producer's); the weights step and the pending sync's. A known producer's heartbeat writes
    its own value only; a new one reads the others' to find room (`producers.record`). `held` keeps the envs the
    beat names only, so that what a producer's record holds is bounded by its envs. The record keeps where the
    trainer stood for its verdicts (`Producer.judged_step`, `judged_weights`): `stall_reason` takes them as a wait
    for the trainer only while the trainer has not moved since."""
    run = state.load(txn)
    for i, env_id in enumerate(beat.env_ids):
        env = run.env(env_id)
        if env is None or actor.hides(env.owner, "env"):
            raise NotFound(f"no environment with env_id {env_id}", loc=("body", "env_ids", i))
    _upgrade(txn)
    weights, pending = load_weights_and_pending(txn)
    names = {run.env_name(e) for e in beat.env_ids}
    fields = {k: v for k, v in beat.model_dump().items() if k in Producer.__dataclass_fields__}  # what is kept
    fields["held"] = {env: why for env, why in beat.held.items() if env in names}
    judged = run.step if beat.trainer_step is None else min(run.step, beat.trainer_step)
    new = Producer(
        **fields, last_seen=now, first_seen=now, owner=actor.owner, judged_step=judged, judged_weights=weights
    )
    old = load_producer(txn, beat.producer_id)
    table = {beat.producer_id: old} if old is not None else load_producers(txn)
    try:
        forgotten = producers.record(
            table, new, now, settings.gone_after, settings.max_producers, actor.may, settings.max_producers_per_key
        )
    except producers.ProducerTaken as exc:
        raise Conflict(str(exc), loc=("body", "producer_id")) from None
    except producers.TooManyProducers as exc:
        raise Unavailable(
            f"{exc}; one is forgotten once it is gone ({settings.gone_after:g} s)", settings.gone_after
        ) from None
    _save(txn, new)
    if old is None:
        for pid in forgotten:
            txn.delete_value(PRODUCER + pid)
        ids = [pid for pid in _ids(txn) if pid not in forgotten]
        txn.set_value(PRODUCER_IDS, orjson.dumps([*ids, beat.producer_id]).decode())
    return weights, pending


def shown_producers(views: list[ProducerView], cap: int) -> list[ProducerView]:
    """The `cap` producers a view lists (`views_max_producers`): live ones first, each kind in the order given
    (oldest first)."""
    return sorted(views, key=lambda p: not p.live)[:cap]


@dataclass(frozen=True, slots=True)
class ProducerReport:
    weights_step: int | None
    producers: list[ProducerView]
    stall_reason: str | None


def report_txn(txn: Txn, now: float, settings: ProducerSettings, known: state.RunState | None = None) -> ProducerReport:
    """Producers as views (live or gone, by env name), the weights step, and why a waiting trainer stalls. `known`:
    a run state this process read (the envs are read only as far as they changed since)."""
    run = state.load(txn, known)
    table = load_producers(txn)
    views = [
        ProducerView(
            producer_id=p.producer_id,
            host=p.host,
            envs=[run.env_name(e) for e in p.env_ids],
            live=p.live(now, settings.gone_after),
            last_seen=p.last_seen,
            last_seen_s=max(0.0, now - p.last_seen),
            in_flight=p.in_flight,
            groups_per_s=p.groups_per_s,
            accepted=p.accepted,
            failures=p.failures,
            weights_step=p.weights_step,
            held=p.held,
            waiting_for=p.waiting_for,
            drains=p.drains,
            drained_for=p.drained_for,
        )
        for p in sorted(table.values(), key=lambda p: p.first_seen)
    ]
    weights = load_weights(txn)
    stall = None
    if run.registration is not None:
        connected = {e.env_id: e.wandb_name for e in run.envs if e.connected}
        stall = producers.stall_reason(connected, table, now, settings.gone_after, step=run.step, weights=weights)
    return ProducerReport(weights, views, stall)
