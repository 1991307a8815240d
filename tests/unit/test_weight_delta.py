"""The sparse patch codec reproduces the publisher's bits exactly, whatever the values (signed
zeros, NaN payloads, infinities, sign flips, integer wrap-around), and refuses damaged patches
and patches made for other weights."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch
import zstandard

from weightstore.errors import CorruptPatch, IntegrityError
from weightstore.patch.bitcodes import pack_fields, symbols_decode, symbols_encode, unpack_fields, varint_encode
from weightstore.patch.codec import CODE_BY_DTYPE, HEADER_BYTES, apply_patch, encode_patch, patch_info, tensor_bits


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


def roundtrip(old: torch.Tensor, new: torch.Tensor) -> bytes:
    """Encode ``old`` -> ``new``, apply it to a copy of ``old``, check every bit; return it."""
    patch = encode_patch(old, new)
    target = old.clone()
    apply_patch(target, patch)
    assert torch.equal(bits(target), bits(new))
    return patch


def adam_like_step(dtype: torch.dtype, numel: int, lr: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Master weights (float64, std 0.02) moved by ±``lr`` each, both versions cast to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(numel, generator=g, dtype=torch.float64) * 0.02
    step = lr * torch.sign(torch.randn(numel, generator=g, dtype=torch.float64))
    return master.to(dtype), (master + step).to(dtype)


def test_small_magnitudes_form_the_hot_class_and_scattered_changes_use_gaps() -> None:
    old, new = adam_like_step(torch.bfloat16, 300_000, 1e-6, seed=1)
    info = patch_info(roundtrip(old, new))
    assert info.position_mode == "hot+gaps" and 0.01 < info.changed / info.numel < 0.1
    torch.manual_seed(1)
    scattered = old.clone()
    mask = torch.rand(old.shape) < 0.001
    scattered[mask] = (scattered[mask].float() * 0.5 + 0.125).to(torch.bfloat16)
    assert patch_info(roundtrip(old, scattered)).position_mode == "gaps"
    small = torch.randn(1000).to(torch.float16)
    assert patch_info(roundtrip(small, small * 2)).position_mode == "all"


def test_one_ulp_steps_cost_far_less_than_their_values() -> None:
    """A changed bf16 element that moved by one ULP costs a few bits, not 16 + an index."""
    old, new = adam_like_step(torch.bfloat16, 1_000_000, 1e-6, seed=2)
    info = patch_info(roundtrip(old, new))
    assert info.total_bytes * 8 / info.changed < 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("lr", [1e-6, 1e-4])
def test_optimizer_like_steps_are_exact_in_every_float_dtype(dtype: torch.dtype, lr: float) -> None:
    old, new = adam_like_step(dtype, 200_000, lr, seed=3)
    roundtrip(old, new)


def special_floats(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs (old[i] -> new[i]) that exercise every escape of the value code."""
    info = torch.finfo(dtype)
    pairs = [
        (0.0, -0.0), (-0.0, 0.0),  # signed zeros
        (info.tiny, -info.tiny), (-info.tiny, info.tiny),  # sign flips next to zero
        (1e-3, -1e-3), (-2.5, 2.5),  # sign flips far from zero
        (info.smallest_normal / 4, -info.smallest_normal / 8),  # subnormals
        (1.0, float("inf")), (float("inf"), float("-inf")), (float("-inf"), 3.0),
        (1.0, float("nan")), (float("nan"), 1.0),
        (info.tiny, info.max), (info.max, info.tiny), (-info.max, info.max),  # largest jumps
        (1.0, 1.0), (2.0, 2.0),  # unchanged neighbours
    ]
    old = torch.tensor([p[0] for p in pairs], dtype=dtype)
    new = torch.tensor([p[1] for p in pairs], dtype=dtype)
    return old, new


def with_nan_payloads(old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two more elements: a quiet NaN whose payload changes, and a number that becomes a
    negative NaN."""
    size = old.element_size()
    width = 8 * size
    mantissa = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}[old.dtype]
    quiet_nan = (((1 << (width - 1 - mantissa)) - 1) << mantissa) | (1 << (mantissa - 1))
    sign = 1 << (width - 1)
    extra_old = np.array([quiet_nan | 1, 5], dtype=f"<u{size}")
    extra_new = np.array([quiet_nan | 2, sign | quiet_nan | 3], dtype=f"<u{size}")

    def as_tensor(raw: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(raw.view(f"<i{size}")).view(old.dtype)

    return torch.cat([old, as_tensor(extra_old)]), torch.cat([new, as_tensor(extra_new)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("context", ["sparse", "all", "hot"])
def test_sign_flips_nan_inf_and_large_jumps_are_exact(dtype: torch.dtype, context: str) -> None:
    old, new = with_nan_payloads(*special_floats(dtype))
    if context == "all":
        keep = ~torch.eq(bits(old), bits(new))
        old, new = old[keep], new[keep]
    if context == "hot":  # embed them in a big tensor with a hot class
        ulp_at_weights = 0.02 * torch.finfo(dtype).eps  # steps of ~1/40 ULP, like lr 1e-6 in bf16
        big_old, big_new = adam_like_step(dtype, 200_000, ulp_at_weights / 40, seed=4)
        where = torch.arange(old.numel()) * 9973
        big_old[where], big_new[where] = old, new
        old, new = big_old, big_new
    expected = {"sparse": "gaps", "all": "all", "hot": "hot+gaps"}[context]
    assert patch_info(roundtrip(old, new)).position_mode == expected


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64])
def test_integer_extremes_are_exact(dtype: torch.dtype) -> None:
    info = torch.iinfo(dtype)
    half = (info.max - info.min + 1) // 2
    old = torch.tensor([0, info.max, info.min, 0, info.min, 1, 7, 7], dtype=dtype)
    # +1 wrap-around, -1 wrap-around, a jump of exactly half the range (the most negative
    # difference), the largest jump, a small step, and unchanged elements.
    new = torch.tensor([info.min + half, info.min, info.max, 1, info.max, 0, 7, 7], dtype=dtype)
    roundtrip(old, new)
    roundtrip(old[:6], new[:6])  # every element changed
    big = torch.randint(info.min, info.max, (70_000,), dtype=dtype) if dtype != torch.uint8 else (
        torch.randint(0, 255, (70_000,), dtype=dtype)
    )
    changed = big.clone()
    changed[::97] = changed[::97] ^ 1 if dtype != torch.uint8 else changed[::97] + 1
    roundtrip(big, changed)


def test_bool_tensors_are_exact() -> None:
    old = torch.rand(10_000) < 0.5
    new = old.clone()
    new[::13] = ~new[::13]
    roundtrip(old, new)
    roundtrip(old, ~old)


def test_very_sparse_changes_use_gap_escapes() -> None:
    old = torch.zeros(3_000_000, dtype=torch.bfloat16)
    new = old.clone()
    new[[0, 1, 700, 2_999_999]] = torch.tensor([1.0, -2.0, 3.0, 4.0], dtype=torch.bfloat16)
    assert patch_info(roundtrip(old, new)).changed == 4


def test_encoding_is_deterministic() -> None:
    old, new = adam_like_step(torch.bfloat16, 300_000, 1e-6, seed=5)
    assert encode_patch(old, new) == encode_patch(old.clone(), new.clone())


def test_a_patch_for_other_weights_is_refused_before_writing() -> None:
    """Values are stored relative to the base weights, so a target that is not the base is
    refused (never silently patched into weights nobody published)."""
    old, new = adam_like_step(torch.bfloat16, 300_000, 1e-6, seed=6)
    patch = encode_patch(old, new)
    changed = int(torch.nonzero(~torch.eq(bits(old), bits(new)))[0, 0])
    drifted = old.clone()
    drifted[changed] = 123.0
    before = drifted.clone()
    with pytest.raises(CorruptPatch, match="other weights|hot"):
        apply_patch(drifted, patch)
    assert torch.equal(bits(drifted), bits(before))
    tiny = old.clone()  # a new small magnitude changes the hot class
    unchanged = int(torch.nonzero(torch.eq(bits(old), bits(new)) & (old.float().abs() > 0.01))[0, 0])
    tiny[unchanged] = 1e-30
    with pytest.raises(CorruptPatch):
        apply_patch(tiny, patch)


def test_patch_leaves_unchanged_positions_alone() -> None:
    old = torch.zeros(10)
    new = old.clone()
    new[3] = 7.0
    target = old.clone()
    target[5] = 123.0  # not part of the patch
    apply_patch(target, encode_patch(old, new))
    assert target[3].item() == 7.0 and target[5].item() == 123.0


def encode_v1(old: torch.Tensor, new: torch.Tensor) -> bytes:
    """A format version 1 patch (varint gaps), as rlbus wrote them before version 2."""
    a, b = tensor_bits(old), tensor_bits(new)
    positions = np.flatnonzero(a != b)
    gaps = np.diff(positions, prepend=-1) - 1
    values = b[positions]
    z = zstandard.ZstdCompressor(level=3, write_checksum=True)
    pos_block = z.compress(varint_encode(gaps.astype(np.uint64)))
    val_block = z.compress(values.view(np.uint8).reshape(-1, b.itemsize).T.tobytes())
    layout = struct.Struct("<4sBBBBQQQQI")
    fields = (
        b"RBDP", 1, CODE_BY_DTYPE[new.dtype], b.itemsize, 1, b.size, positions.size,
        len(pos_block), len(val_block),
    )  # fmt: skip
    crc = zlib.crc32(val_block, zlib.crc32(pos_block, zlib.crc32(layout.pack(*fields, 0)[:-4])))
    return layout.pack(*fields, crc) + pos_block + val_block


def test_version_1_patches_still_apply() -> None:
    old, new = adam_like_step(torch.bfloat16, 50_000, 1e-4, seed=7)
    patch = encode_v1(old, new)
    assert patch_info(patch).version == 1 and patch_info(patch).position_mode == "varint"
    target = old.clone()
    apply_patch(target, patch)
    assert torch.equal(bits(target), bits(new))


@pytest.mark.parametrize("width", [1, 2, 3, 7, 8, 9, 16, 31, 57, 58, 64])
def test_bit_fields_round_trip(width: int) -> None:
    rng = np.random.default_rng(width)
    values = rng.integers(0, 2**63, 1001, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    values &= np.uint64((1 << width) - 1)
    packed = np.frombuffer(pack_fields(values, width), dtype=np.uint8)
    assert np.array_equal(unpack_fields(packed, width, values.size), values)


def test_small_integer_symbols_escape_large_values() -> None:
    values = np.array([0, 1, 254, 255, 256, 2**40, 2**64 - 1], dtype=np.uint64)
    symbols, escapes = symbols_encode(values)
    assert symbols.tolist() == [0, 1, 254, 255, 255, 255, 255]
    decoded = symbols_decode(symbols, np.frombuffer(escapes, dtype=np.uint8), "test")
    assert np.array_equal(decoded, values)


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
