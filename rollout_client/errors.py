"""What can go wrong in an environment's process: the shared tree (`client_core.errors`) and the errors only
rollouts meet.

```
ClientError (= RolloutClientError)
 ├─ TransportError        connect/read timeout, reset, server gone: retried
 ├─ ServerError(status, code, detail)   another 5xx: retried
 │   ├─ Unavailable       429/503 (queue full, store busy): retried after Retry-After
 │   └─ Rejected          any other 4xx: the data or request is wrong; never retried
 ├─ RetriesExhausted      the retry deadline passed; `__cause__` is the last error
 ├─ PromptTooLong         a prompt leaves no room for a completion; the group is skipped and counted
 ├─ EpisodeTruncated      a later turn has no room left: the rollout ends, kept and marked truncated
 ├─ InferenceError(status)  the inference server failed (retried on transport errors and 5xx, never 4xx)
 ├─ TurnTimeout           one generate() ran past `timeouts.turn`: the group fails
 ├─ RolloutTimeout        one rollout ran past `timeouts.rollout`: the group fails
 ├─ GroupTimeout          a whole group (rollouts, scoring, release) ran past `timeouts.group`: it fails
 ├─ EnvExited             environment code raised SystemExit (`exit()`) or the like: the group fails
 ├─ ResourceExhausted     raised by an env's `resource()`: its pool is full now; the runner waits and retries
 ├─ ResourceTimeout       a resource stayed exhausted past the env's `acquire_timeout`: the group fails
 ├─ WorkerDied / WorkerFailed  a worker exited / raised an error that does not pickle
 └─ RunFailed(reason, counts)  what ends a run: too many failed groups (or rejected ones, or the server
                          unreachable); `__cause__` is the original error
```
"""

from __future__ import annotations

from typing import Any

from client_core.errors import (
    ClientError,
    Rejected,
    RetriesExhausted,
    ServerError,
    TransportError,
    Unavailable,
    describe_detail,
    error_for_status,
    is_retryable,
    parse_retry_after,
)

RolloutClientError = ClientError
"""The rollout side's base, which is the shared one: `except RolloutClientError` catches every error."""

__all__ = [
    "FAILURE_REASONS",
    "ClientError",
    "EnvExited",
    "EpisodeTruncated",
    "GroupTimeout",
    "GroupDropped",
    "InferenceError",
    "PromptTooLong",
    "Rejected",
    "ResourceExhausted",
    "ResourceTimeout",
    "RetriesExhausted",
    "RolloutClientError",
    "RolloutTimeout",
    "RunFailed",
    "ServerError",
    "TransportError",
    "TurnTimeout",
    "Unavailable",
    "WorkerDied",
    "WorkerFailed",
    "describe_detail",
    "error_for_status",
    "failure_reason",
    "registration_lost",
    "is_retryable",
    "parse_retry_after",
]


class PromptTooLong(ClientError):
    """The prompt already fills the token budget (trainer's max_token_len or the model's context)."""

    def __init__(self, prompt_tokens: int, limit: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.limit = limit
        super().__init__(f"prompt of {prompt_tokens} tokens leaves no room for a completion within {limit} tokens")


class WorkerDied(ClientError):
    """The worker running a group exited; the group was never submitted and can be run again."""


class WorkerFailed(ClientError):
    """A group raised inside a worker an error that could not be sent back as itself (it does not pickle);
    the message carries the worker's traceback."""


class SetupTimeout(ClientError, TimeoutError):
    """An environment's `worker_setup()` did not finish within its `setup_timeout`."""


class GroupDropped(ClientError):
    """A group cancelled on purpose (a pause that ran out of time): dropped and counted under `reason`."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class EpisodeFailed(ClientError):
    """An episode an external harness ran (verifiers) did not succeed: its group fails, counted in the
    runner's `failed[env][reason]` (`episode_timeout`, `episode_error:<error type>`)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        super().__init__(f"{reason}: {detail}" if detail else reason)


class EpisodeTruncated(ClientError):
    """A turn after the first found no room in the token budget: the episode ends here, truncated (the runner
    keeps and submits it, marked `truncated` in its overrides)."""

    def __init__(self, tokens: int, limit: int) -> None:
        self.tokens = tokens
        self.limit = limit
        super().__init__(f"episode truncated at {tokens} tokens (token budget {limit})")


class InferenceError(ClientError):
    """The inference server answered with an error (`status`), or with something that is not a completion
    (`status` None: a reply that fails validation, say a null logprob), or could not be reached (`transport`
    True). `retry_after`: the seconds a 429 or 503 asked to wait."""

    def __init__(
        self, message: str, status: int | None = None, *, transport: bool = False, retry_after: float | None = None
    ) -> None:
        self.status = status
        self.transport = transport
        self.retry_after = retry_after
        super().__init__(message)

    def __reduce__(self) -> Any:
        return (_inference_error, (str(self), self.status, self.transport, self.retry_after))

    @property
    def retryable(self) -> bool:
        """Connection errors, 429 and 5xx may pass on a retry; another 4xx or a malformed reply never will."""
        return self.transport or (self.status is not None and (self.status >= 500 or self.status == 429))


def _inference_error(message: str, status: int | None, transport: bool, retry_after: float | None) -> InferenceError:
    return InferenceError(message, status, transport=transport, retry_after=retry_after)


class TurnTimeout(ClientError, TimeoutError):
    """One generation request ran past the runner's `timeouts.turn`."""


class RolloutTimeout(ClientError, TimeoutError):
    """One rollout (its turns, tools and waits, pauses excluded) ran past the runner's `timeouts.rollout`."""


class GroupTimeout(ClientError, TimeoutError):
    """A whole group (its rollouts, scoring and resource release, pauses excluded) ran past the runner's
    `timeouts.group`."""


class EnvExited(ClientError):
    """Environment code raised a BaseException that is not an error (SystemExit from `exit()`, a stray
    KeyboardInterrupt, GeneratorExit): its group fails like any other; only a real signal stops a run."""


def exited(exc: BaseException) -> EnvExited:
    """A BaseException from environment code that is not an error (SystemExit, a stray KeyboardInterrupt) as
    the group's error: the group boundary holds it, only a real signal stops a run."""
    error = EnvExited(f"environment code raised {type(exc).__name__}({exc})")
    error.__cause__ = exc
    return error


class ResourceExhausted(ClientError):
    """Raised by an environment's `resource()` when its pool has nothing free now (a capped sandbox server
    answering "exhausted"): it means wait, not fail. The runner lets go of whatever the group holds, backs off
    (at least `retry_after` s when given) and tries again, up to the env's `acquire_timeout`."""

    def __init__(self, message: str = "resource pool exhausted", retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.retry_after), self.__dict__)


class ResourceTimeout(ClientError, TimeoutError):
    """A rollout's resources stayed exhausted past the environment's `acquire_timeout`: the group fails."""


OTHER_UNKNOWNS = ("no task lease", "no dataset", "no group")
"""How the server's 404s for what is not an env begin: a lease, a dataset or an open group it does not know (or
that is another key's) is no reason to register the env again."""


def registration_lost(exc: BaseException) -> bool:
    """The server no longer knows this env (the trainer reset the run, or a memory store restarted): a 404 on
    JSON routes, or a 422 naming `env_id` on the binary one; a 404 for a lease, a dataset or a group is not."""
    if not isinstance(exc, Rejected):
        return False
    detail = str(exc.detail)
    if "no environment with env_id" in detail:
        return True
    return exc.status == 404 and not any(unknown in detail for unknown in OTHER_UNKNOWNS)


class RunFailed(ClientError):
    """The one error a run ends with: `reason` says why, `__cause__` (and `error`) is the original error
    (an environment's own exception, an InferenceError, a Rejected...), `failed` the counts per env and
    reason at that moment."""

    def __init__(self, reason: str, error: BaseException | None, failed: dict[str, dict[str, int]]) -> None:
        self.reason = reason
        self.error = error
        self.failed = failed
        cause = f": {type(error).__name__}: {error}" if error is not None else ""
        super().__init__(f"{reason}{cause}")


FAILURE_REASONS = (
    "turn_timeout",
    "rollout_timeout",
    "group_timeout",
    "inference_error",
    "inference_unreachable",
    "worker_died",
    "resource_timeout",
    "env_error",
)
"""Why a group failed, as counted in `RunnerStats.failed[env][reason]`."""


def failure_reason(exc: BaseException) -> str:
    """The counter a failed group goes to: timeouts and inference errors by name, a worker that died, and
    anything else the environment's code raised (rollout, tools, score, resources) as `env_error`."""
    if isinstance(exc, TurnTimeout):
        return "turn_timeout"
    if isinstance(exc, RolloutTimeout):
        return "rollout_timeout"
    if isinstance(exc, GroupTimeout):
        return "group_timeout"
    if isinstance(exc, InferenceError):
        return "inference_unreachable" if exc.transport else "inference_error"
    if isinstance(exc, WorkerDied):
        return "worker_died"
    if isinstance(exc, ResourceTimeout):
        return "resource_timeout"
    if isinstance(exc, EpisodeFailed):
        return exc.reason
    return "env_error"
