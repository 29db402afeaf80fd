"""The drop-bias monitor: is what a run trains on what its environments generated? Pure logic, no I/O.

Dropping groups is not neutral. A staleness bound drops the groups that took longest to generate, which are
often the longest or the hardest; an env whose groups are dropped or arrive late falls below its share of the
batch. The monitor compares, per env, over a window of recent steps and decisions:

- its *share* of the batches' sequences against its weight's share and its minimum share
  (`min_batch_allocation`, scaled as formation scales it);
- the *length* (tokens per sequence), *reward* (a group's mean score) and *latency* (acknowledged to trained
  or dropped, seconds) of the groups it trained against those it dropped.

It flags, with the thresholds of `Thresholds` (docs/ledger.md, "Drop-bias monitor"):

- **starved**: its share was below its *floor* in each of the last `starve_steps` batches. The floor is its
  minimum share, or `weight_fraction` (half) of its weight's share if that is more: formation never forms a
  batch below a connected env's minimum (it waits instead, and /status says why), so what a run hides is an
  env far below its weight, its groups dropped as stale or never arriving;
- **length skew**: the mean length of dropped groups differs from that of trained ones by more than
  `length_skew` (relative);
- **reward skew**: the mean rewards differ by more than `reward_skew` pooled standard deviations (a
  standardised mean difference, Cohen's d).

Skews count only *unintended* drops (staleness, side-buffer expiry, any other reason): the trainer's own
filters (zero variance, score range) select on reward by design, so they would always look skewed. A skew
needs `min_groups` trained and `min_groups` such dropped groups in the window, and dropped groups making at
least `min_drop_fraction` of the env's decided groups: a handful of drops is noise, not a bias.

The monitor is fed decisions as the ledger records them (`observe_step`, `observe`) and keeps bounded windows
(`window_steps` batches, `window_groups` decisions per env); `report` summarises them, and `Episodes` turns
successive reports into one log line when a condition starts and one when it ends.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from api.config.groups import setting
from api.run.filters import SCORE_RANGE, ZERO_VARIANCE

FILTER_REASONS = frozenset({ZERO_VARIANCE, SCORE_RANGE})
"""Drop reasons that are the trainer's own choice (its group filters): left out of the skew comparisons."""

STARVED = "starved"
LENGTH_SKEW = "length_skew"
REWARD_SKEW = "reward_skew"
CONDITIONS = (STARVED, LENGTH_SKEW, REWARD_SKEW)


@dataclass(frozen=True, slots=True)
class Thresholds:
    starve_steps: int = setting("drop_bias_starve_steps")
    """Consecutive batches below the env's floor before it is starved (K)."""
    weight_fraction: float = 0.5
    """The floor's part of the weight's share: an env below half of what its weight asks for is starved."""
    length_skew: float = setting("drop_bias_length_skew")
    """Relative difference of mean tokens per sequence, dropped against trained, that counts as a skew."""
    reward_skew: float = setting("drop_bias_reward_skew")
    """Difference of mean rewards, in pooled standard deviations, that counts as a skew."""
    min_groups: int = 20
    """Trained groups, and unintentionally dropped groups, a window needs before a skew is judged."""
    min_drop_fraction: float = 0.05
    """Share of an env's decided groups that must be (unintentionally) dropped before a skew is judged."""
    window_steps: int = 100
    """Batches the share is averaged over (and starvation looked for in)."""
    window_groups: int = 2000
    """Decisions (trained or dropped groups) kept per env."""


@dataclass(frozen=True, slots=True)
class EnvTarget:
    """What formation aims at for an env: its weight and minimum share, as registered."""

    name: str
    weight: float
    min_share: float = 0.0
    """Already scaled as formation scales minimum allocations (`api.run.state.scale_shares`)."""
    connected: bool = True


@dataclass(frozen=True, slots=True)
class StepMix:
    """One formed batch: its sequences by env."""

    step: int
    seqs_by_env: Mapping[str, int]

    @property
    def seqs(self) -> int:
        return sum(self.seqs_by_env.values())


@dataclass(frozen=True, slots=True)
class Decision:
    """One group trained or dropped."""

    env: str
    trained: bool
    reason: str | None
    """Why it was dropped (None when trained)."""
    seqs: int
    tokens: int
    reward: float
    """The group's mean score."""
    latency: float | None = None
    """Seconds from acknowledged to trained (served) or dropped, if known."""


@dataclass(frozen=True, slots=True)
class Dist:
    """A distribution's summary: count, mean, standard deviation, median, 90th percentile."""

    n: int = 0
    mean: float | None = None
    std: float | None = None
    p50: float | None = None
    p90: float | None = None

    @staticmethod
    def of(values: Sequence[float]) -> Dist:
        """The summary, finite for any finite values (1e200, ±max, subnormals): they are scaled by the largest
        magnitude first, so no sum, square or difference overflows (`api.ledger.rules.score_summary`'s way)."""
        if not values:
            return Dist()
        n = len(values)
        ordered = sorted(values)
        scale = max(-ordered[0], ordered[-1])
        if scale == 0.0:
            return Dist(n, 0.0, 0.0, 0.0, 0.0)
        unit = [v / scale for v in values]  # in [-1, 1]
        m = math.fsum(unit) / n
        var = math.fsum((u - m) ** 2 for u in unit) / n
        std = scale * min(1.0, math.sqrt(var))  # std <= (max - min) / 2 <= scale
        return Dist(n, scale * m, std, _quantile(ordered, 0.5), _quantile(ordered, 0.9))

    def to_json(self) -> dict[str, float | int | None]:
        return {"n": self.n, "mean": self.mean, "std": self.std, "p50": self.p50, "p90": self.p90}


def _quantile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), as a weighted sum of the two: their
    difference could overflow (max - -max)."""
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    frac, a, b = pos - lo, ordered[lo], ordered[hi]
    if frac == 0 or a == b:
        return a
    return min(b, max(a, a * (1 - frac) + b * frac))  # clamped: subnormals round out of [a, b]


def relative_difference(dropped: Dist, trained: Dist) -> float | None:
    """(dropped mean - trained mean) / trained mean; None without both means, with a zero trained mean or when
    the ratio is past any float (a trained mean of a subnormal against a large one)."""
    if dropped.mean is None or trained.mean is None or trained.mean == 0:
        return None
    # Halved first: the difference of two finite means may pass the largest float, their halves' cannot.
    return _finite((dropped.mean / 2 - trained.mean / 2) / abs(trained.mean) * 2)


def standardised_difference(dropped: Dist, trained: Dist) -> float | None:
    """(dropped mean - trained mean) / pooled standard deviation (Cohen's d); ±inf when both are constant and
    differ, 0 when they are equal; None without both. No step overflows for finite inputs (the deviations are
    scaled by the larger before squaring); a quotient past any float is ±inf, as a constant pair's."""
    if dropped.mean is None or trained.mean is None or dropped.std is None or trained.std is None:
        return None
    half_diff = dropped.mean / 2 - trained.mean / 2
    scale = max(dropped.std, trained.std)
    if scale == 0:
        return 0.0 if half_diff == 0 else math.copysign(math.inf, half_diff)
    a, b = dropped.std / scale, trained.std / scale
    pooled = scale * math.sqrt((dropped.n * a * a + trained.n * b * b) / (dropped.n + trained.n))
    if pooled == 0:  # underflowed: subnormal deviations
        return 0.0 if half_diff == 0 else math.copysign(math.inf, half_diff)
    return half_diff / pooled * 2


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


@dataclass(frozen=True, slots=True)
class EnvBias:
    """One env's comparison over the window."""

    env: str
    weight_share: float
    """Its weight over the connected envs' weights: the share the mix aims at."""
    min_share: float
    floor: float
    """The share below which a batch counts towards starvation: max(min_share, weight_fraction * weight_share)."""
    share: float | None
    """Its mean share of the window's batches (None before any batch)."""
    last_share: float | None
    below_floor_steps: int
    """Consecutive latest batches in which it had less than its floor."""
    trained: int
    dropped: dict[str, int]
    """Groups dropped in the window, by reason (filters included)."""
    length_trained: Dist
    length_dropped: Dist
    reward_trained: Dist
    reward_dropped: Dist
    latency_trained: Dist
    latency_dropped: Dist
    length_skew: float | None
    """relative_difference of the lengths (unintended drops against trained)."""
    reward_skew: float | None
    """standardised_difference of the rewards (unintended drops against trained)."""
    flags: tuple[str, ...] = ()
    """Which of CONDITIONS hold."""

    def to_status(self) -> dict[str, object]:
        """The fields of /status's `drop_bias` entries (non-finite skews as null: JSON has no infinity)."""
        return self._fields(lambda x: x if x is not None and math.isfinite(x) else None)

    def to_json(self) -> dict[str, object]:
        """The dashboard's entry: /status's fields (non-finite skews as "inf" / "-inf"), the last batch's share and
        the trained and dropped distributions."""
        return {
            **self._fields(lambda x: x if x is None or math.isfinite(x) else ("inf" if x > 0 else "-inf")),
            "last_share": self.last_share,
            "length": {"trained": self.length_trained.to_json(), "dropped": self.length_dropped.to_json()},
            "reward": {"trained": self.reward_trained.to_json(), "dropped": self.reward_dropped.to_json()},
            "latency": {"trained": self.latency_trained.to_json(), "dropped": self.latency_dropped.to_json()},
        }

    def _fields(self, skew: Callable[[float | None], object]) -> dict[str, object]:
        return {
            "env": self.env,
            "weight_share": self.weight_share,
            "min_share": self.min_share,
            "floor": self.floor,
            "share": self.share,
            "below_floor_steps": self.below_floor_steps,
            "trained": self.trained,
            "dropped": dict(self.dropped),
            "length_skew": skew(self.length_skew),
            "reward_skew": skew(self.reward_skew),
            "flags": list(self.flags),
        }


@dataclass(frozen=True, slots=True)
class Report:
    steps: int
    """Batches in the window."""
    envs: list[EnvBias]
    thresholds: Thresholds

    def flagged(self) -> set[tuple[str, str]]:
        """(env, condition) of every condition that holds."""
        return {(e.env, flag) for e in self.envs for flag in e.flags}

    def to_json(self) -> dict[str, object]:
        t = self.thresholds
        return {
            "steps": self.steps,
            "thresholds": {
                "starve_steps": t.starve_steps,
                "weight_fraction": t.weight_fraction,
                "length_skew": t.length_skew,
                "reward_skew": t.reward_skew,
                "min_groups": t.min_groups,
                "min_drop_fraction": t.min_drop_fraction,
                "window_steps": t.window_steps,
                "window_groups": t.window_groups,
            },
            "envs": [e.to_json() for e in self.envs],
        }


def required_seqs(share: float, batch_seqs: int) -> int:
    """Sequences a share asks for in a batch of `batch_seqs` (rounded up, as formation rounds a minimum)."""
    return math.ceil(share * batch_seqs - 1e-9) if share > 0 else 0


@dataclass(slots=True)
class DropBias:
    """Bounded windows of recent batches and decisions; `report` compares them per env."""

    thresholds: Thresholds = field(default_factory=Thresholds)
    _steps: deque[StepMix] = field(init=False)
    _decisions: dict[str, deque[Decision]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._steps = deque(maxlen=self.thresholds.window_steps)

    def observe_step(self, mix: StepMix) -> None:
        self._steps.append(mix)

    def observe(self, decision: Decision) -> None:
        window = self._decisions.get(decision.env)
        if window is None:
            window = self._decisions[decision.env] = deque(maxlen=self.thresholds.window_groups)
        window.append(decision)

    def held(self) -> int:
        """Steps and decisions held (bounded by the windows)."""
        return len(self._steps) + sum(len(d) for d in self._decisions.values())

    def report(self, targets: Sequence[EnvTarget]) -> Report:
        """Every target env's comparison, and every env seen in the window without a target (weight 0)."""
        t = self.thresholds
        connected_weight = sum(max(0.0, e.weight) for e in targets if e.connected)
        named = {e.name: e for e in targets}
        seen = [n for n in self._decisions if n not in named]
        seen += sorted({n for m in self._steps for n in m.seqs_by_env if n not in named and n not in seen})
        envs = [
            self._env(
                e.name,
                max(0.0, e.weight) / connected_weight if e.connected and connected_weight > 0 else 0.0,
                e.min_share if e.connected else 0.0,
            )
            for e in targets
        ]
        envs += [self._env(name, 0.0, 0.0) for name in seen]
        return Report(len(self._steps), envs, t)

    def _env(self, name: str, weight_share: float, min_share: float) -> EnvBias:
        t = self.thresholds
        shares = [m.seqs_by_env.get(name, 0) / m.seqs for m in self._steps if m.seqs > 0]
        floor = max(min_share, t.weight_fraction * weight_share)
        below = 0
        for m in reversed(self._steps):
            if floor <= 0 or m.seqs_by_env.get(name, 0) >= required_seqs(floor, m.seqs):
                break
            below += 1
        decisions = self._decisions.get(name, ())
        trained = [d for d in decisions if d.trained]
        dropped = [d for d in decisions if not d.trained]
        unintended = [d for d in dropped if d.reason not in FILTER_REASONS]
        by_reason: dict[str, int] = {}
        for d in dropped:
            by_reason[d.reason or "unknown"] = by_reason.get(d.reason or "unknown", 0) + 1

        def lengths(ds: Sequence[Decision]) -> Dist:
            return Dist.of([d.tokens / d.seqs for d in ds if d.seqs > 0])

        def rewards(ds: Sequence[Decision]) -> Dist:
            return Dist.of([d.reward for d in ds])

        def latencies(ds: Sequence[Decision]) -> Dist:
            return Dist.of([d.latency for d in ds if d.latency is not None])

        length_skew = relative_difference(lengths(unintended), lengths(trained))
        reward_skew = standardised_difference(rewards(unintended), rewards(trained))
        flags: list[str] = []
        if floor > 0 and below >= t.starve_steps:
            flags.append(STARVED)
        judged = (
            len(trained) >= t.min_groups
            and len(unintended) >= t.min_groups
            and len(unintended) >= t.min_drop_fraction * len(decisions)
        )
        if judged and length_skew is not None and abs(length_skew) > t.length_skew:
            flags.append(LENGTH_SKEW)
        if judged and reward_skew is not None and abs(reward_skew) > t.reward_skew:
            flags.append(REWARD_SKEW)
        return EnvBias(
            env=name,
            weight_share=weight_share,
            min_share=min_share,
            floor=floor,
            share=math.fsum(shares) / len(shares) if shares else None,
            last_share=shares[-1] if shares else None,
            below_floor_steps=below,
            trained=len(trained),
            dropped=by_reason,
            length_trained=lengths(trained),
            length_dropped=lengths(unintended),
            reward_trained=rewards(trained),
            reward_dropped=rewards(unintended),
            latency_trained=latencies(trained),
            latency_dropped=latencies(unintended),
            length_skew=length_skew,
            reward_skew=reward_skew,
            flags=tuple(flags),
        )


def describe(env: EnvBias, condition: str, t: Thresholds) -> str:
    """The log line's words for one condition of one env."""
    if condition == STARVED:
        return (
            f"env {env.env!r} is starved: below its floor share {env.floor:.3g} (minimum {env.min_share:.3g}, "
            f"weight share {env.weight_share:.3g}) in the last {env.below_floor_steps} batches (threshold "
            f"{t.starve_steps}); last share {env.last_share or 0:.3g}"
        )
    if condition == LENGTH_SKEW:
        return (
            f"dropping skews env {env.env!r} by length: dropped groups average {env.length_dropped.mean or 0:.1f} "
            f"tokens per sequence, trained ones {env.length_trained.mean or 0:.1f} "
            f"({100 * (env.length_skew or 0):+.0f}%, threshold ±{100 * t.length_skew:.0f}%)"
        )
    return (
        f"dropping skews env {env.env!r} by reward: dropped groups' mean reward "
        f"{env.reward_dropped.mean or 0:.3g}, trained {env.reward_trained.mean or 0:.3g} "
        f"({env.reward_skew or 0:+.2f} pooled std, threshold ±{t.reward_skew:g})"
    )


def describe_end(key: tuple[str, str]) -> str:
    env, condition = key
    if condition == STARVED:
        return f"env {env!r} is no longer starved"
    return f"dropping no longer skews env {env!r} by {condition.split('_')[0]}"


@dataclass(slots=True)
class Episodes:
    """Which conditions hold, remembered between reports, so that each episode is logged once when it starts
    and once when it ends, however often the monitor is polled."""

    active: set[tuple[str, str]] = field(default_factory=set)

    def update(self, report: Report) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """(env, condition) of the conditions that started, and of those that ended, since the last report."""
        now = report.flagged()
        started, ended = sorted(now - self.active), sorted(self.active - now)
        self.active = now
        return started, ended

    def lines(self, report: Report) -> tuple[list[str], list[str]]:
        """`update`, in words: warnings for what started, notes for what ended."""
        started, ended = self.update(report)
        by_name = {e.env: e for e in report.envs}
        return [describe(by_name[env], cond, report.thresholds) for env, cond in started], [
            describe_end(key) for key in ended
        ]
