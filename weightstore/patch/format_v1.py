"""Reading patches of format version 1, so that a follower can still apply deltas that an
older publisher stored. New patches are written in version 2 (``weightstore.patch.codec``).

Version 1 (all integers little-endian)::

    header  "<4sBBBBQQQQI": magic b"RBDP", format version (1), dtype code, element bytes,
            position mode, numel, changed count, positions block bytes, values block bytes,
            crc32 of (header without the crc + positions block + values block)
    positions block   zstd frame, by position mode: 0 none, 1 gaps (pos[i] - pos[i-1] - 1,
                      pos[-1] = -1) as LEB128 varints, 2 numpy.packbits of the changed mask,
                      3 every element (empty block)
    values block      zstd frame of the new bit patterns, byte-plane shuffled
"""

from __future__ import annotations

import struct

import numpy as np
import zstandard

from weightstore.errors import CorruptPatch
from weightstore.patch.bitcodes import varint_decode

HEADER = struct.Struct("<4sBBBBQQQQI")
_MODES = {0: "none", 1: "varint", 2: "bitmask", 3: "all"}
_NP_BITS = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def parse(view: memoryview) -> tuple[int, int, int, int, int, str, memoryview, memoryview]:
    """(dtype code, element bytes, numel, changed, mode, mode name, positions, values); the
    caller has checked the magic, the version and the crc32."""
    if len(view) < HEADER.size:
        raise CorruptPatch(f"v1 patch of {len(view)} bytes is shorter than its header")
    _, _, code, size, mode, numel, count, pos_len, val_len, _ = HEADER.unpack_from(view)
    if size not in _NP_BITS or mode not in _MODES or count > numel:
        raise CorruptPatch(f"v1 patch header is inconsistent (dtype code {code}, mode {mode})")
    if HEADER.size + pos_len + val_len != len(view):
        raise CorruptPatch(f"v1 patch is {len(view)} bytes, header says {HEADER.size + pos_len + val_len}")
    pos_block = view[HEADER.size : HEADER.size + pos_len]
    val_block = view[HEADER.size + pos_len :]
    return code, size, numel, count, mode, _MODES[mode], pos_block, val_block


def _decompress(block: memoryview, expected: int, what: str) -> bytes:
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


def decode(bits: np.ndarray, view: memoryview) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(positions or None for every element, new bit patterns) of a v1 patch for ``bits``."""
    _, size, numel, count, mode, _, pos_block, val_block = parse(view)
    if mode == 0:
        if count or pos_block.nbytes or val_block.nbytes:
            raise CorruptPatch("empty patch carries data")
        return np.zeros(0, dtype=np.int64), bits[:0]
    raw = _decompress(val_block, count * size, "values")
    values = np.frombuffer(raw, dtype=np.uint8).reshape(size, count).T.copy().view(_NP_BITS[size])
    values = values.reshape(count)
    if mode == 3:
        if count != numel or pos_block.nbytes:
            raise CorruptPatch("dense patch does not cover the whole tensor")
        return None, values
    if mode == 2:
        packed = np.frombuffer(_decompress(pos_block, (numel + 7) // 8, "bitmask"), np.uint8)
        mask = np.unpackbits(packed, count=numel).view(bool)
        if int(np.count_nonzero(mask)) != count:
            raise CorruptPatch("bitmask marks a different number of positions than the header")
        return np.flatnonzero(mask), values
    buf = np.frombuffer(_decompress(pos_block, -10 * count, "positions"), np.uint8)
    gaps = varint_decode(buf, count, "varint positions")
    if int(gaps.max()) >= numel:
        raise CorruptPatch("position gap beyond the end of the tensor")
    positions = np.cumsum(gaps + np.uint64(1)) - np.uint64(1)
    if int(positions[-1]) >= numel or (numel > 2**31 and bool(np.any(positions[1:] <= positions[:-1]))):
        raise CorruptPatch("patch positions run past the end of the tensor")
    return positions.astype(np.int64), values
