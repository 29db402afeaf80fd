"""Server memory per request against what the body budget counts (`max_inflight_bytes` counts a
body's bytes as they arrive, then charges what decoding it costs: `api.http.body_cost`). One POST
/scored_data_list of about `--mb` MB (groups of 8 x 2048 tokens, JSON and msgpack) to a fresh `rollbuf
serve` (SQLite); the figure is the peak RSS growth (VmHWM less the RSS before) over the body's size and over
what the budget counts for it. Target: within about 1.3x of the count.

    python -m bench.body_rss [--root DIR] [--mb 64] [--digits 5]

Not a test: figures, not asserts.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import httpx
import orjson

from api.http.body_cost import decoded_cost
from api.wire.records import encode_submission, encode_submission_list
from bench.edges import ROOT, server, start_run


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def body(transport: str, mb: int, env_id: int, digits: int = 5) -> tuple[bytes, str]:
    groups = []
    size = 0
    i = 0
    while size < mb << 20:
        g = {
            "env_id": env_id,
            "tokens": [[(i + j) % 10**digits for j in range(2048)]] * 8,
            "masks": [[1] * 2048] * 8,
            "scores": [float(k % 2) for k in range(8)],
        }
        groups.append(g)
        size += 8 * 2048 * 8  # about what one group costs as JSON
        i += 1
    if transport == "json":
        return orjson.dumps(groups), "application/json"
    return encode_submission_list(encode_submission(**g) for g in groups), "application/msgpack"


def measure(root: Path, transport: str, mb: int, digits: int = 5) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        with server(root, "--store", f"sqlite:///{tmp}/rb.db", "--log-level", "warning") as (url, proc, _):
            with httpx.Client(base_url=url, timeout=600) as c:
                env_id = start_run(c, batch_size=8)
                raw, ctype = body(transport, mb, env_id, digits)
                warm = {"env_id": env_id, "tokens": [[1]] * 8, "masks": [[1]] * 8, "scores": [0.0] * 8}
                c.post("/scored_data", json=warm)  # the ingest path imported before the baseline
                before = _status_kb(proc.pid, "VmRSS")
                r = c.post("/scored_data_list", content=raw, headers={"content-type": ctype})
                peak = _status_kb(proc.pid, "VmHWM")
        grew = (peak - before) * 1024
        return (
            f"{transport}: {len(raw) / 1e6:.1f} MB body -> {r.status_code} {r.text[:40]}; "
            f"peak RSS +{grew / 1e6:.1f} MB = {grew / len(raw):.2f}x its bytes, "
            f"{grew / decoded_cost(raw, ctype):.2f}x what the budget counts"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--digits", type=int, default=5, help="token ids below 10**digits: 1 is JSON's densest")
    args = parser.parse_args()
    for transport in ("json", "msgpack"):
        print(measure(args.root.resolve(), transport, args.mb, args.digits), flush=True)


if __name__ == "__main__":
    main()
