"""The binary codec: exact round trips, signatures, and a precise reason for every bad input.

Bad inputs are crafted with ``_frame``, an independent writer of the documented wire format, so
the decoder is tested against the format rather than against its own encoder.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import numpy as np
import pytest
import zstandard

from broker import codec
from broker.codec import decode_group, decode_prompt, encode_group, encode_prompt
from broker.errors import RecordError
from broker.schema import COLUMNS, PromptRecord, SamplingParams, TrajectoryGroup, TrajectoryHeader

CODES = {np.dtype(np.int32): 1, np.dtype(np.float32): 2, np.dtype(np.uint8): 3, np.dtype(np.int64): 4}


def _group(
    seed: int = 0, group_size: int = 3, vocab_size: int = 1000, lengths: list[int] | None = None
) -> TrajectoryGroup:
    rng = np.random.default_rng(seed)
    lengths = np.array(lengths) if lengths is not None else rng.integers(1, 7, size=group_size)
    group_size = len(lengths)
    total = int(lengths.sum())
    header = TrajectoryHeader(
        run="r1",
        policy="main",
        group_id=f"g{seed}",
        prompt_id=f"p{seed}",
        task="arith",
        worker_id="w0",
        sampling=SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=16),
        rewards=[float(x) for x in rng.normal(size=group_size)],
        finish_reasons=["stop", "length", "abort"][:group_size] + ["stop"] * max(0, group_size - 3),
        min_version=4,
        max_version=6,
        vocab_size=vocab_size,
        created_at=1_700_000_000.125,
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


def _bad(mutate: Any, **kwargs: Any) -> str:
    group = _group(group_size=3)
    header, columns = group.header.model_dump(mode="json"), {k: v.copy() for k, v in _columns(group).items()}
    header = mutate(header, columns) or header
    return _reason(_frame(header, columns), **kwargs)


def test_column_rule_violations() -> None:
    def set_col(name: str, index: int, value: Any) -> Any:
        return lambda h, c: c[name].__setitem__(index, value)

    def offsets(values: list[int]) -> Any:
        return lambda h, c: c.__setitem__("completion_offsets", np.array(values, dtype=np.int32))

    n = len(_group(group_size=3).completion_tokens)
    assert "must start at 0" in _bad(offsets([1, 1, 1, n]))
    assert "not monotonic" in _bad(offsets([0, n, 0, n]))
    assert f"ends at {n + 1}" in _bad(offsets([0, 0, 0, n + 1]))
    assert "at least 2 entries" in _bad(offsets([0]))
    assert "group size disagrees" in _bad(offsets([0, n]))
    assert "group size disagrees" in _bad(lambda h, c: h.update(finish_reasons=["stop"] * 2))
    assert "2 subgroups" in _bad(lambda h, c: h.update(subgroups=[0, 1]))
    assert "per-token columns differ" in _bad(lambda h, c: c.__setitem__("loss_mask", c["loss_mask"][:-1]))
    assert "token id 1000 >= header vocab_size 1000" in _bad(set_col("completion_tokens", 0, 1000))
    assert "negative token id -1" in _bad(set_col("prompt_tokens", 0, -1))
    assert "prompt_tokens has token id 999 >= consumer vocab_size 500" in _bad(
        set_col("prompt_tokens", 0, 999), vocab_size=500
    )
    assert "not finite" in _bad(set_col("behaviour_logprobs", 0, np.nan))
    assert "not finite" in _bad(set_col("behaviour_logprobs", 0, -np.inf))
    assert "must be <= 0" in _bad(set_col("behaviour_logprobs", 0, 0.5))
    assert "token_versions span" in _bad(set_col("token_versions", 0, 3))
    assert "token_versions span" in _bad(set_col("token_versions", 0, 7))
    assert "min_version 6 > max_version 5" in _bad(lambda h, c: h.update(min_version=6, max_version=5))
    assert "loss_mask must be 0 or 1" in _bad(set_col("loss_mask", 0, 2))
    assert "reward of sample 1 is not finite" in _bad(lambda h, c: h["rewards"].__setitem__(1, math.nan))
    assert "reward of sample 0 is not finite" in _bad(lambda h, c: h["rewards"].__setitem__(0, math.inf))


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
    return PromptRecord(
        run="r1",
        policy="main",
        prompt_id="p-1",
        task="arith",
        prompt="What is 2 + 2? Ünïcödé ✓",
        answer="4",
        group_size=8,
        dispatch_version=3,
    )


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
