"""Binary codec of the wire contract: records to bytes and back, validating on the way in.

Prompt record: ``PROMPT_MAGIC | u16 format version (1) | zstd(JSON)``.

Claim record (a group too large for a record, kept in the object store): ``CLAIM_MAGIC | u16 format
version (1) | JSON`` of a ``schema.ClaimRecord``; the stored object holds the encoded group.

Trajectory group, format 2 (written for groups without routing)::

    GROUP_MAGIC | u16 2 | u32 header frame length | header frame | column frame

The header frame is zstd(header JSON); the column frame is zstd of the column section of
``broker.columns`` (each column coded by what its values look like: byte planes of the float
bits, tiers of token ids, runs). Both zstd frames carry a checksum and declare their size.
The optional signature is the hex HMAC-SHA256 of ``GROUP_MAGIC | u16 2 | u32 n | the n bytes of
the header JSON with its signature set to null | the column frame`` (the bytes as sent, so a
consumer checks it before it decompresses the columns); it is then stored in the header. A zstd
build writes the same frame for the same columns, so a decoded group encoded again without a key
keeps a valid signature; written by another zstd build it may not (sign it again).

Trajectory group, format 3 (written for a mixture-of-experts group: ``header.routing`` set)::

    GROUP_MAGIC | u16 3 | u32 header frame length | header frame | u32 column frame length | column frame |
    routing section

The header and column frames are format 2's; the routing section (``broker.routing_codec``: its own
CRC-32) holds ``routed_experts``. The signature is the hex HMAC-SHA256 of ``GROUP_MAGIC | u16 3 | u32 n |
the n bytes of the header JSON with its signature set to null | everything after the header frame``, the
bytes as sent, checked before anything is decompressed. Groups without routing are written in format 2,
byte for byte as before format 3 existed; a reader of formats 1 and 2 refuses format 3 ("unknown format
version 3 ...; upgrade rlbus") instead of dropping the routing.

Trajectory group, format 1 (read only: records written before format 2 still decode and verify)::

    GROUP_MAGIC | u16 1 | zstd(u32 header length | header JSON | column section of format 1)

with the signature over ``u32 header length | header JSON (signature null) | column section``.

All integers are little-endian. The header JSON is canonical: sorted keys, ``,`` and ``:``
separators, non-ASCII escaped (Python's ``json.dumps(obj, sort_keys=True, separators=(",", ":"))``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pydantic
import zstandard

from broker.columns import decode_columns, decode_columns_v1, encode_columns, unpack_at
from broker.errors import RecordError
from broker.routing_codec import decode_routing, encode_routing
from broker.schema import (
    COLUMNS,
    OPTIONAL_HEADER_FIELDS,
    SCHEMA_VERSION,
    ClaimRecord,
    PromptRecord,
    TrajectoryGroup,
    TrajectoryHeader,
)
from broker.validate import check_group, check_offsets

PROMPT_MAGIC = b"RLBP"
GROUP_MAGIC = b"RLBG"
CLAIM_MAGIC = b"RLBC"
FORMAT_VERSION = 1
"""Format of prompt and claim records."""
GROUP_FORMAT_VERSION = 2
"""Format of the trajectory groups this build writes for dense policies."""
ROUTED_GROUP_FORMAT_VERSION = 3
"""Format of the trajectory groups this build writes for mixture-of-experts policies (with routing)."""
GROUP_FORMATS_READ = (1, 2, 3)
MAX_DECOMPRESSED_BYTES = 256 * 1024 * 1024
"""Default cap on the decompressed size of one record (guards against zip bombs)."""

ZSTD_LEVEL = 3
"""Prompt records."""
GROUP_ZSTD_LEVEL = 1
GROUP_ZSTD_MIN_MATCH = 7
"""Trajectory groups: zstd level 1 with matches of at least 7 bytes. The coded columns are byte
planes of nearly independent values, where short matches cost more than the Huffman-coded bytes
they replace; on them this is both smaller and faster than level 3 (``benchmarks/codec.py``)."""

_PREFIX = struct.Struct("<4sH")
_U32 = struct.Struct("<I")
_local = threading.local()  # zstd contexts are reused, one per thread
Columns = dict[str, np.ndarray]


# ----------------------------------------------------------------------------- prompts


def encode_prompt(rec: PromptRecord) -> bytes:
    """Serialize a prompt record as zstd-compressed JSON behind the prompt magic."""
    body = json.dumps(rec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return _PREFIX.pack(PROMPT_MAGIC, FORMAT_VERSION) + _compress(body.encode())


def decode_prompt(data: bytes, *, max_decompressed_bytes: int = MAX_DECOMPRESSED_BYTES) -> PromptRecord:
    """Parse and validate a prompt record; raises ``RecordError`` with the reason."""
    body = _decompress(_strip_prefix(data, PROMPT_MAGIC, "prompt record")[1], max_decompressed_bytes)
    obj = _load_json(body, "prompt record")
    _check_schema_version(obj, "prompt record")
    try:
        return PromptRecord.model_validate(obj)
    except pydantic.ValidationError as exc:
        raise RecordError(f"prompt record fails validation: {_summarize(exc)}") from None


# ----------------------------------------------------------------------------- claims


def encode_claim(claim: ClaimRecord) -> bytes:
    """Serialize a claim record (small: uncompressed JSON behind the claim magic)."""
    body = json.dumps(claim.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return _PREFIX.pack(CLAIM_MAGIC, FORMAT_VERSION) + body.encode()


def is_claim(data: bytes | None) -> bool:
    return bool(data) and data[:4] == CLAIM_MAGIC


def decode_claim(data: bytes) -> ClaimRecord:
    """Parse and validate a claim record; raises ``RecordError`` with the reason."""
    obj = _load_json(bytes(_strip_prefix(data, CLAIM_MAGIC, "claim record")[1]), "claim record")
    _check_schema_version(obj, "claim record")
    try:
        return ClaimRecord.model_validate(obj)
    except pydantic.ValidationError as exc:
        raise RecordError(f"claim record fails validation: {_summarize(exc)}") from None


# ----------------------------------------------------------------------------- groups


def encode_group(group: TrajectoryGroup, *, signing_key: bytes | None = None) -> bytes:
    """Serialize a trajectory group (format 2, or 3 with routing); signs it when ``signing_key`` is given.

    The group is validated first (same rules as ``decode_group``) so a producer learns about a
    bad record before it reaches the broker. Columns of another numeric dtype are converted when
    the conversion keeps every value; otherwise ``RecordError`` names the column. A header that
    already carries a signature (a decoded group) keeps it when no key is given.
    """
    columns = [_as_wire_column(name, getattr(group, name), dtype) for name, dtype in COLUMNS]
    named = dict(zip((n for n, _ in COLUMNS), columns))
    routed = None if group.routed_experts is None else _as_wire_routing(group.routed_experts)
    check_group(group.header, named | {"routed_experts": routed}, vocab_size=None)
    zstd = _group_compressor()
    body = column_frame = _compress_parts(zstd, encode_columns(columns))
    version = GROUP_FORMAT_VERSION
    if routed is not None:
        routing = encode_routing(routed, group.header.routing, columns[0].size, named["completion_offsets"])
        version, body = ROUTED_GROUP_FORMAT_VERSION, _U32.pack(len(column_frame)) + column_frame + routing
    # A single-turn dense group's header is as before the optional fields existed: older readers take it.
    unset = {k for k in OPTIONAL_HEADER_FIELDS if getattr(group.header, k) is None}
    header = group.header.model_dump(mode="json", exclude=unset)
    if signing_key is not None:
        header["signature"] = _sign(signing_key, version, _canonical_header(header | {"signature": None}), body)
    header_frame = zstd.compress(_canonical_header(header))
    prefix = _PREFIX.pack(GROUP_MAGIC, version) + _U32.pack(len(header_frame))
    return b"".join((prefix, header_frame, body))


def decode_group(
    data: bytes,
    *,
    vocab_size: int | None = None,
    signing_key: bytes | None = None,
    require_signature: bool = False,
    max_decompressed_bytes: int = MAX_DECOMPRESSED_BYTES,
) -> TrajectoryGroup:
    """Parse and validate a trajectory group of any readable format; raises ``RecordError`` with
    a precise reason.

    ``vocab_size`` is the consumer's vocabulary size, checked in addition to the header's.
    With ``signing_key`` a present signature must verify; ``require_signature`` also rejects
    unsigned groups (and needs ``signing_key``). ``max_decompressed_bytes`` bounds both what is
    decompressed and what the columns decode to.
    """
    if require_signature and signing_key is None:
        raise ValueError("require_signature=True needs signing_key: pass the fleet's HMAC key")
    version, body = _strip_prefix(data, GROUP_MAGIC, "trajectory group", GROUP_FORMATS_READ)
    read = {1: _read_format1, 2: _read_format2, 3: _read_format3}[version]
    header, columns = read(body, max_decompressed_bytes, signing_key, require_signature)
    check_group(header, columns, vocab_size=vocab_size)
    return TrajectoryGroup(header=header, **columns)


def _read_format1(body: memoryview, limit: int, key: bytes | None, required: bool) -> tuple[TrajectoryHeader, Columns]:
    payload = _decompress(body, limit)
    header_end = _U32.size + unpack_at(_U32, payload, 0, "header length")[0]
    if header_end > len(payload):
        raise RecordError(f"truncated payload: header needs {header_end - 4} bytes, {len(payload) - 4} left")
    header_obj, header = _load_header(payload[_U32.size : header_end])
    column_bytes = payload[header_end:]
    columns = decode_columns_v1(column_bytes)
    _check_signature(key, required, header_obj, header, lambda k, unsigned: _sign_v1(k, unsigned, column_bytes))
    return header, columns


def _read_format2(body: memoryview, limit: int, key: bytes | None, required: bool) -> tuple[TrajectoryHeader, Columns]:
    header_json, header, column_frame = _read_header_frame(body, limit, key, required, 2)
    section = _decompress(column_frame, limit - len(header_json))
    return header, decode_columns(section, limit)


def _read_format3(body: memoryview, limit: int, key: bytes | None, required: bool) -> tuple[TrajectoryHeader, Columns]:
    header_json, header, rest = _read_header_frame(body, limit, key, required, 3)
    if header.routing is None:
        raise RecordError("format 3 record without header.routing: its routing section cannot be read")
    frame_end = _U32.size + unpack_at(_U32, rest, 0, "column frame length")[0]
    if frame_end > len(rest):
        left = len(rest) - _U32.size
        raise RecordError(f"truncated record: the column zstd frame needs {frame_end - 4} bytes, {left} left")
    section = _decompress(rest[_U32.size : frame_end], limit - len(header_json))
    columns = decode_columns(section, limit)
    check_offsets(header, columns["completion_offsets"], len(columns["completion_tokens"]))  # the routing's rows
    routing_limit = limit - len(header_json) - len(section)
    prompt_len, offsets = len(columns["prompt_tokens"]), columns["completion_offsets"]
    columns["routed_experts"] = decode_routing(rest[frame_end:], header.routing, prompt_len, offsets, routing_limit)
    return header, columns


def _read_header_frame(
    body: memoryview, limit: int, key: bytes | None, required: bool, version: int
) -> tuple[bytes, TrajectoryHeader, memoryview]:
    """Formats 2 and 3: the header JSON, the header, and the bytes after the header frame (signature checked)."""
    header_end = _U32.size + unpack_at(_U32, body, 0, "header frame length")[0]
    if header_end > len(body):
        left = len(body) - _U32.size
        raise RecordError(f"truncated record: the header's zstd frame needs {header_end - 4} bytes, {left} left")
    header_json = _decompress(body[_U32.size : header_end], limit)
    header_obj, header = _load_header(header_json)
    rest = body[header_end:]
    # Checked on the bytes as sent: a forged record is refused before the rest is decompressed.
    _check_signature(key, required, header_obj, header, lambda k, unsigned: _sign(k, version, unsigned, rest))
    return header_json, header, rest


def _load_header(header_json: bytes) -> tuple[dict[str, Any], TrajectoryHeader]:
    header_obj = _load_json(header_json, "trajectory header")
    _check_schema_version(header_obj, "trajectory header")
    try:
        return header_obj, TrajectoryHeader.model_validate(header_obj)
    except pydantic.ValidationError as exc:
        raise RecordError(f"trajectory header fails validation: {_summarize(exc)}") from None


def _check_signature(
    key: bytes | None,
    required: bool,
    header_obj: dict[str, Any],
    header: TrajectoryHeader,
    sign: Callable[[bytes, bytes], str],
) -> None:
    """``sign(key, unsigned header JSON)`` is the signature the record should carry."""
    if key is None or (header.signature is None and not required):
        return
    if header.signature is None:
        raise RecordError("signature missing: this consumer requires signed groups")
    expected = sign(key, _canonical_header(header_obj | {"signature": None}))
    if not hmac.compare_digest(expected.encode(), header.signature.encode("utf-8", errors="replace")):
        raise RecordError("signature mismatch: group was altered or signed with another key")


# ----------------------------------------------------------------------------- framing


def _compress(body: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True).compress(body)


def _group_compressor() -> zstandard.ZstdCompressor:
    if not hasattr(_local, "group_compressor"):
        params = zstandard.ZstdCompressionParameters.from_level(
            GROUP_ZSTD_LEVEL, min_match=GROUP_ZSTD_MIN_MATCH, write_checksum=1, write_content_size=1
        )
        _local.group_compressor = zstandard.ZstdCompressor(compression_params=params)
    return _local.group_compressor


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


def _compress_parts(zstd: zstandard.ZstdCompressor, parts: list[bytes]) -> bytes:
    """One zstd frame (size declared) of the parts' concatenation, a block ending after each part
    so that each gets entropy tables of its own."""
    stream = zstd.compressobj(size=sum(map(len, parts)))
    out = []
    for i, part in enumerate(parts):
        out.append(stream.compress(part))
        if i < len(parts) - 1:
            out.append(stream.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
    out.append(stream.flush())
    return b"".join(out)


def _decompress(frame: bytes | memoryview, limit: int) -> bytes:
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as exc:
        raise RecordError(f"zstd frame header unreadable: {exc}") from None
    if declared > limit:
        raise RecordError(f"decompressed size {declared} bytes exceeds the limit of {limit} bytes")
    try:
        # With an undeclared size, max_output_size bounds the output (raises when exceeded; 0 would
        # mean no bound).
        return _decompressor().decompress(frame, max_output_size=max(limit, 1))
    except zstandard.ZstdError as exc:
        raise RecordError(f"zstd decompression failed (corrupt, truncated or over {limit} bytes): {exc}") from None


def _strip_prefix(
    data: bytes, magic: bytes, what: str, versions: tuple[int, ...] = (FORMAT_VERSION,)
) -> tuple[int, memoryview]:
    if not data:
        raise RecordError(f"empty {what}: the record has no value (tombstone?)")
    if len(data) < _PREFIX.size:
        raise RecordError(f"truncated {what}: {len(data)} bytes, shorter than the {_PREFIX.size}-byte prefix")
    got_magic, version = _PREFIX.unpack_from(data, 0)
    if got_magic != magic:
        raise RecordError(f"bad magic {got_magic!r}: expected {magic!r} for a {what}; wrong topic or producer?")
    if version not in versions:
        readable = ", ".join(map(str, versions))
        raise RecordError(f"unknown format version {version} (this build reads {readable}); upgrade rlbus")
    return version, memoryview(data)[_PREFIX.size :]


def _load_json(body: bytes, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RecordError(f"{what} is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise RecordError(f"{what} JSON must be an object, got {type(obj).__name__}")
    return obj


def _check_schema_version(obj: dict[str, Any], what: str) -> None:
    version = obj.get("schema_version")
    if version != SCHEMA_VERSION:
        raise RecordError(f"unknown schema version {version!r} in {what} (this build reads {SCHEMA_VERSION})")


def _summarize(exc: pydantic.ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in exc.errors())


def _canonical_header(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _sign_v1(key: bytes, unsigned_header: bytes, column_bytes: bytes) -> str:
    mac = hmac.new(key, _U32.pack(len(unsigned_header)) + unsigned_header, hashlib.sha256)
    mac.update(column_bytes)
    return mac.hexdigest()


def _sign(key: bytes, version: int, unsigned_header: bytes, rest: bytes | memoryview) -> str:
    """Formats 2 and 3: over the magic, the version, the unsigned header and the bytes after the header frame."""
    prefix = _PREFIX.pack(GROUP_MAGIC, version) + _U32.pack(len(unsigned_header))
    mac = hmac.new(key, prefix + unsigned_header, hashlib.sha256)
    mac.update(rest)
    return mac.hexdigest()


# ----------------------------------------------------------------------------- columns


def _as_wire_column(name: str, value: Any, dtype: type) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise RecordError(f"column {name} must be 1-D, got shape {arr.shape}")
    want = np.dtype(dtype)
    if arr.dtype == want:
        return np.ascontiguousarray(arr)
    if arr.dtype.kind not in "iufb" or (want.kind in "iu" and arr.dtype.kind == "f"):
        raise RecordError(f"column {name} has dtype {arr.dtype}; use {want} (see schema.COLUMNS)")
    converted = arr.astype(want)
    if want.kind in "iu" and not np.array_equal(converted, arr):
        raise RecordError(f"column {name} has {arr.dtype} values that do not fit {want}")
    return converted


def _as_wire_routing(value: Any) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 3:
        raise RecordError(f"routed_experts must be 3-D [P - 1 + T, layers, top_k], got shape {list(arr.shape)}")
    if arr.dtype.kind not in "iu":
        raise RecordError(f"routed_experts has dtype {arr.dtype}; use int16 (expert ids, -1: not recorded)")
    converted = np.ascontiguousarray(arr, dtype=np.int16)
    if not np.array_equal(converted, arr):
        raise RecordError(f"routed_experts has {arr.dtype} values that do not fit int16 (expert ids, -1: not recorded)")
    return converted
