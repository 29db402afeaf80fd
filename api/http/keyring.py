"""The server's keys, from their three sources (`api_key`, `api_keys`, `api_keys_file`), merged and checked so
that they fail closed (docs/security.md, "Keys").

- A source that is set yields at least one key: an empty one (`ROLLBUF_API_KEYS=""`, a file of comments) is
  an error at start on a host other machines reach and a warning on loopback; either way the server is keyed
  and, without keys, refuses every request that needs one (it never falls back to keyless).
- Merged, no name is used twice and no secret holds two keys, whichever sources they come from.
- The key file is read again when its *content* changes (a hash; an operator's rename over it, a symlink
  swapped, an edit within the same second and size are all noticed), off the event loop, at most
  `MAX_KEY_FILE` bytes. A file that disappears, stops parsing or yields no key keeps the last good keys and
  says so loudly: an error log (again every `REPEAT_S` while it lasts), `/readyz`'s detail and the
  `rollbuf_key_file_stale` metric.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path

from api.http.access import Key, check_distinct, parse_keys
from api.views.metrics import KEY_FILE_STALE

log = logging.getLogger("rollbuf")

MAX_KEY_FILE = 1 << 20
"""Largest key file read (a megabyte holds thousands of keys); a larger one is refused, as a broken file is."""
RELOAD_CHECK_S = 1.0
"""A key file is read (in a worker thread) at most this often, so a rotation needs no restart."""
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


class KeyFile:
    """The key file's keys merged with the fixed ones, read again when its content changes (see the module)."""

    def __init__(self, path: Path, fixed: Sequence[Key], *, required: bool) -> None:
        self.path = path
        self.fixed = list(fixed)
        self.keys: list[Key] = list(fixed)
        self.error: str | None = None
        self._digest: bytes | None = None
        self._checked = time.monotonic()
        self._reading = False
        self._logged = 0.0
        try:
            data = read_bounded(path)
            found = parse_key_file(path, data, fixed)
        except NoKey as exc:
            if required:
                raise ValueError(f"{exc}: on a host other machines reach, the key file must hold a key") from None
            self._fail(f"{exc}: every request that needs a key is refused until the file holds one")
            return
        except OSError as exc:
            raise ValueError(f"api_keys_file: {exc}") from None
        self._digest = hashlib.sha256(data).digest()
        self.keys = [*self.fixed, *found]
        KEY_FILE_STALE.set(0)

    def current(self) -> list[Key]:
        """The keys now; starts a read of the file in a worker thread when one is due (the keys it finds are
        used once it is done)."""
        now = time.monotonic()
        if now - self._checked >= RELOAD_CHECK_S and not self._reading:
            self._checked = now
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.reload()
            else:
                self._reading = True
                loop.run_in_executor(None, self.reload).add_done_callback(self._done)
        return self.keys

    __call__ = current  # the front door's `keys`

    def _done(self, _: object) -> None:
        self._reading = False
        self._checked = time.monotonic()

    def reload(self) -> None:
        """Read the file now; keep the last good keys if it cannot be used."""
        try:
            data = read_bounded(self.path)
            digest = hashlib.sha256(data).digest()
            found = None if digest == self._digest else parse_key_file(self.path, data, self.fixed)
        except (OSError, ValueError) as exc:
            self._fail(str(exc))
            return
        if found is not None:
            self.keys = [*self.fixed, *found]
            self._digest = digest
            log.info("api_keys_file %s read again: keys %s", self.path, describe(self.keys))
        if self.error is not None:
            log.warning("api_keys_file %s is usable again: the keys it holds are in use", self.path)
            self.error = None
            KEY_FILE_STALE.set(0)

    def _fail(self, why: str) -> None:
        now = time.monotonic()
        if why != self.error or now - self._logged >= REPEAT_S:
            self._logged = now
            log.error(
                "api_keys_file %s cannot be used (%s): keeping the last good keys (%s)",
                self.path, why, describe(self.keys) or "none",
            )  # fmt: skip
        self.error = why
        KEY_FILE_STALE.set(1)


def describe(keys: Sequence[Key]) -> str:
    """The keys' names and roles, for the log (never a secret)."""
    return ", ".join(f"{k.name} ({k.role})" for k in keys)
