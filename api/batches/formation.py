"""Forming a batch, inside one store transaction: each env's queue head read, stale groups dropped, the
pure planner (`api/batches/planner.py`) asked for a plan, and the plan taken (popped, counted, the step advanced,
kept for serving again). Written once over `Txn`, for every store."""

from __future__ import annotations

import dataclasses
import logging
import time

import orjson

from api.batches.acknowledge import acknowledge
from api.batches.aging import age, is_due
from api.batches.lost import kept_batch_lost
from api.batches.outcomes import BatchWaiting, Formation, FormedBatch
from api.batches.planner import BatchSpec, EnvWindow, LookAhead, NoBatch, Plan, plan_batch
from api.batches.token_staleness import mask_item, oldest_kept
from api.batches.trim import first_sequences
from api.batches.windows import take_window
from api.config.groups import DEFAULTS, part, setting
from api.errors import Conflict, Gone, RollbufError
from api.ledger import rules as ledger
from api.ledger.recorder import OFF, Recorder
from api.run import state, stats
from api.run.filters import STALE
from api.run.kept import COMMIT, ReadAhead, read_ahead_full
from api.run.state import AWAITING, BLOCKED, CREDITS, KEPT, PASSED, QUIET, STEP, RunState, Unit, scale_shares
from api.store.base import ANON_ENV, PayloadLost, QueueCounts, Txn
from api.tasks import ending
from api.tasks.states import RUN_TAIL
from api.wire.records import decode_meta, json_default

log = logging.getLogger("rollbuf")

DEFAULT_READ_AHEAD = ReadAhead()
DEFAULT_GONE_AFTER: float = DEFAULTS["producer_gone_after"]
"""Seconds without a heartbeat after which a producer is gone: the service passes its own (`ProducerSettings`)."""
QUIET_SHARES = "quiet_shares"
"""Counter kind: episodes in which an env's minimum allocation held batches back past `quiet_share_seconds`,
by env name."""


@dataclasses.dataclass(frozen=True, slots=True)
class FormationRules:
    """The server's settings for forming batches (`api/config/settings.py`)."""

    look_ahead: LookAhead = part(LookAhead)
    quiet_share_seconds: float = setting("quiet_share_seconds")
    """How long an env's minimum allocation may hold a batch back (it has too little queued while others have
    enough) before it stops holding it, until it queues enough again."""
    arrival_wait_seconds: float = setting("formation_arrival_wait_seconds")
    """How long, with nothing arriving, an exact fill of the queued sizes is waited for before the trainer's
    `no_exact_fill` applies."""


DEFAULT_RULES = FormationRules()


class Unservable(RollbufError):
    """A formed batch the service cannot answer as asked: refused before its transaction commits, so its groups
    stay queued and the step does not move (ingest refuses such groups: this is for a group stored before)."""

    status_code = 500
    code = "internal"


def check_servable(payload: bytes, step: int, env_name: str) -> None:
    """The group's free-form fields print as JSON (its arrays always do): what a JSON /batch would fail on. A blob
    reference stands for a value validated as printable when it was stored (`json_default`)."""
    meta, group_id = decode_meta(payload)
    try:
        orjson.dumps(meta, default=json_default)
    except (TypeError, orjson.JSONEncodeError) as exc:
        raise Unservable(
            f"batch {step} cannot be served as JSON: a group of {env_name} (group_id {group_id!r}) holds "
            f"a value JSON cannot print ({exc}); nothing was taken: its groups stay queued, and a msgpack trainer "
            "(Accept: application/msgpack) can take the batch"
        ) from None


def batch_txn(
    txn: Txn,
    step: int | None,
    known: RunState | None = None,
    *,
    as_json: bool = False,
    read_ahead: ReadAhead = DEFAULT_READ_AHEAD,
    books: Recorder = OFF,
    rules: FormationRules = DEFAULT_RULES,
    gone_after: float = DEFAULT_GONE_AFTER,
) -> FormedBatch | BatchWaiting:
    """Batch `step` (served again until it is acknowledged), or the next one formed; without `step`, the next
        one formed (in "next" mode not kept: Atropos). The first call marks the run as started. `known`: a run
        state read before, whose envs are reused as far as they have not changed (`state.load`). `as_json`: the
        batch will be served as JSON, so a batch JSON cannot print is refused before the step moves
        (`Unservable`), leaving its groups queued. `read_ahead`: the bound of a trainer in commit mode
        (`api/run/kept.py`). `books`: the ledger's recorder (its rows are written here, with the decisions).
        `rules`:
    how far to look ahead and how long a quiet minimum share may hold a batch. `gone_after`: when a producer is
    gone, for the end of a run fed by datasets (api/tasks/ending.py).

    The run state it changes is read once and written once, at the end of the transaction (`state.Unit`)."""
    unit = Unit(txn)
    result = _batch(txn, unit, step, known, as_json, read_ahead, books, rules, gone_after)
    unit.commit()
    return result


def _batch(
    txn: Txn,
    unit: Unit,
    step: int | None,
    known: RunState | None,
    as_json: bool,
    read_ahead: ReadAhead,
    books: Recorder,
    rules: FormationRules,
    gone_after: float,
) -> FormedBatch | BatchWaiting:
    run = state.load(txn, known)
    reg = run.registration
    if reg is None:
        return BatchWaiting(not_registered=True)
    if not run.started:
        state.save_run(txn, reg, started=True)
    commit_mode = reg.acknowledge == COMMIT
    if step is None and not commit_mode:
        # Atropos's loop: asking for the next batch acknowledges every one before it, so retention and the
        # ledger prune by it (the mark stayed at 0, and retain_bytes kept every served payload).
        # Batches kept by an earlier `?step=` are acknowledged now, as asking for one would.
        kept = unit.kept(run)
        if (after := acknowledge(txn, kept, run.step, books, time.time(), save=False)) != kept:
            unit.set(KEPT, after)
        return form(txn, unit, run, keep=False, as_json=as_json, books=books, rules=rules, gone_after=gone_after)
    if step is None:
        step = run.step
    if step > run.step:
        raise Conflict(
            f"batch {step} cannot be formed yet: the next batch to form is {run.step}", loc=("query", "step")
        )
    kept = before = unit.kept(run)
    if not commit_mode:  # asking for N acknowledges every batch before it (saved below, with what is formed)
        kept = acknowledge(txn, kept, step, books, time.time(), save=False)
    elif step < kept.committed:
        raise Gone(
            f"batch {step} is no longer available: every batch before {kept.committed} was committed",
            loc=("query", "step"),
        )
    if step < run.step:
        if kept != before:
            unit.set(KEPT, kept)
        try:
            stored = txn.get_batch(step)
        except PayloadLost as exc:
            raise kept_batch_lost(step, exc) from exc
        if stored is None:
            raise Gone(
                f"batch {step} is no longer available: a later batch was asked for, or it was "
                "handed out without ?step=",
                loc=("query", "step"),
            )
        return FormedBatch.unpack(step, stored)
    if commit_mode and (why := read_ahead_full(kept, run.step, read_ahead)) is not None:
        unit.set_blocked(why, warn=False)  # /status (and the producers' /status-env) say what holds batches back
        return BatchWaiting(reason=why, blocked=True, read_ahead=True)
    result = form(txn, unit, run, keep=True, as_json=as_json, books=books, rules=rules, gone_after=gone_after)
    if isinstance(result, FormedBatch):
        kept = kept.keep(result.step, result.held or len(result.stored))
    if kept != before:
        unit.set(KEPT, kept)
    return result


def form(
    txn: Txn,
    unit: Unit,
    run: RunState,
    *,
    keep: bool,
    as_json: bool = False,
    books: Recorder = OFF,
    rules: FormationRules = DEFAULT_RULES,
    gone_after: float = DEFAULT_GONE_AFTER,
) -> FormedBatch | BatchWaiting:
    """Plan a batch from each env's queue head (dropping what is too stale on the way) and take it, or say
    why not (`BatchWaiting`, the reason kept for /status). When the heads (a batch's worth) hold no exact fill,
    the queues are read further, as far as `rules.look_ahead` allows, and planned over again. When no batch
    forms in a run fed by datasets, the end of the run is judged (`_tail`): once nothing else can arrive, what is
    queued is the run's tail, and once that is decided the run is finished."""
    start = time.perf_counter()
    now = time.time()
    reg = run.registration
    assert reg is not None
    spec = BatchSpec(reg.batch_size, reg.max_batch_tokens, reg.min_batch_fill, reg.no_exact_fill)
    look = rules.look_ahead
    quiet = unit.get(QUIET)
    released = {e for e, (since, _) in quiet.items() if now - since >= rules.quiet_share_seconds}
    given = {e.env_id: e.min_batch_allocation for e in run.envs if e.connected}
    shares = scale_shares({e: s for e, s in given.items() if e not in released})
    windows = _read(
        txn, unit, run, spec, shares, books, now, max_seqs=spec.batch_size, max_items=None, due_after=look.due_after
    )
    credits = unit.get(CREDITS)
    plan = plan_batch(windows, spec, credits, looked_further=False)
    if isinstance(plan, NoBatch) and plan.look_further:
        dropped = {w.env_id: w.stale for w in windows}  # the first read dropped them: still this batch's
        windows = _read(
            txn,
            unit,
            run,
            spec,
            shares,
            books,
            now,
            max_seqs=look.sequences,
            max_items=look.groups,
            due_after=look.due_after,
        )
        windows = [dataclasses.replace(w, stale=w.stale + dropped.get(w.env_id, 0)) for w in windows]
        plan = plan_batch(windows, spec, credits)
    plan, waited = _await_arrivals(unit, plan, windows, spec, credits, now, run.step, rules.arrival_wait_seconds)
    finished = False
    if isinstance(plan, NoBatch):
        plan, finished, waited = _tail(txn, unit, run, plan, spec, credits, books, now, rules, gone_after, waited)
    recheck = _hold(txn, unit, run, quiet, released, windows, plan, now, rules.quiet_share_seconds, given)
    if waited is not None:
        recheck = waited if recheck is None else min(recheck, waited)
    if isinstance(plan, NoBatch):
        if finished and not plan.left_out and (left := unit.get(BLOCKED)) is not None:
            return BatchWaiting(reason=left, blocked=True, finished=True)  # what the run's end left out, if anything
        unit.set_blocked(plan.reason if plan.blocked else None)
        return BatchWaiting(reason=plan.reason, blocked=plan.blocked, recheck_in=recheck, finished=finished)
    passed = unit.get(PASSED)
    aged = age(passed, plan, run.step)
    if aged != passed:
        unit.set(PASSED, aged)
    if plan.passed_over or plan.smaller:
        stats.count_passed_over(txn, {run.env_name(e): 1 for e in plan.passed_over}, smaller=plan.smaller)
    batch, seqs_by_env = take(txn, unit, run, plan, keep, as_json, books, now, start)
    return dataclasses.replace(batch, formation=Formation(seqs_by_env, time.perf_counter() - start))


def _read(
    txn: Txn,
    unit: Unit,
    run: RunState,
    spec: BatchSpec,
    shares: dict[int, float],
    books: Recorder,
    now: float,
    *,
    max_seqs: int,
    max_items: int | None,
    due_after: int,
) -> list[EnvWindow]:
    """Each env's queue head as far as the bounds, stale items dropped on the way; each env's oldest item marked
    due when it was passed over for `due_after` batches."""
    reg = run.registration
    assert reg is not None
    min_step = None if reg.max_staleness is None else run.step - reg.max_staleness
    passed = unit.get(PASSED)
    windows: list[EnvWindow] = []
    counts = txn.counts()
    for env_id in [ANON_ENV, *(e.env_id for e in run.envs)]:
        env = run.env(env_id)
        share = shares.get(env_id, 0.0)
        if counts.get(env_id, QueueCounts()).items == 0 and share == 0.0:
            continue
        win = take_window(
            txn.head(env_id), min_step=min_step, max_seqs=max_seqs, max_tokens=spec.max_tokens, max_items=max_items
        )
        name = run.env_name(env_id)
        if win.stale:
            ids = [m.item_id for m in win.stale]
            gone = txn.pop(env_id, ids, retain=books.retain)
            payloads = [g.payload for g in gone]
            books.dropped(txn, name, STALE, ids, payloads, step=run.step, at=now, popped=True)
        head = win.items[0] if win.items else None
        due = is_due(passed, env_id, head, run.step, due_after)
        weight = env.weight if env else 1.0
        windows.append(EnvWindow(env_id, name, weight, share, win.items, due, win.more, len(win.stale)))
    return windows


def _tail(
    txn: Txn,
    unit: Unit,
    run: RunState,
    plan: NoBatch,
    spec: BatchSpec,
    credits: dict[int, float],
    books: Recorder,
    now: float,
    rules: FormationRules,
    gone_after: float,
    waited: float | None,
) -> tuple[Plan | NoBatch, bool, float | None]:
    """No batch formed: in a run fed by datasets where nothing else can arrive (`ending.read`), plan the run's
    tail over the whole queue as far as formation looks ahead (`plan_batch(final=True)`: a last batch short of
    `batch_size`, or the tail left out under exact batch sizes, dropped here as `RUN_TAIL`); then whether the run
    is finished. Returns the plan, whether finished, and when to form again (at once while a tail left out has
    more queued beyond what was read)."""
    end, _ = ending.read(txn, run, now, gone_after)
    if not end.final:
        return plan, False, waited
    look = rules.look_ahead
    windows = _read(
        txn, unit, run, spec, {}, books, now, max_seqs=look.sequences, max_items=look.groups, due_after=look.due_after
    )
    tail = plan_batch(windows, spec, credits, final=True)
    if isinstance(tail, NoBatch) and tail.left_out:
        for w in windows:
            if w.items:
                ids = [m.item_id for m in w.items]
                gone = txn.pop(w.env_id, ids, retain=books.retain)
                books.dropped(txn, w.name, RUN_TAIL, ids, [g.payload for g in gone], step=run.step, at=now, popped=True)
    if isinstance(tail, Plan):
        return tail, False, None
    done = ending.finished(txn, end)
    more = not done and tail.left_out and any(c.items for c in txn.counts().values())
    return tail, done, 0.0 if more else waited


def _await_arrivals(
    unit: Unit,
    plan: Plan | NoBatch,
    windows: list[EnvWindow],
    spec: BatchSpec,
    credits: dict[int, float],
    now: float,
    step: int,
    limit: float,
) -> tuple[Plan | NoBatch, float | None]:
    """Bound in time the planner's wait for arrivals that could complete an exact fill: it starts when the
    planner first waits with this many sequences queued (any arrival starts it again), and once `limit` seconds
    pass with nothing arriving the plan is made again with the trainer's `no_exact_fill` applied (a run whose
    producers stop trains what is queued). Returns the plan and the seconds until the wait runs out, if waiting.

    The record is read only while waiting: it names the step it was made at, so one left by a wait that a batch
    ended is told apart without a read (or a write) on every formation."""
    if not isinstance(plan, NoBatch) or plan.awaiting is None:
        return plan, None
    saved = unit.get(AWAITING)
    since = saved[0] if saved is not None and saved[1:] == (plan.awaiting, step) else now
    if now - since >= limit:
        return plan_batch(windows, spec, credits, arrivals_waited_out=True), None
    if saved != (since, plan.awaiting, step):
        unit.set(AWAITING, (since, plan.awaiting, step))
    return plan, since + limit - now


def _hold(
    txn: Txn,
    unit: Unit,
    run: RunState,
    quiet: dict[int, tuple[float, bool]],
    released: set[int],
    windows: list[EnvWindow],
    plan: Plan | NoBatch,
    now: float,
    limit: float,
    given: dict[int, float | None],
) -> float | None:
    """Track the episodes in which an env's minimum allocation holds batches back: one starts when it first
    holds a batch, is released (counted, logged once) after `limit` seconds, and ends once the env queues its
    share again (or is disconnected, or no longer holds). Returns the seconds until the current hold is released
    (for a waiting trainer to try again then), or None."""
    assert run.registration is not None
    batch_size = run.registration.batch_size
    full = scale_shares(given)
    queued = {w.env_id: sum(m.seqs for m in w.items) for w in windows}
    holding = plan.holding if isinstance(plan, NoBatch) else None
    out: dict[int, tuple[float, bool]] = {}
    for env_id, (since, counted) in quiet.items():
        need = full.get(env_id, 0.0) * batch_size
        if env_id not in full or queued.get(env_id, 0) >= need - 1e-9:
            continue  # disconnected, or live again: the episode ends
        if env_id in released:
            if not counted:
                name = run.env_name(env_id)
                txn.add_counts(QUIET_SHARES, {name: 1})
                log.warning(
                    "env %r has held batches back for %.0f s with its min_batch_allocation (it queues too little): "
                    "its minimum no longer holds them until it queues its share again",
                    name,
                    now - since,
                )
            out[env_id] = (since, True)
        elif env_id == holding:
            out[env_id] = (since, counted)
    if holding is not None and holding not in out:
        out[holding] = (now, False)
    if out != quiet:
        unit.set(QUIET, out)
    if holding is None:
        return None
    return max(0.0, out[holding][0] + limit - now)


def take(
    txn: Txn,
    unit: Unit,
    run: RunState,
    plan: Plan,
    keep: bool,
    as_json: bool = False,
    books: Recorder = OFF,
    now: float = 0.0,
    start: float = 0.0,
) -> tuple[FormedBatch, dict[str, int]]:
    """Pop the planned items and advance the step; with `keep`, the store keeps the batch by reference to
    the popped payloads (no copy of them), until a later step is asked for. A group the plan cuts
    (`Plan.trim`) is served with its first sequences only; the store keeps it whole, and the batch's header
    says how to cut it again when the batch is served again (`FormedBatch.unpack`). Also returns the sequences
    taken per env. The recorder writes the groups' ledger rows as served and the batch's row (`start`:
    `perf_counter` when formation began, `now`: its wall-clock time)."""
    payloads: list[bytes] = []  # as served
    stored: list[bytes] = []  # as the store keeps (and retains) them: whole
    order: list[int] = []
    cuts: dict[int, int] = {}  # record index in the batch: sequences kept (`no_exact_fill: "trim"`)
    trimmed: dict[str, int] = {}  # sequences cut off, left out, per env
    masked: dict[int, int] = {}  # record index in the batch: oldest weights version trained (`max_token_staleness`)
    stale: dict[str, int] = {}  # trained tokens masked for their age, per env
    tokens = plan.tokens
    n_groups = 0
    groups_by_env: dict[str, int] = {}
    seqs_by_env: dict[str, int] = {}
    staleness: dict[int, int] = {}
    for env_id, item_ids in plan.take.items():
        name = run.env_name(env_id)
        env = run.env(env_id)
        oldest = oldest_kept(run.step, None if env is None else env.max_token_staleness)
        for item in txn.pop(env_id, item_ids, keep_for=run.step if keep else None, retain=books.retain):
            if as_json:
                check_servable(item.payload, run.step, name)
            payload, seqs = item.payload, item.meta.seqs
            if (keep_seqs := plan.trim.get(item.meta.item_id)) is not None:
                payload, cut_tokens = first_sequences(payload, keep_seqs)  # a stored group is one record
                cuts[n_groups], seqs = keep_seqs, keep_seqs
                tokens -= cut_tokens
                trimmed[name] = trimmed.get(name, 0) + item.meta.seqs - keep_seqs
            if oldest is not None:
                payload, per_record = mask_item(payload, item.n_groups, oldest)
                masked.update((n_groups + k, oldest) for k, n in enumerate(per_record) if n)
                if any(per_record):
                    stale[name] = stale.get(name, 0) + sum(per_record)
            payloads.append(payload)
            stored.append(item.payload)
            order.append(item.meta.item_id)
            n_groups += item.n_groups
            groups_by_env[name] = groups_by_env.get(name, 0) + item.n_groups
            seqs_by_env[name] = seqs_by_env.get(name, 0) + seqs
            age = run.step - item.meta.policy_step
            staleness[age] = staleness.get(age, 0) + item.n_groups
    stats.count_batch(txn, groups_by_env, seqs_by_env, staleness)
    if cuts:
        stats.count_trimmed(txn, trimmed)
    if stale:
        stats.count_stale_masked(txn, stale)
    unit.set(CREDITS, plan.credits)
    unit.set_blocked(None)
    unit.set(STEP, run.step + 1)
    batch = FormedBatch.build(run.step, n_groups, plan.seqs, tokens, payloads, cuts, masked)
    if cuts or masked:
        batch = dataclasses.replace(batch, held=len(batch.prefix()) + sum(map(len, stored)))
    if keep:
        txn.put_batch(batch.step, batch.prefix(), order)
    row = ledger.step_row(
        run.step,
        now,
        time.perf_counter() - start,
        order,
        plan.seqs,
        tokens,
        groups_by_env,
        seqs_by_env,
        staleness,
        committed=not keep,
    )
    books.served(txn, row, stored)
    return batch, seqs_by_env
