"""FastAPI's OpenTelemetry instrumentation is decided once, when the app is built: off without a provider (it
would ask on every request), on where one is configured first (`opentelemetry-instrument`)."""

from __future__ import annotations

import pytest
from opentelemetry import trace

from api.app import TELEMETRY_OFF, create_app, otel_configured
from api.config.settings import Settings


def test_without_a_provider_the_instrumentation_is_off() -> None:
    assert not otel_configured()
    app = create_app(Settings())
    assert all(app._telemetry[k] is False for k in TELEMETRY_OFF)  # noqa: SLF001 (FastAPI keeps it there)


def test_a_provider_configured_before_the_app_is_built_keeps_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace, "get_tracer_provider", trace.NoOpTracerProvider)  # any real provider, not the proxy
    assert otel_configured()
    app = create_app(Settings())
    assert app._telemetry["tracing"] is True  # noqa: SLF001
