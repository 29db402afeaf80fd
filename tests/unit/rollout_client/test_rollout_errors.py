"""rollout_client/errors.py: which server refusals mean the env must be registered again."""

from __future__ import annotations

import pytest

from client_core.errors import Rejected, Unavailable
from rollout_client.errors import registration_lost


@pytest.mark.parametrize(
    ("error", "lost"),
    [
        (Rejected(404, "no environment with env_id 3"), True),  # /status-env after a reset
        (Rejected(422, [{"loc": ["body", "env_id"], "msg": "no environment with env_id 3 is registered"}]), True),
        (Rejected(404, "Not Found"), True),  # a route of a server that restarted empty
        (Rejected(404, "no task lease 'task:d:0:1:2.00'"), False),  # a lease is not the env
        (Rejected(404, "no dataset 'd'"), False),
        (Rejected(404, "no group 'g' was opened"), False),
        (Rejected(409, "the lease lapsed"), False),
        (Unavailable(503, "queue full"), False),
        (ValueError("no environment with env_id 3"), False),
    ],
)
def test_only_an_unknown_env_means_registering_again(error: BaseException, lost: bool) -> None:
    assert registration_lost(error) is lost
