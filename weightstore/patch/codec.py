"""Sparse patch codec for one tensor: which elements changed, and exactly what they became.

Tensors are compared as raw bit patterns (bf16 and fp16 as uint16, fp32 as uint32, ...). A patch
stores the changed positions and, for each, a function of the old and new bit patterns that is
exactly invertible given the old ones; applying it writes the publisher's bits at those
positions (NaN payloads and signed zeros included), so a chain of patches cannot drift. A patch
checks the old bits it expects (a crc32 of them) and refuses other weights before writing.

After an optimizer step at a small learning rate most bf16 weights are bit-identical, and a
changed one has almost always moved by one or a few units in the last place (ULP). How likely
an element is to change, and by how many ULPs, depends on its exponent: the update is about the
same size everywhere while the ULP doubles with each binade. The old weights are on both sides
of the wire, so the codec conditions on their exponent (its "context"):

* **Values.** A change is the wrapping difference ``d = new - old`` of the bit patterns (an
  integer modulo 2**bits, read as signed), stored as a sign bit and a magnitude. Within a sign,
  float bit patterns are ordered like the values, so a step of k ULPs has magnitude k; a sign
  flip, NaN or inf is just a large magnitude. The magnitude is predicted per context (the most
  frequent magnitude of that exponent in this tensor, from a sample; 1 unless the patch's
  table says otherwise) and only the zig-zagged residual is stored, as a byte with an escape.
* **Positions.** Elements whose exponent field is below a per-tensor threshold ``T`` (small
  magnitudes, which change often) form the *hot* class: their change flags are a bitmap in
  (exponent, position) order, so elements of like odds sit together. The other changed
  positions are gaps ``g = pos[i] - pos[i-1] - 1`` (``pos[-1] = -1``): ``g >> s`` as a byte
  with an escape, the low ``s`` bits raw. ``T`` (0: no hot class, and applying never scans the
  whole tensor) and ``s`` are chosen per tensor from its statistics (``weightstore.patch.context``).
  Integer and bool tensors have one context and no hot class.

zstd's Huffman stage entropy-codes the byte streams; the near-random bits (signs, low gap bits)
are stored raw. Values are listed hot changed elements first (in hot order), then the others by
position. The byte layout and its versions are in ``weightstore.patch.format``.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from weightstore.errors import CorruptPatch
from weightstore.patch import format_v1
from weightstore.patch.bitcodes import pack_fields, symbols_encode, unpack_fields, unzigzag, zigzag
from weightstore.patch.context import (
    FloatLayout, choose_hot_threshold, gap_shift, layout_of, magnitude_table, scan_changes, scan_hot,
)  # fmt: skip
from weightstore.patch.format import (
    CODE_BY_DTYPE, FORMAT_VERSION, HEADER_BYTES, MODE_ALL, MODE_NONE, MODE_SPARSE, ParsedPatch,
    PatchInfo, parse_patch, write_patch,
)  # fmt: skip

__all__ = [
    "CODE_BY_DTYPE", "FORMAT_VERSION", "HEADER_BYTES", "PatchInfo", "apply_patch", "encode_patch",
    "patch_info", "tensor_bits",
]  # fmt: skip

_TORCH_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_BITS = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def tensor_bits(t: torch.Tensor) -> np.ndarray:
    """A flat numpy view of ``t``'s raw bit patterns as unsigned integers (shares memory)."""
    if t.device.type != "cpu":
        raise ValueError(f"patches work on CPU tensors; got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError("patches need a contiguous tensor; call .contiguous() first")
    if t.dtype not in CODE_BY_DTYPE:
        raise ValueError(f"dtype {t.dtype} is not supported by the patch codec")
    flat = t.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    size = flat.element_size()
    return flat.view(_TORCH_BITS[size]).numpy().view(_NP_BITS[size])


def encode_patch(old: torch.Tensor, new: torch.Tensor, *, level: int = 3) -> bytes:
    """Encode where ``new``'s bits differ from ``old``'s and what they are there (relative to
    ``old``'s; see the module docstring). ``level`` is the zstd level of the byte streams."""
    if old.dtype != new.dtype or old.shape != new.shape:
        raise ValueError(
            f"a patch needs tensors of one dtype and shape; got {old.dtype}{tuple(old.shape)} "
            f"and {new.dtype}{tuple(new.shape)}"
        )
    a = tensor_bits(old.contiguous())
    b = tensor_bits(new.contiguous())
    lay = layout_of(new.dtype)
    threshold = choose_hot_threshold(a, b, lay) if lay is not None else 0
    found = scan_changes(a, b, lay, threshold)
    hot, hot_old, hot_new = found.hot, found.hot_old, found.hot_new
    assert hot_new is not None and found.cold_new is not None
    if hot.size:
        assert lay is not None
        by_exponent = np.argsort(lay.context(hot_old), kind="stable")
        hot, hot_old, hot_new = hot[by_exponent], hot_old[by_exponent], hot_new[by_exponent]
    flags = hot_old != hot_new
    hot_changed = int(np.count_nonzero(flags))
    count = found.cold.size + hot_changed
    params: list[int] = []
    streams: dict[str, bytes] = {}
    if count == 0:
        mode = MODE_NONE
    elif count == b.size:
        mode = MODE_ALL
        params += _encode_values(a, b, lay, streams)
    else:
        mode = MODE_SPARSE
        streams["hot"] = np.packbits(flags).tobytes()
        params += [threshold, hot.size, hot_changed, _encode_gaps(found.cold, streams)]
        changed_old = np.concatenate([np.compress(flags, hot_old), found.cold_old])
        changed_new = np.concatenate([np.compress(flags, hot_new), found.cold_new])
        params += _encode_values(changed_old, changed_new, lay, streams)
    return write_patch(new.dtype, mode, b.size, count, params, streams, level)


def _encode_gaps(cold: np.ndarray, streams: dict[str, bytes]) -> int:
    """Fill the gap streams of the sorted non-hot changed positions; return the shift."""
    gaps = np.empty(cold.size, dtype=np.uint64)
    if cold.size:
        gaps[0] = cold[0]
        np.subtract(cold[1:], cold[:-1], out=gaps[1:], casting="unsafe")
        gaps[1:] -= np.uint64(1)
    shift = gap_shift(gaps)
    symbols, escapes = symbols_encode(gaps >> np.uint64(shift))
    streams["gaps"], streams["gaps_esc"] = symbols.tobytes(), escapes
    streams["gap_low"] = pack_fields(gaps & np.uint64((1 << shift) - 1), shift)
    return shift


def _encode_values(
    old: np.ndarray, new: np.ndarray, lay: FloatLayout | None, streams: dict[str, bytes]
) -> list[int]:
    """Fill the value streams of the changed elements (old and new bits, in value order);
    return the base crc and the context table as varint parameters."""
    diff = new - old  # wraps: the exact difference modulo 2**bits
    sign = (diff.view(f"<i{diff.itemsize}") >> (8 * diff.itemsize - 1)).view(diff.dtype)  # 0 or ~0
    magnitude = (diff ^ sign) - sign  # |diff| as a signed number; 2**(bits-1) stays itself
    contexts = lay.context(old) if lay is not None else np.zeros(old.size, dtype=np.uint8)
    table = magnitude_table(magnitude, contexts)
    symbols, escapes = symbols_encode(zigzag(magnitude - _predictions(old, table, lay)))
    streams["resid"], streams["resid_esc"] = symbols.tobytes(), escapes
    streams["signs"] = np.packbits(sign.view(f"<i{diff.itemsize}") < 0).tobytes()
    return [zlib.crc32(old), len(table), *(v for item in sorted(table.items()) for v in item)]


def _predictions(old: np.ndarray, table: dict[int, int], lay: FloatLayout | None) -> np.ndarray:
    """The predicted change magnitude of every element (or one for all), in ``old``'s dtype."""
    if not table:
        return old.dtype.type(1)
    if lay is None:
        return old.dtype.type(table.get(0, 1))
    lut = np.ones(2 << lay.exp_bits, dtype=old.dtype)  # indexed by sign and exponent
    for ctx, mag in table.items():
        lut[ctx] = lut[ctx | (1 << lay.exp_bits)] = mag
    return np.take(lut, old >> old.dtype.type(lay.mantissa_bits))


def patch_info(patch: bytes | memoryview) -> PatchInfo:
    """Read and check a patch's header (and checksum) without applying it."""
    return parse_patch(patch).info


def apply_patch(target: torch.Tensor, patch: bytes | memoryview) -> None:
    """Write the patch's new bit patterns into ``target`` in place.

    Everything is decoded and checked before the first write, so a corrupt patch, or one made
    for other weights, raises ``CorruptPatch`` and leaves ``target`` untouched.
    """
    parsed = parse_patch(patch)
    info = parsed.info
    if target.dtype != info.dtype or target.numel() != info.numel:
        raise CorruptPatch(
            f"patch is for {info.dtype}[{info.numel}], target is {target.dtype}[{target.numel()}]"
        )
    bits = tensor_bits(target)
    if info.version == 1:
        positions, values = format_v1.decode(bits, parsed.view)
        if positions is None:
            bits[:] = values
        elif positions.size:
            bits[positions] = values
        return
    if parsed.mode == MODE_NONE:
        return
    lay = layout_of(info.dtype)
    if parsed.mode == MODE_ALL:
        hot, cold, old = None, None, bits
    else:
        hot, cold, old = _decode_positions(bits, lay, parsed)
    if zlib.crc32(old) != parsed.base_crc:
        raise CorruptPatch(
            "patch was made for other weights: the target's old values at the changed positions "
            "differ from the patch's base (a version skipped, repeated or damaged)"
        )
    values = _decode_values(old, lay, parsed)
    if hot is None or cold is None:
        bits[:] = values
        return
    bits[hot] = values[: hot.size]
    bits[cold] = values[hot.size :]


def _decode_positions(
    bits: np.ndarray, lay: FloatLayout | None, parsed: ParsedPatch
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The changed hot positions (in hot order) and the others, and the old bits of both (in
    value order)."""
    numel, count = parsed.info.numel, parsed.info.changed
    threshold, hot_count, hot_changed, shift = parsed.params
    cold_count = count - hot_changed
    if hot_changed > hot_count or cold_count < 0 or shift > 63:
        raise CorruptPatch("patch position parameters are inconsistent")
    if threshold and (lay is None or threshold >= 1 << lay.exp_bits):
        raise CorruptPatch(f"hot threshold {threshold} does not fit dtype {parsed.info.dtype}")
    if hot_count and not threshold:
        raise CorruptPatch("patch lists hot elements without a hot threshold")
    flags = np.unpackbits(parsed.stream("hot", (hot_count + 7) // 8), count=hot_count)
    if int(np.count_nonzero(flags)) != hot_changed:
        raise CorruptPatch("hot flags mark a different number of changes than the header")
    gaps = parsed.symbols("gaps", cold_count, np.dtype(np.uint64))
    low = parsed.stream("gap_low", shift * ((cold_count + 7) // 8))
    if shift:
        gaps = (gaps << np.uint64(shift)) | unpack_fields(low, shift, cold_count)
    if cold_count and int(gaps.max()) >= numel:
        raise CorruptPatch("position gap beyond the end of the tensor")
    gaps += np.uint64(1)  # pos[i] = pos[i-1] + gap + 1, in place
    cold = np.cumsum(gaps, out=gaps).view(np.int64)
    cold -= 1
    if cold_count and (int(cold[-1]) >= numel or (numel > 2**31 and bool(np.any(cold[1:] <= cold[:-1])))):
        raise CorruptPatch("patch positions run past the end of the tensor")
    if not threshold:
        return cold[:0], cold, np.take(bits, cold)
    assert lay is not None
    found = scan_hot(bits, lay, threshold, cold)
    if found.hot.size != hot_count:
        raise CorruptPatch(f"patch expects {hot_count} hot elements, the target has {found.hot.size}")
    if bool(lay.is_hot(found.cold_old, threshold).any()):
        raise CorruptPatch("patch lists a hot element among the gaps")
    changed = np.compress(flags, np.argsort(lay.context(found.hot_old), kind="stable"))
    return found.hot[changed], cold, np.concatenate([found.hot_old[changed], found.cold_old])


def _decode_values(old: np.ndarray, lay: FloatLayout | None, parsed: ParsedPatch) -> np.ndarray:
    """The new bit patterns of the changed elements, from their old ones."""
    count = parsed.info.changed
    residual = unzigzag(parsed.symbols("resid", count, old.dtype)).view(old.dtype)
    negative = np.unpackbits(parsed.stream("signs", (count + 7) // 8), count=count)
    magnitude = _predictions(old, parsed.table, lay) + residual  # wraps like the encoder's
    sign = -negative.astype(old.dtype)  # 0 or ~0
    return old + ((magnitude ^ sign) - sign)
