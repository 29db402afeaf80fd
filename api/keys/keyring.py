"""The server's keys, from their three sources (`api_key`, `api_keys`, `api_keys_file`), merged and checked so
that they fail closed (docs/security.md, "Keys").

- A source that is set yields at least one key: an empty one (`ROLLBUF_API_KEYS=""`, a file of comments) is
  an error at start on a host other machines reach and a warning on loopback; either way the server is keyed
  and, without keys, refuses every request that needs one (it never falls back to keyless).
- Merged, no name is used twice and no secret holds two keys, whichever sources they come from.
- The key file is watched by a thread of its own (`KeyFile.start`): it stats the file every `CHECK_S` and reads
  it when the stat says it may have changed (its device, inode, size, mtime or ctime differ, or its ctime is
  so recent that a second edit could hide behind the same timestamps), at most `MAX_KEY_FILE` bytes. No request
  has to come first: the first request after a change is judged by the new keys, within `settle_s` + 2 looks
  of the file's last write (0.75 s by default, where `settle_s` is a whole number of looks).
- A file is used only once its content has stayed the same at every look for `settle_s` (`Settle`): a file
  caught half written (an editor's save, a script writing it line by line with shorter pauses) is not used.
  One that is missing, does not parse, yields no key or clashes with the other sources for that long keeps the
  last good keys and says so loudly: an error log naming why (again every `REPEAT_S` while it lasts),
  `/readyz`'s detail and the `rollbuf_key_file_stale` metric.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

from api.keys.access import Key, check_distinct, parse_keys
from api.meters import KEY_FILE_STALE

log = logging.getLogger("rollbuf")

MAX_KEY_FILE = 1 << 20
"""Largest key file read (a megabyte holds thousands of keys); a larger one is refused, as a broken file is."""
CHECK_S = 0.25
"""How often the watcher stats the key file: a change is noticed this late at most (a stat costs microseconds)."""
SETTLE_S = 0.5
"""How long a changed file must stay the same before it is used: `api_keys_file_settle`'s default (declared in
`api.config.groups`, which imports no other module of `api`)."""
FRESH_NS = 2_000_000_000
"""A file whose ctime is this recent is read at every look whatever its stat says: timestamps are as coarse as
the kernel's tick (and a filesystem's), so a second edit of the same size could leave every field the same."""
REPEAT_S = 60.0
"""While the key file is broken, its error is logged again this often."""


def fixed_keys(api_key: str | None, api_keys: str | None, *, required: bool) -> tuple[list[Key], list[str]]:
    """The keys of `api_key` (named "admin") and `api_keys`, checked against each other, and warnings. A source
    set but yielding no key raises ValueError when keys are `required` (a host other machines reach), else
    is a warning."""
    keys: list[Key] = []
    warnings: list[str] = []
    if api_key is not None:
        if api_key.strip():
            keys.append(Key("admin", "admin", api_key.encode()))
        else:
            warnings.append(_no_key("api_key is empty", required))
    if api_keys is not None:
        found = parse_keys(api_keys, "api_keys")
        if not found:
            warnings.append(_no_key("api_keys holds no key (only blanks, separators or comments)", required))
        keys += found
    check_distinct(keys, "api_key and api_keys")
    return keys, warnings


def _no_key(what: str, required: bool) -> str:
    if required:
        raise ValueError(
            f"{what}: on a host other machines reach, a key source must hold a key  (give it one, or unset it)"
        )
    return f"{what}: every request that needs a key is refused until a key is configured"


class NoKey(ValueError):
    """A key source that is set yields no key."""


def read_bounded(path: Path) -> bytes:
    """The file's bytes, at most MAX_KEY_FILE + 1 of them (so a huge file costs no more)."""
    with open(path, "rb") as f:
        return f.read(MAX_KEY_FILE + 1)


def parse_key_file(path: Path, data: bytes, fixed: Sequence[Key]) -> list[Key]:
    """The file's keys checked against `fixed`; raises ValueError (`NoKey` for none) saying why not."""
    if len(data) > MAX_KEY_FILE:
        raise ValueError(f"{path}: larger than {MAX_KEY_FILE} bytes")
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    keys = parse_keys(text, str(path))
    if not keys:
        raise NoKey(f"{path}: holds no key (only blanks, separators or comments)")
    check_distinct([*fixed, *keys], f"{path} with api_key and api_keys")
    return keys


class Settle:
    """When a thing seen changing at regular looks is to be acted on: once the same version has been seen at every
    look for `settle_s`, and not again until it changes. Pure: the looks and their times are the caller's."""

    def __init__(self, settle_s: float, current: Hashable) -> None:
        self.settle_s = settle_s
        self.seen = current
        """The version the last look saw."""
        self.since = -float("inf")
        """When the last look's version was first seen (at every look since)."""
        self.decided = current
        """The version last acted on (at the start: the one in use)."""

    def look(self, now: float, version: Hashable) -> bool:
        """Whether to act on `version`, seen at `now`: it differs from the one last acted on and has been seen at
        every look for `settle_s` or more."""
        if version != self.seen:
            self.seen, self.since = version, now
        if version == self.decided or now - self.since < self.settle_s:
            return False
        self.decided = version
        return True


Stat = tuple[int, int, int, int, int]
"""What tells a file's changes without reading it: device, inode, size, mtime and ctime (ns)."""


class KeyFile:
    """The key file's keys merged with the fixed ones; a watcher thread (`start`) uses the file's changes once
    they settle (see the module)."""

    def __init__(self, path: Path, fixed: Sequence[Key], *, required: bool, settle_s: float = SETTLE_S) -> None:
        self.path = path
        self.fixed = list(fixed)
        self.keys: list[Key] = list(fixed)
        """The keys in use: replaced whole, never changed in place (the event loop reads it as the watcher
        replaces it)."""
        self.error: str | None = None
        self._stat: Stat | None = None
        self._data = b""
        self._version: bytes | str = b""
        """The content's digest at the last look, or why it could not be read."""
        self._logged = -float("inf")
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        try:
            self._stat = _stat(path)
            self._data = read_bounded(path)
            self._version = hashlib.sha256(self._data).digest()
            self._settle = Settle(settle_s, self._version)
            found = parse_key_file(path, self._data, fixed)
        except NoKey as exc:
            if required:
                raise ValueError(f"{exc}: on a host other machines reach, the key file must hold a key") from None
            self._fail(f"{exc}: every request that needs a key is refused until the file holds one", time.monotonic())
            return
        except OSError as exc:
            raise ValueError(f"api_keys_file: {exc}") from None
        self.keys = [*self.fixed, *found]
        KEY_FILE_STALE.set(0)

    def current(self) -> list[Key]:
        """The keys now (the watcher's latest)."""
        return self.keys

    __call__ = current  # the front door's `keys`

    def start(self) -> None:
        """Watch the file in a thread of its own, off the event loop, until `stop`."""
        if self._watcher is None:
            self._stop.clear()
            self._watcher = threading.Thread(target=self._watch, name="rollbuf-key-file", daemon=True)
            self._watcher.start()

    def stop(self) -> None:
        if self._watcher is not None:
            self._stop.set()
            self._watcher.join()
            self._watcher = None

    def _watch(self) -> None:
        while not self._stop.wait(CHECK_S):
            try:
                self.look(time.monotonic())
            except Exception:  # a watcher that died would keep revoked keys in use without a word
                log.exception("api_keys_file %s: the watch of the file failed; it goes on", self.path)

    def look(self, now: float) -> None:
        """One look at the file: read it if its stat says it may have changed; use it once settled."""
        try:
            stat = _stat(self.path)
            if stat != self._stat or time.time_ns() - stat[4] < FRESH_NS:
                self._stat = stat  # taken before the read: a change during it shows at the next look
                self._data = read_bounded(self.path)
                self._version = hashlib.sha256(self._data).digest()
        except OSError as exc:
            self._stat, self._version = None, str(exc)
        if self._settle.look(now, self._version):
            self._use(now)
        elif self.error is not None and now - self._logged >= REPEAT_S:
            self._fail(self.error, now)

    def _use(self, now: float) -> None:
        if isinstance(self._version, str):
            self._fail(self._version, now)
            return
        try:
            found = parse_key_file(self.path, self._data, self.fixed)
        except ValueError as exc:
            self._fail(str(exc), now)
            return
        self.keys = [*self.fixed, *found]
        log.info("api_keys_file %s read again: keys %s", self.path, describe(self.keys))
        if self.error is not None:
            log.warning("api_keys_file %s is usable again: the keys it holds are in use", self.path)
            self.error = None
            KEY_FILE_STALE.set(0)

    def _fail(self, why: str, now: float) -> None:
        if why != self.error or now - self._logged >= REPEAT_S:
            self._logged = now
            log.error(
                "api_keys_file %s cannot be used (%s): keeping the last good keys (%s)",
                self.path,
                why,
                describe(self.keys) or "none",
            )
        self.error = why
        KEY_FILE_STALE.set(1)


def _stat(path: Path) -> Stat:
    st = os.stat(path)  # through a symlink: a swapped link shows as another inode
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def watch(keys: Callable[[], list[Key]] | None) -> Callable[[], None]:
    """Start watching the key file, if the keys come from one; returns what stops it (the app's lifespan)."""
    if not isinstance(keys, KeyFile):
        return lambda: None
    keys.start()
    return keys.stop


def describe(keys: Sequence[Key]) -> str:
    """The keys' names and roles, for the log (never a secret)."""
    return ", ".join(f"{k.name} ({k.role})" for k in keys)
