"""The trainer's side of rollbuf: `TrainerClient(url).batches()` yields batches as numpy arrays.

Works against rollbuf (binary encoding, long-poll, exactly-once steps, rank shares) and, over plain
JSON polling, against an Atropos server. Imports numpy, httpx, msgpack and pydantic; never FastAPI, and
torch only when asked for tensors. See docs/trainer-client.md.
"""

from client_core.errors import TransportError
from trainer_client.aio import AsyncTrainerClient
from trainer_client.arrays import Batch, Packed, Padded, first_fit_decreasing
from trainer_client.client import TrainerClient
from trainer_client.errors import (
    BatchGone,
    ClientError,
    NoProgress,
    NotRegistered,
    Rejected,
    RetriesExhausted,
    ServerError,
    ServerUnreachable,
    TrainerClientError,
    Unavailable,
    is_retryable,
)

__all__ = [
    "AsyncTrainerClient",
    "Batch",
    "BatchGone",
    "ClientError",
    "NoProgress",
    "NotRegistered",
    "Packed",
    "Padded",
    "Rejected",
    "RetriesExhausted",
    "ServerError",
    "ServerUnreachable",
    "TrainerClient",
    "TrainerClientError",
    "TransportError",
    "Unavailable",
    "first_fit_decreasing",
    "is_retryable",
]
