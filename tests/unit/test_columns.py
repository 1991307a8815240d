"""Column codings of format 2 (``broker.columns``): every value comes back bit for bit, whichever
coding wrote it, and a section that breaks the documented layout is refused with its reason.

Sections are written by the independent writer of ``tests/unit/test_codec.py``."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from broker.codec import decode_group, encode_group
from broker.errors import RecordError
from broker.schema import COLUMNS, TrajectoryGroup
from tests.unit.test_codec import (
    CODES, CODINGS, PLANES, RAW, RUNS, TIERS, _assert_same, _columns, _frame2, _group, _reason, _section2, _split2,
)

EDGE_IDS = [0, 1, 127, 128, 129, 383, 384, 32639, 32640, 32641, 65535, 65536, 151_935, 2**24, 2**31 - 2]
EDGE_LOGPROBS = [-0.0, 0.0, -1e-45, -1e-38, -1.1754944e-38, -2**-24, -0.05, -1.0, -20.0, -3.4028235e38]


def _edge_group(n_versions: str = "constant") -> TrajectoryGroup:
    group = _group(seed=9, lengths=[len(EDGE_LOGPROBS), len(EDGE_IDS) - len(EDGE_LOGPROBS)], vocab_size=2**31 - 1)
    n = len(group.completion_tokens)
    group.completion_tokens = np.array(EDGE_IDS[::-1], dtype=np.int32)[:n]
    group.prompt_tokens = np.array(EDGE_IDS, dtype=np.int32)
    group.behaviour_logprobs = np.resize(np.array(EDGE_LOGPROBS, dtype=np.float32), n)
    if n_versions == "constant":
        group.token_versions = np.full(n, 5, np.int32)
        group.loss_mask = np.ones(n, np.uint8)
    return group


@pytest.mark.parametrize("kind", ["constant", "changing"])
def test_edge_values_round_trip_bit_exactly(kind: str) -> None:
    group = _edge_group(kind)
    assert np.signbit(group.behaviour_logprobs[0]) and not np.signbit(group.behaviour_logprobs[1])
    _assert_same(group, decode_group(encode_group(group)))


@pytest.mark.parametrize(
    "codings",
    [{}, CODINGS, {name: RUNS for name, _ in COLUMNS}, {"completion_offsets": TIERS, "behaviour_logprobs": RUNS}],
    ids=["raw", "typical", "runs", "odd"],
)
def test_every_coding_decodes_what_the_format_says(codings: dict[str, int]) -> None:
    for group in (_edge_group("constant"), _edge_group("changing"), _group(seed=2, lengths=[0, 0])):
        data = _frame2(group.header.model_dump(mode="json"), _columns(group), codings=codings)
        _assert_same(group, decode_group(data))


def test_empty_columns() -> None:
    group = _group(seed=4, lengths=[0])
    group.prompt_tokens = np.zeros(0, np.int32)
    decoded = decode_group(encode_group(group))
    _assert_same(group, decoded)
    assert decoded.completion_tokens.size == 0 and decoded.prompt_tokens.size == 0


def _entry(name: str, coding: int, count: int, body: bytes, code: int | None = None) -> tuple[bytes, bytes]:
    dtype = dict(COLUMNS)[name]
    return struct.pack("<BBQQ", CODES[np.dtype(dtype)] if code is None else code, coding, count, len(body)), body


def _section(entries: list[tuple[bytes, bytes]], trailing: bytes = b"") -> bytes:
    heads, bodies = b"".join(h for h, _ in entries), b"".join(b for _, b in entries)
    return struct.pack("<H", len(entries)) + heads + bodies + trailing


def _bad_section(**replace: tuple[int, int, bytes] | tuple[int, int, bytes, int]) -> str:
    """The reason a group is refused whose named columns are replaced by (coding, count, body[, dtype code])."""
    group = _group(seed=1, lengths=[3, 4])
    group.token_versions[:] = 5
    entries = []
    for name, _ in COLUMNS:
        arr, coding = getattr(group, name), CODINGS.get(name, RAW)
        body = _section2({name: arr}, {name: coding})[20:]  # past the column count and the column head
        entries.append(_entry(name, *replace[name]) if name in replace else _entry(name, coding, arr.size, body))
    return _reason(_frame2(group.header.model_dump(mode="json"), section=_section(entries)))


def test_sections_that_break_the_layout_are_refused() -> None:
    n = 7
    runs = RUNS, n, struct.pack("<I", 2) + struct.pack("<ii", 5, 5) + struct.pack("<II", 3, 3)
    assert "runs cover 6 values, expected 7" in _bad_section(token_versions=runs)
    zero = RUNS, n, struct.pack("<I", 2) + struct.pack("<ii", 5, 5) + struct.pack("<II", 0, 7)
    assert "run of length 0" in _bad_section(token_versions=zero)
    short = RUNS, n, struct.pack("<I", 3) + struct.pack("<ii", 5, 5) + struct.pack("<II", 3, 4)
    assert "coded bytes, expected" in _bad_section(token_versions=short)
    assert "unknown coding 9" in _bad_section(loss_mask=(9, n, b"\1" * n))
    assert "coding token tiers (only for int32)" in _bad_section(behaviour_logprobs=(TIERS, n, b"\0" * n))
    assert "coding float planes (only for float32)" in _bad_section(token_versions=(PLANES, n, b"\0" * 4 * n))
    assert "expected 28 (4 bytes per value)" in _bad_section(behaviour_logprobs=(PLANES, n, b"\0" * 27))
    escape = b"\xff" + b"\0" * (n - 1) + b"\1\2\3"  # an escaped value needs 4 plane bytes
    assert "coded bytes, expected" in _bad_section(completion_tokens=(TIERS, n, escape))
    assert "7 values" in _bad_section(completion_tokens=(TIERS, n, b"\0" * 3))
    assert "has dtype int64, expected int32" in _bad_section(completion_tokens=(RAW, n, b"\0" * 8 * n, 4))
    assert "unknown dtype code 42" in _bad_section(completion_tokens=(RAW, n, b"\0" * 4 * n, 42))


def test_section_framing_and_size_limits() -> None:
    group = _group(seed=1)
    header, columns = group.header.model_dump(mode="json"), _columns(group)
    section = _section2(columns, CODINGS)
    assert "3 trailing bytes" in _reason(_frame2(header, section=section + b"abc"))
    assert "truncated payload" in _reason(_frame2(header, section=section[:-3]))
    assert "truncated payload" in _reason(_frame2(header, section=section[:30]))
    fewer = {k: v for k, v in columns.items() if k != "loss_mask"}
    assert "5 columns, expected 6" in _reason(_frame2(header, fewer))
    # A run may not expand past the limit: declared counts are checked before anything is decoded.
    huge = _entry("token_versions", RUNS, 2**40, struct.pack("<IiI", 1, 5, 2**32 - 1))
    entries = [_entry(name, RAW, getattr(group, name).size, getattr(group, name).tobytes()) for name, _ in COLUMNS]
    entries[[name for name, _ in COLUMNS].index("token_versions")] = huge
    assert "would decode to" in _reason(_frame2(header, section=_section(entries)), max_decompressed_bytes=10**6)
    data = encode_group(group)
    assert len(_split2(data)[1]) < 10**6
    assert "exceeds the limit" in _reason(data, max_decompressed_bytes=len(_split2(data)[0]) + 10)


def test_damaged_sections_are_record_errors() -> None:
    """Bytes changed, cut out or slipped in anywhere in a section: a ``RecordError``, or the group."""
    rng = np.random.default_rng(0)
    group = _edge_group("constant")
    header = group.header.model_dump(mode="json")
    section = _section2(_columns(group), CODINGS)
    for _ in range(400):
        damaged = bytearray(section)
        at = int(rng.integers(0, len(damaged)))
        kind = rng.integers(0, 3)
        if kind == 0:
            damaged[at] = int(rng.integers(0, 256))
        elif kind == 1:
            del damaged[at : at + int(rng.integers(1, 8))]
        else:
            damaged[at:at] = rng.integers(0, 256, int(rng.integers(1, 8)), dtype=np.uint8).tobytes()
        try:
            decode_group(_frame2(header, section=bytes(damaged)), max_decompressed_bytes=10**7)
        except RecordError:
            pass
