"""rollbuf's load harness for the Atropos protocol: env clients posting scored groups, a trainer fetching
`/batch`, and the server's memory per queued group, against any server that speaks the protocol (rollbuf, the
Atropos server, `bench/do_nothing.py`), so one client measures them all alike.

Phases (`bench/http.py` runs them; `python -m bench.harness --url URL` runs them by hand, JSON lines to stdout):

- `ingest`: K concurrent env clients (`--ingest-clients`, each level on a freshly reset run) post pre-encoded
  groups of `--group-size` sequences of `--seq-min`..`--seq-max` tokens to `/scored_data`, `--ingest-requests`
  in all: groups/s, tokens/s, request MB/s, latency p50/p99 of the acknowledged posts, HTTP codes, errors;
- `batch`: for each batch size B (`--batch-sizes`) the queue is filled with B / G groups per measured call plus
  one (through `/scored_data_list`), then `/batch` is fetched `--batch-reps` times after a first call reported
  apart: latency, time to the first byte, wire bytes, the client's decode and padding into numpy, and the
  longest `/status` answer on a second connection meanwhile (how long the server stalls other clients);
- `memory`: `--memory-groups` groups posted one by one, the server's RSS (`/proc/PID/status`, needs the pid)
  before and after: bytes per queued group and per token position, then again after `/reset_data`.

Transports: `json` (plain bodies; `/batch` asked for without compression), `json-gzip` (as stock Atropos clients
send: bodies of 1 KiB or more gzipped at level 9 when that makes them smaller, gzip accepted on `/batch`) and
`msgpack` (submissions in rollbuf's binary encoding, as `rollout_client` sends them; `/batch` stays JSON).
Control calls (register, status, reset) are always JSON.

Groups are generated before a level starts and encoded once: the client's encoding cost is not measured. Only
loopback URLs are accepted; every loop is bounded in count and in time, every request by a timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import gzip
import ipaddress
import json
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlparse

import httpx
import numpy as np

from api.wire.records import MSGPACK, encode_submission, encode_submission_list

Record = dict[str, Any]
Group = dict[str, Any]
Body = tuple[str, bytes, dict[str, str]]
T = TypeVar("T")

VOCAB = 151_000
"""A Qwen-sized vocabulary: most token ids take 5 or 6 digits in JSON, as in real runs."""


@dataclass
class Config:
    """The workload; the defaults are the shared Atropos-protocol harness's, so figures compare across them."""

    seed: int = 1234
    timeout: float = 60.0
    pool: int = 16
    ingest_clients: list[int] = field(default_factory=lambda: [1, 8, 32])
    ingest_requests: int = 96
    ingest_time_cap: float = 20.0
    group_size: int = 8
    seq_min: int = 512
    seq_max: int = 4096
    memory_groups: int = 120
    memory_time_cap: float = 30.0
    batch_sizes: list[int] = field(default_factory=lambda: [64, 256, 1024])
    batch_group_size: int = 8
    batch_seq_len: int = 2048
    batch_reps: dict[int, int] = field(default_factory=lambda: {64: 5, 256: 3, 1024: 1})
    batch_reps_default: int = 3
    batch_time_cap: float = 45.0
    batch_timeout: float = 120.0
    status_probe: bool = True
    fill_request_bytes: int = 4_000_000


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _reps(text: str) -> dict[int, int]:
    return {int(b): int(r) for b, r in (item.split(":") for item in text.split(",") if ":" in item)}


def parser() -> argparse.ArgumentParser:
    """The flags of `Config` under the shared harness's names, so `bench/http.py` hands either harness the same
    arguments; and, for a run by hand, the target's."""
    ap = argparse.ArgumentParser(
        prog="python -m bench.harness", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--pid", type=int, default=None, help="the server's pid: RSS columns and the memory phase")
    ap.add_argument("--phases", default="memory,ingest,batch", help="comma list of: " + ",".join(PHASES))
    ap.add_argument("--transport", default="json", choices=sorted(TRANSPORTS))
    ap.add_argument("--label", default="")
    d = Config()
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--timeout", type=float, default=d.timeout, help="per request (s)")
    ap.add_argument("--pool", type=int, default=d.pool, help="distinct pre-encoded groups per workload")
    ap.add_argument("--ingest-clients", type=_ints, default=d.ingest_clients)
    ap.add_argument("--ingest-requests", type=int, default=d.ingest_requests, help="measured posts per level")
    ap.add_argument("--ingest-time-cap", type=float, default=d.ingest_time_cap)
    ap.add_argument("--group-size", type=int, default=d.group_size)
    ap.add_argument("--seq-min", type=int, default=d.seq_min)
    ap.add_argument("--seq-max", type=int, default=d.seq_max)
    ap.add_argument("--memory-groups", type=int, default=d.memory_groups)
    ap.add_argument("--memory-time-cap", type=float, default=d.memory_time_cap)
    ap.add_argument("--batch-sizes", type=_ints, default=d.batch_sizes)
    ap.add_argument("--batch-group-size", type=int, default=d.batch_group_size)
    ap.add_argument("--batch-seq-len", type=int, default=d.batch_seq_len)
    ap.add_argument("--batch-reps", type=_reps, default=d.batch_reps, help="B:reps,... measured after the first")
    ap.add_argument("--batch-reps-default", type=int, default=d.batch_reps_default)
    ap.add_argument("--batch-time-cap", type=float, default=d.batch_time_cap)
    ap.add_argument("--batch-timeout", type=float, default=d.batch_timeout)
    ap.add_argument("--no-status-probe", dest="status_probe", action="store_false")
    ap.add_argument("--fill-request-bytes", type=float, default=d.fill_request_bytes)
    return ap


def config(args: Sequence[str]) -> Config:
    """A `Config` from harness flags (`["--ingest-requests", "480"]`); an unknown flag exits with a usage line."""
    ns = vars(parser().parse_args(list(args)))
    ns["fill_request_bytes"] = int(ns["fill_request_bytes"])
    return Config(**{k: v for k, v in ns.items() if k in Config.__dataclass_fields__})


# -- workload ---------------------------------------------------------------------------------------------------


def make_group(rng: np.random.Generator, group_size: int, seq_min: int, seq_max: int) -> Group:
    """One scored group as an Atropos env sends it: masks -100 over the prompt (10-50% of the sequence) and the
    token ids after; inference logprobs 1.0 on the prompt and float32-valued negatives on the completion."""
    tokens, masks, logprobs = [], [], []
    for length in rng.integers(seq_min, seq_max + 1, group_size):
        n = int(length)
        ids = rng.integers(0, VOCAB, n, dtype=np.int64)
        prompt = int(n * rng.uniform(0.1, 0.5))
        mask = ids.copy()
        mask[:prompt] = -100
        lp = np.ones(n, dtype=np.float32)
        lp[prompt:] = -rng.exponential(0.6, n - prompt).astype(np.float32)
        tokens.append(ids.tolist())
        masks.append(mask.tolist())
        logprobs.append(lp.astype(np.float64).tolist())
    return {
        "tokens": tokens,
        "masks": masks,
        "scores": rng.choice([-1.0, 0.0, 1.0], size=group_size).tolist(),
        "advantages": None,
        "ref_logprobs": None,
        "messages": None,
        "inference_logprobs": logprobs,
        "generation_params": None,
        "overrides": None,
        "group_overrides": None,
        "images": None,
        "env_id": None,
    }


def positions(group: Group) -> int:
    return sum(len(t) for t in group["tokens"])


# -- transports -------------------------------------------------------------------------------------------------


class JsonTransport:
    """Atropos JSON both ways, uncompressed: `json.dumps` with its default separators, as Atropos clients write."""

    name = "json"
    gzip_posts = False
    accept_encoding = "identity"

    def _wrap(self, path: str, body: bytes) -> Body:
        headers = {"Content-Type": "application/json"}
        if self.gzip_posts and len(body) >= 1024:  # atroposlib's BaseEnv: gzip level 9, when it is smaller
            packed = gzip.compress(body, compresslevel=9)
            if len(packed) < len(body):
                body, headers["Content-Encoding"] = packed, "gzip"
        return path, body, headers

    def scored(self, group: Group) -> Body:
        return self._wrap("/scored_data", json.dumps(group).encode())

    def scored_list(self, groups: list[Group]) -> Body:
        return self._wrap("/scored_data_list", json.dumps(groups).encode())

    def batch_headers(self) -> dict[str, str]:
        return {"Accept": "application/json", "Accept-Encoding": self.accept_encoding}


class JsonGzipTransport(JsonTransport):
    """The stock Atropos clients: gzip-9 request bodies, gzip accepted on `/batch`."""

    name = "json-gzip"
    gzip_posts = True
    accept_encoding = "gzip, deflate"


def encode_msgpack(group: Group) -> bytes:
    """One group of the Atropos JSON shape in rollbuf's binary encoding, its other fields as they are."""
    fields = dict(group)
    return encode_submission(fields.pop("tokens"), fields.pop("masks"), fields.pop("scores"), **fields)


class MsgpackTransport(JsonTransport):
    """Submissions in rollbuf's binary encoding, as `rollout_client` sends them when the server offers it."""

    name = "msgpack"

    def scored(self, group: Group) -> Body:
        return "/scored_data", encode_msgpack(group), {"Content-Type": MSGPACK}

    def scored_list(self, groups: list[Group]) -> Body:
        return "/scored_data_list", encode_submission_list(encode_msgpack(g) for g in groups), {"Content-Type": MSGPACK}


TRANSPORTS: dict[str, type[JsonTransport]] = {t.name: t for t in (JsonTransport, JsonGzipTransport, MsgpackTransport)}


# -- measurement helpers ----------------------------------------------------------------------------------------


def latency(seconds: Sequence[float]) -> dict[str, float | int]:
    """Milliseconds: n, p50, p90, p99, mean, min, max."""
    if not seconds:
        return {"n": 0}
    ms = np.asarray(seconds, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {
        "n": int(ms.size),
        "p50_ms": round(float(p50), 3),
        "p90_ms": round(float(p90), 3),
        "p99_ms": round(float(p99), 3),
        "mean_ms": round(float(ms.mean()), 3),
        "min_ms": round(float(ms.min()), 3),
        "max_ms": round(float(ms.max()), 3),
    }


def rss_kb(pid: int | None) -> int | None:
    """The process's resident set (VmRSS), or None without a pid or once it has gone."""
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), None)
    except OSError:
        return None


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise SystemExit(f"refusing {url!r}: the harness only loads loopback servers")


# -- the protocol client ----------------------------------------------------------------------------------------


class Client:
    """One keep-alive connection pool to the server, control calls in JSON and the data path in the transport's
    encoding."""

    def __init__(self, url: str, transport: JsonTransport, timeout: float, connections: int) -> None:
        self.url = url.rstrip("/")
        self.transport = transport
        self.timeout = timeout
        self.http = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(timeout, connect=10.0),
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
            headers={"User-Agent": "rollbuf-bench-harness"},
        )

    async def close(self) -> None:
        await self.http.aclose()

    async def control(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> Any:
        """A JSON call; the decoded answer (text when it is not JSON). A status other than 200 raises."""
        content = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        r = await self.http.request(method, path, content=content, headers=headers, timeout=timeout or self.timeout)
        if r.status_code != 200:
            raise RuntimeError(f"{method} {path}: {r.status_code} {r.text[:200]}")
        try:
            return r.json()
        except ValueError:
            return r.text

    async def post(self, body: Body) -> tuple[int, float, str]:
        """One submission: its HTTP status, its seconds, and the answer's `status` field ("?" when there is
        none)."""
        path, content, headers = body
        t0 = time.perf_counter()
        r = await self.http.post(path, content=content, headers=headers)
        seconds = time.perf_counter() - t0
        try:
            answer = r.json()
            status = str(answer.get("status", "?")) if isinstance(answer, dict) else "?"
        except ValueError:
            status = "?"
        return r.status_code, seconds, status

    async def fetch_batch(self, timeout: float) -> Record:
        """`GET /batch` read to the last byte, then decoded and padded into numpy arrays as a trainer does first;
        each step timed apart."""
        t0 = time.perf_counter()
        async with self.http.stream("GET", "/batch", headers=self.transport.batch_headers(), timeout=timeout) as r:
            ttfb = time.perf_counter() - t0
            raw = b"".join([chunk async for chunk in r.aiter_raw()])
            seconds = time.perf_counter() - t0
            encoding = r.headers.get("content-encoding", "")
        out: Record = {"status": r.status_code, "latency_s": seconds, "ttfb_s": ttfb, "wire_bytes": len(raw)}
        if r.status_code != 200:
            return {**out, "error": raw[:300].decode("utf-8", "replace"), "nseqs": 0}
        if "gzip" in encoding:
            t = time.perf_counter()
            raw = gzip.decompress(raw)
            out["decompress_s"] = time.perf_counter() - t
        t = time.perf_counter()
        answer = json.loads(raw)
        out.update(decode_s=time.perf_counter() - t, decoded_bytes=len(raw))
        groups = answer.get("batch") if isinstance(answer, dict) else None
        out["nseqs"] = sum(len(g["tokens"]) for g in groups) if groups else 0
        if groups:
            t = time.perf_counter()
            out["padded_shape"] = list(padded(groups).shape)
            out["materialize_s"] = time.perf_counter() - t
        return out

    async def responsive(self, seconds: float) -> bool:
        """Whether `/status` answers 200 within `seconds` (after a failed call, before the next phase)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                r = await self.http.get("/status", timeout=max(1.0, deadline - time.monotonic()))
                if r.status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
        return False

    async def new_run(self, batch_size: int, max_token_len: int, group_size: int) -> int:
        """Reset, register a trainer, fetch once (Atropos refuses `/register-env` until the trainer's first
        `/batch`), register one env: its id."""
        await self.control("GET", "/reset_data", timeout=120)
        registration = {
            "wandb_group": "bench",
            "wandb_project": "bench",
            "batch_size": batch_size,
            "max_token_len": max_token_len,
            "checkpoint_dir": "bench-ckpt",
            "save_checkpoint_interval": 1000,
            "starting_step": 0,
            "num_steps": 10_000,
        }
        await self.control("POST", "/register", registration)
        env = {"max_token_length": max_token_len, "desired_name": "bench", "weight": 1.0, "group_size": group_size}
        answer: Any = None
        for _ in range(50):  # Atropos answers "wait for trainer to start" until it has seen a /batch
            await self.control("GET", "/batch")
            answer = await self.control("POST", "/register-env", env)
            if isinstance(answer, dict) and answer.get("status") == "success":
                return int(answer["env_id"])
            await asyncio.sleep(0.05)
        raise RuntimeError(f"/register-env never succeeded: {answer}")


def padded(groups: list[Group]) -> np.ndarray[Any, Any]:
    """What a trainer does first with a batch: tokens, masks and logprobs into padded int32 / float32 arrays;
    the tokens' array."""
    seqs = [s for g in groups for s in g["tokens"]]
    masks = [m for g in groups for m in g["masks"]]
    lps = [lp for g in groups for lp in (g.get("inference_logprobs") or [None] * len(g["tokens"]))]
    width = max((len(s) for s in seqs), default=0)
    tokens = np.zeros((len(seqs), width), dtype=np.int32)
    mask = np.full((len(seqs), width), -100, dtype=np.int32)
    logprobs = np.ones((len(seqs), width), dtype=np.float32)
    for i, seq in enumerate(seqs):
        tokens[i, : len(seq)] = seq
        mask[i, : len(masks[i])] = masks[i]
        if lps[i] is not None:
            logprobs[i, : len(lps[i])] = lps[i]
    return tokens


async def while_probing(client: Client, call: Awaitable[T], every: float = 0.05) -> tuple[T, list[float]]:
    """`call`'s result, and the latencies of `GET /status` polled on a second connection meanwhile: the longest
    is how long the server kept other clients waiting while it served `call`."""
    done = asyncio.Event()
    seconds: list[float] = []

    async def probe() -> None:
        async with httpx.AsyncClient(base_url=client.url, timeout=client.timeout) as http:
            while not done.is_set():
                t0 = time.perf_counter()
                try:
                    await http.get("/status")
                except httpx.HTTPError:
                    pass
                seconds.append(time.perf_counter() - t0)
                try:
                    await asyncio.wait_for(done.wait(), every)
                except TimeoutError:
                    pass

    task = asyncio.create_task(probe())
    try:
        result = await call
    finally:
        done.set()
        await task
    return result, seconds


# -- phases -----------------------------------------------------------------------------------------------------


async def ingest(client: Client, cfg: Config, pid: int | None, out: list[Record]) -> None:
    rng = np.random.default_rng(cfg.seed)
    pool = [make_group(rng, cfg.group_size, cfg.seq_min, cfg.seq_max) for _ in range(cfg.pool)]
    for clients in cfg.ingest_clients:
        env_id = await client.new_run(10**9, cfg.seq_max + 1, cfg.group_size)
        bodies = [(client.transport.scored({**g, "env_id": env_id}), positions(g)) for g in pool]
        # Warm-up, not measured: one post per client, so every connection is open before the clock starts.
        await asyncio.gather(*(client.post(bodies[j % len(bodies)][0]) for j in range(clients)))
        rss_before = rss_kb(pid)
        level = await _ingest_level(client, clients, bodies, cfg.ingest_requests, cfg.ingest_time_cap)
        out.append(
            {
                "phase": "ingest",
                "clients": clients,
                "group_size": cfg.group_size,
                "seq_len": [cfg.seq_min, cfg.seq_max],
                **level,
                "avg_req_bytes": int(np.mean([len(b[1]) for b, _ in bodies])),
                "avg_group_tokens": int(np.mean([n for _, n in bodies])),
                "queue_after": await client.control("GET", "/status"),
                "rss_kb_before": rss_before,
                "rss_kb_after": rss_kb(pid),
            }
        )
    await client.control("GET", "/reset_data", timeout=120)


async def _ingest_level(
    client: Client, clients: int, bodies: list[tuple[Body, int]], requests: int, cap: float
) -> Record:
    """`requests` posts (at most `cap` seconds) by `clients` env clients taking the next body in turn."""
    taken = done_tokens = done_bytes = errors = 0
    ok_seconds: list[float] = []
    codes: dict[str, int] = {}
    answers: dict[str, int] = {}
    deadline = time.monotonic() + cap

    async def env_client() -> None:
        nonlocal taken, done_tokens, done_bytes, errors
        while taken < requests and time.monotonic() < deadline:
            body, npos = bodies[taken % len(bodies)]
            taken += 1
            try:
                code, seconds, answer = await client.post(body)
            except httpx.HTTPError as e:
                codes[type(e).__name__] = codes.get(type(e).__name__, 0) + 1
                errors += 1
                continue
            codes[str(code)] = codes.get(str(code), 0) + 1
            if code != 200:
                errors += 1
                continue
            answers[answer] = answers.get(answer, 0) + 1
            ok_seconds.append(seconds)
            done_tokens += npos
            done_bytes += len(body[1])

    t0 = time.perf_counter()
    await asyncio.gather(*(env_client() for _ in range(clients)))
    wall = time.perf_counter() - t0
    return {
        "requests_ok": len(ok_seconds),
        "errors": errors,
        "http_codes": codes,
        "response_status": answers,
        "wall_s": round(wall, 3),
        "groups_per_s": round(len(ok_seconds) / wall, 2),
        "tokens_per_s": round(done_tokens / wall, 1),
        "req_MB_per_s": round(done_bytes / wall / 1e6, 2),
        "latency": latency(ok_seconds),
    }


async def batch(client: Client, cfg: Config, pid: int | None, out: list[Record]) -> None:
    g = cfg.batch_group_size
    for size in cfg.batch_sizes:
        if size % g:
            out.append({"phase": "batch", "batch_size": size, "skipped": f"not a multiple of the group size {g}"})
            continue
        reps = cfg.batch_reps.get(size, cfg.batch_reps_default)
        env_id = await client.new_run(size, cfg.batch_seq_len + 64, g)
        rng = np.random.default_rng(cfg.seed + size)
        pool = [
            {**make_group(rng, g, cfg.batch_seq_len, cfg.batch_seq_len), "env_id": env_id}
            for _ in range(min(cfg.pool, size // g))
        ]
        one = client.transport.scored(pool[0])
        per_request = max(1, min(16, cfg.fill_request_bytes // len(one[1])))
        rss_before = rss_kb(pid)
        fill = await _fill(client, pool, (reps + 1) * size // g, per_request, cfg.batch_time_cap)
        rss_full = rss_kb(pid)
        gc.collect()
        calls: list[Record] = []
        started = time.monotonic()
        for _ in range(reps + 1):
            if len(calls) > 1 and time.monotonic() - started > cfg.batch_time_cap:
                break
            fetch = client.fetch_batch(cfg.batch_timeout)
            call, probe = await while_probing(client, fetch) if cfg.status_probe else (await fetch, [])
            call["status_probe_max_s"] = max(probe) if probe else None
            calls.append(call)
            if not call["nseqs"]:
                break
        first, rest = calls[0], calls[1:]
        ok = [c for c in rest if c["nseqs"]]

        out.append(
            {
                "phase": "batch",
                "batch_size": size,
                "group_size": g,
                "seq_len": cfg.batch_seq_len,
                "fill": fill,
                "fill_groups_per_s": round(fill["groups"] / fill["fill_s"], 2) if fill["fill_s"] else None,
                "first_call": {k: round(v, 4) if isinstance(v, float) else v for k, v in first.items()},
                "n": len(ok),
                "nseqs": sorted({c["nseqs"] for c in ok}),
                "latency": _stats(ok, "latency_s"),
                "ttfb": _stats(ok, "ttfb_s"),
                "decode": _stats(ok, "decode_s"),
                "decompress": _stats(ok, "decompress_s"),
                "materialize": _stats(ok, "materialize_s"),
                "status_probe_max": _stats(ok, "status_probe_max_s"),
                "wire_bytes": int(np.median([c["wire_bytes"] for c in ok])) if ok else None,
                "decoded_bytes": int(np.median([c.get("decoded_bytes", c["wire_bytes"]) for c in ok])) if ok else None,
                "bad_status": [c["status"] for c in rest if c["status"] != 200],
                "rss_kb_before_fill": rss_before,
                "rss_kb_full": rss_full,
            }
        )
        await client.control("GET", "/reset_data", timeout=120)
        gc.collect()


def _stats(calls: list[Record], key: str) -> dict[str, float | int]:
    return latency([c[key] for c in calls if c.get(key) is not None])


async def _fill(client: Client, pool: list[Group], groups: int, per_request: int, cap: float) -> Record:
    """`groups` groups from `pool`, `per_request` at a time (through `/scored_data_list` when more than one), for
    at most `cap` seconds; more than 5 refused requests raise. Each distinct request is encoded once: gzip-9 of a
    4 MB list takes the client a second, which would otherwise take the fill past `cap` on a busy machine."""
    tr = client.transport
    bodies: dict[tuple[int, int], Body] = {}
    t0 = time.monotonic()
    sent = errors = 0
    while sent < groups and time.monotonic() - t0 < cap:
        key = (sent % len(pool), min(per_request, groups - sent))
        if key not in bodies:
            chunk = [pool[(key[0] + j) % len(pool)] for j in range(key[1])]
            bodies[key] = tr.scored(chunk[0]) if len(chunk) == 1 else tr.scored_list(chunk)
        code, _, _ = await client.post(bodies[key])
        if code == 200:
            sent += key[1]
        else:
            errors += 1
            if errors > 5:
                raise RuntimeError(f"filling the queue: {code} {errors} times")
    return {"groups": sent, "fill_s": round(time.monotonic() - t0, 3), "errors": errors}


async def memory(client: Client, cfg: Config, pid: int | None, out: list[Record]) -> None:
    if not pid:
        out.append({"phase": "memory", "skipped": "no --pid"})
        return
    env_id = await client.new_run(10**9, cfg.seq_max + 1, cfg.group_size)
    rng = np.random.default_rng(cfg.seed + 3)
    pool = [{**make_group(rng, cfg.group_size, cfg.seq_min, cfg.seq_max), "env_id": env_id} for _ in range(cfg.pool)]
    bodies = [client.transport.scored(g) for g in pool]
    sizes = [len(json.dumps(g)) for g in pool]
    start = rss_kb(pid) or 0
    groups = tokens = json_bytes = 0
    t0 = time.monotonic()
    while groups < cfg.memory_groups and time.monotonic() - t0 < cfg.memory_time_cap:
        i = groups % len(pool)
        code, _, _ = await client.post(bodies[i])
        if code != 200:
            raise RuntimeError(f"filling the queue: {code}")
        groups += 1
        tokens += positions(pool[i])
        json_bytes += sizes[i]
    await asyncio.sleep(0.3)  # the server's last request is answered; let it settle before reading
    full = rss_kb(pid) or 0
    await client.control("GET", "/reset_data", timeout=120)
    await asyncio.sleep(1.0)
    delta = (full - start) * 1024
    out.append(
        {
            "phase": "memory",
            "groups": groups,
            "token_positions": tokens,
            "group_size": cfg.group_size,
            "fields": "tokens+masks+inference_logprobs (+scores)",
            "rss_kb_start": start,
            "rss_kb_full": full,
            "rss_kb_after_reset": rss_kb(pid),
            "delta_kb": full - start,
            "bytes_per_group": round(delta / groups, 1) if groups else None,
            "bytes_per_token_position": round(delta / tokens, 2) if tokens else None,
            "json_bytes_per_token_position": round(json_bytes / tokens, 2) if tokens else None,
            "dense_bytes_per_token_position": 12.0,
        }
    )


Phase = Callable[[Client, Config, int | None, list[Record]], Awaitable[None]]
PHASES: dict[str, Phase] = {"memory": memory, "ingest": ingest, "batch": batch}


# -- entry points -----------------------------------------------------------------------------------------------


async def run(
    url: str, phases: Sequence[str], cfg: Config, transport: str = "json", pid: int | None = None, label: str = ""
) -> list[Record]:
    """The phases in order against `url`, their records. A phase that fails leaves a record with its `error`
    and the next phase runs, as soon as the server answers again."""
    check_loopback(url)
    unknown = [p for p in phases if p not in PHASES]
    if unknown or transport not in TRANSPORTS:
        raise SystemExit(f"unknown phase {unknown} or transport {transport!r}")
    out: list[Record] = []
    client = Client(url, TRANSPORTS[transport](), cfg.timeout, max(cfg.ingest_clients, default=1) + 8)
    try:
        if not await client.responsive(15):
            raise RuntimeError(f"{url} does not answer GET /status")
        for name in phases:
            try:
                await PHASES[name](client, cfg, pid, out)
            except Exception as e:  # any failure is a result to record; the other phases still run
                out.append({"phase": name, "error": f"{type(e).__name__}: {e}"})
                await client.responsive(60)
    finally:
        await client.close()
    return [{"label": label, "url": url, "transport": transport, **r} for r in out]


def run_sync(
    url: str,
    phases: Sequence[str],
    args: Sequence[str] = (),
    transport: str = "json",
    pid: int | None = None,
    label: str = "",
    timeout: float = 600,
) -> list[Record]:
    """`run` from synchronous code, with harness flags (`args`, the shared harness's names) and a limit on the
    whole call: past `timeout` seconds, one record with the `error` in place of the phases'."""
    cfg = config(args)

    async def bounded() -> list[Record]:
        try:
            return await asyncio.wait_for(run(url, phases, cfg, transport, pid, label), timeout)
        except TimeoutError:
            return [
                {
                    "label": label,
                    "url": url,
                    "transport": transport,
                    "phase": phases[0] if phases else "",
                    "error": f"the harness ran past {timeout} s",
                }
            ]

    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(bounded())


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when it is installed (as the servers' uvicorn runs on): the client costs less per request."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main() -> None:
    ns = parser().parse_args()
    phases = [p for p in ns.phases.split(",") if p]
    for record in run_sync(ns.url, phases, sys.argv[1:], ns.transport, ns.pid, ns.label):
        print(json.dumps(record, default=str), flush=True)


if __name__ == "__main__":
    main()
