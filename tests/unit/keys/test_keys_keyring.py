"""api.keys.keyring: when a changed key file is used (`Settle`, pure), and `KeyFile`'s looks at a file in
`tmp_path` on a clock the test sets; the watcher thread once, on the real clock."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.config.settings import Settings
from api.keys import keyring
from api.keys.access import Identity, identify
from api.keys.keyring import CHECK_S, KeyFile, Settle

SECRET = "0123456789abcdef"
SETTLE = 0.5


@given(
    settle=st.floats(0, 3),
    looks=st.lists(st.tuples(st.floats(0, 1), st.sampled_from("abc")), max_size=40),
)
def test_a_version_is_acted_on_once_it_has_been_seen_at_every_look_for_the_settle_time(
    settle: float, looks: list[tuple[float, str]]
) -> None:
    """Acted on exactly when it differs from the version last acted on and the looks have seen it, and only it,
    for `settle` seconds or more: never a version caught between two others for less."""
    settler = Settle(settle, "a")
    now, decided, run_start, previous = 0.0, "a", -float("inf"), "a"
    for step, version in looks:
        now += step
        if version != previous:
            run_start = now
        acted = settler.look(now, version)
        assert acted == (version != decided and now - run_start >= settle)
        if acted:
            decided = version
        previous = version


@given(
    interval=st.floats(0.01, 1),
    settle=st.floats(0, 3),
    changed=st.floats(0, 1, exclude_max=True),
    looks_before=st.integers(0, 5),
)
def test_a_change_is_acted_on_within_the_settle_time_and_two_intervals(
    interval: float, settle: float, changed: float, looks_before: int
) -> None:
    """Looks every `interval`: a change that then stays is acted on by `settle` + 2 intervals after it (one to
    see it, at most one more to pass `settle` between two looks)."""
    settler = Settle(settle, "old")
    at = (looks_before + changed) * interval  # between two looks
    k = 0
    while not settler.look(k * interval, "new" if k * interval > at else "old"):
        k += 1
        assert k * interval <= at + settle + 2 * interval + 1e-9, "not acted on within the bound"
    assert k * interval > at  # not before it


def test_the_settle_default_is_the_settings_default() -> None:
    assert Settings(store="memory://").api_keys_file_settle == keyring.SETTLE_S


def used(keys: KeyFile, at: float) -> float:
    """Looks at the file as the watcher does, from `at` until past the settle time; the time after."""
    for n in range(int(SETTLE / CHECK_S) + 1):
        keys.look(at + n * CHECK_S)
    return at + SETTLE + CHECK_S


def test_a_rotation_is_used_once_settled_and_noticed_by_content(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"math env {SECRET}old\n")
    keys = KeyFile(path, [], required=True, settle_s=SETTLE)
    assert identify(keys(), f"{SECRET}old") == Identity("math", "env")
    stat = path.stat()
    path.write_text(f"math env {SECRET}new\n")  # a rotation: the same name, a new secret, the same size and mtime
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    keys.look(10.0)
    keys.look(10.0 + SETTLE / 2)
    assert identify(keys(), f"{SECRET}old") is not None  # not settled yet
    keys.look(10.0 + SETTLE)
    assert identify(keys(), f"{SECRET}new") == Identity("math", "env") and identify(keys(), f"{SECRET}old") is None
    replacement = tmp_path / "keys.new"
    replacement.write_text(f"math env {SECRET}newer\n")
    replacement.rename(path)  # how operators replace a file atomically
    used(keys, 20.0)
    assert identify(keys(), f"{SECRET}newer") == Identity("math", "env") and keys.error is None


def test_a_file_caught_half_written_is_not_used(tmp_path: Path) -> None:
    """Written in halves, each look before the settle time: the first half (it parses, without the trainer's key)
    is never used, the whole file is once it has stayed the same for the settle time."""
    path = tmp_path / "keys"
    path.write_text(f"math env {SECRET}1\ntrainer trainer {SECRET}2\n")
    keys = KeyFile(path, [], required=True, settle_s=SETTLE)
    with path.open("w") as f:
        f.write(f"math env {SECRET}1\n")
        f.flush()
        for n in range(3):
            keys.look(n * SETTLE / 3)
            assert identify(keys(), f"{SECRET}2") is not None and keys.error is None
        f.write(f"trainer trainer {SECRET}3\n")
    keys.look(SETTLE)
    assert identify(keys(), f"{SECRET}3") is None  # the whole file, just seen: not settled either
    used(keys, SETTLE)
    assert identify(keys(), f"{SECRET}3") is not None and identify(keys(), f"{SECRET}2") is None


def test_a_broken_or_lost_file_keeps_the_last_good_keys_and_says_why_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys"
    path.write_text(f"math env {SECRET}1\n")
    keys = KeyFile(path, [], required=True, settle_s=SETTLE)
    path.write_text(f"math env {SECRET}1\ntrainer trainer\n")
    with caplog.at_level(logging.INFO, "rollbuf"):
        now = used(keys, 0.0)
        for n in range(20):
            keys.look(now + n * CHECK_S)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "entry 2: expected 'name role secret'" in errors[0], errors
    assert identify(keys(), f"{SECRET}1") is not None and "entry 2" in (keys.error or "")
    caplog.clear()
    with caplog.at_level(logging.INFO, "rollbuf"):
        keys.look(now + keyring.REPEAT_S)  # while it lasts, said again every REPEAT_S
    assert [r.levelno for r in caplog.records] == [logging.ERROR]
    path.write_text(f"math env {SECRET}1\n")  # mended
    used(keys, 100.0)
    assert keys.error is None
    path.unlink()
    keys.look(200.0)  # gone for less than the settle time (`rm` then `cp`): not a failure
    path.write_text(f"math env {SECRET}1\n")
    keys.look(200.0 + CHECK_S)
    used(keys, 200.0 + 2 * CHECK_S)
    assert keys.error is None
    path.unlink()
    used(keys, 300.0)
    assert identify(keys(), f"{SECRET}1") is not None and "No such file" in (keys.error or "")
    path.write_text("x" * (keyring.MAX_KEY_FILE + 1))
    used(keys, 400.0)
    assert identify(keys(), f"{SECRET}1") is not None and "larger than" in (keys.error or "")


def test_an_unchanged_file_is_only_stat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its stat the same and its ctime no longer recent, a look reads nothing."""
    path = tmp_path / "keys"
    path.write_text(f"math env {SECRET}1\n")
    keys = KeyFile(path, [], required=True, settle_s=SETTLE)
    reads: list[Path] = []

    def read(p: Path) -> bytes:
        reads.append(p)
        return b""

    monkeypatch.setattr(keyring, "read_bounded", read)
    monkeypatch.setattr(keyring, "FRESH_NS", 0)
    used(keys, 0.0)
    assert reads == [] and identify(keys(), f"{SECRET}1") is not None
    path.write_text(f"math env {SECRET}2\n")
    keys.look(10.0)
    assert reads == [path]


def test_the_watcher_uses_a_change_without_being_asked(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"math env {SECRET}1\n")
    keys = KeyFile(path, [], required=True, settle_s=0.0)
    keys.start()
    try:
        path.write_text(f"math env {SECRET}2\n")
        deadline = time.monotonic() + 60  # hang guard: it takes a look, 0.25 s
        while identify(keys(), f"{SECRET}2") is None:
            assert time.monotonic() < deadline, "the watcher did not use the change"
            time.sleep(0.01)  # polling interval
    finally:
        keys.stop()
    assert keys._watcher is None
