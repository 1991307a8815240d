"""Column sections of trajectory-group records: the per-token arrays as bytes and back.

Format 2 (written) codes each column by what its values look like, so that the zstd frame around
the section compresses well and fast::

    u16 column count |
    per column of ``schema.COLUMNS``: u8 dtype code | u8 coding | u64 element count | u64 coded bytes |
    then each column's coded bytes, in the same order

Codings (all integers little-endian):

* ``RAW`` (0): the values' little-endian bytes.
* ``RUNS`` (1): u32 run count ``k`` | ``k`` values | ``k`` u32 run lengths (each >= 1, summing to
  the element count). Token versions and the loss mask are nearly constant.
* ``FLOAT_PLANES`` (2, float32 only): each value's 32 bits rotated left by one (the sign becomes
  the lowest bit), then split into 4 byte planes of ``n`` bytes, the most significant first: the
  exponents, then three planes of mantissa. Exponents of log-probabilities are few and compress
  to a few bits; the mantissa bytes are close to random and cost what they are.
* ``TOKEN_TIERS`` (3, int32 only): one byte ``a`` per value (``n`` bytes), then one byte ``lo``
  per value with ``128 <= a < 255`` (in order), then 4 byte planes of the values with ``a == 255``
  (their unsigned 32-bit patterns, least significant plane first). ``a < 128``: the value is
  ``a``; ``128 <= a < 255``: ``128 + (a - 128) * 256 + lo``; ``a == 255``: the next escaped
  value. Frequent token ids are small (BPE merge order), so ``a`` takes most of the information.

The encoder returns the section as parts; each part of more than a few hundred bytes is a plane
whose byte statistics differ from its neighbours', and the codec ends a zstd block after each so
that each gets its own entropy tables. Parts are only a compression hint: the section is their
concatenation.

Format 1 (read only): ``u16 column count | per column: u8 dtype code | u64 element count |
little-endian bytes`` (every column raw).
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from broker.errors import RecordError
from broker.schema import COLUMNS

RAW, RUNS, FLOAT_PLANES, TOKEN_TIERS = 0, 1, 2, 3
CODING_NAMES = {RAW: "raw", RUNS: "runs", FLOAT_PLANES: "float planes", TOKEN_TIERS: "token tiers"}

DTYPE_BY_CODE: dict[int, np.dtype] = {
    1: np.dtype("<i4"),
    2: np.dtype("<f4"),
    3: np.dtype("u1"),
    4: np.dtype("<i8"),
    5: np.dtype("<f8"),
    6: np.dtype("<f2"),
}
"""Wire dtype codes. Only the dtypes in ``schema.COLUMNS`` are accepted for each column; the
others are listed so a wrong dtype is reported as such rather than as an unknown code."""

_CODE_OF = {dtype.newbyteorder("="): code for code, dtype in DTYPE_BY_CODE.items()}
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_HEAD_V1 = struct.Struct("<BQ")
_HEAD_V2 = struct.Struct("<BBQQ")
_LITERALS, _TIER_END = 128, 128 + 127 * 256  # token tiers: a < 128 literal; 128..254 bucket + lo; 255 escape
_TOKEN_COLUMNS = ("prompt_tokens", "completion_tokens")
_CODING_DTYPE = {FLOAT_PLANES: np.dtype("<f4"), TOKEN_TIERS: np.dtype("<i4")}


# ----------------------------------------------------------------------------- format 2


def encode_columns(columns: list[np.ndarray]) -> list[bytes]:
    """Format 2 section of ``columns`` (in ``schema.COLUMNS`` order, of its dtypes) as parts."""
    heads, bodies = [_U16.pack(len(columns))], []
    for (name, _), arr in zip(COLUMNS, columns):
        coding, parts = encode_column(name, arr)
        heads.append(_HEAD_V2.pack(_CODE_OF[arr.dtype.newbyteorder("=")], coding, arr.size, sum(map(len, parts))))
        bodies += parts
    return _merge_small([b"".join(heads), *bodies])


def decode_columns(buf: bytes, max_decoded_bytes: int) -> dict[str, np.ndarray]:
    """Columns of a format 2 section; ``RecordError`` names what is wrong. The decoded arrays
    may not exceed ``max_decoded_bytes`` in all (run lengths could otherwise expand without bound)."""
    (count,) = unpack_at(_U16, buf, 0, "column count")
    _check_count(count)
    offset, heads, decoded_bytes = _U16.size, [], 0
    for name, dtype in COLUMNS:
        code, coding, n, nbytes = unpack_at(_HEAD_V2, buf, offset, f"{name} column head")
        offset += _HEAD_V2.size
        wire = _wire_dtype(name, code, dtype)
        if coding not in _DECODERS:
            raise RecordError(f"column {name} has unknown coding {coding}")
        if _CODING_DTYPE.get(coding, wire) != wire:
            only = f"only for {_CODING_DTYPE[coding]}"
            raise RecordError(f"column {name} of dtype {wire} has coding {CODING_NAMES[coding]} ({only})")
        decoded_bytes += n * wire.itemsize
        heads.append((name, dtype, wire, coding, n, nbytes))
    if decoded_bytes > max_decoded_bytes:
        raise RecordError(f"columns would decode to {decoded_bytes} bytes, over the limit of {max_decoded_bytes}")
    columns: dict[str, np.ndarray] = {}
    for name, dtype, wire, coding, n, nbytes in heads:
        if offset + nbytes > len(buf):
            raise RecordError(f"truncated payload: column {name} needs {nbytes} bytes, {len(buf) - offset} left")
        body = np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=offset)
        columns[name] = _DECODERS[coding](name, body, wire, n).astype(dtype, copy=False)
        offset += nbytes
    if offset != len(buf):
        raise RecordError(f"payload has {len(buf) - offset} trailing bytes after the last column")
    return columns


def encode_column(name: str, arr: np.ndarray) -> tuple[int, list[bytes]]:
    """The coding format 2 uses for column ``name`` (of its schema dtype) and its coded parts."""
    if arr.dtype == np.float32:
        return FLOAT_PLANES, _float_planes(arr)
    if arr.dtype == np.int32 and name in _TOKEN_COLUMNS:
        return TOKEN_TIERS, _token_tiers(arr)
    runs = _runs(arr)
    if runs is not None:
        return RUNS, [runs]
    return RAW, [arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()]


def _float_planes(arr: np.ndarray) -> list[bytes]:
    bits = arr.astype("<f4", copy=False).view("<u4")
    rotated = (bits << 1) | (bits >> 31)
    return [(rotated >> shift).astype(np.uint8).tobytes() for shift in (24, 16, 8, 0)]


def _from_float_planes(name: str, body: np.ndarray, wire: np.dtype, n: int) -> np.ndarray:
    _check_len(name, body, 4 * n, "4 bytes per value")
    planes = body.reshape(4, n).astype(np.uint32)
    rotated = (planes[0] << 24) | (planes[1] << 16) | (planes[2] << 8) | planes[3]
    return ((rotated >> 1) | (rotated << 31)).view(np.float32)


def _token_tiers(arr: np.ndarray) -> list[bytes]:
    value = arr.astype("<i4", copy=False).view("<u4")
    # min(value, bucket byte, 255): literals are below 128, a bucket byte never exceeds its value.
    first = np.minimum(value, np.minimum(((value - _LITERALS) >> 8) + _LITERALS, 255)).astype(np.uint8)
    bucket = np.flatnonzero((first >= _LITERALS) & (first != 255))
    low = value.astype(np.uint8)[bucket] ^ np.uint8(_LITERALS)  # (value - 128) mod 256
    escaped = value[np.flatnonzero(first == 255)].view(np.uint8).reshape(-1, 4).T
    return [first.tobytes(), low.tobytes(), *(plane.tobytes() for plane in escaped)]


def _from_token_tiers(name: str, body: np.ndarray, wire: np.dtype, n: int) -> np.ndarray:
    if body.size < n:
        raise RecordError(f"column {name} (token tiers) has {body.size} bytes for {n} values")
    first = body[:n]
    value = first.astype("<u4")
    bucket = np.flatnonzero((first >= _LITERALS) & (first != 255))
    escape = np.flatnonzero(first == 255)
    _check_len(name, body, n + bucket.size + 4 * escape.size, "token tiers")
    low = body[n : n + bucket.size]
    value[bucket] = ((value[bucket] - _LITERALS) << 8) + _LITERALS + low
    planes = body[n + bucket.size :].reshape(4, escape.size)
    value[escape] = np.ascontiguousarray(planes.T).view("<u4").reshape(escape.size)
    return value.view("<i4")


def _runs(arr: np.ndarray) -> bytes | None:
    """Run-length coding of ``arr`` (compared bit for bit), or None when it would not be smaller."""
    n, size = arr.size, arr.dtype.itemsize
    wire = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
    if n == 0:
        return _U32.pack(0)
    bits = wire.view(f"u{size}")
    starts = np.flatnonzero(bits[1:] != bits[:-1]) + 1
    if (starts.size + 1) * (size + 4) >= n * size:
        return None
    starts = np.concatenate(([0], starts))
    lengths = np.diff(np.append(starts, n)).astype("<u4")
    return _U32.pack(starts.size) + wire[starts].tobytes() + lengths.tobytes()


def _from_runs(name: str, body: np.ndarray, wire: np.dtype, n: int) -> np.ndarray:
    if body.size < _U32.size:
        raise RecordError(f"column {name} (runs) is truncated: no run count")
    k = int(body[: _U32.size].view("<u4")[0])
    _check_len(name, body, _U32.size + k * (wire.itemsize + 4), f"runs for {k} runs")
    values = body[_U32.size : _U32.size + k * wire.itemsize].view(wire)
    lengths = body[_U32.size + k * wire.itemsize :].view("<u4")
    covered = int(lengths.sum(dtype=np.int64))
    if covered != n:
        raise RecordError(f"column {name} runs cover {covered} values, expected {n}")
    if k and int(lengths.min()) == 0:
        raise RecordError(f"column {name} has a run of length 0")
    return np.repeat(values, lengths)


def _from_raw(name: str, body: np.ndarray, wire: np.dtype, n: int) -> np.ndarray:
    _check_len(name, body, n * wire.itemsize, f"{wire.itemsize} bytes per value")
    return body.view(wire).copy()


_DECODERS = {RAW: _from_raw, RUNS: _from_runs, FLOAT_PLANES: _from_float_planes, TOKEN_TIERS: _from_token_tiers}


def _merge_small(parts: list[bytes], small: int = 512) -> list[bytes]:
    """Join each part shorter than ``small`` bytes to the next one (a block of its own would only
    cost its entropy tables)."""
    merged: list[bytes] = []
    pending = b""
    for part in parts:
        pending += part
        if len(pending) >= small:
            merged.append(pending)
            pending = b""
    if pending:
        merged.append(pending)
    return merged


# ----------------------------------------------------------------------------- format 1


def decode_columns_v1(buf: bytes) -> dict[str, np.ndarray]:
    """Columns of a format 1 section (every column raw)."""
    (count,) = unpack_at(_U16, buf, 0, "column count")
    _check_count(count)
    offset = _U16.size
    columns: dict[str, np.ndarray] = {}
    for name, dtype in COLUMNS:
        code, n = unpack_at(_HEAD_V1, buf, offset, f"{name} column head")
        offset += _HEAD_V1.size
        wire = _wire_dtype(name, code, dtype)
        nbytes = n * wire.itemsize
        if offset + nbytes > len(buf):
            raise RecordError(f"truncated payload: column {name} needs {nbytes} bytes, {len(buf) - offset} left")
        columns[name] = np.frombuffer(buf, dtype=wire, count=n, offset=offset).astype(dtype)
        offset += nbytes
    if offset != len(buf):
        raise RecordError(f"payload has {len(buf) - offset} trailing bytes after the last column")
    return columns


# ----------------------------------------------------------------------------- shared checks


def _check_count(count: int) -> None:
    if count != len(COLUMNS):
        raise RecordError(f"payload has {count} columns, expected {len(COLUMNS)} ({', '.join(n for n, _ in COLUMNS)})")


def _wire_dtype(name: str, code: int, dtype: type) -> np.dtype:
    wire = DTYPE_BY_CODE.get(code)
    if wire is None:
        raise RecordError(f"column {name} has unknown dtype code {code}")
    if wire.newbyteorder("=") != np.dtype(dtype):
        raise RecordError(f"column {name} has dtype {wire}, expected {np.dtype(dtype)}")
    return wire


def _check_len(name: str, body: np.ndarray, want: int, what: str) -> None:
    if body.size != want:
        raise RecordError(f"column {name} has {body.size} coded bytes, expected {want} ({what})")


def unpack_at(fmt: struct.Struct, buf: bytes, offset: int, what: str) -> tuple[Any, ...]:
    """``fmt`` read at ``offset`` of ``buf``; a ``RecordError`` naming ``what`` when the bytes end first."""
    if offset + fmt.size > len(buf):
        raise RecordError(f"truncated payload: no room for the {what} at byte {offset}")
    return fmt.unpack_from(buf, offset)
