"""The one settings object: sources, refusals, and the round trip through the environment for workers."""

from __future__ import annotations

import pytest
from pydantic import SecretStr, ValidationError

from api.settings import Settings, to_environ


def test_environment_round_trip_rebuilds_the_same_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    original = Settings(
        store="sqlite:///x.db", workers=3, api_key=SecretStr("k"), max_queue_tokens=None, max_env_queue_groups=7,
        allow_unauthenticated=True, retry_after=0.5,
    )  # fmt: skip
    for key, value in to_environ(original).items():
        monkeypatch.setenv(key, value)
    rebuilt = Settings()
    assert rebuilt.model_dump() == original.model_dump()
    assert rebuilt.api_key is not None and rebuilt.api_key.get_secret_value() == "k"


def test_null_unsets_an_optional_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().max_queue_tokens == 2**28
    monkeypatch.setenv("ROLLBUF_MAX_QUEUE_TOKENS", "null")
    assert Settings().max_queue_tokens is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"store": "memory://", "workers": 2}, "workers=2 needs a store the processes share"),
        ({"host": "0.0.0.0"}, "no api_key is set"),
        ({"store": "redis://localhost"}, "use memory://, sqlite:///path.db or postgresql://"),
    ],
)
def test_unsafe_or_impossible_settings_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Settings(**kwargs)  # type: ignore[arg-type]
