"""Ingest against the machine's limit: what a group costs the server next to reading its bytes.

One table in one run: a do-nothing FastAPI endpoint that reads the body (`bench/do_nothing.py`,
the framework's ceiling), the same that keeps every body (`bench/keeping_sink.py`: the floor
of a buffer that holds its groups in memory), rollbuf on the memory store, SQLite and PostgreSQL, and the
machine itself (sequential append + fsync per MiB on the disk the SQLite file lives on; a TCP transfer over
loopback). Workloads, all msgpack as `rollout_client` sends them, each group with a fresh `group_id` (so the
idempotency path runs, as it does for every group the rollout client submits):

- small: groups of 8 x 64 tokens (tokens, masks, float64 logprobs: 8.4 KB) to /scored_data,
- large: groups of 8 x 2048 tokens (262 KB) to /scored_data,
- list16: small groups in lists of 16 to /scored_data_list.

The client is a bare asyncio HTTP/1.1 keep-alive loop (8 connections) over 64 pre-encoded groups per workload,
each sent under a fresh group id, so it costs little beside the server on 2 cores. Each row also gives the cores
the server and the client used, and the share of the whole machine busy (`/proc/stat`): near 1, the run is
at the machine's CPU limit. Server CPU per group (user + system of the server process, from /proc,
around the measured requests) is the steady figure on a shared machine; groups/s and MB/s are given too, and
the server's minor page faults per group (memory touched afresh: what holding bytes costs on a VM).
With `--base DIR` (another checkout, e.g. `git worktree add /tmp/base <rev>`) each rollbuf side runs from
there as well, in turns with this checkout, fresh server each round, so before/after come from one run.

    python -m bench.limit [--rounds 2] [--base DIR] [--sides sink,keep,memory,sqlite,postgresql] [--seconds 4]
                          [--clients 8] [--workers 1] [--sqlite-query page_size=4096] [--pin]

`--pin` runs each server pinned to one CPU (the last this process may use, with `taskset`) and the client on
the others: the event loop and the store's writer thread then hand over to each other on one core. On a
2-vCPU VM, cross-core handoffs cost SQLite 8-17% of its CPU per group (docs/benchmarks.md).

`--workers 2 --clients 32` measures server processes sharing the store (`rollbuf serve --workers N`): the
clients' connections spread over the processes only when there are more of them than processes (8 keep-alive
connections opened at once tend to land on one).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from api.wire.records import MSGPACK, encode_submission, encode_submission_list
from bench import pg
from bench.http import children, cpu_seconds, minor_faults
from bench.servers import ROOT, Target, ceiling, keeping_sink, rollbuf, serve

CLIENTS = 8
WORKERS = 1
"""Server processes of each rollbuf side (`--workers`); the memory store keeps nothing across them, so it runs
only with one."""
PIN: tuple[int, set[int]] | None = None
"""(the servers' CPU, the client's CPUs) with `--pin`; None: the kernel places both."""
SQLITE_QUERY = ""
"""Query of the SQLite store's URL (`--sqlite-query page_size=4096`: the page size's write amplification)."""
LIST = 16
SIDES = ["sink", "keep", "memory", "sqlite", "postgresql"]


@dataclass(frozen=True)
class Workload:
    name: str
    seq_len: int
    per_request: int  # 1: /scored_data; more: /scored_data_list


WORKLOADS = [Workload("small", 64, 1), Workload("large", 2048, 1), Workload("list16", 64, LIST)]
TEMPLATES = 64
"""Distinct groups drawn per workload; each request takes one (or LIST) of them under a fresh group_id."""


def _group(rng: np.random.Generator, seq_len: int, env_id: int) -> bytes:
    tokens = rng.integers(0, 150_000, size=(8, seq_len), dtype=np.int32)
    masks = np.where(rng.random((8, seq_len)) < 0.3, -100, tokens).astype(np.int32)
    logprobs = -rng.random((8, seq_len))  # float64 that float32 does not hold: 8 bytes a token, as vLLM's JSON
    return encode_submission(
        tokens, masks, rng.random(8), env_id=env_id, group_id=uuid.uuid4().hex, inference_logprobs=logprobs
    )


class Requests:
    """HTTP requests (head + body) built as the clients ask for them: the workload's templates, each group
    under a fresh group_id. The arrays are drawn once (the client's CPU is not what is measured); the copy
    and the id cost the client a few microseconds, and no measurement ends for want of pre-built requests."""

    def __init__(self, w: Workload, env_id: int, port: int, rng: np.random.Generator) -> None:
        self.w, self.port, self.sent = w, port, 0
        self.base = [_group(rng, w.seq_len, env_id) for _ in range(TEMPLATES)]

    def next(self) -> tuple[bytes, int]:
        """The next request and its body's size."""
        i, per = self.sent, self.w.per_request
        self.sent += 1
        groups = [_regroup(self.base[(i * per + j) % TEMPLATES]) for j in range(per)]
        body, path = (groups[0], "/scored_data") if per == 1 else (encode_submission_list(groups), "/scored_data_list")
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\nContent-Type: {MSGPACK}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        return head + body, len(body)


def _regroup(record: bytes) -> bytes:
    """The same record under a fresh group id (32 hex digits, in place: msgpack keeps the length)."""
    at = record.index(b"group_id") + len(b"group_id") + 2  # a str8 header (0xd9, 32) follows the key
    return record[:at] + uuid.uuid4().hex.encode() + record[at + 32 :]


async def _load(
    port: int, reqs: Requests, seconds: float, limit: int | None = None
) -> tuple[int, int, int, list[float]]:
    """CLIENTS keep-alive connections posting `reqs` until `seconds` pass (or `limit` requests are sent):
    (requests answered 200, other answers, body bytes of the 200s, latencies)."""
    state = {"ok": 0, "bad": 0, "bytes": 0}
    stop = reqs.sent + limit if limit is not None else None
    lat: list[float] = []
    deadline = time.perf_counter() + seconds

    async def client() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while time.perf_counter() < deadline and (stop is None or reqs.sent < stop):
                raw, size = reqs.next()
                t0 = time.perf_counter()
                writer.write(raw)
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                await reader.readexactly(length)
                lat.append(time.perf_counter() - t0)
                if head.startswith(b"HTTP/1.1 200"):
                    state["ok"] += 1
                    state["bytes"] += size
                else:
                    state["bad"] += 1
        finally:
            writer.close()

    await asyncio.gather(*[client() for _ in range(CLIENTS)])
    return state["ok"], state["bad"], state["bytes"], lat


def trainer_registration(max_len: int) -> dict[str, Any]:
    """The bench's trainer: a batch it never fills, so every group posted stays queued."""
    return {
        "wandb_group": "bench",
        "wandb_project": "bench",
        "batch_size": 10**9,
        "max_token_len": max_len,
        "checkpoint_dir": "x",
        "save_checkpoint_interval": 1000,
        "starting_step": 0,
        "num_steps": 10_000,
    }


def env_registration(max_len: int) -> dict[str, Any]:
    """The bench's one env, of groups of 8."""
    return {"max_token_length": max_len, "desired_name": "limit", "weight": 1.0, "group_size": 8}


def _setup(url: str, max_len: int) -> int:
    """A trainer registered (and its first /batch asked), one env of groups of 8: its env_id."""
    with httpx.Client(base_url=url, timeout=30) as c:
        c.post("/register", json=trainer_registration(max_len))
        c.get("/batch")
        r = c.post("/register-env", json=env_registration(max_len))
        return int(r.json().get("env_id", 0))


def measure(target: Target, w: Workload, seconds: float, db_dir: Path | None) -> dict[str, Any]:
    port = int(target.url.rsplit(":", 1)[1])
    env_id = _setup(target.url, w.seq_len + 1)
    reqs = Requests(w, env_id, port, np.random.default_rng(0))
    asyncio.run(_load(port, reqs, 60, limit=CLIENTS * 4))  # warm-up: connections, caches, the run state
    io0 = _written(target.pid)
    busy0, own0 = _machine_busy(), time.process_time()
    faults0, cpu0, t0 = minor_faults(target.pid), cpu_seconds(target.pid), time.perf_counter()
    ok, bad, size, lat = asyncio.run(_load(port, reqs, seconds))
    wall, cpu = time.perf_counter() - t0, cpu_seconds(target.pid) - cpu0
    faults = minor_faults(target.pid) - faults0
    client = time.process_time() - own0
    busy = [b - a for a, b in zip(busy0, _machine_busy(), strict=True)]
    groups = ok * w.per_request
    written = _written(target.pid) - io0
    return {
        "workload": w.name,
        "groups": groups,
        "errors": bad,
        "groups_per_s": round(groups / wall, 1),
        "MB_per_s": round(size / wall / 1e6, 1),
        "server_cpu_ms_per_group": round(cpu * 1e3 / groups, 4) if groups else None,
        "server_cpu_ms_per_MB": round(cpu * 1e3 / (size / 1e6), 2) if size else None,
        "page_faults_per_group": round(faults / groups, 1) if groups else None,
        "p50_ms": round(statistics.median(lat) * 1e3, 2) if lat else None,
        "server_cores": round(cpu / wall, 2),
        "client_cores": round(client / wall, 2),
        "machine_busy": round(busy[0] / busy[1], 3) if busy[1] else None,
        "write_amplification": round(written / size, 2) if size and db_dir is not None and written else None,
    }


def _machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot (`/proc/stat`): the share of the machine in use, whoever
    uses it. Near 1 means the run is at the machine's CPU limit, client and neighbours included."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _written(pid: int) -> int:
    """Bytes the process and its live children (`--workers`), their threads included, caused to be written to
    storage."""
    total = 0
    for each in (pid, *(child for child, _ in children(pid))):
        try:
            text = Path(f"/proc/{each}/io").read_text()
        except OSError:  # ended while we looked
            continue
        total += next(int(line.split()[1]) for line in text.splitlines() if line.startswith("write_bytes"))
    return total


def disk(directory: Path, total: int = 256 << 20, chunk: int = 262_144) -> dict[str, Any]:
    """Sequential appends of `chunk` bytes with an fsync every MiB: the disk's durable bandwidth."""
    buf = os.urandom(chunk)
    path = directory / "disk.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    t0, since = time.perf_counter(), 0
    try:
        for _ in range(total // chunk):
            os.write(fd, buf)
            since += chunk
            if since >= 1 << 20:
                os.fsync(fd)
                since = 0
        os.fsync(fd)
    finally:
        os.close(fd)
        path.unlink()
    return {
        "side": "disk",
        "workload": "append+fsync/MiB",
        "MB_per_s": round(total / (time.perf_counter() - t0) / 1e6, 1),
    }


def loopback(total: int = 512 << 20, chunk: int = 1 << 20) -> dict[str, Any]:
    """One TCP stream over 127.0.0.1, sender and receiver in two threads: the wire's ceiling."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def sink() -> None:
        conn, _ = srv.accept()
        buf = bytearray(chunk)
        got = 0
        while got < total and (n := conn.recv_into(buf)):
            got += n
        conn.close()

    th = threading.Thread(target=sink)
    th.start()
    data = bytes(chunk)
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as s:
        for _ in range(total // chunk):
            s.sendall(data)
        th.join()
    srv.close()
    return {"side": "loopback", "workload": "TCP", "MB_per_s": round(total / (time.perf_counter() - t0) / 1e6, 1)}


def pinning(cpus: set[int]) -> tuple[int, set[int]]:
    """`--pin`: the servers' CPU (the highest of `cpus`) and the client's (the others)."""
    if len(cpus) < 2:
        raise SystemExit("--pin needs two CPUs: one for the server, the others for the client")
    if shutil.which("taskset") is None:
        raise SystemExit("--pin runs the servers under taskset (util-linux), which is not on PATH")
    server = max(cpus)
    return server, cpus - {server}


def _pinned(cmd: list[str]) -> list[str]:
    return cmd if PIN is None else ["taskset", "-c", str(PIN[0]), *cmd]


@contextlib.contextmanager
def _server(side: str, tmp: Path, cwd: Path, dbs: contextlib.ExitStack) -> Iterator[Target]:
    log = tmp / f"{side}.log"
    if side in ("sink", "keep"):
        name, cmd, port = ceiling(log) if side == "sink" else keeping_sink()
        with serve(name, _pinned(cmd), port, log, ready_path="/ping") as t:
            yield t
        return
    files = tmp / f"{side}-{time.monotonic_ns()}"
    store = {"memory": "memory://", "sqlite": f"sqlite:///{files}/rollbuf.db{SQLITE_QUERY}"}.get(side)
    if side == "postgresql":
        store = dbs.enter_context(pg.database())
    assert store is not None
    name, cmd, port = rollbuf(store, log, workers=WORKERS)
    try:
        with serve(name, _pinned(cmd), port, log, cwd=cwd) as t:
            yield t
    finally:  # the next measurement starts without this one's files in the page cache
        shutil.rmtree(files, ignore_errors=True)


def run(sides: list[str], rounds: int, seconds: float, base: Path | None) -> list[dict[str, Any]]:
    if "postgresql" in sides and not pg.available():
        sides = [s for s in sides if s != "postgresql"]
    if WORKERS > 1:
        sides = [s for s in sides if s != "memory"]
    checkouts = [("after", ROOT)] + ([("before", base)] if base else [])
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for rnd in range(rounds):
            out.append({"round": rnd, **disk(tmp)})
            out.append({"round": rnd, **loopback()})
            order = checkouts if rnd % 2 == 0 else checkouts[::-1]
            for side in sides:
                for label, cwd in order if side not in ("sink", "keep") else order[:1]:
                    for w in WORKLOADS:  # a fresh server per workload: no queue depth carried over
                        with contextlib.ExitStack() as dbs, _server(side, tmp, cwd, dbs) as target:
                            row = measure(target, w, seconds, tmp if side == "sqlite" else None)
                        label = label if side not in ("sink", "keep") else "-"
                        row = {"bench": "limit", "round": rnd, "side": side, "checkout": label, **row}
                        print(json.dumps(row), flush=True)
                        out.append(row)
    return out


def summary(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians over rounds per (side, checkout, workload), with the ratio of server CPU per group to the sink's."""
    rows = [r for r in results if r.get("bench") == "limit"]
    keys = list(dict.fromkeys((r["side"], r["checkout"], r["workload"]) for r in rows))
    out = []
    sink: dict[str, float] = {}
    for side, checkout, wl in keys:
        got = [r for r in rows if (r["side"], r["checkout"], r["workload"]) == (side, checkout, wl)]

        def med(field: str, got: list[dict[str, Any]] = got) -> float | None:
            vals = [r[field] for r in got if r.get(field) is not None]
            return round(statistics.median(vals), 4) if vals else None

        row = {"side": side, "checkout": checkout, "workload": wl, "rounds": len(got)}
        for field in (
            "groups_per_s",
            "MB_per_s",
            "server_cpu_ms_per_group",
            "server_cpu_ms_per_MB",
            "p50_ms",
            "server_cores",
            "client_cores",
            "machine_busy",
            "write_amplification",
            "page_faults_per_group",
        ):
            row[field] = med(field)
        if side == "sink" and row["server_cpu_ms_per_group"]:
            sink[wl] = row["server_cpu_ms_per_group"]
        out.append(row)
    for row in out:
        cpu = row["server_cpu_ms_per_group"]
        row["cpu_x_sink"] = round(cpu / sink[row["workload"]], 2) if cpu and row["workload"] in sink else None
    for kind in ("disk", "loopback"):
        vals = [r["MB_per_s"] for r in results if r.get("side") == kind and "bench" not in r]
        if vals:
            out.append({"side": kind, "checkout": "-", "workload": "bytes", "MB_per_s": statistics.median(vals)})
    return out


def report(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'side':11} {'checkout':8} {'workload':8} {'groups/s':>9} {'MB/s':>7} {'CPU ms/group':>12} "
        f"{'x sink':>6} {'CPU ms/MB':>9} {'p50 ms':>7} {'server':>6} {'client':>6} {'busy':>5} "
        f"{'write amp':>9} {'faults':>6}"
    ]
    for r in rows:
        cells = [
            r.get(f)
            for f in (
                "groups_per_s",
                "MB_per_s",
                "server_cpu_ms_per_group",
                "cpu_x_sink",
                "server_cpu_ms_per_MB",
                "p50_ms",
                "server_cores",
                "client_cores",
                "machine_busy",
                "write_amplification",
                "page_faults_per_group",
            )
        ]
        g, mb, cpu, x, permb, p50, sc, cc, busy, wa, pf = ("-" if c is None else c for c in cells)
        lines.append(
            f"{r['side']:11} {r['checkout']:8} {r['workload']:8} {g:>9} {mb:>7} {cpu:>12} {x:>6} "
            f"{permb:>9} {p50:>7} {sc:>6} {cc:>6} {busy:>5} {wa:>9} {pf:>6}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=4.0, help="time cap of one measurement")
    ap.add_argument("--base", type=Path, help="another checkout, run in turns with this one (the 'before' side)")
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--clients", type=int, default=8, help="keep-alive connections posting (1: one client)")
    ap.add_argument("--workers", type=int, default=1, help="server processes per rollbuf side (not memory)")
    ap.add_argument("--sqlite-query", default="", help="query of the SQLite URL, e.g. page_size=4096 (new files)")
    ap.add_argument("--pin", action="store_true", help="each server on one CPU (taskset), the client on the others")
    args = ap.parse_args()
    global CLIENTS, SQLITE_QUERY, WORKERS, PIN
    CLIENTS, SQLITE_QUERY = args.clients, f"?{args.sqlite_query}" if args.sqlite_query else ""
    WORKERS = args.workers
    if args.pin:
        PIN = pinning(os.sched_getaffinity(0))
        os.sched_setaffinity(0, PIN[1])  # this process: the client (and the disk and loopback rows)
    results = run(args.sides.split(","), args.rounds, args.seconds, args.base.resolve() if args.base else None)
    rows = summary(results)
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(exist_ok=True)
    out = out_dir / time.strftime("limit-%Y%m%dT%H%M%S.json")
    out.write_text(json.dumps({"results": results, "summary": rows}, indent=1))
    print(report(rows))
    print(f"\nJSON: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
