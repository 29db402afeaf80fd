"""Store URLs: a password never shows, and the reply limits read the same on every durable backend."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.store.postgres import parse_url as postgres_url
from api.store.sqlite import parse_url as sqlite_url
from api.store.url import (
    COMMIT_DELAY_MAX_US,
    COMMIT_DELAY_US,
    DURABLE_PARAMS,
    MAX_REPLIES,
    Durable,
    durable_params,
    redacted,
    without_password,
)


def test_redacted_masks_only_the_password() -> None:
    assert redacted("postgresql://u:secret@h:5432/db?x=1") == "postgresql://u:***@h:5432/db?x=1"
    assert redacted("postgresql://u@h/db") == "postgresql://u@h/db"
    assert redacted("sqlite:///data/x.db") == "sqlite:///data/x.db"
    # libpq also reads the password from the query: printed unmasked before
    assert redacted("postgresql://u@h/db?password=pw&schema=s") == "postgresql://u@h/db?password=***&schema=s"
    assert without_password("no: postgresql://u@h/db?password=pw", "postgresql://u@h/db?password=pw") == (
        "no: postgresql://u@h/db?password=***"
    )


@given(st.text("ABCXYZ0123456789", min_size=1, max_size=20))
def test_no_message_quotes_the_password(password: str) -> None:
    """(Passwords of upper-case letters and digits: the rest of the text, lower-case, cannot contain one.)"""
    url = f"postgresql://u:{password}@h/db"
    message = f"could not connect to {url}: password {password} refused"
    assert redacted(url) == "postgresql://u:***@h/db"
    assert without_password(message, url) == "could not connect to postgresql://u:***@h/db: password *** refused"


def test_durable_parameters_parse_alike_on_every_backend() -> None:
    default = Durable(max_replies=MAX_REPLIES, reply_ttl=None, commit_delay=COMMIT_DELAY_US / 1e6)
    assert durable_params({}, "x://") == Durable() == default
    given = {"max_replies": "5", "reply_ttl": "1.5", "commit_delay": "0"}
    assert durable_params(given, "x://") == Durable(max_replies=5, reply_ttl=1.5, commit_delay=0.0)
    bad = (
        {"max_replies": "x"},
        {"max_replies": "-1"},
        {"reply_ttl": "-2"},
        {"reply_ttl": "nan"},
        {"commit_delay": "-1"},
        {"commit_delay": "0.5"},
        {"commit_delay": ""},
        {"commit_delay": str(COMMIT_DELAY_MAX_US + 1)},
    )
    for params in bad:
        [name] = params
        with pytest.raises(ValueError, match=f": {name} must") as raised:  # the parameter at fault, alone
            durable_params(params, "x://")
        assert not (DURABLE_PARAMS - {name}) & set(str(raised.value).replace(",", " ").split()), raised.value
    query = "max_replies=7&reply_ttl=60&commit_delay=1500"
    for config in (sqlite_url(f"sqlite:///x.db?{query}"), postgres_url(f"postgresql://h/db?{query}")):
        assert (config.max_replies, config.reply_ttl, config.commit_delay) == (7, 60.0, 0.0015)


def test_a_bad_parameter_names_the_url_without_its_password() -> None:
    with pytest.raises(ValueError, match=r"u:\*\*\*@h") as err:
        postgres_url("postgresql://u:hunter2@h/db?max_replies=lots")
    assert "hunter2" not in str(err.value)
