"""Lease tokens (api/tasks/tokens.py): any text parses or is None, with numbers every store holds, and one that
parses is exactly the token the server writes for its parts; every token the server writes parses back."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from api.tasks import tokens as task_tokens

digits = st.text(st.sampled_from("0123456789²٣߁𝟗¹") | st.characters(categories=["Nd"]), min_size=1, max_size=4)
"""ASCII digits and what else `str.isdigit` or `int` take (superscripts, Arabic-Indic, mathematical digits)."""
numbers = (
    digits
    | st.integers(0, 2**80).map(str)
    | st.integers(0, 10**18).map(lambda n: f"0{n}")
    | st.text(st.characters(categories=["Cs", "Nd", "Zs"]), max_size=3)
)
nonces = st.just("") | st.text("0123456789abcdefABCDEF\ud800", min_size=20, max_size=26).map(lambda t: "." + t)
tokens = st.builds(
    lambda name, epoch, index, lease, nonce: f"task:{name}:{epoch}:{index}:{lease}{nonce}",
    st.sampled_from(["gsm8k", "a.b-c_d", "x" * 64, "x" * 65, "", "d:e", "d\ud800"]),
    numbers,
    numbers,
    numbers,
    nonces,
)


@settings(max_examples=400, deadline=None)
@given(tokens | st.text(max_size=40) | st.text(st.characters(categories=["Cs", "Nd"]), max_size=40))
def test_a_lease_token_parses_totally_and_only_as_the_server_writes_it(token: str) -> None:
    """Any text is a token or not (no exception): Unicode digits, integers past 64 bits, leading zeros, lone
    surrogates. One that parses is exactly the token `token_of` writes for its parts (one text per lease), with
    numbers every store holds (below 2^63)."""
    parsed = task_tokens.parse_token(token)
    if parsed is None:
        return
    assert all(0 <= n < 2**63 for n in (parsed.epoch, parsed.index, parsed.lease))
    assert task_tokens.token_of(parsed.dataset, parsed.epoch, parsed.index, parsed.lease, parsed.nonce) == token


@given(
    st.text(max_size=30),
    st.integers(0, 10**18 - 1),
    st.integers(0, 10**18 - 1),
    st.integers(0, 10**18 - 1),
    st.none() | st.binary(min_size=12, max_size=12).map(bytes.hex),
)
def test_every_token_the_server_writes_parses_back(name: str, epoch: int, index: int, lease: int, nonce: str) -> None:
    name = "".join(c for c in name if c.isascii() and (c.isalnum() or c in "_.-"))[:64] or "d"
    token = task_tokens.token_of(name, epoch, index, lease, nonce)
    assert task_tokens.parse_token(token) == task_tokens.Token(name, epoch, index, lease, nonce)
