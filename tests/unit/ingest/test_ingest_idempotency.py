"""Content digests of groups: equal for the same content however it was sent, different otherwise."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.ingest.idempotency import (
    DIGEST_VERSION,
    content_digest,
    digest_as,
    legacy_digest,
    remember,
    same_content,
    sha256_digest,
)
from api.ingest.validation import GroupLimits, pack_group
from api.wire.records import GroupRecord, decode, encode_submission
from api.wire.schema import ScoredData
from tests.factories import group

LIMITS = GroupLimits(max_token_len=512, max_group_seqs=16)


def packed(body: dict[str, object], step: int = 0):  # type: ignore[no-untyped-def]
    return pack_group(ScoredData.model_validate(body), env_id=0, current_step=step, limits=LIMITS)


def test_json_and_binary_of_one_group_have_one_digest() -> None:
    body = group(3, length=[5, 9, 2], group_id="g", overrides=[{"t": 1.0}] * 3)
    raw = encode_submission(
        body["tokens"],
        body["masks"],
        body["scores"],
        env_id=0,
        group_id="g",
        inference_logprobs=body["inference_logprobs"],
        overrides=body["overrides"],
    )
    assert content_digest(packed(body), None) == content_digest(decode(raw), None)


def test_the_stamped_step_is_not_content() -> None:
    body = group(2, length=4, group_id="g")
    assert content_digest(packed(body, step=0), None) == content_digest(packed(body, step=9), None)
    assert content_digest(packed(body, step=9), 3) != content_digest(packed(body, step=9), None)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 1), st.integers(0, 7), st.integers(1, 1000))
def test_any_change_changes_the_digest(seq: int, pos: int, delta: int) -> None:
    body = group(2, length=8, group_id="g")
    base = content_digest(packed(body), None)
    for field in ("tokens", "masks"):
        other = {**body, field: [list(r) for r in body[field]]}
        other[field][seq][pos] = abs(other[field][seq][pos]) + delta
        assert content_digest(packed(other), None) != base
    other = {**body, "inference_logprobs": [list(r) for r in body["inference_logprobs"]]}
    other["inference_logprobs"][seq][pos] = float(np.nextafter(np.float32(other["inference_logprobs"][seq][pos]), 9))
    assert content_digest(packed(other), None) != base
    versions = [[0] * 8, [0] * 8]
    with_versions = content_digest(packed({**body, "token_weight_versions": versions}), None)
    assert with_versions != base  # sending them is content
    versions[seq][pos] = delta
    assert content_digest(packed({**body, "token_weight_versions": versions}), None) != with_versions


def test_remembered_replies_carry_the_digest_and_legacy_ones_match_anything() -> None:
    text = remember({"status": "received"}, "abc")
    assert same_content(text, "abc") and not same_content(text, "abd")
    assert same_content('{"status":"received"}', "abc")  # remembered before digests existed


@pytest.mark.parametrize("earlier", [legacy_digest, sha256_digest], ids=["blake2b", "sha256"])
def test_digests_remembered_in_an_earlier_form_still_tell_duplicates_from_conflicts(
    earlier: Callable[[GroupRecord, int | None], str],
) -> None:
    body = group(2, length=4, group_id="g")
    rec, other = packed(body), packed({**body, "scores": [9.0, 9.0]})
    text = remember({"status": "received"}, earlier(rec, None))
    assert content_digest(rec, None).startswith(DIGEST_VERSION) and content_digest(rec, None) != earlier(rec, None)
    assert same_content(text, content_digest(rec, None), lambda old: digest_as(old, rec, None))
    assert not same_content(text, content_digest(other, None), lambda old: digest_as(old, other, None))


def test_the_sha256_form_is_the_one_the_previous_version_wrote() -> None:
    """The digest the previous release (ee41de4) remembered for this group, as its `content_digest` gave it: a
    retry across the upgrade is still recognised as the same group."""
    assert sha256_digest(packed(group(2, length=4, group_id="g")), None) == "2:5ff430dd82c3267f07df62e0cdb0258c"


def test_float64_values_float32_holds_have_the_digest_of_float32() -> None:
    body = group(2, length=4, group_id="g")
    rec = packed(body)
    wide = replace(rec, floats={k: v.astype(np.float64) for k, v in rec.floats.items()})
    assert rec.floats and all(v.dtype == np.float32 for v in rec.floats.values())
    assert content_digest(wide, None) == content_digest(rec, None)


def test_a_validated_record_hashes_alike_without_narrowing_again() -> None:
    body = group(2, length=4, group_id="g")
    wide = {**body, "inference_logprobs": [[-0.7] * 4] * 2}  # float64 that float32 does not hold
    for rec in (packed(body), packed(wide)):
        assert content_digest(rec, None, narrowed=True) == content_digest(rec, None)
    assert packed(wide).floats["inference_logprobs"].dtype == np.float64
