"""A transport plug-in for the shared harness (`buffer_bench.py --transport bench.harness_msgpack:MsgpackTransport`):
the same groups submitted in rollbuf's binary encoding, as `rollout_client` sends them when the server offers it.

Only submissions change; everything else (/batch included) stays the harness's JSON. Run the harness with
this checkout on PYTHONPATH (bench/http.py does).
"""

from __future__ import annotations

from typing import Any

from buffer_bench import JsonTransport  # the harness, importable from its own directory

from api.wire.records import MSGPACK, encode_submission, encode_submission_list


class MsgpackTransport(JsonTransport):  # type: ignore[misc]
    name = "msgpack"

    def encode_scored(self, group: dict[str, Any]) -> tuple[str, bytes, dict[str, str]]:
        return "/scored_data", _encode(group), {"Content-Type": MSGPACK}

    def encode_scored_list(self, groups: list[dict[str, Any]]) -> tuple[str, bytes, dict[str, str]]:
        return "/scored_data_list", encode_submission_list(_encode(g) for g in groups), {"Content-Type": MSGPACK}


def _encode(group: dict[str, Any]) -> bytes:
    fields = dict(group)
    return encode_submission(fields.pop("tokens"), fields.pop("masks"), fields.pop("scores"), **fields)
