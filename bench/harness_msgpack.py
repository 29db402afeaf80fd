"""A transport plug-in for the shared harness (`buffer_bench.py --transport bench.harness_msgpack:MsgpackTransport`),
used only by `--harness shared`: the same groups submitted in rollbuf's binary encoding, as `bench/harness.py`'s
`msgpack` transport sends them.

Only submissions change; everything else (/batch included) stays the harness's JSON. Run the harness with
this checkout on PYTHONPATH (bench/http.py does).
"""

from __future__ import annotations

from typing import Any

from buffer_bench import JsonTransport  # the shared harness, importable from its own directory

from api.wire.records import MSGPACK, encode_submission_list
from bench.harness import encode_msgpack


class MsgpackTransport(JsonTransport):  # type: ignore[misc]
    name = "msgpack"

    def encode_scored(self, group: dict[str, Any]) -> tuple[str, bytes, dict[str, str]]:
        return "/scored_data", encode_msgpack(group), {"Content-Type": MSGPACK}

    def encode_scored_list(self, groups: list[dict[str, Any]]) -> tuple[str, bytes, dict[str, str]]:
        return "/scored_data_list", encode_submission_list(encode_msgpack(g) for g in groups), {"Content-Type": MSGPACK}
