"""The byte layout of a sparse patch (``weightstore.patch.codec`` says what the streams mean).

Format version 2 (integers little-endian; varints are unsigned LEB128)::

    fixed header "<4sBBBBQQI" (HEADER_BYTES): magic b"RBDP", format version (2), dtype code,
        element bytes, mode (0 none, 1 sparse, 2 all), numel, changed count, crc32 of every
        other byte of the patch
    varints, mode sparse: T, hot elements, hot changed, s, base crc, context table
    varints, mode all:    base crc, context table
        base crc: crc32 of the old bit patterns of the changed elements in value order
        context table: entries, then (context, predicted magnitude) per entry
    stream table (varints): per stream in the order below, raw bytes, then stored bytes
        (0 when empty; a zstd stream is one magicless frame, a raw one is stored as is)
    streams, sparse: hot flags (zstd), gap bytes (zstd), gap escapes (zstd), gap low bits (raw),
                     residual bytes (zstd), residual escapes (zstd), signs (raw)
             all:    residual bytes, residual escapes, signs

Mode none is the fixed header alone. Version 1 patches (``weightstore.patch.format_v1``) are read
too; other versions are refused with a message that says to upgrade.
"""

from __future__ import annotations

import struct
import threading
import zlib
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from weightstore.errors import CorruptPatch
from weightstore.patch import format_v1
from weightstore.patch.bitcodes import ESCAPE, symbols_decode
from weightstore.patch.context import layout_of

MAGIC = b"RBDP"
FORMAT_VERSION = 2
_FIXED = struct.Struct("<4sBBBBQQI")
HEADER_BYTES = _FIXED.size

MODE_NONE, MODE_SPARSE, MODE_ALL = 0, 1, 2
_MODE_NAMES = {MODE_NONE: "none", MODE_SPARSE: "sparse", MODE_ALL: "all"}
SPARSE_STREAMS = ("hot", "gaps", "gaps_esc", "gap_low", "resid", "resid_esc", "signs")
ALL_STREAMS = ("resid", "resid_esc", "signs")
_RAW_STREAMS = {"gap_low", "signs"}
_POSITION_STREAMS = {"hot", "gaps", "gaps_esc", "gap_low"}

CODE_BY_DTYPE: dict[torch.dtype, int] = {
    torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4, torch.int8: 5,
    torch.uint8: 6, torch.int16: 7, torch.int32: 8, torch.int64: 9, torch.bool: 10,
}  # fmt: skip
_DTYPE_BY_CODE = {c: d for d, c in CODE_BY_DTYPE.items()}


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
    version: int = FORMAT_VERSION


_local = threading.local()  # zstd contexts are reused, one per thread


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        params = zstandard.ZstdCompressionParameters.from_level(
            level, format=zstandard.FORMAT_ZSTD1_MAGICLESS, write_checksum=0,
            write_content_size=1, write_dict_id=0,
        )  # fmt: skip
        cache[level] = zstandard.ZstdCompressor(compression_params=params)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor(format=zstandard.FORMAT_ZSTD1_MAGICLESS)
    return _local.decompressor


def _varints(values: list[int]) -> bytes:
    out = bytearray()
    for value in values:
        while value >= 0x80:
            out.append((value & 0x7F) | 0x80)
            value >>= 7
        out.append(value)
    return bytes(out)


def write_patch(
    dtype: torch.dtype, mode: int, numel: int, count: int, params: list[int],
    streams: dict[str, bytes], level: int,
) -> bytes:  # fmt: skip
    """Assemble a version 2 patch; ``params`` are the mode's varints up to the context table."""
    names = () if mode == MODE_NONE else SPARSE_STREAMS if mode == MODE_SPARSE else ALL_STREAMS
    lengths: list[int] = []
    body: list[bytes] = []
    for name in names:
        raw = streams[name]
        stored = raw if name in _RAW_STREAMS or not raw else _compressor(level).compress(raw)
        lengths += [len(raw), len(stored)]
        body.append(stored)
    varints = _varints(params + lengths)
    size = torch.empty(0, dtype=dtype).element_size()
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, CODE_BY_DTYPE[dtype], size, mode, numel, count, 0)
    crc = zlib.crc32(b"".join(body), zlib.crc32(varints, zlib.crc32(fixed[:-4])))
    return b"".join([fixed[:-4], crc.to_bytes(4, "little"), varints, *body])


@dataclass
class ParsedPatch:
    """A patch whose header and checksum were checked; streams are decoded on demand."""

    info: PatchInfo
    mode: int
    params: list[int]  # sparse: T, hot elements, hot changed, s
    table: dict[int, int]
    base_crc: int
    streams: dict[str, tuple[int, memoryview]]  # name -> (raw bytes, stored bytes)
    view: memoryview

    def stream(self, name: str, expected: int | None, limit: int = 0) -> np.ndarray:
        """The raw bytes of a stream: exactly ``expected`` of them, or (None) at most ``limit``."""
        raw, stored = self.streams[name]
        if (expected is not None and raw != expected) or (expected is None and raw > limit):
            want = expected if expected is not None else f"at most {limit}"
            raise CorruptPatch(f"patch stream {name} holds {raw} bytes, expected {want}")
        if raw == 0:
            return np.zeros(0, dtype=np.uint8)
        if name in _RAW_STREAMS:
            return np.frombuffer(stored, dtype=np.uint8)
        try:
            framed = zstandard.get_frame_parameters(stored, format=zstandard.FORMAT_ZSTD1_MAGICLESS)
            if framed.content_size != raw:
                raise CorruptPatch(f"patch stream {name} frame holds {framed.content_size} bytes, expected {raw}")
            data = _decompressor().decompress(stored, max_output_size=raw)
        except zstandard.ZstdError as exc:
            raise CorruptPatch(f"patch stream {name} does not decompress: {exc}") from exc
        if len(data) != raw:
            raise CorruptPatch(f"patch stream {name} decompressed to {len(data)} bytes, expected {raw}")
        return np.frombuffer(data, dtype=np.uint8)

    def symbols(self, name: str, count: int, dtype: np.dtype) -> np.ndarray:
        """``count`` small-integer symbols of stream ``name`` with their escapes, as ``dtype``."""
        symbols = self.stream(name, count)
        escapes = self.stream(f"{name}_esc", None, 10 * int(np.count_nonzero(symbols == ESCAPE)))
        return symbols_decode(symbols, escapes, name, dtype)


def _read_varints(view: memoryview, offset: int, count: int) -> tuple[list[int], int]:
    data = bytes(view[offset : offset + 10 * count])
    out, at = [], 0
    for _ in range(count):
        value = shift = 0
        while True:
            if at >= len(data) or shift > 63:
                raise CorruptPatch("patch header ends inside a varint")
            byte = data[at]
            at += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
        out.append(value)
    return out, offset + at


def parse_patch(patch: bytes | memoryview) -> ParsedPatch:
    """Check the magic, version, checksum and every length of a patch."""
    view = memoryview(patch).cast("B")
    if len(view) < HEADER_BYTES:
        raise CorruptPatch(f"patch of {len(view)} bytes is shorter than its {HEADER_BYTES}-byte header")
    magic, version, code, size, mode, numel, count, crc = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise CorruptPatch(f"not a weight patch (magic {bytes(magic)!r})")
    if version not in (1, FORMAT_VERSION):
        raise CorruptPatch(
            f"patch format version {version} is not supported (this build reads 1 and "
            f"{FORMAT_VERSION}); upgrade rlbus on this machine"
        )
    if version == 1:
        return _parse_v1(view)
    if zlib.crc32(view[HEADER_BYTES:], zlib.crc32(view[: HEADER_BYTES - 4])) != crc:
        raise CorruptPatch("patch checksum mismatch: the bytes were damaged in storage or transit")
    dtype = _DTYPE_BY_CODE.get(code)
    if dtype is None or size != torch.empty(0, dtype=dtype).element_size() or mode not in _MODE_NAMES:
        raise CorruptPatch(f"patch header is inconsistent (dtype code {code}, mode {mode})")
    if count > numel or (mode == MODE_NONE) != (count == 0) or (mode == MODE_ALL) != (count == numel > 0):
        raise CorruptPatch(f"patch mode {mode} does not fit {count} changes of {numel}")
    lay = layout_of(dtype)
    contexts = 1 if lay is None else 1 << lay.exp_bits
    params: list[int] = []
    table: dict[int, int] = {}
    streams: dict[str, tuple[int, memoryview]] = {}
    offset, base_crc = HEADER_BYTES, 0
    if mode != MODE_NONE:
        if mode == MODE_SPARSE:
            params, offset = _read_varints(view, offset, 4)
        (base_crc, entries), offset = _read_varints(view, offset, 2)
        if entries > contexts:  # at most one entry per context
            raise CorruptPatch(f"context table of {entries} entries is too long")
        flat, offset = _read_varints(view, offset, 2 * entries)
        table = dict(zip(flat[::2], flat[1::2]))
        if any(c >= contexts or not 1 <= m <= 1 << (8 * size - 1) for c, m in table.items()):
            raise CorruptPatch("patch context table is out of range")
        names = SPARSE_STREAMS if mode == MODE_SPARSE else ALL_STREAMS
        lengths, offset = _read_varints(view, offset, 2 * len(names))
        for name, raw, stored in zip(names, lengths[::2], lengths[1::2], strict=True):
            if (name in _RAW_STREAMS and raw != stored) or (raw == 0) != (stored == 0) or raw > 10 * numel:
                raise CorruptPatch(f"patch stream {name} has inconsistent sizes")
            streams[name] = (raw, view[offset : offset + stored])
            offset += stored
    if offset != len(view):
        raise CorruptPatch(f"patch is {len(view)} bytes, its header accounts for {offset} (truncated?)")
    pos_bytes = sum(len(streams[n][1]) for n in _POSITION_STREAMS if n in streams)
    position_mode = _MODE_NAMES[mode] if mode != MODE_SPARSE else "hot+gaps" if params[0] else "gaps"
    values_bytes = len(view) - HEADER_BYTES - pos_bytes
    info = PatchInfo(dtype, numel, count, position_mode, pos_bytes, values_bytes, len(view))
    return ParsedPatch(info, mode, params, table, base_crc, streams, view)


def _parse_v1(view: memoryview) -> ParsedPatch:
    header = format_v1.HEADER.size
    if len(view) < header:
        raise CorruptPatch(f"v1 patch of {len(view)} bytes is shorter than its header")
    stored_crc = int.from_bytes(view[header - 4 : header], "little")
    if zlib.crc32(view[header:], zlib.crc32(view[: header - 4])) != stored_crc:
        raise CorruptPatch("patch checksum mismatch: the bytes were damaged in storage or transit")
    code, size, numel, count, mode, name, pos_block, val_block = format_v1.parse(view)
    dtype = _DTYPE_BY_CODE.get(code)
    if dtype is None or size != torch.empty(0, dtype=dtype).element_size():
        raise CorruptPatch(f"v1 patch header is inconsistent (dtype code {code})")
    info = PatchInfo(dtype, numel, count, name, len(pos_block), len(val_block), len(view), version=1)
    return ParsedPatch(info, mode, [], {}, 0, {}, view)
