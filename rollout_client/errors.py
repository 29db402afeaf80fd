"""What can go wrong talking to rollbuf, as a small tree, and the pure predicate that decides what to retry.

```
RolloutClientError
 ├─ TransportError        connect/read timeout, reset, server gone: retryable
 ├─ ServerError(status, code, detail)
 │   ├─ Unavailable       429/503 (queue full, store busy): retryable after Retry-After
 │   └─ Rejected          any other 4xx: the data or request is wrong; never retried
 ├─ RetriesExhausted      the retry deadline passed; `__cause__` is the last error
 ├─ PromptTooLong         a prompt leaves no room for a completion; the group is skipped and counted
 ├─ EpisodeTruncated      a later turn has no room left: the rollout ends, kept and marked truncated
 ├─ InferenceError(status)  the inference server failed (retried on transport errors and 5xx, never 4xx)
 ├─ TurnTimeout           one generate() ran past `turn_timeout`: the group fails
 ├─ RolloutTimeout        one rollout ran past `rollout_timeout`: the group fails
 └─ RunFailed(reason, counts)  what ends a run: too many failed groups (or rejected ones, or the server
                          unreachable); `__cause__` is the original error
```
"""

from __future__ import annotations

from typing import Any


class RolloutClientError(Exception):
    """Base of every error the rollout client raises."""


class TransportError(RolloutClientError):
    """The request never got an HTTP answer (refused, reset, timed out)."""


class ServerError(RolloutClientError):
    """The server answered with an error status."""

    def __init__(self, status: int, detail: Any, code: str | None = None, retry_after: float | None = None) -> None:
        self.status = status
        self.detail = detail
        self.code = code
        self.retry_after = retry_after
        super().__init__(f"HTTP {status}: {describe_detail(detail)}")


class Unavailable(ServerError):
    """429/503: try again later (the server stored nothing)."""


class Rejected(ServerError):
    """4xx other than 429: resending the same request will never work."""


class RetriesExhausted(RolloutClientError):
    """Retryable errors kept coming until the deadline; the last one is the `__cause__`."""


class PromptTooLong(RolloutClientError):
    """The prompt already fills the token budget (trainer's max_token_len or the model's context)."""

    def __init__(self, prompt_tokens: int, limit: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.limit = limit
        super().__init__(f"prompt of {prompt_tokens} tokens leaves no room for a completion within {limit} tokens")


def describe_detail(detail: Any) -> str:
    """A 422 detail list as `loc: msg; ...` (the field and the rule); anything else as text."""
    if isinstance(detail, list) and detail and all(isinstance(d, dict) and "msg" in d for d in detail):
        return "; ".join(f"{'.'.join(str(p) for p in d.get('loc', []))}: {d['msg']}" for d in detail)
    return str(detail)


def error_for_status(status: int, body: Any, retry_after: str | None) -> ServerError:
    """The exception for an error reply; `body` is the decoded JSON (or text) the server sent."""
    detail = body.get("detail", body) if isinstance(body, dict) else body
    code = body.get("code") if isinstance(body, dict) else None
    wait = parse_retry_after(retry_after)
    if status in (429, 503):
        return Unavailable(status, detail, code, wait)
    if 400 <= status < 500:
        return Rejected(status, detail, code)
    return ServerError(status, detail, code, wait)


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds form; the HTTP-date form is not used by rollbuf)."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return max(0.0, seconds)


def is_retryable(exc: BaseException) -> bool:
    """True for errors where sending the same request again may succeed: transport failures, 429/503 and
    other 5xx. A 4xx is a verdict on the request and is never retried."""
    if isinstance(exc, TransportError | Unavailable):
        return True
    if isinstance(exc, Rejected):
        return False
    return isinstance(exc, ServerError) and exc.status >= 500


class WorkerDied(RolloutClientError):
    """The worker running a group exited; the group was never submitted and can be run again."""


class WorkerFailed(RolloutClientError):
    """A group raised inside a worker an error that could not be sent back as itself (it does not pickle);
    the message carries the worker's traceback."""


class GroupDropped(RolloutClientError):
    """A group cancelled on purpose (a pause that ran out of time): dropped and counted under `reason`."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class EpisodeTruncated(RolloutClientError):
    """A turn after the first found no room in the token budget: the episode ends here, truncated (the runner
    keeps and submits it, marked `truncated` in its overrides)."""

    def __init__(self, tokens: int, limit: int) -> None:
        self.tokens = tokens
        self.limit = limit
        super().__init__(f"episode truncated at {tokens} tokens (token budget {limit})")


class InferenceError(RolloutClientError):
    """The inference server answered with an error (`status`), or with something that is not a completion
    (`status` None), or could not be reached (`transport` True)."""

    def __init__(self, message: str, status: int | None = None, *, transport: bool = False) -> None:
        self.status = status
        self.transport = transport
        super().__init__(message)

    @property
    def retryable(self) -> bool:
        """Connection errors and 5xx may pass on a retry; a 4xx or a malformed reply never will."""
        return self.transport or (self.status is not None and self.status >= 500)


class TurnTimeout(RolloutClientError, TimeoutError):
    """One generation request ran past the runner's `turn_timeout`."""


class RolloutTimeout(RolloutClientError, TimeoutError):
    """One rollout (its turns, tools and waits, pauses excluded) ran past the runner's `rollout_timeout`."""


class RunFailed(RolloutClientError):
    """The one error a run ends with: `reason` says why, `__cause__` (and `error`) is the original error
    (an environment's own exception, an InferenceError, a Rejected...), `failed` the counts per env and
    reason at that moment."""

    def __init__(self, reason: str, error: BaseException | None, failed: dict[str, dict[str, int]]) -> None:
        self.reason = reason
        self.error = error
        self.failed = failed
        cause = f": {type(error).__name__}: {error}" if error is not None else ""
        super().__init__(f"{reason}{cause}")


FAILURE_REASONS = ("turn_timeout", "rollout_timeout", "inference_error", "worker_died", "env_error")
"""Why a group failed, as counted in `RunnerStats.failed[env][reason]`."""


def failure_reason(exc: BaseException) -> str:
    """The counter a failed group goes to: timeouts and inference errors by name, a worker that died, and
    anything else the environment's code raised (rollout, tools, score, resources) as `env_error`."""
    if isinstance(exc, TurnTimeout):
        return "turn_timeout"
    if isinstance(exc, RolloutTimeout):
        return "rollout_timeout"
    if isinstance(exc, InferenceError):
        return "inference_error"
    if isinstance(exc, WorkerDied):
        return "worker_died"
    return "env_error"
