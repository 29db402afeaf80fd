"""rollout_client's pure logic: token budget, pacing, task sources, completion parsing (the retry predicate
and backoff are client_core's: tests/unit/test_client_core_*.py)."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.wire.schema import EnvStatus
from rollout_client import Curriculum, PromptTooLong, Task, Tasks, clip_max_tokens
from rollout_client.policy import InferenceError, parse_completion
from rollout_client.runner.backpressure import Backpressure
from rollout_client.runner.pacing import AHEAD, QUEUE_FULL, is_stale, pause_reason, pick_env


@given(st.integers(0, 5000), st.integers(1, 5000), st.none() | st.integers(1, 6000), st.none() | st.integers(1, 6000))
def test_clip_max_tokens_never_exceeds_a_limit(prompt: int, want: int, trainer: int | None, ctx: int | None) -> None:
    limits = [x for x in (trainer, ctx) if x is not None]
    try:
        n = clip_max_tokens(prompt, want, trainer, ctx)
    except PromptTooLong as exc:
        assert prompt >= min(limits) and exc.limit == min(limits)
        return
    assert 1 <= n <= want
    assert all(prompt + n <= lim for lim in limits)
    if not limits or prompt + want <= min(limits):
        assert n == want


def _status(**kw: float | None) -> EnvStatus:
    base = dict(
        current_step=0,
        queue_size=0,
        unallocated_fraction=1.0,
        self_queue_size=0,
        max_group_size=4,
        env_weight=1.0,
        queue_capacity_groups=None,
    )
    return EnvStatus.model_validate({**base, **kw})


def test_pause_reason() -> None:
    kw = dict(batch_size=16, group_size=4, policy_step=5)
    assert pause_reason(_status(current_step=5), max_staleness=None, **kw) is None
    assert pause_reason(_status(queue_capacity_groups=0), max_staleness=None, **kw) == QUEUE_FULL
    assert pause_reason(_status(queue_capacity_groups=3), max_staleness=None, **kw) is None
    # this env gets half of each batch of 16: 8 sequences a step. 3 groups of 4 queued + 1 in flight + the
    # new one = 20 sequences: the new group is consumed 2 steps from now, at step 7, 2 steps after its weights
    half = _status(current_step=5, self_queue_size=3, env_weight=0.5)
    assert pause_reason(half, max_staleness=2, pending_seqs=4, **kw) is None
    assert pause_reason(half, max_staleness=1, pending_seqs=4, **kw) == AHEAD
    assert pause_reason(half, max_staleness=2, pending_seqs=9, **kw) == AHEAD
    behind = _status(current_step=8)  # weights 3 steps old: whatever is produced now arrives stale
    assert pause_reason(behind, max_staleness=2, **kw) == AHEAD
    assert pause_reason(_status(current_step=5, queue_size=1000), max_staleness=None, **kw) is None


def test_a_batch_short_of_sequences_holds_no_env_back() -> None:
    """Three envs of equal weight (G 4, 8, 4), batch 32: the server holds 28 sequences, one G=8 group of them
    this env's, and the weights are 2 steps old at bound 2. By its own third of a batch (10 sequences a step) a
    new group of 8 looked a step late; but the batch being formed lacks 4 sequences and can take it."""
    kw = dict(batch_size=32, group_size=8, policy_step=3, max_staleness=2)
    short = _status(current_step=5, queue_size=3, self_queue_size=1, env_weight=1 / 3, queued_sequences=28)
    assert pause_reason(short, **kw) is None
    assert pause_reason(short, pending_seqs=0, pending_all=4, **kw) == AHEAD, "another env's 4 in flight fill it"
    assert pause_reason(_status(current_step=5, queue_size=3, self_queue_size=1, env_weight=1 / 3), **kw) is None


@given(
    st.integers(1, 64),
    st.sampled_from([1, 2, 4, 8, 16]),
    st.integers(0, 3),
    st.integers(0, 3),
    st.floats(0.01, 1.0),
    st.integers(0, 200),
    st.integers(0, 200),
    st.integers(0, 200),
)
def test_no_env_is_held_ahead_while_the_batch_being_formed_lacks_sequences(
    batch: int, g: int, bound: int, lag: int, weight: float, queued: int, own: int, pending: int
) -> None:
    """Whatever this env's share and queue: while every queued and pending sequence leaves the batch short, a
    group generated with weights within the bound is wanted now; otherwise AHEAD only past the bound."""
    read = _status(
        current_step=10, queue_size=queued // g, self_queue_size=own // g, env_weight=weight, queued_sequences=queued
    )
    reason = pause_reason(
        read,
        batch_size=batch,
        group_size=g,
        policy_step=10 - lag,
        max_staleness=bound,
        pending_seqs=min(pending, own),
        pending_all=pending,
    )
    if lag > bound:
        assert reason == AHEAD
    elif queued + pending < batch:
        assert reason is None
    elif reason is None:
        assert lag + 1 <= bound  # a group for a later batch is started only if it stays within the bound


def test_is_stale() -> None:
    assert not is_stale(3, 5, None)
    assert not is_stale(3, 5, 2)
    assert is_stale(3, 6, 2)


@given(st.lists(st.floats(0.05, 10), min_size=1, max_size=5), st.integers(50, 400))
def test_pick_env_follows_rates(rates: list[float], rounds: int) -> None:
    credit = [0.0] * len(rates)
    picks = Counter(pick_env(credit, rates, [True] * len(rates)) for _ in range(rounds))
    total = sum(rates)
    for i, r in enumerate(rates):
        assert abs(picks[i] - rounds * r / total) <= len(rates)  # smooth WRR stays within a few picks


def test_pick_env_skips_ineligible() -> None:
    credit = [0.0, 0.0]
    assert {pick_env(credit, [1.0, 1.0], [False, True]) for _ in range(5)} == {1}
    assert pick_env(credit, [1.0, 1.0], [False, False]) is None


def test_tasks_from_list_function_and_cycle() -> None:
    ts = [Task(str(i), f"p{i}") for i in range(3)]
    once = Tasks(ts)
    assert [once.next_task() for _ in range(4)] == [*ts, None]
    cyc = Tasks(ts, cycle=True)
    assert [cyc.next_task() for _ in range(5)] == [*ts, *ts[:2]]
    made = Tasks(lambda i: Task(f"t{i}", "p"))
    assert [t.id for t in (made.next_task(), made.next_task()) if t] == ["t0", "t1"]


def test_curriculum_moves_up_and_down_by_mean_score() -> None:
    levels = [Tasks(lambda i, lv=lv: Task(f"L{lv}-{i}", "p")) for lv in range(3)]
    cur = Curriculum(levels, window=4, promote=0.75, demote=0.25)
    for _ in range(4):
        task = cur.next_task()
        assert task is not None and task.id.startswith("L0")
        cur.report(task, 1.0)
    assert cur.level == 1
    old = cur.next_task()
    for _ in range(4):
        task = cur.next_task()
        assert task is not None
        cur.report(task, 0.0)
    assert cur.level == 0
    assert old is not None
    cur.report(old, 1.0)  # a group started at the old level does not move the new one
    assert cur.level == 0
    with pytest.raises(ValueError, match="demote < promote"):
        Curriculum(levels, promote=0.2, demote=0.5)


def test_parse_completion_takes_ids_from_the_server() -> None:
    logprobs = {"tokens": ["token_id:5", "token_id:7"], "token_logprobs": [-0.5, -1.25]}
    body = {"choices": [{"text": "hi", "finish_reason": "length", "logprobs": logprobs}]}
    out = parse_completion(body)
    assert (out.token_ids, out.logprobs, out.text, out.finish_reason) == ([5, 7], [-0.5, -1.25], "hi", "length")
    body["choices"][0]["logprobs"]["tokens"] = ["hi", "!"]
    with pytest.raises(InferenceError, match="return_tokens_as_token_ids"):
        parse_completion(body)
    with pytest.raises(InferenceError, match="missing"):
        parse_completion({"choices": [{"text": "x"}]})


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), "x", True])
def test_parse_completion_refuses_a_logprob_that_is_not_a_finite_number(bad: object) -> None:
    body = {"choices": [{"logprobs": {"tokens": ["token_id:5", "token_id:7"], "token_logprobs": [-0.5, bad]}}]}
    with pytest.raises(InferenceError, match="position 1: not a finite number"):
        parse_completion(body)


def test_parse_completion_refuses_more_tokens_than_asked() -> None:
    body = {"choices": [{"logprobs": {"tokens": ["token_id:5"] * 3, "token_logprobs": [-0.5] * 3}}]}
    assert len(parse_completion(body, 3).token_ids) == 3
    with pytest.raises(InferenceError, match="3 tokens in a completion asked for at most 2"):
        parse_completion(body, 2)


@given(st.lists(st.tuples(st.integers(0, 2), st.booleans()), max_size=80))
def test_curriculum_with_repeated_ids_reports_every_handout_once(ops: list[tuple[int, bool]]) -> None:
    """Ids repeat: every handout is remembered apart, so a report or discard never loses another's."""
    levels = [Tasks(lambda i, lv=lv: Task(f"t{i % 2}", f"L{lv}")) for lv in range(3)]
    cur = Curriculum(levels, window=2, promote=0.5, demote=0.1)
    out: list[Task] = []
    for k, report in ops:
        if k == 0 or not out:
            task = cur.next_task()
            assert task is not None
            out.append(task)
        elif report:
            cur.report(out.pop(0), 1.0)
        else:
            cur.discard(out.pop())
        assert sum(map(len, cur._level_of.values())) == len(out)


def test_curriculum_moves_on_when_a_level_runs_out() -> None:
    cur = Curriculum([Tasks([Task(f"L{lv}-{i}", "p") for i in range(2)]) for lv in range(3)], window=4)
    ids = [t.id for t in iter(cur.next_task, None)]
    assert ids == ["L0-0", "L0-1", "L1-0", "L1-1", "L2-0", "L2-1"] and cur.level == 2
    cur = Curriculum([Tasks([Task(f"L{lv}-{i}", "p") for i in range(2)]) for lv in range(3)], window=1)
    first = cur.next_task()
    assert first is not None
    cur.report(first, 1.0)
    cur.report(cur.next_task() or first, 1.0)  # level 1 done scoring: promoted to 2
    assert cur.level == 2
    rest = [t.id for t in iter(cur.next_task, None)]
    assert rest == ["L2-0", "L2-1", "L1-1", "L0-1"], "the top runs out: the nearest level below that has tasks"


# ------------------------------------------------------------------------------ pacing against a simulated run


@dataclass(frozen=True)
class Shape:
    """A run: its envs (G, weight), the trainer's batch, how often it syncs its weights and its staleness bound,
    how many rollouts the runner runs at once, how long groups take (ticks, cycled over the groups started) and
    how long the trainer trains on each batch before it asks for the next (and syncs its weights).
    With `lengths` (tokens per sequence, per env) the trainer registered a token budget, `max_batch_tokens`."""

    sizes: tuple[int, ...]
    weights: tuple[float, ...]
    batch_size: int
    interval: int
    bound: int
    max_in_flight: int
    durations: tuple[int, ...] = (1,)
    step_ticks: int = 0
    lengths: tuple[int, ...] | None = None
    max_batch_tokens: int = 0


def feasible(run: Shape) -> bool:
    """Whether producers could fill each batch within `bound` steps of the weights they generate with:

    - the weights live while batch S forms are the last sync's, up to `interval - 1` steps old, so nothing is
      fresh enough for the batch before a sync unless `bound >= interval - 1`;
    - every queue of at least `batch_size` sequences holds a batch: group sizes that divide the batch and each
      other (powers of two), or, with a token budget, groups no larger than the batch and the budget;
    - the runner can run a group of each env (`max_in_flight` at least every G)."""
    if run.bound < run.interval - 1 or max(run.sizes) > min(run.max_in_flight, run.batch_size):
        return False
    if run.lengths is not None:
        return all(g * n <= run.max_batch_tokens for g, n in zip(run.sizes, run.lengths, strict=True))
    chain = sorted(set(run.sizes))
    return run.batch_size % chain[-1] == 0 and all(b % a == 0 for a, b in itertools.pairwise(chain))


@dataclass
class Queued:
    env: int
    size: int
    tokens: int
    step: int


class Batches:
    """The server's side, as api/batches forms batches: per-env FIFO queues; at each formation stale groups
    dropped, every env with data earning `batch_size x weight / (weights with data)` credit (capped at two
    batches either way) and the env furthest ahead in credit giving its oldest group while it fits; in exact
    mode a batch of exactly `batch_size` (any exact fill of the queue where that order finds none), with a token
    budget one released full, at `min_batch_fill` of the tokens, or when no env's next group fits."""

    def __init__(self, run: Shape) -> None:
        self.run = run
        self.step = 0
        self.queues: list[list[Queued]] = [[] for _ in run.sizes]
        self.credit = [0.0] * len(run.sizes)
        self.stale = 0
        """Groups dropped as too stale when a batch was formed."""

    def statuses(self) -> list[EnvStatus]:
        """/status-env per env, as api/views/status.py computes it (no minimum allocations)."""
        total = sum(q.size for queue in self.queues for q in queue)
        out = []
        for i, g in enumerate(self.run.sizes):
            own = sum(q.size for q in self.queues[i])
            out.append(
                EnvStatus.model_validate(
                    {
                        "current_step": self.step,
                        "queue_size": total // g,
                        "unallocated_fraction": 1.0,
                        "self_queue_size": own // g,
                        "max_group_size": max(self.run.sizes),
                        "env_weight": self.run.weights[i] / sum(self.run.weights),
                        "queued_sequences": total,
                    }
                )
            )
        return out

    def form(self) -> bool:
        """Form batch `step` if the queue holds one: True, and the step moves on."""
        run = self.run
        for queue in self.queues:
            fresh = [q for q in queue if q.step >= self.step - run.bound]
            self.stale += len(queue) - len(fresh)
            queue[:] = fresh
        with_data = [i for i, queue in enumerate(self.queues) if queue]
        if not with_data:
            return False
        credit = list(self.credit)
        for i in with_data:
            credit[i] += run.batch_size * run.weights[i] / sum(run.weights[j] for j in with_data)
        taken = [0] * len(self.queues)
        seqs = tokens = 0
        budget = run.max_batch_tokens if run.lengths is not None else None
        while True:
            fits = [
                i
                for i in with_data
                if taken[i] < len(self.queues[i])
                and seqs + self.queues[i][taken[i]].size <= run.batch_size
                and (budget is None or tokens + self.queues[i][taken[i]].tokens <= budget)
            ]
            if not fits:
                break
            i = max(fits, key=lambda j: credit[j])
            q = self.queues[i][taken[i]]
            taken[i] += 1
            seqs, tokens, credit[i] = seqs + q.size, tokens + q.tokens, credit[i] - q.size
        if budget is not None:
            left = any(taken[i] < len(self.queues[i]) for i in with_data)
            if not (seqs == run.batch_size or tokens >= 0.9 * budget or left):
                return False
            chosen = [q for i, queue in enumerate(self.queues) for q in queue[: taken[i]]]
        elif seqs == run.batch_size:
            chosen = [q for i, queue in enumerate(self.queues) for q in queue[: taken[i]]]
        else:
            found = exact_fill([q for queue in self.queues for q in queue], run.batch_size)
            if found is None:
                return False
            chosen, credit = found, list(self.credit)
            for q in chosen:
                credit[q.env] -= q.size
        for queue in self.queues:
            queue[:] = [q for q in queue if all(q is not c for c in chosen)]
        self.credit = [max(-2.0 * run.batch_size, min(2.0 * run.batch_size, c)) for c in credit]
        self.step += 1
        return True


def exact_fill(groups: list[Queued], total: int) -> list[Queued] | None:
    """Some groups whose sizes add up to `total`, or None (a subset sum)."""
    reach: dict[int, list[Queued]] = {0: []}
    for q in groups:
        for s, chosen in list(reach.items()):
            if s + q.size <= total and s + q.size not in reach:
                reach[s + q.size] = [*chosen, q]
    return reach.get(total)


@dataclass
class Flying:
    env: int
    step: int
    done_at: int


@dataclass
class Outcome:
    batches: int
    """Batches formed. Fewer than asked: the run stalled (nothing in flight, nothing the runner may start, no
    batch to form) or ran out of ticks."""
    stale: int
    """Groups that went stale: cancelled by the runner, or dropped by the server."""


def simulate(run: Shape, batches: int, paced: bool = True) -> Outcome:
    """Run the trainer, the server and one runner (its `Backpressure`, `pause_reason` and `pick_env`; without
    `paced`, no `max_staleness` for it) tick by tick until `batches` batches formed. Each tick the runner reads
    every env's status, then learns of the groups finished since (acknowledged after the read, as a real poll
    misses them), the trainer, unless it is training, takes each batch the server can form (and syncs its
    weights every `interval` steps once it trained on it: the runner follows at once), and the runner starts
    what its pacing lets it."""
    server = Batches(run)
    bp = Backpressure(run.sizes, run.bound if paced else None)
    bp.batch_size = run.batch_size
    weights, started, idle, cancelled, training_until, sync_due = 0, 0, 0, 0, 0, False
    longest = max(run.durations) + run.step_ticks + 2
    ticks = batches * (run.batch_size // min(run.sizes) + 2) * longest  # a bound on any run that goes on
    flying: list[Flying] = []
    credit = [0.0] * len(run.sizes)
    rates = [w / g for w, g in zip(run.weights, run.sizes, strict=True)]
    for now in range(ticks):
        mark, reads = bp.mark(), server.statuses()
        done = [f for f in flying if f.done_at <= now]
        flying = [f for f in flying if f.done_at > now]
        for f in done:
            if is_stale(f.step, reads[0].current_step, run.bound):
                cancelled += 1  # the runner cancels what has become useless
                continue
            n = run.sizes[f.env]
            bp.acked(f.env, n)
            server.queues[f.env].append(Queued(f.env, n, n * (run.lengths or run.sizes)[f.env], f.step))
        bp.observed(reads, mark)
        formed = False
        while now >= training_until:
            if sync_due:  # trained on batch N: the weights of step N + 1 go live
                weights, sync_due = server.step, False
            if not server.form():
                break
            formed = True
            if server.step >= batches:
                return Outcome(server.step, server.stale + cancelled)
            sync_due = server.step % run.interval == 0
            training_until = now + run.step_ticks
        launched = False
        while True:
            held = bp.refresh([(f.env, run.sizes[f.env]) for f in flying], weights)
            pick = list(credit)  # the runner commits an env's turn only when it starts a group
            i = pick_env(pick, rates, [h is None for h in held])
            if i is None or sum(run.sizes[f.env] for f in flying) + run.sizes[i] > run.max_in_flight:
                break
            credit = pick
            flying.append(Flying(i, weights, now + run.durations[started % len(run.durations)]))
            started, launched = started + 1, True
        idle = 0 if (done or formed or launched or flying or now < training_until or sync_due) else idle + 1
        if idle >= 2:  # a second read changed nothing either
            break
    return Outcome(server.step, server.stale + cancelled)


POWERS_OF_TWO = st.sampled_from([1, 2, 4, 8, 16, 32, 64])


@st.composite
def shapes(draw: st.DrawFn, tokens: bool) -> Shape:
    """Feasible runs: 1 to 4 envs of any weights, G and the batch powers of two, syncs every 1 to 4 steps at
    the least bound or a little more, groups of 1 to 6 ticks, steps of 0 to 4."""
    n = draw(st.integers(1, 4))
    batch = draw(st.sampled_from([8, 16, 32, 64]))
    sizes = tuple(draw(st.lists(POWERS_OF_TWO.filter(lambda g: g <= batch), min_size=n, max_size=n)))
    interval = draw(st.integers(1, 4))
    lengths = tuple(draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))) if tokens else None
    budget = max(g * m for g, m in zip(sizes, lengths, strict=True)) * draw(st.integers(1, 6)) if lengths else 0
    return Shape(
        sizes=sizes,
        weights=tuple(draw(st.lists(st.floats(0.1, 5.0), min_size=n, max_size=n))),
        batch_size=batch,
        interval=interval,
        bound=interval - 1 + draw(st.integers(0, 2)),
        max_in_flight=max(sizes) * draw(st.integers(1, 4)),
        durations=tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=8))),
        step_ticks=draw(st.integers(0, 4)),
        lengths=lengths,
        max_batch_tokens=budget,
    )


THREE_ENVS = Shape(
    sizes=(4, 8, 4), weights=(1.0, 1.0, 1.0), batch_size=32, interval=3, bound=2, max_in_flight=32, step_ticks=2
)


def test_three_envs_at_the_least_bound_run_on() -> None:
    """G 4/8/4 of equal weights, batch 32, a sync every 3 steps at bound 2: pacing that judged each env by its
    own share of a batch held all three back while the batch lacked 4 sequences."""
    assert feasible(THREE_ENVS)
    assert simulate(THREE_ENVS, 50) == Outcome(50, stale=0)
    every_2 = dataclasses.replace(THREE_ENVS, interval=2, bound=1)
    assert feasible(every_2) and simulate(every_2, 50) == Outcome(50, stale=0)
    assert simulate(THREE_ENVS, 50, paced=False).stale > 0, "the pacing is what keeps groups from going stale"


def test_below_the_least_bound_a_run_stalls() -> None:
    """The bound in `feasible` is needed: below it the batch before a sync can hold nothing fresh enough."""
    short = dataclasses.replace(THREE_ENVS, bound=1)
    assert not feasible(short)
    assert simulate(short, 50).batches < 50


@given(shapes(tokens=False))
def test_every_batch_forms_in_feasible_runs(run: Shape) -> None:
    assert feasible(run)
    assert simulate(run, 12).batches == 12


@given(shapes(tokens=True))
def test_every_batch_forms_in_feasible_runs_with_a_token_budget(run: Shape) -> None:
    assert feasible(run)
    assert simulate(run, 12).batches == 12
