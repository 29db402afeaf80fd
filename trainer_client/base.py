"""What `TrainerClient` and `AsyncTrainerClient` are built from apart from their send paths, as httpx's
`BaseClient` is for `Client` and `AsyncClient`: one constructor (URL, timeout, auth, retry budget)."""

from __future__ import annotations

import logging
from typing import Generic, TypeVar

import httpx

from client_core.config import DEFAULT_TIMEOUT, RETRY_DEADLINE_S
from client_core.outage import Outage
from trainer_client.protocol import Endpoint

log = logging.getLogger("trainer_client")

H = TypeVar("H", httpx.Client, httpx.AsyncClient)


class BaseTrainerClient(Generic[H]):
    """The shared constructor; each client supplies its default http client (`_default_http`)."""

    def __init__(
        self,
        base_url: str | None = None,
        *,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        api_key: str | None = None,
        http_client: H | None = None,
        retry_deadline: float = RETRY_DEADLINE_S,
        tries: int | None = None,
    ) -> None:
        self.endpoint = Endpoint.make(
            base_url, str(http_client.base_url) if http_client else "", timeout, api_key, retry_deadline, tries
        )
        self.base_url, self.timeout = self.endpoint.base_url, self.endpoint.timeout
        self._own = http_client is None
        self._outage = Outage(f"rollbuf server {self.base_url}", log)
        """Logged while the server does not answer (the retries are silent), and when it answers again."""
        """The client's own http client is closed with it; one passed in is the caller's."""
        self._http: H = http_client or self._default_http()
        self._moves = 0
        """Weights announcements this client completed (POST /weights): the trainer moved without a batch, so a
        stall said in the reply to a /batch sent before the latest one is not counted (`protocol.Progress`)."""

    def _default_http(self) -> H:
        raise NotImplementedError
