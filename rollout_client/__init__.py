"""The environment's side of rollbuf: `RolloutClient` to register and submit groups, `RolloutRunner` to run
environments concurrently (optionally in worker processes) as a well-behaved producer (docs/rollout-client.md)."""

from rollout_client.client import RolloutClient, SyncRolloutClient, TrainerNotStarted
from rollout_client.env import Environment, Episode, EpisodeEnvironment, Gate, Session, Task
from rollout_client.errors import (
    PromptTooLong,
    Rejected,
    RetriesExhausted,
    RolloutClientError,
    ServerError,
    TransportError,
    Unavailable,
    is_retryable,
)
from rollout_client.group import GroupOutcome, acquire_all, build_group, run_group
from rollout_client.policy import (
    CharTokenizer,
    Completion,
    InferenceError,
    OpenAIPolicy,
    Policy,
    ScriptedPolicy,
    clip_max_tokens,
)
from rollout_client.runner import RolloutRunner, RunnerStats
from rollout_client.tasks import Curriculum, Tasks, TaskSource
from rollout_client.workers import WorkerDied, WorkerFailed

__all__ = [
    "CharTokenizer",
    "Completion",
    "Curriculum",
    "Environment",
    "Episode",
    "EpisodeEnvironment",
    "Gate",
    "GroupOutcome",
    "InferenceError",
    "OpenAIPolicy",
    "Policy",
    "PromptTooLong",
    "Rejected",
    "RetriesExhausted",
    "RolloutClient",
    "RolloutClientError",
    "RolloutRunner",
    "RunnerStats",
    "ScriptedPolicy",
    "ServerError",
    "Session",
    "SyncRolloutClient",
    "Task",
    "TaskSource",
    "Tasks",
    "TrainerNotStarted",
    "TransportError",
    "Unavailable",
    "WorkerDied",
    "WorkerFailed",
    "acquire_all",
    "build_group",
    "clip_max_tokens",
    "is_retryable",
    "run_group",
]
