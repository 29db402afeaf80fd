"""`rollbuf export` as a real process beside a real server: from the SQLite file the server is writing, and from
the server over HTTP; both read back as /batch served the run, and a bad source is one line and exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest

from api.export.cli import main as export_main
from tests.api.test_export import assert_sequences_match, scripted_run
from tests.servers import running_server

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


def rollbuf_export(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "api", "export", *args], capture_output=True, text=True, timeout=120, check=False
    )


async def test_export_from_the_store_and_from_the_server(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'run.db'}"
    with running_server(store, tmp_path / "server.log", "--retain-steps", "100") as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            served = await scripted_run(c)
        direct = rollbuf_export(str(tmp_path / "direct"), "--store", store)  # beside the running server
        assert direct.returncode == 0, direct.stderr
        remote = rollbuf_export(str(tmp_path / "remote"), "--url", server.url)
        assert remote.returncode == 0, remote.stderr
        for source in (("--store", store), ("--url", server.url)):  # a full disk: one line, exit 2, no traceback
            full = tmp_path / f"full{source[0]}"
            full.mkdir()
            (full / "sequences.parquet.part").symlink_to("/dev/full")  # every write: ENOSPC
            out = rollbuf_export(str(full), *source)
            assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
            assert out.stderr.strip().splitlines()[-1].endswith("(nothing of this table was left behind)")
            assert "No space left on device" in out.stderr and list(full.iterdir()) == []
    lines = direct.stderr.splitlines()  # not a terminal: one line per table, when it is done
    assert [line.split()[:3] for line in lines] == [
        ["sequences", "28", "rows,"],
        ["groups", "8", "rows,"],
        ["steps", "2", "rows,"],
    ]
    for out in ("direct", "remote"):
        assert sorted(p.name for p in (tmp_path / out).iterdir()) == [
            "groups.parquet",
            "sequences.parquet",
            "steps.parquet",
        ]  # no .part left behind
        assert_sequences_match(pq.read_table(tmp_path / out / "sequences.parquet").to_pylist(), served)
        assert pq.read_table(tmp_path / out / "groups.parquet").num_rows == 8
    direct_groups = pq.read_table(tmp_path / "direct" / "groups.parquet")
    assert direct_groups.equals(pq.read_table(tmp_path / "remote" / "groups.parquet"))


def test_a_source_that_cannot_be_exported_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    memory = rollbuf_export(str(tmp_path / "out"), "--store", "memory://")
    assert memory.returncode == 2 and memory.stderr.count("\n") == 1 and "--url" in memory.stderr
    with pytest.raises(SystemExit) as exited:  # the same command, in process
        export_main([str(tmp_path / "out"), "--tables", "sequences,nope"])
    assert exited.value.code == 2 and "--tables: nope" in capsys.readouterr().err
