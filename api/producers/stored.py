"""Producers and the announced weights as stored: two values of the store's key-value table (no schema of
their own), so every server process and replica sharing the store sees the same producers and weights."""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from api import state
from api.config.groups import setting
from api.errors import Conflict, InvalidData, Unavailable
from api.owners import ANYONE, Actor
from api.producers import live as producers
from api.producers.live import Producer
from api.store.base import Txn
from api.wire.producers import Heartbeat, ProducerView, WeightSyncReply

PRODUCERS_KEY = "producers"
WEIGHTS_KEY = "weights"
PENDING_KEY = "weights_pending"
"""The step of a weight sync begun (POST /weights/pending) and not yet announced; "null" when none."""


def load_producers(txn: Txn) -> dict[str, Producer]:
    raw = txn.get_value(PRODUCERS_KEY)
    if raw is None:
        return {}
    return {pid: Producer.from_json(p) for pid, p in orjson.loads(raw).items()}


def save_producers(txn: Txn, table: dict[str, Producer]) -> None:
    txn.set_value(PRODUCERS_KEY, orjson.dumps({pid: p.to_json() for pid, p in table.items()}).decode())


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
        raise InvalidData(("body", "step"), f"step {step} is past the trainer's current step {run.step}: groups "
                          "stamped with it would be refused")  # fmt: skip
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
    """Record a heartbeat (each env it names must exist and be `actor`'s to use; its id must not be another
    key's live producer's); the weights step and the pending sync's."""
    run = state.load(txn)
    for i, env_id in enumerate(beat.env_ids):
        env = run.env(env_id)
        if env is None or actor.hides(env.owner, "env"):
            raise InvalidData(("body", "env_ids", i), f"no environment with env_id {env_id}")
    table = load_producers(txn)
    fields = beat.model_dump()
    try:
        producers.record(table, Producer(**fields, last_seen=now, first_seen=now, owner=actor.owner), now,
                         settings.gone_after, settings.max_producers, actor.may)  # fmt: skip
    except producers.ProducerTaken as exc:
        raise Conflict(str(exc), loc=("body", "producer_id")) from None
    except producers.TooManyProducers as exc:
        raise Unavailable(f"{exc}; one is forgotten once it is gone ({settings.gone_after:g} s)",
                          settings.gone_after) from None  # fmt: skip
    save_producers(txn, table)
    return load_weights_and_pending(txn)


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
        )  # fmt: skip
        for p in sorted(table.values(), key=lambda p: p.first_seen)
    ]
    stall = None
    if run.registration is not None:
        connected = {e.env_id: e.wandb_name for e in run.envs if e.connected}
        stall = producers.stall_reason(connected, table, now, settings.gone_after)
    return ProducerReport(load_weights(txn), views, stall)
