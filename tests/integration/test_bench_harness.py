"""The repository's own load harness (`bench/harness.py`) against a real server, as `python -m bench` and
`bench.ab` drive it through `bench/http.py`: every phase, every transport, the records' fields and counts.
Never timings: the workload is a few small groups, so it takes seconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import harness
from bench.http import GZIP_TRANSPORT, MSGPACK_TRANSPORT, run_harness, run_ingest
from bench.servers import Target
from tests.servers import running_server

pytestmark = pytest.mark.integration

SMALL = ["--pool", "2", "--group-size", "4", "--seq-min", "16", "--seq-max", "64"]
INGEST = [*SMALL, "--ingest-requests", "6", "--ingest-time-cap", "30"]
BATCH = [
    *SMALL,
    "--batch-sizes",
    "8,6",
    "--batch-group-size",
    "4",
    "--batch-seq-len",
    "32",
    "--batch-reps",
    "8:2",
    "--memory-groups",
    "4",
]


def test_every_phase_and_transport_against_a_server(tmp_path: Path) -> None:
    with running_server("memory://", tmp_path / "server.log") as server:
        target = Target("rollbuf[memory]", server.url, server.proc.pid)
        memory, *batches = run_harness(target, "memory,batch", BATCH)
        ingest = {t: run_ingest(target, [2], INGEST, transport=t) for t in ("json", GZIP_TRANSPORT, MSGPACK_TRANSPORT)}

    assert memory["phase"] == "memory" and memory["target"] == "rollbuf[memory]"
    assert memory["groups"] == 4 and memory["token_positions"] >= 4 * 4 * 16
    assert isinstance(memory["bytes_per_token_position"], float) and memory["rss_kb_full"] > 0

    full, skipped = batches  # B=6 is not a multiple of the group size 4
    assert skipped == {**skipped, "phase": "batch", "batch_size": 6} and "skipped" in skipped
    assert full["phase"] == "batch" and full["batch_size"] == 8 and "error" not in full
    assert full["fill"] == {**full["fill"], "groups": 3 * 8 // 4, "errors": 0}  # (reps + 1) batches queued
    assert full["first_call"]["nseqs"] == 8 and full["first_call"]["padded_shape"] == [8, 32]
    assert full["n"] == 2 and full["nseqs"] == [8] and full["bad_status"] == []
    assert full["latency"]["n"] == 2 and full["latency"]["p50_ms"] > 0 and full["wire_bytes"] > 0

    for transport, records in ingest.items():
        [r] = records
        assert r["phase"] == "ingest" and r["clients"] == 2 and r["transport"] == transport
        assert r["requests_ok"] == 6 and r["errors"] == 0 and r["http_codes"] == {"200": 6}
        assert r["response_status"] == {"received": 6}
        assert r["queue_after"]["queue_size"] == 6 + 2  # the measured posts and one warm-up post per client
        assert r["latency"]["n"] == 6 and r["latency"]["p99_ms"] >= r["latency"]["p50_ms"] > 0
        assert r["groups_per_s"] > 0 and r["tokens_per_s"] > 0 and r["server_cpu_ms_per_group"] is not None
    sizes = {t: records[0]["avg_req_bytes"] for t, records in ingest.items()}
    assert sizes[GZIP_TRANSPORT] < sizes["json"] and sizes[MSGPACK_TRANSPORT] < sizes["json"]


def test_only_loopback_targets() -> None:
    with pytest.raises(SystemExit, match="loopback"):
        harness.check_loopback("http://10.0.0.1:8000")
    harness.check_loopback("http://127.0.0.1:8000")
    harness.check_loopback("http://localhost:8000")


def test_unknown_flags_exit_with_usage() -> None:
    assert harness.config(["--ingest-requests", "480", "--batch-reps", "256:3,1024:2"]).batch_reps == {256: 3, 1024: 2}
    with pytest.raises(SystemExit):
        harness.config(["--scaling-queue", "100"])
