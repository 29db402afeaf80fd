"""The one settings object. Sources, highest first: command-line flags, `ROLLBUF_*` environment variables,
defaults (docs/settings.md)."""

from __future__ import annotations

import ipaddress
import json
import logging
from collections.abc import Callable

from pydantic import SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from api.config.groups import (
    BatchSettings,
    BlobSettings,
    DropBiasSettings,
    KeySettings,
    LedgerRetention,
    ProducerLimits,
    QueueSettings,
    RequestLimits,
    RolloutGroups,
    ServerSettings,
    TaskLeases,
)
from api.keys.access import MIN_SECRET, Key
from api.keys.keyring import KeyFile, NoKey, describe, fixed_keys, parse_key_file, read_bounded
from api.store import redacted

log = logging.getLogger("rollbuf")

SHARED_STORES = ("sqlite:///", "postgresql://", "postgres://")
"""Store URLs that several server processes can share."""


class Settings(
    RequestLimits,
    DropBiasSettings,
    RolloutGroups,
    TaskLeases,
    ProducerLimits,
    BlobSettings,
    LedgerRetention,
    BatchSettings,
    QueueSettings,
    KeySettings,
    ServerSettings,
    BaseSettings,
):
    """Every concern's settings (`api.config.groups.GROUPS`), flat: each field is a `ROLLBUF_*` variable and a
    `rollbuf serve` flag of its name. Bases in reverse: pydantic lists the last base's fields first."""

    model_config = SettingsConfigDict(
        env_prefix="ROLLBUF_",
        use_attribute_docstrings=True,
        extra="forbid",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        env_parse_none_str="null",
    )

    @model_validator(mode="after")
    def _safe(self) -> Settings:
        if not self.store.startswith(SHARED_STORES + ("memory://",)):
            raise ValueError(
                f"store {redacted(self.store)!r}: use memory://, sqlite:///path.db or postgresql://host/dbname"
            )
        if self.workers > 1 and not self.store.startswith(SHARED_STORES):
            raise ValueError(
                f"workers={self.workers} needs a store the processes share: sqlite:///path.db or postgresql://, "
                f"not {redacted(self.store)}"
            )
        keyed = self.api_key is not None or self.api_keys is not None or self.api_keys_file is not None
        short = self.api_key is not None and len(self.api_key.get_secret_value()) < MIN_SECRET
        if short and not _is_loopback(self.host):
            raise ValueError(
                f"api_key is shorter than {MIN_SECRET} characters on {self.host}, reachable from other machines: "
                "a key that can be guessed is no key"
            )
        fixed, _ = _fixed(self)
        if self.api_keys_file is not None:
            try:
                parse_key_file(self.api_keys_file, read_bounded(self.api_keys_file), fixed)
            except NoKey:
                if not _is_loopback(self.host):
                    raise ValueError(
                        f"api_keys_file {self.api_keys_file} holds no key: on a host other machines reach, a key "
                        "source must hold a key (give it one, or unset it)"
                    ) from None
            except OSError as exc:
                raise ValueError(f"api_keys_file: {exc}") from None
        if not keyed and not self.allow_unauthenticated and not _is_loopback(self.host):
            raise ValueError(
                f"host {self.host!r} is reachable from other machines and no api_key is set: "
                "set --api-key (ROLLBUF_API_KEY), or --allow-unauthenticated to accept that"
            )
        return self


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def to_environ(settings: Settings) -> dict[str, str]:
    """The `ROLLBUF_*` variables that rebuild these settings in another process (uvicorn's worker processes
    build their app from the environment)."""
    out = {}
    for name in Settings.model_fields:
        value = getattr(settings, name)
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        if isinstance(value, list):
            out[f"ROLLBUF_{name.upper()}"] = json.dumps(value)
            continue
        out[f"ROLLBUF_{name.upper()}"] = (
            "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        )
    return out


def _fixed(settings: Settings) -> tuple[list[Key], list[str]]:
    """`api_key`'s and `api_keys`' keys, checked (`api.keys.keyring.fixed_keys`), and warnings."""
    return fixed_keys(
        None if settings.api_key is None else settings.api_key.get_secret_value(),
        None if settings.api_keys is None else settings.api_keys.get_secret_value(),
        required=not _is_loopback(settings.host),
    )


def door_keys(settings: Settings) -> Callable[[], list[Key]] | None:
    """The keys the front door checks, as a function (a key file is read again when it changes); None only when
    no key source is set. A source set but empty leaves a keyed server with no keys, which refuses every
    request needing one: keys fail closed."""
    keyed = settings.api_key is not None or settings.api_keys is not None or settings.api_keys_file is not None
    if not keyed:
        return None
    fixed, _ = _fixed(settings)
    if settings.api_keys_file is not None:
        return KeyFile(
            settings.api_keys_file,
            fixed,
            required=not _is_loopback(settings.host),
            settle_s=settings.api_keys_file_settle,
        )
    return lambda: fixed


def log_keys(settings: Settings, keys: Callable[[], list[Key]] | None) -> None:
    """At start: the active keys' names and roles (never a secret), and why a key source gives none."""
    if keys is None:
        return
    for warning in _fixed(settings)[1]:
        log.warning("%s", warning)
    if isinstance(keys, KeyFile) and keys.error is not None:
        log.error("api_keys_file %s: %s", keys.path, keys.error)
    log.info("keys in use: %s", describe(keys()) or "none (every request needing a key is refused)")


def inflight_per_client(settings: Settings) -> int:
    """`max_inflight_bytes_per_client`, or its default: half the budget, at least one valid request's bytes."""
    if settings.max_inflight_bytes_per_client is not None:
        return settings.max_inflight_bytes_per_client
    one_request = settings.max_body_bytes + settings.max_decompressed_bytes
    return min(settings.max_inflight_bytes, max(settings.max_inflight_bytes // 2, one_request))


def door_hosts(settings: Settings) -> tuple[str, ...] | None:
    """`allowed_hosts`, or its default: loopback names on a keyless loopback server, any host otherwise."""
    if settings.allowed_hosts is not None:
        return tuple(h.lower() for h in settings.allowed_hosts)
    keyed = settings.api_key is not None or settings.api_keys is not None or settings.api_keys_file is not None
    return ("loopback",) if not keyed and _is_loopback(settings.host) else None
