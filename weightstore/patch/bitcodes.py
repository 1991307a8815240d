"""Vectorised integer codes for the patch codec: varints, fixed-width bit fields, small-integer
symbols with an escape, and zig-zag signed integers.

Everything here works on whole numpy arrays; nothing loops over elements in Python.
"""

from __future__ import annotations

import numpy as np

from weightstore.errors import CorruptPatch

ESCAPE = 255  # a symbol byte of 255 means "255 + the next varint of the escape stream"


def varint_sizes(values: np.ndarray) -> np.ndarray:
    """Bytes of each value's LEB128 varint (uint8)."""
    sizes = np.ones(values.shape, dtype=np.uint8)
    vmax = int(values.max()) if values.size else 0
    k = 1
    while k < 10 and vmax >= (1 << (7 * k)):
        sizes += values >= np.uint64(1 << (7 * k))
        k += 1
    return sizes


def varint_encode(values: np.ndarray) -> bytes:
    """LEB128 of every (unsigned) value: fill a (count, max size) byte table column by column,
    then keep the used cells row by row."""
    if values.size == 0:
        return b""
    values = values.astype(np.uint64, copy=False)
    sizes = varint_sizes(values)
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


def varint_decode(buf: np.ndarray, count: int, what: str) -> np.ndarray:
    """Exactly ``count`` varints filling all of ``buf`` (uint8), as uint64."""
    if count == 0:
        if buf.size:
            raise CorruptPatch(f"{what}: {buf.size} bytes where no varints were expected")
        return np.zeros(0, dtype=np.uint64)
    ends = np.flatnonzero(buf < 0x80)
    if ends.size != count or buf[-1] >= 0x80:
        raise CorruptPatch(f"{what} hold {ends.size} varints, expected {count}")
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    sizes = ends - starts + 1
    if int(sizes.max()) > 10:
        raise CorruptPatch(f"{what}: varint longer than 10 bytes")
    values = (buf[starts] & 0x7F).astype(np.uint64)
    for k in range(1, int(sizes.max())):
        sel = sizes > k
        values[sel] |= (buf[starts[sel] + k] & 0x7F).astype(np.uint64) << np.uint64(7 * k)
    return values


def pack_fields(values: np.ndarray, width: int) -> bytes:
    """The low ``width`` bits of every value as bit planes, the most significant plane first;
    each plane is ``numpy.packbits`` of one bit of every value (ceil(count / 8) bytes)."""
    if width == 0 or values.size == 0:
        return b""
    work = values.astype(_work_dtype(width), copy=False)
    one = work.dtype.type(1)
    return b"".join(
        np.packbits((work >> work.dtype.type(k)) & one).tobytes() for k in range(width - 1, -1, -1)
    )


def unpack_fields(buf: np.ndarray, width: int, count: int) -> np.ndarray:
    """Inverse of ``pack_fields``: ``count`` values of ``width`` bits (uint64)."""
    if width == 0 or count == 0:
        return np.zeros(count, dtype=np.uint64)
    plane = (count + 7) // 8
    out = np.zeros(count, dtype=_work_dtype(width))
    one = out.dtype.type(1)
    for k in range(width):
        out <<= one
        out |= np.unpackbits(buf[k * plane : (k + 1) * plane], count=count)
    return out.astype(np.uint64, copy=False)


def _work_dtype(width: int) -> np.dtype:
    return np.dtype(next(f"<u{n}" for n in (1, 2, 4, 8) if 8 * n >= width))


def symbols_encode(values: np.ndarray) -> tuple[np.ndarray, bytes]:
    """Unsigned values as one byte each, ``min(v, 255)``; values ≥ 255 also put ``v - 255`` in
    the escape stream (varints). The byte stream is what an entropy coder sees."""
    symbols = np.minimum(values, ESCAPE).astype(np.uint8)
    big = values[symbols == ESCAPE]
    return symbols, varint_encode(big - np.asarray(ESCAPE, dtype=values.dtype))


def symbols_decode(
    symbols: np.ndarray, escapes: np.ndarray, what: str, dtype: np.dtype = np.dtype(np.uint64)
) -> np.ndarray:
    """Inverse of ``symbols_encode``, as unsigned integers of ``dtype``."""
    values = symbols.astype(dtype)
    big = symbols == ESCAPE
    count = int(np.count_nonzero(big))
    if count or escapes.size:
        extra = varint_decode(escapes, count, f"{what} escapes")
        if int(extra.max()) > np.iinfo(dtype).max - ESCAPE:
            raise CorruptPatch(f"{what} escape value too large for {dtype}")
        values[big] += extra.astype(dtype)
    return values


def zigzag(values: np.ndarray) -> np.ndarray:
    """Signed → unsigned of the same width, small magnitudes first: 0, -1, 1, -2 → 0, 1, 2, 3."""
    width = values.dtype.itemsize * 8
    v = values.view(f"<i{values.dtype.itemsize}")
    return ((v << 1) ^ (v >> (width - 1))).view(f"<u{values.dtype.itemsize}")


def unzigzag(values: np.ndarray) -> np.ndarray:
    """Unsigned → signed of the same width (inverse of ``zigzag``)."""
    signed = np.dtype(f"<i{values.dtype.itemsize}")
    return (values >> values.dtype.type(1)).view(signed) ^ -(values & values.dtype.type(1)).view(signed)
