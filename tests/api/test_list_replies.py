"""POST /scored_data_list says which groups were duplicates (`duplicate_at`, by index), so that a client that
sends its groups in lists (the rollout runner's coalescer) counts each as /scored_data would; and
`RolloutClient.submit_list` through the ASGI app, as JSON and as msgpack."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from api.wire.records import MSGPACK, encode_submission, encode_submission_list
from api.wire.schema import ScoredData
from rollout_client import Rejected, RolloutClient
from tests.api.test_ingest import queued, start
from tests.factories import group

pytestmark = pytest.mark.anyio


async def _post_list(client: httpx.AsyncClient, groups: list[dict[str, Any]], binary: bool) -> httpx.Response:
    if binary:
        body = encode_submission_list(encode_submission(**g) for g in groups)
        return await client.post("/scored_data_list", content=body, headers={"Content-Type": MSGPACK})
    return await client.post("/scored_data_list", json=groups)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
async def test_duplicate_at_names_the_duplicates_by_index(client: httpx.AsyncClient, binary: bool) -> None:
    await start(client)
    a, b, c, d, e = (group(4, env_id=0, seed=i, group_id=f"g{i}") for i in range(5))
    r = await _post_list(client, [a, b], binary)
    assert r.json() == {"status": "received", "groups_processed": 2}, "no duplicate: no extension field"
    r = await _post_list(client, [c, a, d, b], binary)
    assert r.json() == {"status": "received", "groups_processed": 4, "duplicates": 2, "duplicate_at": [1, 3]}
    r = await _post_list(client, [e, e], binary)  # the same group twice in one list: the second is the duplicate
    assert r.json()["duplicate_at"] == [1]
    assert await queued(client) == 5


@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
async def test_submit_list_fills_ids_once_and_reads_the_duplicates(client: httpx.AsyncClient, binary: bool) -> None:
    await start(client)
    rc = RolloutClient(http_client=client, prefer_binary=binary)
    await rc.info()
    assert rc.binary == binary
    rc.env_id = 0  # as register() sets it; the groups carry none
    sent = [ScoredData.model_validate(group(4, env_id=None, seed=i, group_id=f"t{i}")) for i in range(2)]
    sent.append(ScoredData.model_validate(group(4, env_id=None, seed=9)))  # no id: the client picks one
    first = await rc.submit_list(sent)
    assert (first.groups_processed, first.duplicate_at) == (3, None)
    again = await rc.submit_list(sent)  # the given ids are duplicates; the third gets a fresh id, stored again
    assert (again.duplicates, again.duplicate_at) == (2, [0, 1])
    assert await queued(client) == 4
    bad = sent[1].model_copy(update={"scores": [1.0]})
    with pytest.raises(Rejected) as refused:
        await rc.submit_list([sent[0], bad])
    assert refused.value.status == 422 and "1" in str(refused.value), "the refusal names the group's index"
    assert await queued(client) == 4
