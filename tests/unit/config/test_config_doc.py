"""docs/settings.md's tables are what the settings' declarations generate: a setting added, a default or a
meaning changed without `python -m api.config.doc` fails here."""

from __future__ import annotations

from api.config.doc import DOC, default_text, main, render
from api.config.groups import GROUPS, QueueSettings, RequestLimits, ServerSettings


def test_the_doc_is_what_the_settings_generate() -> None:
    current = DOC.read_text()
    assert render(current) == current, "docs/settings.md differs from api/config/groups.py: python -m api.config.doc"
    assert main(["--check"]) == 0


def test_every_setting_has_a_row() -> None:
    current = DOC.read_text()
    for group in GROUPS:
        for name in group.model_fields:
            assert f"\n| `{name}` | " in current, name


def test_defaults_read_as_an_operator_would() -> None:
    queue, requests, server = QueueSettings.model_fields, RequestLimits.model_fields, ServerSettings.model_fields
    assert default_text("max_queue_bytes", queue["max_queue_bytes"]) == "4 GiB"
    assert default_text("max_header_bytes", requests["max_header_bytes"]) == "64 KiB"
    assert default_text("max_queue_groups", queue["max_queue_groups"]) == "none"
    assert default_text("metrics", server["metrics"]) == "`true`"
    assert default_text("retry_after", queue["retry_after"]) == "`2`"
    assert default_text("max_queue_tokens", queue["max_queue_tokens"]) == "268435456 (2^28)"
