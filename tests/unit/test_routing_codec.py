"""Mixture-of-experts routing in the trajectory record (format 3): exact round trips, dense records as they
were, the signature over the routing, a reason for every bad input, and a size near the routing's entropy.

Synthetic routing stands in for a recorded one (``synthetic_routing``): per layer a Zipf popularity over its
experts; a position keeps the previous position's experts with probability ``keep``, else draws top_k of them
without replacement by popularity (top-k of log-popularity + Gumbel noise: a router's noisy logits); every
sample's first row is the prompt's last position. Bad records are written with ``_section`` and ``_frame3``,
independent writers of the documented formats.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import struct
import zlib
from typing import Any

import numpy as np
import pytest
import zstandard

from broker import codec
from broker.codec import decode_group, encode_group
from broker.errors import RecordError
from broker.routing_codec import RAW, SETS, predecessors, routing_entropy
from broker.schema import COLUMNS, RoutingShape, SamplingParams, TrajectoryGroup, TrajectoryHeader

SHAPES = [(4, 2, 8), (8, 4, 32), (48, 8, 128)]
"""(layers, top_k, num_experts): a small MoE, a middle one, Qwen3-30B-A3B's."""


def synthetic_routing(
    rng: np.random.Generator, prompt_len: int, lengths: list[int], shape: RoutingShape, zipf: float = 1.0,
    keep: float = 0.5,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """``routed_experts`` (int16 [P - 1 + T, layers, top_k]) and each layer's log-popularity [layers, E]."""
    layers, k, experts = shape.layers, shape.top_k, shape.num_experts
    popularity = 1.0 / np.arange(1, experts + 1) ** zipf
    log_pop = np.stack([np.log(popularity / popularity.sum())[rng.permutation(experts)] for _ in range(layers)])

    def chain(n: int, start: np.ndarray | None) -> np.ndarray:
        """``n`` positions after ``start`` (the previous position's experts; None: draw the first)."""
        keys = rng.gumbel(size=(n, layers, experts)) + log_pop
        fresh = np.sort(np.argpartition(-keys, k - 1, axis=-1)[..., :k], axis=-1)
        drawn = rng.random((n, layers)) >= keep
        drawn[:1] |= start is None
        source = np.maximum.accumulate(np.where(drawn, np.arange(n)[:, None], -1), axis=0)
        out = fresh[np.maximum(source, 0), np.arange(layers)]
        return out if start is None else np.where((source < 0)[..., None], start, out)

    prompt = chain(max(prompt_len, 1), None)
    rows = [prompt[:-1]]
    for n in lengths:  # a sample: the prompt's last position, then its own tokens' positions
        rows += [prompt[-1:], chain(n - 1, prompt[-1])] if n else []
    return np.concatenate(rows).astype(np.int16), log_pop


def source_bits(routed: np.ndarray, log_pop: np.ndarray, keep: float, prompt_len: int, offsets: np.ndarray) -> float:
    """Bits per row of ``routed`` under the process that drew it (its entropy, what no code beats on average):
    a set drawn without replacement has the probability of any of its orders (summed over subsets)."""
    rows, layers, k = routed.shape
    w = np.exp(log_pop)[np.arange(layers)[:, None], routed.astype(np.int64)]  # [rows, layers, k]
    drawn = np.empty((rows, layers))
    for chunk in np.array_split(np.arange(layers), max(1, layers // 8)):
        # [subset, row, layer]: the probability that the subset is drawn first, and its popularity
        prob, mass = np.zeros((1 << k, rows, chunk.size)), np.zeros((1 << k, rows, chunk.size))
        prob[0] = 1.0
        for subset in range(1, 1 << k):
            low = (subset & -subset).bit_length() - 1
            mass[subset] = mass[subset & (subset - 1)] + w[:, chunk, low]
            for e in range(k):
                if subset >> e & 1:
                    prob[subset] += prob[subset ^ 1 << e] * w[:, chunk, e] / (1 - mass[subset ^ 1 << e])
        drawn[:, chunk] = prob[-1]
    pred = predecessors(rows, prompt_len, offsets)
    same = (routed == routed[np.maximum(pred, 0)]).all(-1) & (pred >= 0)[:, None]
    bits = -np.log2(np.where((pred >= 0)[:, None], (1 - keep) * drawn + keep * same, drawn))
    firsts = (prompt_len - 1 + offsets[:-1])[np.diff(offsets) > 0]
    bits[firsts[1:]] = 0.0  # copies of the first sample's first row: certain
    return float(bits.sum()) / rows


def _header(shape: RoutingShape | None, group_size: int, **extra: Any) -> TrajectoryHeader:
    return TrajectoryHeader(
        run="r43", policy="p", group_id="g43", prompt_id="p43", task="t", worker_id="w",
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=64),
        rewards=[(1.0, 0.0, 0.5)[i % 3] for i in range(group_size)],
        finish_reasons=[("stop", "length", "stop")[i % 3] for i in range(group_size)],
        min_version=1, max_version=2, vocab_size=1000, created_at=1_700_000_000.0, published_at=1_700_000_001.0,
        routing=shape, **extra,
    )  # fmt: skip


def _group(
    shape: RoutingShape | None, lengths: list[int], prompt_len: int = 7, seed: int = 43, routed: Any = None
) -> TrajectoryGroup:
    rng = np.random.default_rng(seed)
    total = int(sum(lengths))
    if shape is not None and routed is None:
        routed = synthetic_routing(rng, prompt_len, lengths, shape)[0]
    return TrajectoryGroup(
        header=_header(shape, len(lengths)),
        prompt_tokens=rng.integers(0, 1000, size=prompt_len, dtype=np.int32),
        completion_tokens=rng.integers(0, 1000, size=total, dtype=np.int32),
        completion_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
        behaviour_logprobs=-rng.exponential(size=total).astype(np.float32),
        token_versions=rng.integers(1, 3, size=total, dtype=np.int32),
        loss_mask=np.ones(total, dtype=np.uint8),
        routed_experts=routed,
    )


def _split3(data: bytes) -> tuple[bytes, bytes, bytes]:
    """The header JSON, the column frame and the routing section of a format 3 record."""
    assert data[:6] == b"RLBG\x03\x00"
    (n,) = struct.unpack_from("<I", data, 6)
    (m,) = struct.unpack_from("<I", data, 10 + n)
    return zstandard.ZstdDecompressor().decompress(data[10 : 10 + n]), data[14 + n : 14 + n + m], data[14 + n + m :]


def _section(coding: int, head: tuple[int, int, int, int], body: bytes, crc: int | None = None) -> bytes:
    """A routing section (broker.routing_codec's docstring): head (rows, layers, top_k, experts), CRC, body."""
    crc = zlib.crc32(body) if crc is None else crc
    return struct.pack("<BIIHHI", coding, *head, crc) + body


def _frame3(header: dict[str, Any], column_frame: bytes, section: bytes, key: bytes | None = None) -> bytes:
    """A format 3 record from parts (broker.codec's docstring); ``key`` signs it."""
    rest = struct.pack("<I", len(column_frame)) + column_frame + section
    if key is not None:
        unsigned = _canonical(header | {"signature": None})
        signed = b"RLBG" + struct.pack("<HI", 3, len(unsigned)) + unsigned + rest
        header = header | {"signature": hmac.new(key, signed, hashlib.sha256).hexdigest()}
    header_frame = zstandard.ZstdCompressor().compress(_canonical(header))
    return b"RLBG" + struct.pack("<HI", 3, len(header_frame)) + header_frame + rest


def _canonical(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _reason(data: bytes, **kwargs: Any) -> str:
    with pytest.raises(RecordError) as info:
        decode_group(data, **kwargs)
    return info.value.reason


def _encode_reason(group: TrajectoryGroup) -> str:
    with pytest.raises(RecordError) as info:
        encode_group(group)
    return info.value.reason


def _assert_same(a: TrajectoryGroup, b: TrajectoryGroup) -> None:
    assert a.header == b.header
    for name, dtype in COLUMNS:
        assert getattr(a, name).tobytes() == getattr(b, name).tobytes(), name
    assert b.routed_experts.dtype == np.int16 and b.routed_experts.shape == a.routed_experts.shape
    assert b.routed_experts.tobytes() == np.asarray(a.routed_experts, dtype=np.int16).tobytes()


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    ("dims", "coding"),
    [((4, 2, 8), SETS), ((8, 4, 32), SETS), ((48, 8, 128), SETS), ((1, 1, 2), SETS), ((2, 8, 8), SETS),
     ((3, 33, 40), RAW)],
    ids=["4x2of8", "8x4of32", "48x8of128", "top1of2", "all8of8", "raw-top33"],
)  # fmt: skip
def test_round_trip_is_bit_exact(dims: tuple[int, int, int], coding: int) -> None:
    shape = RoutingShape(layers=dims[0], top_k=dims[1], num_experts=dims[2])
    group = _group(shape, [40, 0, 25, 31], prompt_len=12)
    data = encode_group(group)
    assert data[4:6] == b"\x03\x00" and _split3(data)[2][0] == coding
    decoded = decode_group(data)
    _assert_same(group, decoded)
    decoded.routed_experts[0, 0, 0] = 0  # consumers get writable arrays


def test_round_trip_of_unrecorded_rows_and_small_groups() -> None:
    shape = RoutingShape(layers=3, top_k=2, num_experts=8)
    group = _group(shape, [30, 12], prompt_len=20)
    group.routed_experts[:19] = -1  # the prompt pass not recorded
    group.routed_experts[25:31] = -1  # nor a run of completion positions
    group.routed_experts[-1] = -1
    _assert_same(group, decode_group(encode_group(group)))
    group.routed_experts[:] = -1  # nothing recorded
    _assert_same(group, decode_group(encode_group(group)))
    for lengths, prompt_len in [([17], 9), ([1], 1), ([0, 0], 5), ([0, 6, 0], 1), ([3, 3], 1)]:
        single = _group(shape, lengths, prompt_len=prompt_len)
        assert single.routed_experts.shape[0] == prompt_len - 1 + sum(lengths)
        _assert_same(single, decode_group(encode_group(single)))


def test_routed_experts_of_another_integer_dtype_are_converted() -> None:
    group = _group(RoutingShape(layers=2, top_k=2, num_experts=8), [5, 4])
    expected = group.routed_experts.copy()
    group.routed_experts = group.routed_experts.astype(np.int64)
    assert decode_group(encode_group(group)).routed_experts.tobytes() == expected.tobytes()


def test_dense_records_are_unchanged_format_2() -> None:
    """A dense group is written as before routing existed: format 2, the same header JSON and column section
    (digests of what the encoder wrote before format 3, at the commit that introduced routing's contract)."""
    data = encode_group(_group(None, [20, 0, 13]))
    assert data[:6] == b"RLBG\x02\x00"
    (n,) = struct.unpack_from("<I", data, 6)
    header_json = zstandard.ZstdDecompressor().decompress(data[10 : 10 + n])
    section = zstandard.ZstdDecompressor().decompress(data[10 + n :])
    assert b"routing" not in header_json
    assert hashlib.sha256(header_json).hexdigest() == "394239aa20d5fb5da235ac6f451a46d7e096697f2a5f6874bc2ec2c51fa0cb8f"
    assert hashlib.sha256(section).hexdigest() == "a8f189565d0999b9d768d07465fc890c1682f74bf28523ef326e94dae01b7d93"


def test_format_2_readers_refuse_format_3() -> None:
    data = encode_group(_group(RoutingShape(layers=2, top_k=2, num_experts=8), [5]))
    with pytest.raises(RecordError, match=r"unknown format version 3 \(this build reads 1, 2\); upgrade rlbus"):
        codec._strip_prefix(data, codec.GROUP_MAGIC, "trajectory group", (1, 2))


# ----------------------------------------------------------------------------- signature


def test_signature_covers_the_routing() -> None:
    key = b"fleet-secret"
    group = _group(RoutingShape(layers=4, top_k=2, num_experts=8), [40, 30])
    data = encode_group(group, signing_key=key)
    header_json, column_frame, section = _split3(data)
    header = json.loads(header_json)
    unsigned = _canonical(header | {"signature": None})
    rest = struct.pack("<I", len(column_frame)) + column_frame + section
    signed = b"RLBG" + struct.pack("<HI", 3, len(unsigned)) + unsigned + rest
    assert header["signature"] == hmac.new(key, signed, hashlib.sha256).hexdigest()
    decoded = decode_group(data, signing_key=key, require_signature=True)
    assert decode_group(encode_group(decoded), signing_key=key, require_signature=True).header == decoded.header

    flipped = bytearray(data)
    flipped[-3] ^= 1  # a byte of the routing section's ANS words
    assert "signature mismatch" in _reason(bytes(flipped), signing_key=key)
    assert "CRC-32 does not match" in _reason(bytes(flipped))
    # The section of another group under this group's signed header: refused.
    other = _split3(encode_group(_group(RoutingShape(layers=4, top_k=2, num_experts=8), [40, 30], seed=7)))[2]
    assert "signature mismatch" in _reason(data[: len(data) - len(section)] + other, signing_key=key)
    # An independent writer's signed record verifies.
    independent = decode_group(_frame3(header, column_frame, section, key=key), signing_key=key, require_signature=True)
    independent.header = independent.header.model_copy(update={"signature": None})
    _assert_same(group, independent)


# ----------------------------------------------------------------------------- bad inputs


def test_encode_rejects_bad_routing_with_its_reason() -> None:
    shape = RoutingShape(layers=2, top_k=3, num_experts=8)

    def bad(change: Any, **kwargs: Any) -> str:
        group = _group(shape, [6, 4], **kwargs)
        change(group)
        return _encode_reason(group)

    def put(row: int, layer: int, values: list[int]) -> Any:
        return lambda g: g.routed_experts.__setitem__((row, layer), values)

    def routed(value: Any) -> Any:
        return lambda g: setattr(g, "routed_experts", value(g) if callable(value) else value)

    more = np.zeros((17, 2, 3), np.int16) + np.arange(3, dtype=np.int16)
    for change, reason in [
        (lambda g: setattr(g, "header", _header(None, 2)), "routed_experts without header.routing"),
        (routed(None), "header.routing is set but the group has no routed_experts"),
        (routed(more), "routed_experts has shape [17, 2, 3], expected [P - 1 + T, layers, top_k] = [16, 2, 3]"),
        (routed(lambda g: g.routed_experts[:, :1]), "has shape [16, 1, 3], expected"),
        (routed(lambda g: g.routed_experts[:, :, :2]), "has shape [16, 2, 2], expected"),
        (put(3, 1, [1, 2, 8]), "expert id 8 at row 3, layer 1: ids are -1 (a row not recorded) or below "
                               "header.routing.num_experts 8"),
        (put(4, 0, [-2, 1, 2]), "expert id -2 at row 4, layer 0"),
        (put(5, 1, [1, 1, 4]), "row 5, layer 1: experts [1, 1, 4] are not strictly increasing"),
        (put(2, 0, [4, 3, 5]), "row 2, layer 0: experts [4, 3, 5] are not strictly increasing"),
        (put(6, 1, [-1, -1, -1]), "row 6 is partly -1 (layer 1)"),
        (put(6, 0, [-1, 2, 3]), "row 6 is partly -1 (layer 0)"),
        (routed(lambda g: g.routed_experts[:, 0]), "routed_experts must be 3-D"),
        (routed(lambda g: g.routed_experts.astype(np.float32)), "routed_experts has dtype float32; use int16"),
    ]:  # fmt: skip
        assert reason in bad(change)
    empty_prompt = np.zeros((9, 2, 3), np.int16)
    assert "need a prompt of at least one token" in bad(lambda g: None, prompt_len=0, routed=empty_prompt)


def test_decode_rejects_bad_routing_sections_with_their_reason() -> None:
    shape = RoutingShape(layers=2, top_k=3, num_experts=8)
    group = _group(shape, [6, 4])
    data = encode_group(group)
    header_json, column_frame, section = _split3(data)
    header = json.loads(header_json)
    rows, head = 16, (16, 2, 3, 8)

    def raw(routed: np.ndarray, head: tuple[int, int, int, int] = head) -> bytes:
        return _frame3(header, column_frame, _section(RAW, head, routed.astype("<i2").tobytes()))

    ok = group.routed_experts
    _assert_same(group, decode_group(raw(ok)))  # the independent writer's raw section reads back
    for row, layer, values, reason in [
        (3, 1, [1, 1, 4], "row 3, layer 1: experts [1, 1, 4] are not strictly increasing"),
        (2, 0, [0, 2, 9], "expert id 9 at row 2, layer 0"),
        (5, 1, [-1, -1, -1], "row 5 is partly -1 (layer 1)"),
    ]:
        routed = ok.copy()
        routed[row, layer] = values
        assert reason in _reason(raw(routed))
    assert "routing section has 15 rows, expected P - 1 + T = 16" in _reason(raw(ok[:-1], (15, 2, 3, 8)))
    assert "routing section is for 3 layers, top_k 3 of 8 experts; header.routing says 2 layers" in _reason(
        raw(np.zeros((16, 3, 3)), (16, 3, 3, 8))
    )
    assert "routing section (raw) has 186 bytes, expected 192" in _reason(
        _frame3(header, column_frame, _section(RAW, head, ok.astype("<i2").tobytes()[:-6]))
    )
    assert "CRC-32 does not match" in _reason(_frame3(header, column_frame, section[:-4]))
    assert "truncated routing section: 9 bytes" in _reason(_frame3(header, column_frame, section[:9]))
    body = section[17:]
    assert "unknown coding 7 (this build reads 0 and 1); upgrade rlbus" in _reason(
        _frame3(header, column_frame, _section(7, head, body))
    )
    assert "2 trailing bytes" in _reason(_frame3(header, column_frame, _section(SETS, head, body + b"\0\0")))
    runs = struct.pack("<I", 2) + struct.pack("<4I", 3, 4, 5, 1)  # rows 3..6 and 5: overlapping
    overlapping = _section(SETS, head, runs + body[4:])
    assert "not ascending, disjoint runs" in _reason(_frame3(header, column_frame, overlapping))
    zero_q = _section(SETS, head, body[:4] + b"\0\0" + body[6:])
    assert "repeat probability is outside 1..65535" in _reason(_frame3(header, column_frame, zero_q))
    columns_size = len(zstandard.ZstdDecompressor().decompress(column_frame))
    limit = len(header_json) + columns_size + 100
    assert "routing would decode to 192 bytes, over the limit of 100" in _reason(data, max_decompressed_bytes=limit)
    assert "truncated record: the column zstd frame needs" in _reason(data[: len(data) - len(section) - 5])
    # The header and the record's format disagree.
    dense = {k: v for k, v in header.items() if k != "routing"}
    assert "format 3 record without header.routing" in _reason(_frame3(dense, column_frame, section))
    header_frame = zstandard.ZstdCompressor().compress(header_json)
    frame2 = b"RLBG" + struct.pack("<HI", 2, len(header_frame)) + header_frame + column_frame
    assert "header.routing is set but the group has no routed_experts" in _reason(frame2)


# ----------------------------------------------------------------------------- size


@pytest.mark.parametrize("dims", SHAPES, ids=["4x2of8", "8x4of32", "48x8of128"])
def test_coded_size_is_near_the_entropy(dims: tuple[int, int, int]) -> None:
    """8 samples of 256 tokens after a 256-token prompt. The coding is held to the better of the two honest
    measures (order 0 or order 1 with the cost of learning their tables, ``routing_entropy``) and, closer, to
    the entropy of the process that drew the routing: within 1.1x of both. The plug-in order-1 entropy is no
    bound: on one group nearly every context is seen once and it falls far below what any code reaches."""
    shape = RoutingShape(layers=dims[0], top_k=dims[1], num_experts=dims[2])
    prompt_len, lengths = 256, [256] * 8
    routed, log_pop = synthetic_routing(np.random.default_rng(dims[2]), prompt_len, lengths, shape)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    group = _group(shape, lengths, prompt_len=prompt_len, routed=routed)
    coded_bits = 8 * len(_split3(encode_group(group))[2]) / routed.shape[0]
    measures = routing_entropy(routed, shape)
    honest = min(measures["order0_adaptive_bits"], measures["order1_adaptive_bits"])
    source = source_bits(routed, log_pop, 0.5, prompt_len, offsets)
    assert coded_bits <= 1.1 * honest
    assert 0.95 * source <= coded_bits <= 1.1 * source
    assert measures["raw_bits"] == 16 * dims[0] * dims[1]
    assert measures["order1_bits"] < source < measures["order1_adaptive_bits"]


def test_routing_entropy_of_simple_sequences() -> None:
    shape = RoutingShape(layers=2, top_k=2, num_experts=4)
    constant = np.tile(np.array([[0, 1], [2, 3]], np.int16), (100, 1, 1))
    m = routing_entropy(constant, shape)
    assert m["order0_bits"] == m["order1_bits"] == 0.0 and m["raw_bits"] == 64
    alternating = np.stack([constant[0], constant[0][::-1]] * 50)  # layer sets swap every row
    m = routing_entropy(alternating, shape)
    assert m["order0_bits"] == pytest.approx(2.0) and m["order1_bits"] == 0.0
    assert m["order0_adaptive_bits"] > m["order0_bits"] and m["order1_adaptive_bits"] > m["order1_bits"]
    assert m["order1_adaptive_bits"] < m["order0_adaptive_bits"]
    rng = np.random.default_rng(0)
    pairs = np.array(list(itertools.combinations(range(4), 2)), np.int16)
    uniform = pairs[rng.integers(0, 6, (4000, 2))]
    m = routing_entropy(uniform, shape)
    assert m["order0_bits"] == pytest.approx(2 * np.log2(6), abs=0.01)
    assert m["order0_adaptive_bits"] == pytest.approx(2 * np.log2(6), abs=0.05)
