"""Padded and packed views against a naive per-sequence reference, and the torch tensors a training step
takes as they come: int64 ids and labels, bool masks, float32 floats, values equal to the numpy arrays."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.wire.records import GroupRecord
from tests.clients.test_arrays import group_lengths, make_records
from trainer_client.arrays import Batch, from_records

torch = pytest.importorskip("torch")

equal_lengths = st.integers(1, 30).flatmap(
    lambda n: st.lists(st.lists(st.just(n), min_size=1, max_size=5), min_size=1, max_size=6)
)


def reference_padded(batch: Batch, width: int, pad_id: int) -> dict[str, np.ndarray]:
    """One sequence at a time, the obvious way."""
    n = batch.n_seqs
    out = {
        "tokens": np.full((n, width), pad_id, np.int32),
        "masks": np.full((n, width), -100, np.int32),
        "attention_mask": np.zeros((n, width), bool),
        "advantages": np.zeros((n, width), np.float32),
        **{k: np.zeros((n, width), np.float32) for k in batch.floats},
    }
    adv = batch.advantages
    for i, (a, b) in enumerate(zip(batch.offsets[:-1], batch.offsets[1:], strict=True)):
        out["tokens"][i, : b - a] = batch.tokens[a:b]
        out["masks"][i, : b - a] = batch.masks[a:b]
        out["attention_mask"][i, : b - a] = True
        out["advantages"][i, : b - a] = adv[a:b]
        for k, v in batch.floats.items():
            out[k][i, : b - a] = v[a:b]
    return out


def padded_arrays(batch: Batch, multiple: int = 1, pad_id: int = 0) -> dict[str, np.ndarray]:
    p = batch.padded(pad_to_multiple_of=multiple, pad_id=pad_id)
    return {
        "tokens": p.tokens,
        "masks": p.masks,
        "attention_mask": p.attention_mask,
        "advantages": p.advantages,
        **p.floats,
    }


@given(st.one_of(group_lengths, equal_lengths), st.integers(1, 8), st.lists(st.booleans(), min_size=12, max_size=12))
@settings(max_examples=120)
def test_padded_equals_the_per_sequence_reference(groups: list[list[int]], multiple: int, sent: list[bool]) -> None:
    batch = from_records(make_records(groups, advantages=sent[: len(groups)]), step=0)
    got = padded_arrays(batch, multiple, pad_id=5)
    width = got["tokens"].shape[1]
    want = reference_padded(batch, width, pad_id=5)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k], equal_nan=True), k


def test_equal_lengths_are_reshaped_views_without_a_copy() -> None:
    batch = from_records(make_records([[6, 6, 6], [6]]), step=0)
    p = batch.padded()
    assert np.shares_memory(p.tokens, batch.tokens) and p.tokens.shape == (4, 6)
    assert np.array_equal(p.tokens, reference_padded(batch, 6, 0)["tokens"])


@given(group_lengths, st.integers(40, 90))
@settings(max_examples=80)
def test_packed_equals_the_per_sequence_reference(groups: list[list[int]], max_len: int) -> None:
    batch = from_records(make_records(groups, advantages=[i % 2 == 1 for i in range(len(groups))]), step=0)
    p = batch.packed(max_len, pad_id=9)
    rows = p.tokens.shape[0]
    tokens = np.full((rows, max_len), 9, np.int32)
    segment = np.full((rows, max_len), -1, np.int32)
    position = np.zeros((rows, max_len), np.int32)
    advantages = np.zeros((rows, max_len), np.float32)
    logprobs = np.zeros((rows, max_len), np.float32)
    adv = batch.advantages
    for i, (a, b) in enumerate(zip(batch.offsets[:-1], batch.offsets[1:], strict=True)):
        r, c = p.row[i], p.start[i]
        tokens[r, c : c + b - a] = batch.tokens[a:b]
        segment[r, c : c + b - a] = i
        position[r, c : c + b - a] = np.arange(b - a)
        advantages[r, c : c + b - a] = adv[a:b]
        logprobs[r, c : c + b - a] = batch.floats["inference_logprobs"][a:b]
    assert np.array_equal(p.tokens, tokens) and np.array_equal(p.segment_ids, segment)
    assert np.array_equal(p.position_ids, position) and np.array_equal(p.advantages, advantages)
    assert np.array_equal(p.floats["inference_logprobs"], logprobs)
    assert np.array_equal(p.masks, np.where(segment >= 0, p.masks, -100))


def test_padded_tensors_have_the_dtypes_a_loss_takes_and_equal_the_arrays() -> None:
    batch = from_records(make_records([[3, 5], [4]]), step=0)
    p = batch.padded(pad_to_multiple_of=8)
    t = p.to_torch()
    assert sorted(t) == ["advantages", "attention_mask", "inference_logprobs", "labels", "tokens", "trained"]
    assert t["tokens"].dtype == torch.int64 and t["labels"].dtype == torch.int64
    assert t["trained"].dtype == torch.bool and t["attention_mask"].dtype == torch.bool
    assert t["advantages"].dtype == torch.float32 and t["inference_logprobs"].dtype == torch.float32
    assert all(v.shape == (3, 8) and v.device.type == "cpu" for v in t.values())
    trained = p.masks != -100
    assert np.array_equal(t["tokens"].numpy(), p.tokens)
    assert np.array_equal(t["trained"].numpy(), trained)
    assert np.array_equal(t["labels"].numpy(), np.where(trained, p.tokens, -100))
    assert np.array_equal(t["attention_mask"].numpy(), p.attention_mask)
    assert np.array_equal(t["advantages"].numpy(), p.advantages)
    assert np.array_equal(t["inference_logprobs"].numpy(), p.floats["inference_logprobs"])
    # as they come: an embedding takes the ids, cross_entropy the labels (ignoring -100), a loss the bool mask
    emb = torch.nn.Embedding(50_000, 4)
    logits = emb(t["tokens"]) @ torch.randn(4, 50_000)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), t["labels"].flatten())
    assert torch.isfinite(loss)
    assert float(t["advantages"][t["trained"]].abs().sum()) == float(np.abs(p.advantages[trained]).sum())


def test_labels_follow_the_trained_positions_whatever_the_masks_hold() -> None:
    """A handler that sent 1 for "train here" still gets token ids as labels, never the mask's value."""
    [rec] = make_records([[4]])
    rec = GroupRecord(
        **{
            **{f: getattr(rec, f) for f in GroupRecord.__dataclass_fields__},
            "masks": np.array([-100, 1, 1, -100], np.int32),
        }
    )
    t = from_records([rec], step=0).padded().to_torch()
    assert t["labels"].tolist() == [[-100, int(rec.tokens[1]), int(rec.tokens[2]), -100]]


def test_packed_and_flat_tensors() -> None:
    batch = from_records(make_records([[3, 5], [4]]), step=0)
    p = batch.packed(8)
    t = p.to_torch("cpu")
    for k in ("tokens", "labels", "position_ids", "segment_ids"):
        assert t[k].dtype == torch.int64 and t[k].shape == p.tokens.shape, k
    assert np.array_equal(t["position_ids"].numpy(), p.position_ids)
    assert np.array_equal(t["segment_ids"].numpy(), p.segment_ids)
    flat = batch.to_torch()
    assert flat["tokens"].dtype == torch.int64 and flat["offsets"].dtype == torch.int64
    assert flat["group_index"].dtype == torch.int64 and flat["scores"].dtype == torch.float64
    assert np.array_equal(flat["labels"].numpy(), np.where(batch.masks != -100, batch.tokens, -100))


def test_read_only_arrays_are_copied_without_a_warning() -> None:
    batch = from_records(make_records([[4, 4]]), step=0)
    frozen = np.frombuffer(batch.tokens.tobytes(), np.int32).reshape(2, 4)
    p = batch.padded()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from trainer_client.tensors import to_tensors

        t = to_tensors({"tokens": frozen, "masks": p.masks, "advantages": p.advantages.copy()})
    assert np.array_equal(t["tokens"].numpy(), frozen)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_straight_onto_a_cuda_device() -> None:
    batch = from_records(make_records([[3, 5], [4]], versions=[True, False]), step=0)
    p = batch.padded()
    t = p.to_torch("cuda")
    torch.cuda.synchronize()
    assert all(v.device.type == "cuda" for v in t.values())
    assert t["tokens"].dtype == torch.int64 and t["trained"].dtype == torch.bool
    cpu = p.to_torch()
    for k, v in cpu.items():
        assert torch.equal(t[k].cpu(), v), k


def test_merged_advantages_win_over_the_handlers_raw_ones_in_tensors() -> None:
    """`floats["advantages"]` is NaN where a group sent none; the tensor is the merged `advantages`."""
    batch = from_records(make_records([[3], [2]], advantages=[True, False]), step=0)
    p = batch.padded()
    t = p.to_torch()
    assert np.array_equal(t["advantages"].numpy(), p.advantages) and not np.isnan(p.advantages).any()
    assert np.isnan(p.floats["advantages"]).any()


def test_the_device_path_gives_the_same_dtypes_and_shapes() -> None:
    """The path a GPU takes (copy narrow, widen and derive labels there), on torch's `meta` device: shapes and
    dtypes without data, so it runs on a machine with no GPU."""
    p = from_records(make_records([[3, 5], [4]]), step=0).padded()
    on_host, on_meta = p.to_torch(), p.to_torch("meta")
    assert sorted(on_meta) == sorted(on_host)
    for k, v in on_host.items():
        assert on_meta[k].device.type == "meta" and on_meta[k].dtype == v.dtype and on_meta[k].shape == v.shape, k


def test_weight_versions_travel_as_int64_beside_the_masks() -> None:
    """Per-token weight versions (a group that sent them, one that did not: -1) in every view's tensors, on the host
    and on the device path."""
    batch = from_records(make_records([[3, 5], [4]], versions=[True, False]), step=0)
    assert batch.weight_versions is not None
    for view in (batch, batch.padded(), batch.packed(8)):
        on_host, on_meta = view.to_torch(), view.to_torch("meta")
        versions = view.weight_versions
        assert versions is not None
        assert on_host["weight_versions"].dtype == torch.int64
        assert np.array_equal(on_host["weight_versions"].numpy(), versions)
        assert on_meta["weight_versions"].dtype == torch.int64 and on_meta["weight_versions"].shape == versions.shape
    assert "weight_versions" not in from_records(make_records([[3]]), step=0).padded().to_torch()
