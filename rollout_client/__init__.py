"""The environment's side of rollbuf: `RolloutClient` to register and submit groups, `RolloutRunner` to run
environments concurrently (optionally in worker processes) as a well-behaved producer (docs/rollout-client.md)."""

from rollout_client.aio import acquire_all
from rollout_client.chat.session import AssistantTurn, ChatEnvironment, ChatSession, ChatTemplateError
from rollout_client.chat.tools import Tool, tool_schema
from rollout_client.client import RolloutClient, SyncRolloutClient, TrainerNotStarted
from rollout_client.env import Environment, Episode, EpisodeEnvironment, ExternalSequence, Gate, Session, Task
from rollout_client.errors import (
    ClientError,
    EpisodeFailed,
    EpisodeTruncated,
    InferenceError,
    PromptTooLong,
    Rejected,
    ResourceExhausted,
    ResourceTimeout,
    RetriesExhausted,
    RolloutClientError,
    RolloutTimeout,
    RunFailed,
    ServerError,
    TransportError,
    TurnTimeout,
    Unavailable,
    WorkerDied,
    WorkerFailed,
    is_retryable,
)
from rollout_client.group import GroupOutcome, Limits, build_group, run_group
from rollout_client.leases.datasets import register_dataset
from rollout_client.leases.tasks import LeasedTasks
from rollout_client.policy import (
    CharTokenizer,
    Completion,
    OpenAIPolicy,
    Policy,
    ScriptedPolicy,
    clip_max_tokens,
)
from rollout_client.runner.failures import FailurePolicy
from rollout_client.runner.handle import RunnerHandle, run_in_thread
from rollout_client.runner.runner import RolloutRunner
from rollout_client.runner.stats import RunnerHealth, RunnerStats
from rollout_client.runner.timeouts import Timeouts
from rollout_client.tasks import Curriculum, Tasks, TaskSource
from rollout_client.workers.recycling import RecyclePolicy

__all__ = [
    "AssistantTurn",
    "CharTokenizer",
    "ChatEnvironment",
    "ChatSession",
    "ChatTemplateError",
    "ClientError",
    "Completion",
    "Curriculum",
    "Environment",
    "Episode",
    "EpisodeEnvironment",
    "EpisodeFailed",
    "EpisodeTruncated",
    "ExternalSequence",
    "FailurePolicy",
    "Gate",
    "GroupOutcome",
    "InferenceError",
    "LeasedTasks",
    "Limits",
    "OpenAIPolicy",
    "Policy",
    "PromptTooLong",
    "RecyclePolicy",
    "Rejected",
    "ResourceExhausted",
    "ResourceTimeout",
    "RetriesExhausted",
    "RolloutClient",
    "RolloutClientError",
    "RolloutRunner",
    "RolloutTimeout",
    "RunFailed",
    "RunnerHandle",
    "RunnerHealth",
    "RunnerStats",
    "ScriptedPolicy",
    "ServerError",
    "Session",
    "SyncRolloutClient",
    "Task",
    "TaskSource",
    "Tasks",
    "Timeouts",
    "Tool",
    "TrainerNotStarted",
    "TransportError",
    "TurnTimeout",
    "Unavailable",
    "WorkerDied",
    "WorkerFailed",
    "acquire_all",
    "build_group",
    "clip_max_tokens",
    "is_retryable",
    "register_dataset",
    "run_group",
    "run_in_thread",
    "tool_schema",
]
