"""Delta payloads: small tensors patched together in buckets, large ones alone, old payloads."""

from __future__ import annotations

import json

import numpy as np
import pytest
import safetensors.numpy
import torch

from weightstore import payload as payload_mod
from weightstore.errors import CorruptPatch
from weightstore.manifest import Manifest, TensorInfo, dtype_name, weights_sha256
from weightstore.patch.codec import encode_patch, tensor_bits
from weightstore.payload import (
    BUCKET_PREFIX, BUCKETS_METADATA, apply_delta, delta_payload, payload_metadata, plan_buckets,
)  # fmt: skip


def trained_pair(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Weights before and after one real AdamW step of a small MLP, published as bf16, plus an
    fp32 buffer that also moves and an int64 counter that does not."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 40), torch.nn.Linear(40, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def snapshot(step: int) -> dict[str, torch.Tensor]:
        state = {n: t.detach().to(torch.bfloat16).clone() for n, t in model.state_dict().items()}
        state["stats.running_mean"] = torch.linspace(0, 1, 30) * (1 + step)
        state["stats.count"] = torch.tensor([7, 8, 9], dtype=torch.int64)
        return state

    before = snapshot(0)
    loss = model(torch.randn(32, 8)).square().mean()
    loss.backward()
    opt.step()
    return before, snapshot(1)


def manifest_of(state: dict[str, torch.Tensor], version: int = 1) -> Manifest:
    return Manifest(
        version=version, policy="main", kind="delta", base_version=version - 1, anchor_version=0,
        codec="rbdp1+safetensors", dtype="bfloat16", chunks=[],
        tensors={n: TensorInfo(shape=list(t.shape), dtype=dtype_name(t.dtype)) for n, t in state.items()},
        weights_sha256=weights_sha256(state), publisher_id="test",
    )  # fmt: skip


def assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert np.array_equal(tensor_bits(got[name].contiguous()), tensor_bits(want[name].contiguous())), name


def bucket_table(data: bytes) -> dict[str, list[str]]:
    return json.loads(payload_metadata(data)[BUCKETS_METADATA])


def rewrite(patches: dict[str, np.ndarray], buckets: object) -> bytes:
    """A payload of these patches and this bucket table (damage a test wants to see caught)."""
    return safetensors.numpy.save(patches, metadata={BUCKETS_METADATA: json.dumps(buckets)})


def test_plan_buckets_splits_by_dtype_size_and_leaves_large_tensors_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(payload_mod, "BUCKET_TENSOR_MAX", 100)
    monkeypatch.setattr(payload_mod, "BUCKET_MAX", 150)
    state = {
        "a": torch.zeros(60), "b": torch.zeros(60), "c": torch.zeros(60),  # 180 > 150: two buckets
        "big": torch.zeros(101),  # alone
        "h1": torch.zeros(10, dtype=torch.bfloat16), "h2": torch.zeros(10, dtype=torch.bfloat16),
        "lonely": torch.zeros(3, dtype=torch.int64),  # the only int64: patched under its own name
    }  # fmt: skip
    plan = plan_buckets(state)
    assert sorted(plan.values()) == [["a", "b"], ["h1", "h2"]]
    assert all(key.startswith(BUCKET_PREFIX) for key in plan)
    # "c" would be a bucket of one: patched alone, like "big" and "lonely"
    assert not {"c", "big", "lonely"} & {n for names in plan.values() for n in names}


def test_bucketed_payload_roundtrips_bit_exactly_and_leaves_the_base_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(payload_mod, "BUCKET_TENSOR_MAX", 1000)  # 2.weight (2560 elements) goes alone
    monkeypatch.setattr(payload_mod, "BUCKET_MAX", 2000)
    old, new = trained_pair()
    data = delta_payload(old, new)
    patches = safetensors.numpy.load(data)
    table = bucket_table(data)
    assert table, "small changed tensors should travel in buckets"
    assert "2.weight" in patches and "stats.running_mean" in patches  # too large; the only fp32 tensor
    assert sorted(n for v in table.values() for n in v) == ["0.bias", "0.weight", "2.bias", "3.bias", "3.weight"]
    assert "stats.count" not in patches and all("stats.count" not in v for v in table.values())  # unchanged
    assert set(table) <= set(patches)
    base = {n: t.clone() for n, t in old.items()}
    state = dict(old)
    owned: set[str] = set()
    apply_delta(state, owned, data, manifest_of(new))
    assert_bit_equal(state, new)
    assert_bit_equal(old, base)  # the follower's current weights were not written to
    assert {n for v in table.values() for n in v} <= owned
    assert weights_sha256(state) == weights_sha256(new)


def test_payload_without_buckets_from_before_still_applies() -> None:
    old, new = trained_pair(1)
    legacy = safetensors.numpy.save(
        {n: np.frombuffer(encode_patch(old[n], new[n]), dtype=np.uint8) for n in sorted(new) if n != "stats.count"}
    )
    state = dict(old)
    apply_delta(state, set(), legacy, manifest_of(new))
    assert_bit_equal(state, new)


def test_two_versions_in_a_row_through_buckets() -> None:
    old, mid = trained_pair(2)
    new = {n: t.clone() for n, t in mid.items()}
    new["0.bias"] = new["0.bias"] + 1
    state = dict(old)
    owned: set[str] = set()
    apply_delta(state, owned, delta_payload(old, mid), manifest_of(mid, 1))
    apply_delta(state, owned, delta_payload(mid, new), manifest_of(new, 2))
    assert_bit_equal(state, new)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p, t: (p, {**t, f"{BUCKET_PREFIX}9": ["0.bias"]}), "has no patch"),
        (lambda p, t: (p, {k: [*v, "nope"] for k, v in t.items()}), "not in the weights"),
        (lambda p, t: (p, {k: [*v, "stats.count"] for k, v in t.items()}), "mixes dtypes"),
        (lambda p, t: (p, {k: [*v, v[0]] for k, v in t.items()}), "patched twice"),
        (lambda p, t: ({**p, next(iter(t.values()))[0]: p[next(iter(t))]}, t), "patched twice"),  # and alone
        (lambda p, t: ({**p, "x": p[next(iter(t))]}, t), "unknown tensors"),
        (lambda p, t: (p, {k: v[::-1] for k, v in t.items()}), "other weights"),
        (lambda p, t: (p, {"wrong": v for v in t.values()}), "has no patch"),
        (lambda p, t: (p, ["a", "list"]), "must map keys"),
    ],
)
def test_a_damaged_bucket_table_is_refused_before_any_write(damage, message: str) -> None:
    old, new = trained_pair(3)
    data = delta_payload(old, new)
    table = bucket_table(data)
    patches, table = damage(dict(safetensors.numpy.load(data)), table)
    base = {n: t.clone() for n, t in old.items()}
    state = dict(old)
    with pytest.raises(CorruptPatch, match=message):
        apply_delta(state, set(), rewrite(patches, table), manifest_of(new))
    assert_bit_equal(old, base)


def test_unreadable_bucket_table_and_reserved_names() -> None:
    old, new = trained_pair(4)
    data = delta_payload(old, new)
    garbled = safetensors.numpy.save(dict(safetensors.numpy.load(data)), metadata={BUCKETS_METADATA: "{not json"})
    with pytest.raises(CorruptPatch, match="unreadable bucket table"):
        apply_delta(dict(old), set(), garbled, manifest_of(new))
    with pytest.raises(ValueError, match="reserved"):
        delta_payload({f"{BUCKET_PREFIX}0": torch.zeros(2)}, {f"{BUCKET_PREFIX}0": torch.ones(2)})


def test_a_bucket_patch_for_other_weights_is_refused() -> None:
    old, new = trained_pair(5)
    other = {n: t.clone() for n, t in old.items()}
    other["0.bias"] = other["0.bias"] + 1  # a member of a bucket differs from the patch's base
    base = {n: t.clone() for n, t in other.items()}
    with pytest.raises(CorruptPatch, match="other weights"):
        apply_delta(dict(other), set(), delta_payload(old, new), manifest_of(new))
    assert_bit_equal(other, base)
