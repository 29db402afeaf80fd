"""`/batch` end to end: from sending the request to numpy arrays in the trainer's hands.

Batches of 256 and 1024 sequences of 2048 tokens (masks and logprobs included) are fetched the way
`trainer_client` fetches them (`protocol.parse_batch_reply`: JSON -> `from_json`, msgpack ->
`from_records`, over the client's `StdlibTransport`), from rollbuf (memory store) as msgpack and as
JSON, and from the Atropos server as JSON. Every fetch forms a fresh batch. The physical reference is
a trivial server process sending the same number of bytes over loopback, viewed as int32/float32
arrays on arrival: received with a raw socket into one buffer (the floor), and as an HTTP reply through
the same client. Each binary fetch is followed by one of each, and ratios are taken per pair (the
machine is shared and noisy).

    python -m bench.transport [--sizes 256,1024] [--skip-atropos] [--skip-json] [--store sqlite]
    python -m bench.transport --compare-stores --sizes 1024     # memory vs SQLite, paired
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson

from api.ingest.binary_groups import check_record
from api.ingest.json_groups import read_groups
from api.ingest.validation import GroupLimits, pack_group
from api.wire.records import MSGPACK, encode, encode_submission
from bench import pg
from bench.servers import ATROPOS_VENV, atropos, rollbuf, save_rows, serve
from trainer_client.arrays import Batch
from trainer_client.protocol import parse_batch_reply
from trainer_client.transport import StdlibTransport

SEQ_LEN = 2048
GROUP_SIZE = 8
POOL = 16
"""Distinct groups generated; the fill cycles through them (content does not matter to the transport)."""
REPS = {256: 7, 1024: 7}
ATROPOS_REPS = {256: 2, 1024: 2}
"""Atropos takes ~5 s and ~19 s per batch of these sizes; two fetches bound the run."""
POST_GROUPS = 8
"""Groups per /scored_data_list request while filling."""
TIMEOUT = httpx.Timeout(300.0, connect=10.0)


def make_pool(rng: np.random.Generator) -> list[dict[str, Any]]:
    """Groups as an Atropos handler sends them: prompt masked with -100, float logprobs on the completion."""
    pool = []
    for _ in range(POOL):
        tokens = rng.integers(0, 150_000, (GROUP_SIZE, SEQ_LEN))
        masks = tokens.copy()
        masks[:, : SEQ_LEN // 4] = -100
        lps = np.zeros((GROUP_SIZE, SEQ_LEN), np.float32)
        lps[:, SEQ_LEN // 4 :] = -rng.exponential(0.5, (GROUP_SIZE, SEQ_LEN - SEQ_LEN // 4))
        pool.append(
            {
                "tokens": tokens.tolist(),
                "masks": masks.tolist(),
                "scores": rng.integers(0, 2, GROUP_SIZE).astype(float).tolist(),
                "inference_logprobs": lps.astype(np.float64).tolist(),
            }
        )
    return pool


def start_run(c: httpx.Client, batch_size: int, pool: list[dict[str, Any]], batches: int) -> None:
    """Reset, register, start the run, register one env, queue `batches` batches' worth of groups."""
    c.get("/reset_data")
    reg = {
        "wandb_group": "bench",
        "wandb_project": "bench",
        "batch_size": batch_size,
        "max_token_len": SEQ_LEN,
        "checkpoint_dir": "c",
        "save_checkpoint_interval": 0,
        "starting_step": 0,
        "num_steps": 10**6,
    }
    c.post("/register", json=reg).raise_for_status()
    c.get("/batch")  # Atropos gates /register-env on the trainer's first poll
    env = {"max_token_length": SEQ_LEN, "desired_name": "bench", "weight": 1.0, "group_size": GROUP_SIZE}
    env_id = c.post("/register-env", json=env).json()["env_id"]
    n_groups = batches * batch_size // GROUP_SIZE
    for start in range(0, n_groups, POST_GROUPS):
        body = [{**pool[(start + i) % POOL], "env_id": env_id} for i in range(min(POST_GROUPS, n_groups - start))]
        c.post("/scored_data_list", json=body).raise_for_status()


def fetch(c: httpx.Client, *, step: int | None, binary: bool, pad: bool = False) -> tuple[float, int, Batch, int]:
    """One batch, timed from the request to the arrays (the trainer_client path); with `pad`, to the padded
    `[n, L]` arrays a training step takes. Also returns the bytes of those output arrays."""
    params = {} if step is None else {"step": step}
    headers = {"Accept": MSGPACK if binary else "application/json"}
    t0 = time.perf_counter()
    reply = c.get("/batch", params=params, headers=headers)
    batch = parse_batch_reply(reply, step)
    if pad and isinstance(batch, Batch):
        p = batch.padded()
        out_bytes = sum(a.nbytes for a in (p.tokens, p.masks, p.attention_mask, p.advantages, *p.floats.values()))
    seconds = time.perf_counter() - t0
    if not isinstance(batch, Batch):
        raise RuntimeError(f"no batch from {c.base_url}: {reply.text[:200]}")
    return seconds, len(reply.content), batch, out_bytes if pad else 0


def measure(
    url: str, size: int, pool: list[dict[str, Any]], *, modes: list[str], reps: int, raw: RawReference | None = None
) -> list[dict[str, Any]]:
    """Median seconds per mode. With `raw`, each binary fetch is followed by raw transfers of the same
    bytes, so ratios compare them under the same load of a shared machine."""
    out = []
    with httpx.Client(base_url=url, timeout=TIMEOUT, transport=StdlibTransport()) as c:  # as TrainerClient sends
        start_run(c, size, pool, reps * len(modes))
        step = 0
        for mode in modes:
            times: list[float] = []
            refs: dict[str, list[float]] = {"raw-loopback": [], "raw-http": [], "raw-loopback+copy": []}
            wire = out_bytes = 0
            for _ in range(reps):
                seconds, wire, batch, out_bytes = fetch(
                    c,
                    step=step if mode != "atropos-json" else None,
                    binary=mode.startswith("msgpack"),
                    pad=mode == "msgpack-padded",
                )
                assert batch.n_seqs == size and batch.n_tokens == size * SEQ_LEN, (batch.n_seqs, batch.n_tokens)
                times.append(seconds)
                if raw is not None and mode == "msgpack":
                    refs["raw-loopback"].append(raw.fetch(wire))
                    refs["raw-http"].append(raw.fetch_http(c, wire))
                if raw is not None and mode == "msgpack-padded":
                    refs["raw-loopback+copy"].append(raw.fetch(wire) + copy_seconds(out_bytes))
                step += 1
            out.append(
                {
                    "bench": "transport",
                    "mode": mode,
                    "sequences": size,
                    "seq_len": SEQ_LEN,
                    "median_s": statistics.median(times),
                    "times_s": times,
                    "wire_bytes": wire,
                    "out_bytes": out_bytes,
                }
            )
            for ref, ref_times in refs.items():
                if ref_times:
                    ratios = [t / r for t, r in zip(times, ref_times, strict=True)]
                    out.append(
                        {
                            "bench": "transport",
                            "mode": ref,
                            "sequences": size,
                            "wire_bytes": wire,
                            "median_s": statistics.median(ref_times),
                            "times_s": ref_times,
                            "paired_ratio_median": statistics.median(ratios),
                        }
                    )
    return out


# ------------------------------------------------------------------------------------- raw reference

RAW_MAX = 64 << 20
"""Largest raw transfer the reference server sends (a 1024 x 2048 batch is ~25 MB)."""


def _raw_server(sock: socket.socket) -> None:
    """Per connection: read `GET /N`, answer with N bytes from one preallocated buffer."""
    payload = memoryview(np.random.default_rng(0).integers(0, 255, RAW_MAX, dtype=np.uint8).tobytes())
    while True:
        conn, _ = sock.accept()
        with conn:
            n = int(conn.recv(4096).split(b" ")[1][1:])
            conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {n}\r\n\r\n".encode())
            conn.sendall(payload[:n])


class RawReference:
    """A separate process sending raw bytes over loopback: the physical floor for moving a batch."""

    def __enter__(self) -> RawReference:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen()
        self.port = self._sock.getsockname()[1]
        self._proc = multiprocessing.get_context("fork").Process(target=_raw_server, args=(self._sock,), daemon=True)
        self._proc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._proc.terminate()  # our own child, by its pid
        self._proc.join(timeout=10)
        self._sock.close()

    def fetch(self, nbytes: int) -> float:
        """Seconds from connecting to int32/float32 views over the received bytes."""
        t0 = time.perf_counter()
        buf = bytearray(nbytes + 4096)
        view = memoryview(buf)
        with socket.create_connection(("127.0.0.1", self.port)) as conn:
            conn.sendall(f"GET /{nbytes} HTTP/1.1\r\n\r\n".encode())
            got = 0
            while b"\r\n\r\n" not in buf[: min(got, 256)]:
                got += conn.recv_into(view[got:])
            body_at = bytes(buf[:256]).index(b"\r\n\r\n") + 4
            while got < body_at + nbytes:
                got += conn.recv_into(view[got:])
        _views(buf, body_at, nbytes)
        return time.perf_counter() - t0

    def fetch_http(self, client: httpx.Client, nbytes: int) -> float:
        """The same bytes through the trainer's HTTP client: the HTTP floor for this client."""
        t0 = time.perf_counter()
        body = client.get(f"http://127.0.0.1:{self.port}/{nbytes}").content
        _views(body, 0, nbytes)
        return time.perf_counter() - t0


def copy_seconds(nbytes: int) -> float:
    """One copy of `nbytes` into freshly allocated memory (as building the output arrays needs at least)."""
    src = np.ones(nbytes, np.uint8)
    t0 = time.perf_counter()
    dst = np.empty_like(src)
    np.copyto(dst, src)
    return time.perf_counter() - t0


def _views(buf: bytes | bytearray, at: int, nbytes: int) -> None:
    """int32 tokens and masks, float32 logprobs over the received bytes, as the trainer would use them."""
    third = nbytes // 3 // 4
    arrays = [np.frombuffer(buf, dt, third, at + k * third * 4) for k, dt in enumerate(["<i4", "<i4", "<f4"])]
    assert all(a.size == third for a in arrays)


# ------------------------------------------------------------------------------------- ingest


def ingest(group: dict[str, Any], reps: int = 20) -> list[dict[str, Any]]:
    """Server-side cost of validating and storing-ready one group (in-process, no HTTP): JSON parse +
    pack, binary re-encode (no policy_step), binary canonical (stored as sent)."""
    limits = GroupLimits(max_token_len=SEQ_LEN, max_group_seqs=GROUP_SIZE)
    json_body = orjson.dumps(group)
    loose = encode_submission(**group)
    canonical = encode_submission(**group, policy_step=0)

    def json_path() -> None:
        [g] = read_groups(json_body, many=False)
        encode(pack_group(g.data, env_id=None, current_step=0, limits=limits, columns=g.columns))

    def binary_path(raw: bytes) -> Callable[[], None]:
        return lambda: check_record(raw, env_ids=(), current_step=0, limits=limits)

    assert check_record(canonical, env_ids=(), current_step=0, limits=limits).passthrough
    out = []
    for mode, fn in [
        ("json", json_path),
        ("msgpack-reencoded", binary_path(loose)),
        ("msgpack-canonical", binary_path(canonical)),
    ]:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out.append(
            {
                "bench": "transport-ingest",
                "mode": mode,
                "tokens": GROUP_SIZE * SEQ_LEN,
                "median_ms": statistics.median(times) * 1e3,
            }
        )
    return out


# ------------------------------------------------------------------------------------- stores


def compare_stores(size: int, reps: int = 7, say: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Binary `/batch` from a memory-store server and a SQLite server (the default store), fetched in turns
    (memory first on even reps, SQLite first on odd ones) so both see the same load: a paired ratio."""
    pool = make_pool(np.random.default_rng(0))
    with tempfile.TemporaryDirectory() as tmp:
        mem, sql = rollbuf("memory://", Path(tmp) / "m.log"), rollbuf(f"sqlite:///{tmp}/s.db", Path(tmp) / "s.log")
        with (
            serve(*mem, Path(tmp) / "m.log") as m,
            serve(*sql, Path(tmp) / "s.log") as q,
            httpx.Client(base_url=m.url, timeout=TIMEOUT, transport=StdlibTransport()) as cm,
            httpx.Client(base_url=q.url, timeout=TIMEOUT, transport=StdlibTransport()) as cq,
        ):
            say(f"memory vs SQLite, binary /batch {size} x {SEQ_LEN}, {reps} fetches each in turns ...")
            start_run(cm, size, pool, reps)
            start_run(cq, size, pool, reps)
            times: dict[str, list[float]] = {"memory": [], "sqlite": []}
            for step in range(reps):
                order = [("memory", cm), ("sqlite", cq)] if step % 2 == 0 else [("sqlite", cq), ("memory", cm)]
                for name, client in order:
                    times[name].append(fetch(client, step=step, binary=True)[0])
    ratios = [s / m for s, m in zip(times["sqlite"], times["memory"], strict=True)]
    return [
        {
            "bench": "transport-stores",
            "sequences": size,
            "seq_len": SEQ_LEN,
            "memory_s": statistics.median(times["memory"]),
            "sqlite_s": statistics.median(times["sqlite"]),
            "times_s": times,
            "paired_ratio_median": statistics.median(ratios),
        }
    ]


# ------------------------------------------------------------------------------------- driver


def run(
    sizes: list[int],
    *,
    with_atropos: bool = True,
    with_json: bool = True,
    store: str = "memory",
    with_ingest: bool = True,
    say: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    pool = make_pool(np.random.default_rng(0))
    results: list[dict[str, Any]] = ingest(pool[0]) if with_ingest else []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        if store == "postgresql":
            if not pg.available():
                return results
            url = stack.enter_context(pg.database())
        else:
            url = "memory://" if store == "memory" else f"sqlite:///{tmp}/transport.db"
        name, cmd, port = rollbuf(url, Path(tmp) / "r.log")
        with serve(name, cmd, port, Path(tmp) / "r.log") as target, RawReference() as raw:
            for size in sizes:
                say(f"rollbuf[{store}] {size} x {SEQ_LEN}: msgpack (each paired with a raw transfer), padded, JSON ...")
                modes = ["msgpack", "msgpack-padded", "json"] if with_json else ["msgpack", "msgpack-padded"]
                rows = measure(target.url, size, pool, modes=modes, reps=REPS.get(size, 3), raw=raw)
                results += [{"server": f"rollbuf[{store}]", **r} for r in rows]
        side = atropos(Path(tmp) / "a.log") if with_atropos else None
        if with_atropos and side is None:
            say(f"Atropos not installed in {ATROPOS_VENV}: skipped")
        if side is not None:
            with serve(*side, Path(tmp) / "a.log") as target:
                for size in sizes:
                    say(f"atropos {size} x {SEQ_LEN}: JSON ...")
                    rows = measure(target.url, size, pool, modes=["atropos-json"], reps=ATROPOS_REPS.get(size, 2))
                    results += [{"server": "atropos", **r} for r in rows]
    return results


def report(results: list[dict[str, Any]]) -> str:
    lines = [
        f"binary /batch {r['sequences']} x {SEQ_LEN}, fetched in turns: memory {r['memory_s'] * 1e3:.1f} ms, "
        f"SQLite {r['sqlite_s'] * 1e3:.1f} ms; SQLite / memory = {r['paired_ratio_median']:.2f}x, median of "
        "paired fetches (target <= 1.5x)"
        for r in results
        if r.get("bench") == "transport-stores"
    ]
    ingest_rows = [r for r in results if r.get("bench") == "transport-ingest"]
    if ingest_rows:
        cells = " | ".join(f"{r['mode']} {r['median_ms']:.3f}" for r in ingest_rows)
        lines.append(f"ingest, one group of {GROUP_SIZE} x {SEQ_LEN} checked into storable bytes (median ms): {cells}")
    results = [r for r in results if r.get("bench") == "transport"]
    if not results:
        return "\n".join(lines)
    lines.append(f"/batch end to end, request -> numpy arrays (median ms; sequences of {SEQ_LEN} tokens):")
    labels = {
        "msgpack": "rollbuf msgpack",
        "msgpack-padded": "msgpack to padded",
        "json": "rollbuf JSON",
        "atropos-json": "Atropos JSON",
        "raw-loopback": "raw socket",
        "raw-http": "raw over HTTP",
        "raw-loopback+copy": "raw socket + one copy of the padded bytes",
    }
    for server, size in sorted({(r.get("server", ""), r["sequences"]) for r in results}):
        rows = {r["mode"]: r for r in results if r["sequences"] == size and r.get("server", "") in (server, "atropos")}
        if server == "atropos":
            continue
        lines.append(f"  {server}:")
        cells = [f"{label} {rows[m]['median_s'] * 1e3:.1f}" for m, label in labels.items() if m in rows]
        wire = {m: f"{rows[m]['wire_bytes'] / 1e6:.1f} MB" for m in ("msgpack", "json", "atropos-json") if m in rows}
        lines.append(f"  {size:5} x {SEQ_LEN}: " + " | ".join(cells) + f"   (decoded body: {wire})")
        b = rows.get("msgpack")
        if b and "atropos-json" in rows:
            ratio = rows["atropos-json"]["median_s"] / b["median_s"]
            lines.append(f"         Atropos JSON / rollbuf msgpack = {ratio:.1f}x (target >= 30x)")
        for ref in ("raw-loopback", "raw-http"):
            if b and ref in rows:
                ratio = rows[ref]["paired_ratio_median"]
                lines.append(
                    f"         rollbuf msgpack / {labels[ref]} = {ratio:.2f}x, median of paired runs (target <= 3x)"
                )
        memory = next(
            (
                r
                for r in results
                if r["mode"] == "msgpack" and r["sequences"] == size and r.get("server") == "rollbuf[memory]"
            ),
            None,
        )
        if b and memory and server != "rollbuf[memory]":
            lines.append(
                f"         {server} msgpack / rollbuf[memory] msgpack = "
                f"{b['median_s'] / memory['median_s']:.2f}x (target <= 1.5x)"
            )
        padded, ref = rows.get("msgpack-padded"), rows.get("raw-loopback+copy")
        if padded and ref:
            lines.append(
                f"         request -> padded arrays / (raw socket + one copy of the {padded['out_bytes'] / 1e6:.0f} MB "
                f"output) = {ref['paired_ratio_median']:.2f}x, median of paired runs (target <= 2x)"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="256,1024", help="batch sizes in sequences (default 256,1024)")
    ap.add_argument("--skip-atropos", action="store_true")
    ap.add_argument("--store", choices=["memory", "sqlite", "postgresql"], default="memory", help="rollbuf's store")
    ap.add_argument("--skip-json", action="store_true", help="binary only (JSON takes seconds per batch)")
    ap.add_argument("--compare-stores", action="store_true", help="only memory vs SQLite, fetched in turns")
    args = ap.parse_args(argv)
    if args.compare_stores:
        results = [r for size in args.sizes.split(",") for r in compare_stores(int(size))]
        print(report(results))
        return
    results = run(
        [int(s) for s in args.sizes.split(",")],
        with_atropos=not args.skip_atropos,
        with_json=not args.skip_json,
        store=args.store,
    )
    out = save_rows("transport", results)
    print(report(results))
    print(f"\nJSON lines: {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
