"""client_core.errors: one tree for both clients, one retry predicate, one reading of an error reply."""

from __future__ import annotations

import httpx
import pytest

import rollout_client
import trainer_client
from client_core import errors as core
from client_core.errors import ClientError, Rejected, ServerError, Unavailable


def reply(status: int, **kw: object) -> httpx.Response:
    return httpx.Response(status, request=httpx.Request("POST", "http://x/scored_data"), **kw)  # type: ignore[arg-type]


def test_both_clients_raise_the_same_classes() -> None:
    """A program running both sides catches one ServerError, one Unavailable, one base."""
    for name in ("ServerError", "Unavailable", "Rejected", "RetriesExhausted", "TransportError", "ClientError"):
        assert getattr(trainer_client, name) is getattr(rollout_client, name), name
    assert trainer_client.TrainerClientError is rollout_client.RolloutClientError is ClientError
    assert issubclass(trainer_client.ServerUnreachable, core.RetriesExhausted)
    assert issubclass(trainer_client.BatchGone, Rejected)
    assert issubclass(rollout_client.RunFailed, ClientError)


@pytest.mark.parametrize(
    ("exc", "retry"),
    [
        (core.TransportError("reset"), True),
        (core.TransportError("ftp://", retryable=False), False),
        (httpx.ConnectError("refused"), True),
        (httpx.ReadTimeout("slow"), True),
        (httpx.UnsupportedProtocol("ftp://"), False),
        (httpx.LocalProtocolError("bad header"), False),
        (Unavailable(503, "queue full"), True),
        (Unavailable(429, "slow down"), True),
        (ServerError(500, "boom"), True),
        (ServerError(502, "bad gateway"), True),
        (Rejected(422, []), False),
        (Rejected(404, "no env"), False),
        (Rejected(410, "gone"), False),
        (core.RetriesExhausted("gave up"), False),
        (ValueError("not ours"), False),
    ],
)
def test_is_retryable(exc: BaseException, retry: bool) -> None:
    assert core.is_retryable(exc) is retry


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (429, Unavailable),
        (503, Unavailable),
        (500, ServerError),
        (502, ServerError),
        (504, ServerError),
        (400, Rejected),
        (401, Rejected),
        (404, Rejected),
        (409, Rejected),
        (413, Rejected),
        (422, Rejected),
    ],
)
def test_status_to_error(status: int, kind: type[ServerError]) -> None:
    """429 and 503 are "not now"; another 5xx is a plain (retried) ServerError; a 4xx is Rejected."""
    exc = core.error_for_status(status, {"detail": "x"}, None)
    assert type(exc) is kind and exc.status == status


def test_error_for_status_names_field_and_rule() -> None:
    body = {"detail": [{"loc": ["body", "scores", 2], "msg": "scores must be finite", "type": "value_error"}]}
    exc = core.error_for_status(422, body, None)
    assert isinstance(exc, Rejected)
    assert "body.scores.2: scores must be finite" in str(exc)
    busy = core.error_for_status(503, {"detail": "queue full", "code": "unavailable"}, "2")
    assert isinstance(busy, Unavailable) and busy.retry_after == 2.0 and busy.code == "unavailable"


def test_error_for_reads_an_httpx_reply_json_or_not() -> None:
    busy = core.error_for(reply(503, json={"detail": "queue full"}, headers={"Retry-After": "4"}))
    assert isinstance(busy, Unavailable) and busy.retry_after == 4.0 and busy.detail == "queue full"
    page = core.error_for(reply(502, text="<html>bad gateway</html>"))
    assert type(page) is ServerError and page.detail == "<html>bad gateway</html>" and page.retry_after is None


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(None, None), ("2", 2.0), ("0.5", 0.5), ("-3", 0.0), ("soon", None), ("Wed, 21 Oct 2015 07:28:00 GMT", None)],
)
def test_parse_retry_after(value: str | None, seconds: float | None) -> None:
    assert core.parse_retry_after(value) == seconds
