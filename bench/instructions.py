"""Instructions per ingested group, counted by valgrind's callgrind: a figure that does not wander with the VM.

On the 2-vCPU VMs rollbuf is measured on, CPU time per group moves 10-20% between runs of the same code
(docs/benchmarks.md), more than most single changes to ingest are worth. Callgrind counts the instructions
executed instead, which are the same for the same work whatever else the machine does. This runs rollbuf's app
in process under callgrind twice, posting `--few` and then `--many` groups one after another through a bare
ASGI call (no sockets, no HTTP parsing: uvicorn's share is not counted), and reports the instructions of one
more group: (I(many) - I(few)) / (many - few), so start-up and imports cancel out.

    python -m bench.instructions [--store memory,sqlite] [--workload small,large,list16] [--base DIR]

The workloads are bench/limit.py's (msgpack groups of 8 x 64 and 8 x 2048 tokens, lists of 16 small ones).
With `--base DIR` the same runs go through another checkout too (`git worktree add /tmp/base <rev>`; the
child takes its workloads and registrations from that checkout's bench/limit.py), for a change's before
and after. One client, so a SQLite group commits alone; the count includes the writer thread,
the cyclic garbage collector and SQLite itself, not the kernel's side of system calls. Needs valgrind (Debian's
package); a run takes a minute or two per store and workload.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
COLLECTED = re.compile(rb"Collected : (\d+)")


async def _asgi(app: Any, method: str, path: str, body: bytes, content_type: str) -> tuple[int, bytes]:
    """One request through the app, as a server would call it: (status, body)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"content-type", content_type.encode()),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
    }
    sent = False
    status, out = 0, bytearray()

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            await asyncio.Event().wait()  # a disconnect never comes: the app answers first
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            out.extend(message.get("body", b""))

    await app(scope, receive, send)
    return status, bytes(out)


async def registered(app: Any, workload: str) -> list[bytes]:
    """A trainer registered and started and one env registered on `app`, through ASGI; 16 of `workload`'s
    groups for that env, to post again under fresh ids (`bench.limit._regroup`)."""
    import numpy as np

    from bench.limit import WORKLOADS, _group, env_registration, trainer_registration

    w = next(x for x in WORKLOADS if x.name == workload)
    register = trainer_registration(w.seq_len + 1)
    await _asgi(app, "POST", "/register", json.dumps(register).encode(), "application/json")
    await _asgi(app, "GET", "/batch", b"", "application/json")  # the trainer started: envs may register
    env = json.dumps(env_registration(w.seq_len + 1)).encode()
    status, reply = await _asgi(app, "POST", "/register-env", env, "application/json")
    if status != 200:
        raise SystemExit(f"POST /register-env: {status} {reply[:200]!r}")
    env_id = int(json.loads(reply)["env_id"])
    rng = np.random.default_rng(0)
    return [_group(rng, w.seq_len, env_id) for _ in range(16)]


async def _child(store: str, workload: str, n: int) -> None:
    """Post `n` groups of `workload` to an app on `store`, one after another (what callgrind counts)."""
    from api.app import create_app
    from api.config.settings import Settings
    from api.wire.records import MSGPACK, encode_submission_list
    from bench.limit import WORKLOADS, _regroup

    w = next(x for x in WORKLOADS if x.name == workload)
    app = create_app(Settings(store=store))
    async with app.router.lifespan_context(app):
        templates = await registered(app, workload)
        # What start-up made is left out of later collections: a full collection walks every object, and
        # whether one falls in the shorter or the longer run would otherwise move the difference by 100,000s.
        gc.collect()
        gc.freeze()
        for i in range(n // w.per_request):
            groups = [_regroup(templates[(i * w.per_request + j) % 16]) for j in range(w.per_request)]
            body, path = (
                (groups[0], "/scored_data")
                if w.per_request == 1
                else (encode_submission_list(groups), "/scored_data_list")
            )
            status, reply = await _asgi(app, "POST", path, body, MSGPACK)
            if status != 200:
                raise SystemExit(f"POST {path}: {status} {reply[:200]!r}")


def count(cwd: Path, store: str, workload: str, n: int) -> int:
    """Instructions callgrind counted for a child posting `n` groups, run from checkout `cwd`."""
    # This file runs the child (another checkout may not have it); `api` and `bench` come from `cwd` (`-P`: not
    # bench/, whose http.py would shadow the standard library's).
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        "-P",
        str(Path(__file__).resolve()),
        "--child",
        store,
        workload,
        str(n),
    ]
    env = {**os.environ, "PYTHONPATH": str(cwd), "PYTHONDONTWRITEBYTECODE": ""}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, timeout=1800)
    found = COLLECTED.search(proc.stderr)
    if proc.returncode != 0 or found is None:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-2000:].decode(errors='replace')}")
    return int(found.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default="memory,sqlite", help="stores, comma-separated: memory, sqlite")
    ap.add_argument("--workload", default="small,large,list16", help="bench/limit.py's workloads, comma-separated")
    ap.add_argument("--few", type=int, default=32, help="groups of the shorter run (start-up, warm-up)")
    ap.add_argument("--many", type=int, default=288, help="groups of the longer run")
    ap.add_argument("--base", type=Path, help="another checkout, counted the same way (the 'before' side)")
    ap.add_argument("--child", nargs=3, metavar=("STORE", "WORKLOAD", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        store, workload, n = args.child
        asyncio.run(_child(store, workload, int(n)))
        return
    checkouts = [("after", ROOT)] + ([("before", args.base.resolve())] if args.base else [])
    for _, cwd in checkouts:  # compiled once outside the count: a first run that compiles would count it
        env = {**os.environ, "PYTHONPATH": str(cwd), "PYTHONDONTWRITEBYTECODE": ""}
        subprocess.run(
            [sys.executable, "-P", str(Path(__file__).resolve()), "--child", "memory://", "small", "1"],
            cwd=cwd,
            env=env,
            check=True,
            timeout=600,
        )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for store_name in args.store.split(","):
            for workload in args.workload.split(","):
                for label, cwd in checkouts:
                    counts = []
                    for n in (args.few, args.many):
                        url = "memory://" if store_name == "memory" else f"sqlite:///{tmp}/{label}-{workload}-{n}/r.db"
                        counts.append(count(cwd, url, workload, n))
                    per_group = (counts[1] - counts[0]) / (args.many - args.few)
                    row = {
                        "bench": "instructions",
                        "store": store_name,
                        "workload": workload,
                        "checkout": label,
                        "instructions_per_group": round(per_group),
                    }
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    out = ROOT / "bench" / "results" / time.strftime("instructions-%Y%m%dT%H%M%S.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(f"JSON: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
