"""A transport plug-in for the shared harness (`buffer_bench.py --transport bench.harness_gzip:GzipJsonTransport`):
the same JSON, gzipped as Atropos's `BaseEnv` posts it (level 9, when that makes it smaller).

That is what Atropos rollout handlers really send, so the server's gunzip is on their path; the harness
measures plain JSON unless told otherwise.
"""

from __future__ import annotations

from buffer_bench import JsonTransport  # the harness, importable from its own directory


class GzipJsonTransport(JsonTransport):  # type: ignore[misc]
    name = "json-gzip"
    post_gzip = True
