"""Attacks on the bounded surfaces (keys, retention, slow uploads, export), each against a real `rollbuf serve`
from a given checkout, printing one figure per attack (run it with the checkout before and after a change to
compare):

    python -m bench.edges [--root /path/to/checkout] [attack ...]

Attacks: keys, retention, slow_uploads, dribble, slow_conns, big_score, steps64, export_rss, export_full,
keyfile. Not a test: figures, not asserts (the tests hold the behaviours).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
SECRET = "s" * 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@contextlib.contextmanager
def server(
    root: Path, *args: str, env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()
) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    port = free_port()
    log = Path(tempfile.mkstemp(suffix=".log")[1])
    cmd = [*prefix, sys.executable, "-m", "api", "serve", "--port", str(port), *args]
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": str(root)}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=root, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"exited {proc.returncode}: {log.read_text()[-500:]}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "not ready"
            time.sleep(0.05)
        yield url, proc, log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def group(env_id: int, n: int = 4, length: int = 8, scores: list[float] | None = None, **extra: object) -> dict:
    return {
        "env_id": env_id,
        "tokens": [[1] * length] * n,
        "masks": [[1] * length] * n,
        "scores": scores or [float(i % 2) for i in range(n)],
        **extra,
    }


def start_run(c: httpx.Client, batch_size: int = 4, **reg: object) -> int:
    c.post(
        "/register",
        json={
            "batch_size": batch_size,
            "max_token_len": 4096,
            "wandb_group": "g",
            "wandb_project": "p",
            "checkpoint_dir": "c",
            "save_checkpoint_interval": 1,
            "starting_step": 0,
            "num_steps": 100000,
            **reg,
        },
    )
    c.get("/batch")
    reply = c.post(
        "/register-env", json={"max_token_length": 4096, "desired_name": "math", "weight": 1.0, "group_size": 4}
    )
    return int(reply.json()["env_id"])


# --------------------------------------------------------------------------------------------------- attacks


def keys(root: Path) -> str:
    env = {"ROLLBUF_API_KEYS": ""}
    try:
        with server(root, "--host", "0.0.0.0", "--store", "memory://", env=env) as (url, _, _):
            r = httpx.get(url + "/reset_data", headers={"Host": "evil.example"})
            return f'ROLLBUF_API_KEYS="" on 0.0.0.0: started; GET /reset_data, no key: {r.status_code} {r.text[:40]}'
    except RuntimeError as exc:
        return f'ROLLBUF_API_KEYS="" --host 0.0.0.0: refused at start ({str(exc).strip().splitlines()[-1][:120]})'


def retention(root: Path) -> str:
    with tempfile.TemporaryDirectory() as d:
        db = Path(d) / "r.db"
        with server(root, "--store", f"sqlite:///{db}", "--retain-bytes", str(2 * MiB)) as (url, _, _):
            with httpx.Client(base_url=url, timeout=30) as c:
                env_id = start_run(c, batch_size=4)
                pad = "x" * (100 * 1024)
                for i in range(300):  # 120 MB of payloads, served by a plain GET /batch loop
                    c.post(
                        "/scored_data",
                        json=group(env_id, scores=[0, 1, 0, 1], group_id=f"g{i}", overrides=[{"pad": pad}] * 4),
                    )
                    c.get("/batch")
                committed = c.get("/status").json().get("committed_step")
                time.sleep(12)  # the background prune runs every 10 s
                kept = sum(1 for i in range(300) if c.get(f"/ledger/groups/g{i}").json()["groups"][0]["kept"])
        size = db.stat().st_size + sum(p.stat().st_size for p in Path(d).glob("r.db-*"))
    return (
        f"retain_bytes 2 MB, 120 MB served by GET /batch: committed_step {committed}, {kept}/300 payloads kept, "
        f"store {size / 1e6:.1f} MB"
    )


def _dribbler(port: int, declared: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST /scored_data HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n " % declared
    )
    return sock


def slow_uploads(root: Path) -> str:
    with server(root, "--store", "memory://") as (url, proc, _):
        port = int(url.rsplit(":", 1)[1])
        with httpx.Client(base_url=url, timeout=30) as c:
            env_id = start_run(c)
            socks = [_dribbler(port, 268435456) for _ in range(4)]
            time.sleep(1)
            codes = [c.post("/scored_data", json=group(env_id)).status_code for _ in range(50)]
            for s in socks:
                s.close()
    return (
        f"4 uploads declaring 256 MiB, dribbling: another handler's 50 ingests: {codes.count(503)} x 503, "
        f"{codes.count(200)} x 200"
    )


def dribble(root: Path) -> str:
    with server(root, "--store", "memory://", "--body-timeout", "2") as (url, _, _):
        port = int(url.rsplit(":", 1)[1])
        sock = _dribbler(port, 268435456)
        sock.settimeout(1.5)
        start = time.monotonic()
        reply = b""
        while time.monotonic() - start < 30:
            try:
                sock.sendall(b" ")  # a byte every 1.5 s, under body_timeout 2 s
                reply = sock.recv(4096)
                break
            except TimeoutError:
                continue
            except OSError:
                break
        sock.close()
    took = time.monotonic() - start
    status = reply.split(b"\r\n", 1)[0].decode() if reply else "none"
    return f"body_timeout 2 s, a byte every 1.5 s: ended after {took:.1f} s with {status!r} (30 s cap)"


def slow_conns(root: Path) -> str:
    with server(root, "--store", "memory://", prefix=("prlimit", "--nofile=1024:1024")) as (url, _, _):
        port = int(url.rsplit(":", 1)[1])
        socks = []
        for _ in range(1100):
            with contextlib.suppress(OSError):
                socks.append(_dribbler(port, 1000))
        answered = resets = 0
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and answered < 10:
            try:
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    answered += 1
            except httpx.TransportError:
                resets += 1
        for s in socks:
            s.close()
    return f"1,100 dribbling connections at 1,024 descriptors: probe {answered} answers, {resets} failures in 20 s"


def big_score(root: Path) -> str:
    out = []
    for store in ("memory://", "sqlite"):
        with tempfile.TemporaryDirectory() as d:
            url_store = store if store == "memory://" else f"sqlite:///{d}/r.db"
            with server(root, "--store", url_store) as (url, _, _):
                with httpx.Client(base_url=url, timeout=30) as c:
                    env_id = start_run(c)
                    c.post("/scored_data", json=group(env_id, scores=[1e200, 0.0, 1e200, 0.0]))
                    c.post("/scored_data", json=group(env_id, scores=[0.0, 1.0, 0.0, 1.0]))
                    c.get("/batch")
                    c.get("/batch")
                    time.sleep(1.2)
                    out.append(f"{store.split(':')[0]} /status {c.get('/status').status_code}")
    return "a group scoring 1e200: " + ", ".join(out)


def steps64(root: Path) -> str:
    with tempfile.TemporaryDirectory() as d:
        with server(root, "--store", f"sqlite:///{d}/r.db") as (url, _, _):
            with httpx.Client(base_url=url, timeout=30) as c:
                start_run(c)
                return f"sqlite /ledger/steps/2**64: {c.get(f'/ledger/steps/{2**64}').status_code}"


def export_rss(root: Path) -> str:
    with server(root, "--store", "memory://", "--retain-steps", "100000") as (url, proc, _):
        with httpx.Client(base_url=url, timeout=120) as c:
            env_id = start_run(c, batch_size=4)
            image = "i" * MiB
            for _ in range(300):
                c.post("/scored_data", json=group(env_id, images=[image]))
                c.get("/batch")
            before = rss_kb(proc.pid)
            peak = before
            with c.stream("GET", "/export", params={"table": "sequences"}) as reply:
                size = 0
                for chunk in reply.iter_raw():
                    size += len(chunk)
                    peak = max(peak, rss_kb(proc.pid))
    growth = (peak - before) / 1024
    return f"export of 300 groups of 1 MB images: RSS +{growth:.0f} MB (peak), {size / 1e3:.0f} KB Parquet"


def export_full(root: Path) -> str:
    with tempfile.TemporaryDirectory() as d:
        store = f"sqlite:///{d}/r.db"
        with server(root, "--store", store, "--retain-steps", "100") as (url, _, _):
            with httpx.Client(base_url=url, timeout=30) as c:
                env_id = start_run(c)
                c.post("/scored_data", json=group(env_id))
                c.get("/batch")
        out_dir = Path(d) / "out"
        out_dir.mkdir()
        (out_dir / "sequences.parquet.part").symlink_to("/dev/full")
        out = subprocess.run(
            [sys.executable, "-m", "api", "export", str(out_dir), "--store", store],
            cwd=root,
            env={**os.environ, "PYTHONPATH": str(root)},
            capture_output=True,
            text=True,
            check=False,
        )
    lines = out.stderr.strip().splitlines()
    traceback = "Traceback" in out.stderr
    return f"rollbuf export on a full disk: exit {out.returncode}, {len(lines)} stderr lines, traceback: {traceback}"


def keyfile(root: Path) -> str:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "keys"
        path.write_text(f"a env {SECRET}1\n")
        with server(root, "--store", "memory://", "--api-keys-file", str(path)) as (url, _, _):

            def status(secret: str) -> int:
                return httpx.get(url + "/status", headers={"Authorization": f"Bearer {secret}"}).status_code

            st = path.stat()
            path.write_text(f"a env {SECRET}2\n")  # same size, same mtime
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
            time.sleep(2.5)
            status(f"{SECRET}2")
            time.sleep(0.5)
            same = status(f"{SECRET}2")
            refused = 0
            for _ in range(50):  # truncate-then-write, as an editor may
                with path.open("w") as f:
                    f.flush()
                    os.fsync(f.fileno())
                    time.sleep(0.05)
                    if status(f"{SECRET}2") != 200:
                        refused += 1
                    f.write(f"a env {SECRET}2\n")
            path.unlink()
            time.sleep(1.5)
            status(f"{SECRET}2")
            time.sleep(0.5)
            ready = httpx.get(url + "/readyz").json()
    return (
        f"key file: same-size same-mtime rotation {'noticed' if same == 200 else 'unnoticed'}; "
        f"truncate-then-write: {refused}/50 requests refused; deleted: /readyz {ready}"
    )


ATTACKS: dict[str, Callable[[Path], str]] = {
    f.__name__: f
    for f in (keys, retention, slow_uploads, dribble, slow_conns, big_score, steps64, export_rss, export_full, keyfile)
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument("attacks", nargs="*", default=list(ATTACKS))
    args = parser.parse_args()
    for name in args.attacks:
        try:
            print(f"{name}: {ATTACKS[name](args.root.resolve())}", flush=True)
        except Exception as exc:  # a figure, not a test: say what broke and go on
            print(f"{name}: failed: {type(exc).__name__}: {exc}", flush=True)


if __name__ == "__main__":
    main()
