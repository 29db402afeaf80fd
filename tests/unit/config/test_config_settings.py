"""The one settings object: sources, refusals, and the round trip through the environment for workers."""

from __future__ import annotations

import os

import pytest
from pydantic import SecretStr, ValidationError

from api.app import create_app
from api.batches.formation import FormationRules
from api.batches.planner import LookAhead
from api.config.groups import GROUPS, built
from api.config.settings import Settings, to_environ
from api.ingest.queue_limits import QueueLimits
from api.ingest.side_buffer import SideLimits
from api.ledger.drop_bias import Thresholds
from api.ledger.rules import LedgerSettings
from api.producers.stored import ProducerSettings
from api.run.kept import ReadAhead
from api.service import Service
from api.store import make_store
from api.views.metrics import MAX_ENVS as METRICS_MAX_ENVS


def test_environment_round_trip_rebuilds_the_same_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    original = Settings(
        store="sqlite:///x.db",
        workers=3,
        api_key=SecretStr("k"),
        max_queue_tokens=None,
        max_env_queue_groups=7,
        allow_unauthenticated=True,
        retry_after=0.5,
    )
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


def test_every_setting_is_declared_once_in_one_concern() -> None:
    names = [name for group in GROUPS for name in group.model_fields]
    assert len(names) == len(set(names))
    assert list(Settings.model_fields) == names  # flat: `--max-queue-tokens`, `ROLLBUF_MAX_QUEUE_TOKENS`


def test_in_process_defaults_are_the_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A `Service()` built in process (tests, embedding) holds what `rollbuf serve` holds with no flags: its
    config objects take their defaults from the settings' concerns."""
    for key in [k for k in os.environ if k.startswith("ROLLBUF_")]:
        monkeypatch.delenv(key)
    server = Settings()
    service = Service(make_store("memory://"))
    assert service.limits == built(QueueLimits, server)
    assert (service.limits.max_tokens, service.limits.max_bytes) == (2**28, 4 << 30)  # bounded, as the server
    assert service.limits.side == built(SideLimits, server)
    assert service.read_ahead == built(ReadAhead, server)
    assert service.ledger.settings == built(LedgerSettings, server)
    assert service.rules == built(FormationRules, server)
    assert service.rules.look_ahead == built(LookAhead, server)
    assert service.ledger.bias.thresholds == built(Thresholds, server)
    assert service.producers.settings == built(ProducerSettings, server)
    assert METRICS_MAX_ENVS == server.metrics_max_envs


@pytest.mark.anyio
async def test_the_app_builds_its_service_from_its_settings() -> None:
    settings = Settings(
        store="memory://",
        max_queue_tokens=None,
        max_read_ahead_batches=3,
        ledger=False,
        formation_due_after=9,
        drop_bias_starve_steps=4,
        max_producers=7,
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        service: Service = app.state.service
        assert service.limits.max_tokens is None and service.read_ahead.max_batches == 3
        assert not service.ledger.settings.enabled and service.rules.look_ahead.due_after == 9
        assert service.ledger.bias.thresholds.starve_steps == 4 and service.producers.settings.max_producers == 7
