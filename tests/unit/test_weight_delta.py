"""The sparse patch codec reproduces the publisher's bits exactly, and refuses damaged patches."""

from __future__ import annotations

import pytest
import torch

from weightstore.delta import HEADER_BYTES, apply_patch, encode_patch, patch_info
from weightstore.errors import CorruptPatch, IntegrityError


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bit patterns, so NaN payloads and signed zeros compare exactly."""
    flat = t.contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    return flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])


def assert_same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(bits(a[name]), bits(b[name])), name


def train_snapshots(dtype: torch.dtype, lr: float, steps: int) -> list[dict[str, torch.Tensor]]:
    """Weights (cast to ``dtype``) after each of ``steps`` real AdamW steps on a real loss."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(64, 32),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 8, 64),
        torch.nn.GELU(),
        torch.nn.LayerNorm(64),
        torch.nn.Linear(64, 64),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    tokens = torch.randint(0, 64, (128, 8))
    targets = (tokens.sum(dim=1) % 64).long()
    snapshots = [{n: p.detach().to(dtype).clone() for n, p in model.state_dict().items()}]
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(tokens), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        snapshots.append({n: p.detach().to(dtype).clone() for n, p in model.state_dict().items()})
    return snapshots


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("lr", [1e-3, 1e-6])
def test_patch_chain_after_adamw_steps_is_bit_exact(dtype: torch.dtype, lr: float) -> None:
    snapshots = train_snapshots(dtype, lr, steps=4)
    follower = {n: t.clone() for n, t in snapshots[0].items()}
    for old, new in zip(snapshots, snapshots[1:]):
        for name in new:
            apply_patch(follower[name], encode_patch(old[name], new[name]))
        assert_same_bits(follower, new)
    if lr == 1e-3:
        changed = sum(patch_info(encode_patch(snapshots[0][n], snapshots[1][n])).changed for n in follower)
        assert changed > 0, "AdamW at lr 1e-3 must change some weights"


def test_identical_tensors_give_an_empty_patch_that_changes_nothing() -> None:
    t = torch.randn(100, 10).to(torch.bfloat16)
    patch = encode_patch(t, t.clone())
    info = patch_info(patch)
    assert info.changed == 0 and info.position_mode == "none" and len(patch) == HEADER_BYTES
    target = t.clone()
    apply_patch(target, patch)
    assert torch.equal(bits(target), bits(t))


def test_dense_patch_overwrites_every_element() -> None:
    old = torch.randn(257, 3)
    new = old + 1.0
    patch = encode_patch(old, new)
    assert patch_info(patch).position_mode == "all"
    target = old.clone()
    apply_patch(target, patch)
    assert torch.equal(bits(target), bits(new))


@pytest.mark.parametrize(("fraction", "mode"), [(0.001, "varint"), (0.5, "bitmask")])
def test_position_encoding_follows_density(fraction: float, mode: str) -> None:
    torch.manual_seed(1)
    old = torch.randn(100_000).to(torch.float16)
    new = old.clone()
    mask = torch.rand(old.shape) < fraction
    new[mask] = (new[mask].float() * 0.5 + 0.125).to(torch.float16)
    patch = encode_patch(old, new)
    assert patch_info(patch).position_mode == mode
    target = old.clone()
    apply_patch(target, patch)
    assert torch.equal(bits(target), bits(new))


def test_patch_writes_values_so_a_drifted_target_is_corrected() -> None:
    """Patch semantics: changed positions get the new bits, whatever the target held there."""
    old = torch.zeros(10)
    new = old.clone()
    new[3] = 7.0
    drifted = old.clone()
    drifted[3] = 123.0
    apply_patch(drifted, encode_patch(old, new))
    assert drifted[3].item() == 7.0


def test_special_values_and_integer_tensors_are_exact() -> None:
    old = torch.tensor([0.0, 1.0, float("inf"), 2.0, 3.0], dtype=torch.bfloat16)
    new = torch.tensor([-0.0, float("nan"), float("-inf"), 2.0, 3.0], dtype=torch.bfloat16)
    target = old.clone()
    apply_patch(target, encode_patch(old, new))
    assert torch.equal(bits(target), bits(new))
    ints = torch.arange(1000, dtype=torch.int64).reshape(10, 100)
    changed = ints.clone()
    changed[4, 7] = -(2**62)
    target_i = ints.clone()
    apply_patch(target_i, encode_patch(ints, changed))
    assert torch.equal(target_i, changed)


def test_non_contiguous_source_and_scalar() -> None:
    old = torch.randn(8, 6)
    new = (old + 0.5).t()
    patch = encode_patch(old.t(), new)
    target = old.t().contiguous()
    apply_patch(target, patch)
    assert torch.equal(target, new)
    scalar = torch.tensor(1.5)
    apply_patch(scalar, encode_patch(torch.tensor(1.5), torch.tensor(-2.0)))
    assert scalar.item() == -2.0


def damaged(patch: bytes, how: str) -> bytes:
    if how == "truncated":
        return patch[:-5]
    if how == "flipped_payload_byte":
        i = HEADER_BYTES + (len(patch) - HEADER_BYTES) // 2
        return patch[:i] + bytes([patch[i] ^ 0x40]) + patch[i + 1 :]
    if how == "bad_magic":
        return b"XXXX" + patch[4:]
    if how == "future_version":
        return patch[:4] + bytes([99]) + patch[5:]
    if how == "wrong_count":
        return patch[:16] + (10**9).to_bytes(8, "little") + patch[24:]
    raise AssertionError(how)


@pytest.mark.parametrize(
    "how", ["truncated", "flipped_payload_byte", "bad_magic", "future_version", "wrong_count"]
)
def test_corrupted_patch_raises_and_leaves_target_untouched(how: str) -> None:
    torch.manual_seed(2)
    old = torch.randn(5000).to(torch.bfloat16)
    new = old.clone()
    new[::7] = 1.0
    target = old.clone()
    with pytest.raises(CorruptPatch) as info:
        apply_patch(target, damaged(encode_patch(old, new), how))
    assert isinstance(info.value, IntegrityError)
    assert torch.equal(bits(target), bits(old))


def test_patch_for_another_tensor_is_refused() -> None:
    patch = encode_patch(torch.zeros(10), torch.ones(10))
    with pytest.raises(CorruptPatch, match="patch is for"):
        apply_patch(torch.zeros(11), patch)
    with pytest.raises(CorruptPatch, match="patch is for"):
        apply_patch(torch.zeros(10, dtype=torch.float16), patch)
    with pytest.raises(ValueError, match="one dtype and shape"):
        encode_patch(torch.zeros(10), torch.zeros(11))
