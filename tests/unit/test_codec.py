"""The binary codec: exact round trips, signatures, and a precise reason for every bad input.

Bad inputs are crafted with ``_frame`` (format 1) and ``_frame2`` (format 2), independent writers
of the documented wire formats, so the decoder is tested against the formats rather than against
its own encoder. Records written by the format 1 encoder are kept in ``codec_v1_records.json``.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zstandard

from broker import codec
from broker.codec import decode_group, decode_prompt, encode_group, encode_prompt
from broker.errors import RecordError
from broker.schema import COLUMNS, OPTIONAL_HEADER_FIELDS, PromptRecord, SamplingParams, TrajectoryGroup
from tests.fixtures.helpers import make_header, make_prompt

CODES = {np.dtype(np.int32): 1, np.dtype(np.float32): 2, np.dtype(np.uint8): 3, np.dtype(np.int64): 4}
RAW, RUNS, PLANES, TIERS = 0, 1, 2, 3
CODINGS = {"prompt_tokens": TIERS, "completion_tokens": TIERS, "behaviour_logprobs": PLANES, "token_versions": RUNS,
           "loss_mask": RUNS}
"""What the encoder picks for typical columns (``_frame2`` writes columns not named here raw)."""
V1_RECORDS = Path(__file__).parent / "codec_v1_records.json"


def _group(
    seed: int = 0, group_size: int = 3, vocab_size: int = 1000, lengths: list[int] | None = None
) -> TrajectoryGroup:
    rng = np.random.default_rng(seed)
    lengths = np.array(lengths) if lengths is not None else rng.integers(1, 7, size=group_size)
    group_size = len(lengths)
    total = int(lengths.sum())
    header = make_header(
        run="r1", group_id=f"g{seed}", prompt_id=f"p{seed}", task="arith", worker_id="w0",
        sampling=SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=16),
        rewards=[float(x) for x in rng.normal(size=group_size)],
        finish_reasons=["stop", "length", "abort"][:group_size] + ["stop"] * max(0, group_size - 3),
        min_version=4, max_version=6, vocab_size=vocab_size, created_at=1_700_000_000.125,
    )
    return TrajectoryGroup(
        header=header,
        prompt_tokens=rng.integers(0, vocab_size, size=5, dtype=np.int32),
        completion_tokens=rng.integers(0, vocab_size, size=total, dtype=np.int32),
        completion_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
        behaviour_logprobs=-rng.exponential(size=total).astype(np.float32),
        token_versions=rng.integers(4, 7, size=total, dtype=np.int32),
        loss_mask=rng.integers(0, 2, size=total, dtype=np.uint8),
    )


def _columns(group: TrajectoryGroup) -> dict[str, np.ndarray]:
    return {name: getattr(group, name) for name, _ in COLUMNS}


def _frame(
    header: dict[str, Any],
    columns: dict[str, np.ndarray],
    *,
    magic: bytes = b"RLBG",
    version: int = 1,
    cut_payload: int = 0,
) -> bytes:
    """Write a trajectory frame from parts, following the format documented in broker.codec."""
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    parts = [struct.pack("<I", len(head)), head, struct.pack("<H", len(columns))]
    for arr in columns.values():
        parts += [struct.pack("<BQ", CODES[arr.dtype], arr.size), arr.astype(arr.dtype.newbyteorder("<")).tobytes()]
    payload = b"".join(parts)
    if cut_payload:
        payload = payload[:-cut_payload]
    return struct.pack("<4sH", magic, version) + zstandard.ZstdCompressor().compress(payload)


def _canonical(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _le(arr: np.ndarray) -> np.ndarray:
    return arr.astype(arr.dtype.newbyteorder("<"))


def _code_runs(arr: np.ndarray) -> bytes:
    runs = [(value, len(list(run))) for value, run in itertools.groupby(x.tobytes() for x in _le(arr))]
    return struct.pack("<I", len(runs)) + b"".join(v for v, _ in runs) + b"".join(struct.pack("<I", n) for _, n in runs)


def _code_planes(arr: np.ndarray) -> bytes:
    rotated = [((b << 1) | (b >> 31)) & 0xFFFFFFFF for b in arr.astype("<f4").view("<u4").tolist()]
    return b"".join(bytes((r >> shift) & 255 for r in rotated) for shift in (24, 16, 8, 0))


def _code_tiers(arr: np.ndarray) -> bytes:
    first, low, escaped = bytearray(), bytearray(), []
    for v in arr.astype("<i4").view("<u4").tolist():
        if v < 128:
            first.append(v)
        elif v < 128 + 127 * 256:
            first.append(128 + (v - 128) // 256)
            low.append((v - 128) % 256)
        else:
            first.append(255)
            escaped.append(v)
    return bytes(first) + bytes(low) + b"".join(bytes((v >> shift) & 255 for v in escaped) for shift in (0, 8, 16, 24))


CODERS = {RAW: lambda a: _le(a).tobytes(), RUNS: _code_runs, PLANES: _code_planes, TIERS: _code_tiers}


def _section2(columns: dict[str, np.ndarray], codings: dict[str, int] | None = None) -> bytes:
    """A format 2 column section (broker.columns' docstring); columns not in ``codings`` raw."""
    heads, bodies = [struct.pack("<H", len(columns))], []
    for name, arr in columns.items():
        coding = (codings or {}).get(name, RAW)
        bodies.append(CODERS[coding](arr))
        heads.append(struct.pack("<BBQQ", CODES[arr.dtype], coding, arr.size, len(bodies[-1])))
    return b"".join(heads + bodies)


def _frame2(
    header: dict[str, Any],
    columns: dict[str, np.ndarray] | None = None,
    *,
    codings: dict[str, int] | None = CODINGS,
    section: bytes | None = None,
    header_json: bytes | None = None,
    key: bytes | None = None,
) -> bytes:
    """Write a format 2 trajectory record from parts, following the format documented in broker.codec;
    ``key`` signs it (the HMAC of magic, version, unsigned header and column frame)."""
    zstd = zstandard.ZstdCompressor()
    column_frame = zstd.compress(_section2(columns or {}, codings) if section is None else section)
    if key is not None:
        unsigned = _canonical(header | {"signature": None})
        signed = b"RLBG" + struct.pack("<HI", 2, len(unsigned)) + unsigned + column_frame
        header = header | {"signature": hmac.new(key, signed, hashlib.sha256).hexdigest()}
    header_frame = zstd.compress(_canonical(header) if header_json is None else header_json)
    return b"RLBG" + struct.pack("<HI", 2, len(header_frame)) + header_frame + column_frame


def _split2(data: bytes) -> tuple[bytes, bytes]:
    """The header JSON and the column frame of a format 2 record."""
    assert data[:6] == b"RLBG\x02\x00"
    (length,) = struct.unpack_from("<I", data, 6)
    return zstandard.ZstdDecompressor().decompress(data[10 : 10 + length]), data[10 + length :]


def _reason(data: bytes, **kwargs: Any) -> str:
    with pytest.raises(RecordError) as info:
        decode_group(data, **kwargs)
    assert info.value.retriable is False
    return info.value.reason


def _assert_same(a: TrajectoryGroup, b: TrajectoryGroup) -> None:
    assert a.header == b.header
    for name, dtype in COLUMNS:
        x, y = getattr(a, name), getattr(b, name)
        assert y.dtype == np.dtype(dtype)
        assert x.tobytes() == y.tobytes(), name


def test_round_trip_is_bit_exact() -> None:
    group = _group()
    group.behaviour_logprobs[0] = np.float32(-1e-38)  # subnormal-adjacent values survive
    decoded = decode_group(encode_group(group))
    _assert_same(group, decoded)
    assert decoded.header.signature is None
    decoded.completion_tokens[:1] = 0  # consumers get writable arrays


def test_round_trip_of_a_group_with_an_empty_sample() -> None:
    group = _group(seed=3, lengths=[0, 4, 0])  # an aborted sample may have no tokens
    decoded = decode_group(encode_group(group))
    _assert_same(group, decoded)
    assert [len(decoded.completion_tokens[decoded.sample(i)]) for i in range(3)] == [0, 4, 0]


def test_encode_converts_lossless_dtypes_and_defaults_the_loss_mask() -> None:
    ref = _group()
    group = TrajectoryGroup(
        header=ref.header,
        prompt_tokens=ref.prompt_tokens.astype(np.int64),
        completion_tokens=ref.completion_tokens.tolist(),
        completion_offsets=ref.completion_offsets.astype(np.int64),
        behaviour_logprobs=ref.behaviour_logprobs.astype(np.float64),
        token_versions=ref.token_versions,
    )
    decoded = decode_group(encode_group(group))
    assert decoded.prompt_tokens.tobytes() == ref.prompt_tokens.tobytes()
    assert decoded.behaviour_logprobs.tobytes() == ref.behaviour_logprobs.tobytes()
    assert decoded.loss_mask.tolist() == [1] * len(ref.completion_tokens)


def test_encode_refuses_lossy_or_invalid_groups() -> None:
    group = _group()
    group.prompt_tokens = group.prompt_tokens.astype(np.float32)
    with pytest.raises(RecordError, match="prompt_tokens has dtype float32"):
        encode_group(group)
    group = _group()
    group.completion_tokens = group.completion_tokens.astype(np.int64)
    group.completion_tokens[0] = 2**40
    with pytest.raises(RecordError, match="do not fit int32"):
        encode_group(group)
    group = _group()
    group.behaviour_logprobs[0] = np.nan
    with pytest.raises(RecordError, match="not finite"):
        encode_group(group)


def test_signature_round_trip_and_rejections() -> None:
    key = b"fleet-secret"
    group = _group()
    signed = encode_group(group, signing_key=key)
    decoded = decode_group(signed, signing_key=key, require_signature=True)
    assert decoded.header.signature is not None and len(decoded.header.signature) == 64
    assert decoded.header.model_copy(update={"signature": None}) == group.header
    assert all(getattr(decoded, n).tobytes() == getattr(group, n).tobytes() for n, _ in COLUMNS)
    # A decoded group re-encoded without a key keeps its (still valid) signature.
    assert decode_group(encode_group(decoded), signing_key=key, require_signature=True).header == decoded.header

    assert "signature mismatch" in _reason(signed, signing_key=b"another-key")
    tampered = decoded.header.model_dump(mode="json") | {"rewards": [9.0] * group.group_size}
    assert "signature mismatch" in _reason(_frame(tampered, _columns(decoded)), signing_key=key)
    columns = _columns(decoded)
    columns["completion_tokens"] = columns["completion_tokens"].copy()
    columns["completion_tokens"][0] ^= 1
    assert "signature mismatch" in _reason(_frame(decoded.header.model_dump(mode="json"), columns), signing_key=key)

    unsigned = encode_group(group)
    assert decode_group(unsigned, signing_key=key).header.signature is None  # not required: accepted
    assert "signature missing" in _reason(unsigned, signing_key=key, require_signature=True)
    with pytest.raises(ValueError, match="signing_key"):
        decode_group(signed, require_signature=True)


def test_records_written_in_format_1_still_decode_and_verify() -> None:
    records = json.loads(V1_RECORDS.read_text())["records"]
    assert {r["name"] for r in records} >= {"small", "empty samples", "signed", "zipf 151k vocab, signed"}
    for rec in records:
        data = bytes.fromhex(rec["record_hex"])
        assert data[:6] == b"RLBG\x01\x00", rec["name"]
        key = rec["signing_key"].encode() if rec["signing_key"] else None
        signed = key is not None
        group = decode_group(data, signing_key=key, require_signature=signed, vocab_size=rec["header"]["vocab_size"])
        assert all(getattr(group.header, k) is None for k in OPTIONAL_HEADER_FIELDS), rec["name"]
        assert group.header.model_dump(mode="json", exclude=set(OPTIONAL_HEADER_FIELDS)) == rec["header"], rec["name"]
        for name, dtype in COLUMNS:
            column = getattr(group, name)
            assert column.dtype == np.dtype(dtype) and column.tobytes().hex() == rec["columns"][name]["hex"], name
        if key is not None:
            assert group.header.signature is not None
            assert "signature mismatch" in _reason(data, signing_key=b"another-key")
            flipped = bytearray(data)
            flipped[-10] ^= 1
            assert _reason(bytes(flipped), signing_key=key)  # the zstd checksum or the signature catches it
        # Written again the group is format 2 (signed anew: the signature covers the new bytes).
        again = encode_group(group, signing_key=key)
        assert again[4:6] == b"\x02\x00"
        _assert_same(_unsigned(group), _unsigned(decode_group(again, signing_key=key, require_signature=signed)))


def _unsigned(group: TrajectoryGroup) -> TrajectoryGroup:
    group.header = group.header.model_copy(update={"signature": None})
    return group


def test_format_2_layout_and_what_is_signed() -> None:
    key = b"fleet-secret"
    group = _group(seed=5, lengths=[40, 0, 25])
    group.token_versions[:] = 5
    group.loss_mask[:] = 1
    data = encode_group(group, signing_key=key)
    header_json, column_frame = _split2(data)
    header = json.loads(header_json)
    assert header_json == _canonical(header)
    # The signature: HMAC-SHA256 of magic, version 2, u32 length + unsigned header JSON, column frame as sent.
    unsigned = _canonical(header | {"signature": None})
    signed = b"RLBG" + struct.pack("<HI", 2, len(unsigned)) + unsigned + column_frame
    assert header["signature"] == hmac.new(key, signed, hashlib.sha256).hexdigest()
    # The column section is the documented one, with the codings the encoder picks for such columns.
    section = zstandard.ZstdDecompressor().decompress(column_frame)
    assert section == _section2(_columns(group), CODINGS)
    assert zstandard.get_frame_parameters(column_frame).has_checksum
    # A record written by the independent writer (signed by it) decodes and verifies.
    # (A single-turn header leaves out the multi-turn fields.)
    single_turn = group.header.model_dump(mode="json", exclude=set(OPTIONAL_HEADER_FIELDS))
    independent = _frame2(single_turn, _columns(group), key=key)
    decoded = decode_group(independent, signing_key=key, require_signature=True)
    assert decoded.header.signature == hmac.new(
        key, b"RLBG" + struct.pack("<HI", 2, len(unsigned)) + unsigned + _split2(independent)[1], hashlib.sha256
    ).hexdigest()
    _assert_same(group, _unsigned(decoded))


def test_format_2_signature_is_checked_before_the_columns_are_decompressed() -> None:
    key = b"fleet-secret"
    data = encode_group(_group(), signing_key=key)
    header_json, column_frame = _split2(data)
    stream = zstandard.ZstdCompressor().compressobj()
    bomb = stream.compress(b"\0" * (8 * 1024 * 1024)) + stream.flush()
    forged = data[: len(data) - len(column_frame)] + bomb
    assert "signature mismatch" in _reason(forged, signing_key=key, max_decompressed_bytes=1024 * 1024)
    assert "zstd decompression failed" in _reason(forged, max_decompressed_bytes=1024 * 1024)
    flipped = bytearray(data)
    flipped[-20] ^= 1
    assert "signature mismatch" in _reason(bytes(flipped), signing_key=key)
    assert "zstd" in _reason(bytes(flipped))
    # Header changes break the signature, the header frame's checksum catches corruption.
    header = json.loads(header_json)
    resigned = _frame2(header | {"rewards": [9.0] * 3}, section=zstandard.ZstdDecompressor().decompress(column_frame))
    assert "signature mismatch" in _reason(resigned, signing_key=key)
    flipped = bytearray(data)
    flipped[20] ^= 1
    assert "zstd" in _reason(bytes(flipped))


def test_format_2_framing_errors() -> None:
    group = _group()
    header, columns = group.header.model_dump(mode="json"), _columns(group)
    data = encode_group(group)
    assert "zstd" in _reason(data[:12])
    assert "zstd" in _reason(data[:6] + struct.pack("<I", 10**6) + data[10:])
    assert "zstd frame header unreadable" in _reason(data[:6] + struct.pack("<I", 4) + b"oops" + data[10:])
    assert "not valid UTF-8 JSON" in _reason(_frame2(header, columns, header_json=b"{oops"))
    assert "must be an object" in _reason(_frame2(header, columns, header_json=b"[1]"))
    assert "unknown schema version 99" in _reason(_frame2(header | {"schema_version": 99}, columns))
    assert "header fails validation" in _reason(_frame2(header | {"surprise": 1}, columns))
    assert "exceeds the limit of 100 bytes" in _reason(data, max_decompressed_bytes=100)


def test_framing_errors() -> None:
    data = encode_group(_group())
    assert "bad magic" in _reason(b"XXXX" + data[4:])
    assert "bad magic" in _reason(encode_prompt(_prompt()))
    assert "unknown format version 7" in _reason(data[:4] + struct.pack("<H", 7) + data[6:])
    assert "truncated" in _reason(data[:3])
    assert "zstd" in _reason(data[:6] + b"not a zstd frame at all")
    assert "zstd" in _reason(data[: len(data) - 4])
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    assert "zstd" in _reason(bytes(flipped))


def test_payload_errors() -> None:
    group = _group()
    header, columns = group.header.model_dump(mode="json"), _columns(group)
    assert "truncated payload" in _reason(_frame(header, columns, cut_payload=3))
    assert "unknown schema version 99" in _reason(_frame(header | {"schema_version": 99}, columns))
    assert "header fails validation" in _reason(_frame(header | {"surprise": 1}, columns))
    assert "header fails validation" in _reason(_frame({k: v for k, v in header.items() if k != "run"}, columns))
    assert "not valid UTF-8 JSON" in _reason(_raw_frame(b"{oops", columns))
    assert "not valid UTF-8 JSON" in _reason(_raw_frame(b'{"run": "\xff"}', columns))
    wrong = columns | {"completion_tokens": columns["completion_tokens"].astype(np.int64)}
    assert "completion_tokens has dtype int64, expected int32" in _reason(_frame(header, wrong))
    fewer = {k: v for k, v in columns.items() if k != "loss_mask"}
    assert "5 columns, expected 6" in _reason(_frame(header, fewer))


def _raw_frame(header_bytes: bytes, columns: dict[str, np.ndarray]) -> bytes:
    parts = [struct.pack("<I", len(header_bytes)), header_bytes, struct.pack("<H", len(columns))]
    for arr in columns.values():
        parts += [struct.pack("<BQ", CODES[arr.dtype], arr.size), arr.tobytes()]
    return struct.pack("<4sH", b"RLBG", 1) + zstandard.ZstdCompressor().compress(b"".join(parts))


def _bad(mutate: Any, writer: Any = _frame, **kwargs: Any) -> str:
    group = _group(group_size=3)
    header, columns = group.header.model_dump(mode="json"), {k: v.copy() for k, v in _columns(group).items()}
    header = mutate(header, columns) or header
    return _reason(writer(header, columns), **kwargs)


@pytest.mark.parametrize("writer", [_frame, _frame2], ids=["format1", "format2"])
def test_column_rule_violations(writer: Any) -> None:
    def bad(mutate: Any, **kwargs: Any) -> str:
        return _bad(mutate, writer, **kwargs)

    def set_col(name: str, index: int, value: Any) -> Any:
        return lambda h, c: c[name].__setitem__(index, value)

    def offsets(values: list[int]) -> Any:
        return lambda h, c: c.__setitem__("completion_offsets", np.array(values, dtype=np.int32))

    n = len(_group(group_size=3).completion_tokens)
    assert "must start at 0" in bad(offsets([1, 1, 1, n]))
    assert "not monotonic" in bad(offsets([0, n, 0, n]))
    assert f"ends at {n + 1}" in bad(offsets([0, 0, 0, n + 1]))
    assert "at least 2 entries" in bad(offsets([0]))
    assert "group size disagrees" in bad(offsets([0, n]))
    assert "group size disagrees" in bad(lambda h, c: h.update(finish_reasons=["stop"] * 2))
    assert "2 subgroups" in bad(lambda h, c: h.update(subgroups=[0, 1]))
    assert "per-token columns differ" in bad(lambda h, c: c.__setitem__("loss_mask", c["loss_mask"][:-1]))
    assert "token id 1000 >= header vocab_size 1000" in bad(set_col("completion_tokens", 0, 1000))
    assert "negative token id -1" in bad(set_col("prompt_tokens", 0, -1))
    assert "prompt_tokens has token id 999 >= consumer vocab_size 500" in bad(
        set_col("prompt_tokens", 0, 999), vocab_size=500
    )
    assert "not finite" in bad(set_col("behaviour_logprobs", 0, np.nan))
    assert "not finite" in bad(set_col("behaviour_logprobs", 0, -np.inf))
    assert "must be <= 0" in bad(set_col("behaviour_logprobs", 0, 0.5))
    assert "token_versions span" in bad(set_col("token_versions", 0, 3))
    assert "token_versions span" in bad(set_col("token_versions", 0, 7))
    assert "min_version 6 > max_version 5" in bad(lambda h, c: h.update(min_version=6, max_version=5))
    assert "loss_mask must be 0 or 1" in bad(set_col("loss_mask", 0, 2))
    assert "reward of sample 1 is not finite" in bad(lambda h, c: h["rewards"].__setitem__(1, math.nan))
    assert "reward of sample 0 is not finite" in bad(lambda h, c: h["rewards"].__setitem__(0, math.inf))


def test_zip_bomb_guard() -> None:
    group = _group()
    data = encode_group(group)
    assert "exceeds the limit of 100 bytes" in _reason(data, max_decompressed_bytes=100)
    # A frame that does not declare its size is bounded while decompressing.
    stream = zstandard.ZstdCompressor().compressobj()
    bomb = stream.compress(b"\0" * (8 * 1024 * 1024)) + stream.flush()
    assert zstandard.frame_content_size(bomb) == -1
    assert "zstd decompression failed" in _reason(b"RLBG\x01\x00" + bomb, max_decompressed_bytes=1024 * 1024)
    assert codec.MAX_DECOMPRESSED_BYTES >= 64 * 1024 * 1024


def _prompt() -> PromptRecord:
    return make_prompt(run="r1", prompt_id="p-1", task="arith", prompt="What is 2 + 2? Ünïcödé ✓", answer="4",
                       group_size=8, dispatch_version=3)


def test_prompt_round_trip_and_rejections() -> None:
    rec = _prompt()
    data = encode_prompt(rec)
    assert data[:4] == b"RLBP"
    assert decode_prompt(data) == rec
    for bad, reason in [
        (encode_group(_group()), "bad magic"),
        (data[:4] + b"\x09\x00" + data[6:], "unknown format version 9"),
        (data[:-2], "zstd"),
        (b"RLBP\x01\x00" + zstandard.ZstdCompressor().compress(b"[1, 2]"), "must be an object"),
        (b"RLBP\x01\x00" + zstandard.ZstdCompressor().compress(b'{"schema_version": 2}'), "unknown schema version 2"),
        (b"RLBP\x01\x00" + zstandard.ZstdCompressor().compress(b'{"schema_version": 1}'), "fails validation"),
    ]:
        with pytest.raises(RecordError, match=reason):
            decode_prompt(bad)
    with pytest.raises(RecordError, match="exceeds the limit"):
        decode_prompt(data, max_decompressed_bytes=10)


def test_empty_values_and_odd_signatures_are_record_errors() -> None:
    assert "empty trajectory group" in _reason(b"")
    with pytest.raises(RecordError, match="empty prompt record"):
        decode_prompt(b"")
    group = _group()
    header = group.header.model_dump(mode="json") | {"signature": "ünïcode-not-hex"}
    assert "signature mismatch" in _reason(_frame(header, _columns(group)), signing_key=b"k")
