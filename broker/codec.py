"""Binary codec of the wire contract: records to bytes and back, validating on the way in.

Prompt record: ``PROMPT_MAGIC | u16 format version | zstd(JSON)``.

Claim record (a group too large for a record, kept in the object store): ``CLAIM_MAGIC | u16 format
version | JSON`` of a ``schema.ClaimRecord``; the stored object holds the encoded group.

Trajectory group: ``GROUP_MAGIC | u16 format version | zstd(payload)`` where the payload is

    u32 header length | header JSON | u16 column count |
    per column of ``schema.COLUMNS``: u8 dtype code | u64 element count | little-endian bytes

All integers are little-endian. The header JSON is canonical: sorted keys, ``,`` and ``:``
separators, non-ASCII escaped (Python's ``json.dumps(obj, sort_keys=True, separators=(",", ":"))``).
The optional signature is the hex HMAC-SHA256 of the payload as it is encoded with the header's
``signature`` set to null; it is then stored in the header. The zstd frame carries a checksum.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from typing import Any

import numpy as np
import pydantic
import zstandard

from broker.errors import RecordError
from broker.schema import COLUMNS, SCHEMA_VERSION, ClaimRecord, PromptRecord, TrajectoryGroup, TrajectoryHeader
from broker.validate import check_group

PROMPT_MAGIC = b"RLBP"
GROUP_MAGIC = b"RLBG"
CLAIM_MAGIC = b"RLBC"
FORMAT_VERSION = 1
MAX_DECOMPRESSED_BYTES = 256 * 1024 * 1024
"""Default cap on the decompressed size of one record (guards against zip bombs)."""

ZSTD_LEVEL = 3

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
_PREFIX = struct.Struct("<4sH")
_U32 = struct.Struct("<I")
_U16 = struct.Struct("<H")
_COLUMN_HEAD = struct.Struct("<BQ")


# ----------------------------------------------------------------------------- prompts


def encode_prompt(rec: PromptRecord) -> bytes:
    """Serialize a prompt record as zstd-compressed JSON behind the prompt magic."""
    body = json.dumps(rec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return _PREFIX.pack(PROMPT_MAGIC, FORMAT_VERSION) + _compress(body.encode())


def decode_prompt(data: bytes, *, max_decompressed_bytes: int = MAX_DECOMPRESSED_BYTES) -> PromptRecord:
    """Parse and validate a prompt record; raises ``RecordError`` with the reason."""
    body = _decompress(_strip_prefix(data, PROMPT_MAGIC, "prompt record"), max_decompressed_bytes)
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
    obj = _load_json(_strip_prefix(data, CLAIM_MAGIC, "claim record"), "claim record")
    _check_schema_version(obj, "claim record")
    try:
        return ClaimRecord.model_validate(obj)
    except pydantic.ValidationError as exc:
        raise RecordError(f"claim record fails validation: {_summarize(exc)}") from None


# ----------------------------------------------------------------------------- groups


def encode_group(group: TrajectoryGroup, *, signing_key: bytes | None = None) -> bytes:
    """Serialize a trajectory group; signs it when ``signing_key`` is given.

    The group is validated first (same rules as ``decode_group``) so a producer learns about a
    bad record before it reaches the broker. Columns of another numeric dtype are converted when
    the conversion keeps every value; otherwise ``RecordError`` names the column.
    """
    columns = [_as_wire_column(name, getattr(group, name), dtype) for name, dtype in COLUMNS]
    check_group(group.header, dict(zip((n for n, _ in COLUMNS), columns)), vocab_size=None)
    column_bytes = _pack_columns(columns)
    header = group.header
    if signing_key is not None:
        unsigned = _canonical_header(header.model_dump(mode="json") | {"signature": None})
        signature = _sign(signing_key, unsigned, column_bytes)
        header = header.model_copy(update={"signature": signature})
    payload = _pack_header(_canonical_header(header.model_dump(mode="json"))) + column_bytes
    return _PREFIX.pack(GROUP_MAGIC, FORMAT_VERSION) + _compress(payload)


def decode_group(
    data: bytes,
    *,
    vocab_size: int | None = None,
    signing_key: bytes | None = None,
    require_signature: bool = False,
    max_decompressed_bytes: int = MAX_DECOMPRESSED_BYTES,
) -> TrajectoryGroup:
    """Parse and validate a trajectory group; raises ``RecordError`` with a precise reason.

    ``vocab_size`` is the consumer's vocabulary size, checked in addition to the header's.
    With ``signing_key`` a present signature must verify; ``require_signature`` also rejects
    unsigned groups (and needs ``signing_key``).
    """
    if require_signature and signing_key is None:
        raise ValueError("require_signature=True needs signing_key: pass the fleet's HMAC key")
    payload = _decompress(_strip_prefix(data, GROUP_MAGIC, "trajectory group"), max_decompressed_bytes)
    (header_len,) = _unpack(_U32, payload, 0, "header length")
    header_end = _U32.size + header_len
    if header_end > len(payload):
        raise RecordError(f"truncated payload: header needs {header_len} bytes, {len(payload) - _U32.size} left")
    header_obj = _load_json(payload[_U32.size : header_end], "trajectory header")
    _check_schema_version(header_obj, "trajectory header")
    try:
        header = TrajectoryHeader.model_validate(header_obj)
    except pydantic.ValidationError as exc:
        raise RecordError(f"trajectory header fails validation: {_summarize(exc)}") from None
    column_bytes = payload[header_end:]
    columns = _unpack_columns(column_bytes)
    if signing_key is not None and (header.signature is not None or require_signature):
        if header.signature is None:
            raise RecordError("signature missing: this consumer requires signed groups")
        unsigned = _canonical_header(header_obj | {"signature": None})
        expected = _sign(signing_key, unsigned, column_bytes)
        if not hmac.compare_digest(expected.encode(), header.signature.encode("utf-8", errors="replace")):
            raise RecordError("signature mismatch: group was altered or signed with another key")
    check_group(header, columns, vocab_size=vocab_size)
    return TrajectoryGroup(header=header, **columns)


# ----------------------------------------------------------------------------- framing


def _compress(body: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True).compress(body)


def _decompress(frame: bytes, limit: int) -> bytes:
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as exc:
        raise RecordError(f"zstd frame header unreadable: {exc}") from None
    if declared > limit:
        raise RecordError(f"decompressed size {declared} bytes exceeds the limit of {limit} bytes")
    try:
        # With an undeclared size, max_output_size bounds the output (raises when exceeded).
        return zstandard.ZstdDecompressor().decompress(frame, max_output_size=limit)
    except zstandard.ZstdError as exc:
        raise RecordError(f"zstd decompression failed (corrupt, truncated or over {limit} bytes): {exc}") from None


def _strip_prefix(data: bytes, magic: bytes, what: str) -> bytes:
    if not data:
        raise RecordError(f"empty {what}: the record has no value (tombstone?)")
    if len(data) < _PREFIX.size:
        raise RecordError(f"truncated {what}: {len(data)} bytes, shorter than the {_PREFIX.size}-byte prefix")
    got_magic, version = _PREFIX.unpack_from(data, 0)
    if got_magic != magic:
        raise RecordError(f"bad magic {got_magic!r}: expected {magic!r} for a {what}; wrong topic or producer?")
    if version != FORMAT_VERSION:
        raise RecordError(f"unknown format version {version} (this build reads {FORMAT_VERSION}); upgrade rlbus")
    return bytes(data[_PREFIX.size :])


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


def _pack_header(header_json: bytes) -> bytes:
    return _U32.pack(len(header_json)) + header_json


def _sign(key: bytes, unsigned_header: bytes, column_bytes: bytes) -> str:
    mac = hmac.new(key, _pack_header(unsigned_header), hashlib.sha256)
    mac.update(column_bytes)
    return mac.hexdigest()


def _unpack(fmt: struct.Struct, buf: bytes, offset: int, what: str) -> tuple[Any, ...]:
    if offset + fmt.size > len(buf):
        raise RecordError(f"truncated payload: no room for the {what} at byte {offset}")
    return fmt.unpack_from(buf, offset)


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


def _pack_columns(columns: list[np.ndarray]) -> bytes:
    parts = [_U16.pack(len(columns))]
    for arr in columns:
        parts.append(_COLUMN_HEAD.pack(_CODE_OF[arr.dtype.newbyteorder("=")], arr.size))
        parts.append(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())
    return b"".join(parts)


def _unpack_columns(buf: bytes) -> dict[str, np.ndarray]:
    (count,) = _unpack(_U16, buf, 0, "column count")
    if count != len(COLUMNS):
        raise RecordError(f"payload has {count} columns, expected {len(COLUMNS)} ({', '.join(n for n, _ in COLUMNS)})")
    offset = _U16.size
    columns: dict[str, np.ndarray] = {}
    for name, dtype in COLUMNS:
        code, n = _unpack(_COLUMN_HEAD, buf, offset, f"{name} column head")
        offset += _COLUMN_HEAD.size
        wire = DTYPE_BY_CODE.get(code)
        if wire is None:
            raise RecordError(f"column {name} has unknown dtype code {code}")
        if wire.newbyteorder("=") != np.dtype(dtype):
            raise RecordError(f"column {name} has dtype {wire}, expected {np.dtype(dtype)}")
        nbytes = n * wire.itemsize
        if offset + nbytes > len(buf):
            raise RecordError(f"truncated payload: column {name} needs {nbytes} bytes, {len(buf) - offset} left")
        columns[name] = np.frombuffer(buf, dtype=wire, count=n, offset=offset).astype(dtype)
        offset += nbytes
    if offset != len(buf):
        raise RecordError(f"payload has {len(buf) - offset} trailing bytes after the last column")
    return columns
