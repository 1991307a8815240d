"""Sparse patch codec for one tensor: the positions whose bits changed, and their new bits.

Applying a patch *writes* the new bit patterns at the stored positions; it never adds a
difference, so a follower that applies a chain of patches ends with exactly the publisher's
bits, whatever the dtype. Tensors are compared and patched as raw bit patterns (bf16 and fp16
as uint16, fp32 as uint32, ...), which also makes NaN payloads and signed zeros exact.

Patch format, version 1 (all integers little-endian)::

    header  "<4sBBBBQQQQI": magic b"RBDP", format version (1), dtype code, element bytes,
            position mode, numel, changed count, positions block bytes, values block bytes,
            crc32 of (header without the crc + positions block + values block)
    positions block   zstd frame (checksummed), by position mode:
            0 NONE     nothing changed; both blocks are empty
            1 VARINT   gaps between consecutive changed positions (gap = pos[i] - pos[i-1] - 1,
                       pos[-1] = -1), each as an unsigned LEB128 varint
            2 BITMASK  numpy.packbits of the changed-mask (numel bits, big-endian bit order)
            3 ALL      every element changed; the block is empty
    values block      zstd frame (checksummed) of the new bit patterns, byte-plane shuffled:
                      all byte-0s of the values, then all byte-1s, ... (sign/exponent bytes
                      sit together and compress well)

The encoder picks VARINT or BITMASK by whichever raw encoding is smaller. Unknown versions are
rejected, so the format can evolve behind the version byte.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from weightstore.errors import CorruptPatch

MAGIC = b"RBDP"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sBBBBQQQQI")
HEADER_BYTES = _HEADER.size

POS_NONE, POS_VARINT, POS_BITMASK, POS_ALL = 0, 1, 2, 3
_MODE_NAMES = {POS_NONE: "none", POS_VARINT: "varint", POS_BITMASK: "bitmask", POS_ALL: "all"}

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4, torch.int8: 5,
    torch.uint8: 6, torch.int16: 7, torch.int32: 8, torch.int64: 9, torch.bool: 10,
}  # fmt: skip
_TORCH_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_BITS = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


@dataclass(frozen=True)
class PatchInfo:
    """What a patch holds, read from its header."""

    dtype: torch.dtype
    numel: int
    changed: int
    position_mode: str
    positions_bytes: int
    values_bytes: int
    total_bytes: int


def tensor_bits(t: torch.Tensor) -> np.ndarray:
    """A flat numpy view of ``t``'s raw bit patterns as unsigned integers (shares memory)."""
    if t.device.type != "cpu":
        raise ValueError(f"patches work on CPU tensors; got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError("patches need a contiguous tensor; call .contiguous() first")
    if t.dtype not in DTYPE_CODES:
        raise ValueError(f"dtype {t.dtype} is not supported by the patch codec")
    flat = t.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    size = flat.element_size()
    return flat.view(_TORCH_BITS[size]).numpy().view(_NP_BITS[size])


def _varint_sizes(values: np.ndarray) -> np.ndarray:
    """Bytes of each value's LEB128 varint (uint8)."""
    sizes = np.ones(values.shape, dtype=np.uint8)
    vmax = int(values.max()) if values.size else 0
    k = 1
    while k < 10 and vmax >= (1 << (7 * k)):
        sizes += values >= np.uint64(1 << (7 * k))
        k += 1
    return sizes


def _varint_encode(values: np.ndarray, sizes: np.ndarray) -> bytes:
    """LEB128 of every value: fill a (count, max size) byte table column by column, then keep
    the used cells row by row."""
    width = int(sizes.max())
    work = values.astype(np.uint32) if width <= 4 else values  # 4 varint bytes hold 28 bits
    table = np.empty((values.size, width), dtype=np.uint8)
    for k in range(width):
        column = (work >> (7 * k)).astype(np.uint8) & 0x7F
        if k < width - 1:
            column |= (sizes > k + 1).view(np.uint8) << 7
        table[:, k] = column
    if width == 1:
        return table.tobytes()
    return table[np.arange(width, dtype=np.uint8) < sizes[:, None]].tobytes()


def _varint_decode(buf: np.ndarray, count: int) -> np.ndarray:
    ends = np.flatnonzero(buf < 0x80)
    if ends.size != count or buf.size == 0 or buf[-1] >= 0x80:
        raise CorruptPatch(f"varint positions hold {ends.size} values, header says {count}")
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    sizes = ends - starts + 1
    if int(sizes.max()) > 10:
        raise CorruptPatch("varint position longer than 10 bytes")
    values = (buf[starts] & 0x7F).astype(np.uint64)
    for k in range(1, int(sizes.max())):
        sel = sizes > k
        values[sel] |= (buf[starts[sel] + k] & 0x7F).astype(np.uint64) << np.uint64(7 * k)
    return values


def _compress(raw: bytes | memoryview, level: int) -> bytes:
    if len(raw) == 0:
        return b""
    return zstandard.ZstdCompressor(level=level, write_checksum=True).compress(raw)


def _decompress(block: bytes | memoryview, expected: int, what: str) -> bytes:
    """Decompress one block whose size must be ``expected`` bytes (or at most it, if negative)."""
    limit = abs(expected)
    try:
        size = zstandard.frame_content_size(block)
        if size < 0 or size > limit or (expected >= 0 and size != expected):
            raise CorruptPatch(f"{what} block claims {size} bytes, expected {expected}")
        raw = zstandard.ZstdDecompressor().decompress(block, max_output_size=limit)
    except zstandard.ZstdError as exc:
        raise CorruptPatch(f"{what} block does not decompress: {exc}") from exc
    if len(raw) != size:
        raise CorruptPatch(f"{what} block decompressed to {len(raw)} bytes, expected {size}")
    return raw


def encode_patch(old: torch.Tensor, new: torch.Tensor, *, level: int = 3) -> bytes:
    """Encode the positions where ``new``'s bits differ from ``old``'s, with ``new``'s bits."""
    if old.dtype != new.dtype or old.shape != new.shape:
        raise ValueError(
            f"a patch needs tensors of one dtype and shape; got {old.dtype}{tuple(old.shape)} "
            f"and {new.dtype}{tuple(new.shape)}"
        )
    a = tensor_bits(old.contiguous())
    b = tensor_bits(new.contiguous())
    numel, size = b.size, b.itemsize
    changed = a != b
    positions = np.flatnonzero(changed)
    count = positions.size
    pos_raw: bytes = b""
    if count == 0:
        mode, values = POS_NONE, b[:0]
    elif count == numel:
        mode, values = POS_ALL, b
    else:
        values = b[positions]
        gaps = np.empty(count, dtype=np.uint64)
        gaps[0] = positions[0]
        np.subtract(positions[1:], positions[:-1], out=gaps[1:], casting="unsafe")
        gaps[1:] -= np.uint64(1)
        sizes = _varint_sizes(gaps)
        if int(sizes.sum(dtype=np.int64)) <= (numel + 7) // 8:
            mode, pos_raw = POS_VARINT, _varint_encode(gaps, sizes)
        else:
            mode, pos_raw = POS_BITMASK, np.packbits(changed).tobytes()
    shuffled = values.view(np.uint8).reshape(count, size).T.tobytes() if count else b""
    pos_block = _compress(pos_raw, level)
    val_block = _compress(shuffled, level)
    fields = (
        MAGIC, FORMAT_VERSION, DTYPE_CODES[new.dtype], size, mode, numel, count,
        len(pos_block), len(val_block),
    )  # fmt: skip
    crc = _crc(_HEADER.pack(*fields, 0)[:-4], pos_block, val_block)
    return _HEADER.pack(*fields, crc) + pos_block + val_block


def _crc(*parts: bytes | memoryview) -> int:
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return crc


def _parse(patch: bytes | memoryview) -> tuple[PatchInfo, int, memoryview, memoryview]:
    view = memoryview(patch)
    if len(view) < HEADER_BYTES:
        raise CorruptPatch(f"patch of {len(view)} bytes is shorter than its {HEADER_BYTES}-byte header")
    magic, version, code, size, mode, numel, count, pos_len, val_len, crc = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise CorruptPatch(f"not a weight patch (magic {bytes(magic)!r})")
    if version != FORMAT_VERSION:
        raise CorruptPatch(
            f"patch format version {version} is not supported (this build reads {FORMAT_VERSION}); "
            "upgrade rlbus on this machine"
        )
    dtype = next((d for d, c in DTYPE_CODES.items() if c == code), None)
    if dtype is None or size not in _NP_BITS or mode not in _MODE_NAMES or count > numel:
        raise CorruptPatch(f"patch header is inconsistent (dtype code {code}, mode {mode})")
    if HEADER_BYTES + pos_len + val_len != len(view):
        raise CorruptPatch(
            f"patch is {len(view)} bytes, header says {HEADER_BYTES + pos_len + val_len} (truncated?)"
        )
    pos_block = view[HEADER_BYTES : HEADER_BYTES + pos_len]
    val_block = view[HEADER_BYTES + pos_len :]
    if _crc(view[: HEADER_BYTES - 4], pos_block, val_block) != crc:
        raise CorruptPatch("patch checksum mismatch: the bytes were damaged in storage or transit")
    info = PatchInfo(dtype, numel, count, _MODE_NAMES[mode], pos_len, val_len, len(view))
    return info, mode, pos_block, val_block


def patch_info(patch: bytes | memoryview) -> PatchInfo:
    """Read and check a patch's header (and checksum) without applying it."""
    return _parse(patch)[0]


def apply_patch(target: torch.Tensor, patch: bytes | memoryview) -> None:
    """Write the patch's new bit patterns into ``target`` in place.

    Everything is decoded and checked before the first write, so a corrupt patch raises
    ``CorruptPatch`` and leaves ``target`` untouched.
    """
    info, mode, pos_block, val_block = _parse(patch)
    if target.dtype != info.dtype or target.numel() != info.numel:
        raise CorruptPatch(
            f"patch is for {info.dtype}[{info.numel}], target is {target.dtype}[{target.numel()}]"
        )
    bits = tensor_bits(target)
    size = bits.itemsize
    count = info.changed
    if mode == POS_NONE:
        if count or pos_block.nbytes or val_block.nbytes:
            raise CorruptPatch("empty patch carries data")
        return
    raw = _decompress(val_block, count * size, "values")
    values = np.frombuffer(raw, dtype=np.uint8).reshape(size, count).T.copy().view(_NP_BITS[size])
    values = values.reshape(count)
    if mode == POS_ALL:
        if count != info.numel or pos_block.nbytes:
            raise CorruptPatch("dense patch does not cover the whole tensor")
        bits[:] = values
    elif mode == POS_BITMASK:
        packed = np.frombuffer(_decompress(pos_block, (info.numel + 7) // 8, "bitmask"), np.uint8)
        mask = np.unpackbits(packed, count=info.numel).view(bool)
        if int(np.count_nonzero(mask)) != count:
            raise CorruptPatch("bitmask marks a different number of positions than the header")
        bits[mask] = values
    else:
        buf = np.frombuffer(_decompress(pos_block, -10 * count, "positions"), np.uint8)
        gaps = _varint_decode(buf, count)
        if int(gaps.max()) >= info.numel:
            raise CorruptPatch("position gap beyond the end of the tensor")
        positions = np.cumsum(gaps + np.uint64(1)) - np.uint64(1)
        if int(positions[-1]) >= info.numel or (
            info.numel > 2**31 and bool(np.any(positions[1:] <= positions[:-1]))
        ):
            raise CorruptPatch("patch positions run past the end of the tensor")
        bits[positions.astype(np.int64)] = values
