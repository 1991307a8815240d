"""Routing section of trajectory-group records (format 3): ``TrajectoryGroup.routed_experts``, the experts a
mixture-of-experts policy selected per position and MoE layer, as bytes and back; and ``routing_entropy``,
the information they hold.

Section (integers little-endian)::

    u8 coding | u32 rows | u32 layers | u16 top_k | u16 num_experts | u32 CRC-32 of the body | body

``RAW`` (0) body: the ``rows * layers * top_k`` int16 values in row, layer, rank order; written for shapes
beyond ``SETS``' limits (top_k > 32 or num_experts > 4096). ``SETS`` (1) body::

    u32 R | R * (u32 first row | u32 row count)   the rows not recorded (all -1): ascending, disjoint, apart
    layers * u16 q                                each layer's repeat probability, q / 65536 (0: no flags)
    u32 W | W * u32                               ANS words: constriction's stack AnsCoder (64-bit state,
                                                  32-bit words, probabilities in 24-bit fixed point)

The ANS stream holds, in decoding order: (1) each layer's expert levels, ``layers * num_experts`` symbols of
6 bits (uniform over 64); (2) each layer's repeat flags, its candidate rows ascending; (3) per layer, per
rank ``i``, the gap ``g_i`` of each of the layer's new sets (rows ascending), over ``0 .. num_experts - 1``.

Rows and flags. Row r's predecessor is r - 1 (none for row 0), except that the first row of each sample
after the first sample with tokens has that sample's first row as predecessor (all route the prompt's last
position). A recorded row whose predecessor is recorded is a candidate: per layer a flag says whether it
has the predecessor's experts there (probability q / 65536). Every other recorded (row, layer) is a new set.

Sets. A level ``v`` gives an expert the weight ``W(v) = B[(v - 1) % 4] * 2**((v - 1) // 4 - 31)``,
``B = (65536, 77936, 92682, 110218)`` (2**(j / 4), 16-bit fixed point); ``v = 0``: weight 0, in none of the
layer's new sets. (rlbus writes the odds of the expert's share of the layer's new sets, in quarter octaves
below the largest.) The walk lists a layer's experts by level, highest first, ties by id; ``w`` are their
weights in that order. A new set is its experts' walk positions ``p_0 < ... < p_(k-1)``, sent as the gaps
``g_i = p_i - p_(i-1) - 1`` (``p_-1 = -1``). The model of ``g_i`` is its distribution under the
conditional-Bernoulli model ``P(S) ~ prod(W(e) for e in S)`` over sets of ``k``, marginalised over
``p_(i-1)``, in buckets of gaps: ``g < 8`` alone; else, with ``m = floor(log2 g)``, bucket
``8 + 4 (m - 3) + ((g >> (m - 2)) & 3)`` of ``2**(m - 2)`` gaps. Bucket ``b``'s mass is::

    M_i[b] = sum_(j = 0 .. E) A_i[j] * sum_(g in b) C_i[j + g]
    A_i[j] = e_(i-1)(w[: j-1]) * w[j - 1]   (j >= 1; for i = 0: 1 at j = 0, 0 elsewhere)
    C_i[x] = w[x] * e_(k-1-i)(w[x+1 :])     (0 for x >= E)

(``e_a`` elementary symmetric polynomials). A distribution over ``n`` symbols becomes integer frequencies
``c = floor(p * ((2**24 - n) / sum(p)))``, the shortfall added to the first largest, and a symbol has
probability ``(c + 1) / 2**24``: the buckets' masses so (``n = E``), each bucket's frequency then split evenly
over its gaps below E, the remainder to its first; a flag ``c = (2**24 - 2 - (256 q - 1), 256 q - 1)``; a level
``c = 2**18 - 1`` each.

``_gap_models`` is normative: IEEE float64 multiplications, additions and divisions in its order (the sums
over a bucket's gaps by pairwise doubling, over ``j`` and over buckets left to right, no library reductions
whose order may vary), so that every machine derives the same frequencies from the same levels.
"""

from __future__ import annotations

import math
import struct
import zlib

import constriction
import numpy as np

from broker.columns import unpack_at
from broker.errors import RecordError
from broker.schema import RoutingShape

RAW, SETS = 0, 1
SETS_MAX_TOP_K, SETS_MAX_EXPERTS = 32, 4096
LEVEL_BITS = 6
PRECISION = 24
_LEVEL_BASE = np.array([65536.0, 77936.0, 92682.0, 110218.0])
_HEAD = struct.Struct("<BIIHH")
_U32 = struct.Struct("<I")


# ----------------------------------------------------------------------------- section


def encode_routing(routed: np.ndarray, shape: RoutingShape, prompt_len: int, offsets: np.ndarray) -> bytes:
    """The routing section of ``routed`` (int16 [rows, layers, top_k], already validated)."""
    rows = routed.shape[0]
    coding = SETS if shape.top_k <= SETS_MAX_TOP_K and shape.num_experts <= SETS_MAX_EXPERTS else RAW
    if coding == SETS:
        body = _encode_sets(routed, shape, predecessors(rows, prompt_len, offsets))
    else:
        body = routed.astype("<i2").tobytes()
    head = _HEAD.pack(coding, rows, shape.layers, shape.top_k, shape.num_experts)
    return head + _U32.pack(zlib.crc32(body)) + body


def decode_routing(
    section: bytes | memoryview, shape: RoutingShape, prompt_len: int, offsets: np.ndarray, limit: int
) -> np.ndarray:
    """``routed_experts`` from a routing section written for ``shape`` and these columns; ``RecordError``
    names what is wrong. ``limit`` bounds the decoded bytes."""
    if len(section) < _HEAD.size + _U32.size:
        raise RecordError(f"truncated routing section: {len(section)} bytes, shorter than its 17-byte head")
    coding, rows, layers, top_k, experts = _HEAD.unpack_from(section, 0)
    if prompt_len < 1:
        raise RecordError("routed_experts need a prompt of at least one token (its last position routes first tokens)")
    want_rows = prompt_len - 1 + int(offsets[-1])
    if (layers, top_k, experts) != (shape.layers, shape.top_k, shape.num_experts):
        raise RecordError(
            f"routing section is for {layers} layers, top_k {top_k} of {experts} experts; header.routing says "
            f"{shape.layers} layers, top_k {shape.top_k} of {shape.num_experts}"
        )
    if rows != want_rows:
        raise RecordError(f"routing section has {rows} rows, expected P - 1 + T = {want_rows}")
    if rows * layers * top_k * 2 > limit:
        raise RecordError(f"routing would decode to {rows * layers * top_k * 2} bytes, over the limit of {limit}")
    body = bytes(section[_HEAD.size + _U32.size :])
    if zlib.crc32(body) != _U32.unpack_from(section, _HEAD.size)[0]:
        raise RecordError("routing section is corrupt or truncated: its CRC-32 does not match")
    if coding == RAW:
        if len(body) != rows * layers * top_k * 2:
            raise RecordError(f"routing section (raw) has {len(body)} bytes, expected {rows * layers * top_k * 2}")
        return np.frombuffer(body, "<i2").reshape(rows, layers, top_k).astype(np.int16)
    if coding != SETS:
        raise RecordError(f"routing section has unknown coding {coding} (this build reads 0 and 1); upgrade rlbus")
    try:
        return _decode_sets(body, shape, predecessors(rows, prompt_len, offsets))
    except RecordError:
        raise
    except (ValueError, IndexError) as exc:  # constriction's refusal of words no encoder wrote
        raise RecordError(f"routing section is corrupt: {exc}") from None


def predecessors(rows: int, prompt_len: int, offsets: np.ndarray) -> np.ndarray:
    """Each row's predecessor row (-1: none): the previous row, but for the first row of each sample after
    the first sample with tokens, that sample's first row (all are the prompt's last position)."""
    pred = np.arange(-1, rows - 1)
    firsts = (prompt_len - 1 + offsets[:-1].astype(np.int64))[np.diff(offsets) > 0]
    if firsts.size > 1:
        pred[firsts[1:]] = firsts[0]
    return pred


# ----------------------------------------------------------------------------- SETS coding


def _encode_sets(routed: np.ndarray, shape: RoutingShape, pred: np.ndarray) -> bytes:
    layers, k, experts = shape.layers, shape.top_k, shape.num_experts
    rows = routed.shape[0]
    recorded = routed[:, 0, 0] >= 0
    cand = np.flatnonzero(recorded & (pred >= 0) & recorded[np.maximum(pred, 0)])
    repeat = np.zeros((rows, layers), bool)
    repeat[cand] = (routed[cand] == routed[pred[cand]]).all(-1)
    q = np.clip(np.round(repeat[cand].mean(0) * 65536), 1, 65535) if cand.size else np.zeros(layers)
    layer_of, row_of = np.nonzero((recorded[:, None] & ~repeat).T)  # new sets, layer-major
    sets = routed[row_of, layer_of].astype(np.int64)
    counts = np.bincount((layer_of[:, None] * experts + sets).ravel(), minlength=layers * experts)
    levels = _levels(counts.reshape(layers, experts), np.bincount(layer_of, minlength=layers))
    walk, weights = _walk(levels)
    rank = np.argsort(walk, axis=1).astype(np.int32)
    gaps = np.diff(np.sort(rank[layer_of[:, None], sets], axis=1), axis=1, prepend=-1) - 1
    models = _gap_models(weights, k)
    coder = constriction.stream.stack.AnsCoder()
    ends = np.cumsum(np.bincount(layer_of, minlength=layers))
    gaps = gaps.astype(np.int32)
    for layer in reversed(range(layers)):  # a stack: pushed in the reverse of the decoding order
        start = ends[layer - 1] if layer else 0
        for i in reversed(range(k if ends[layer] > start else 0)):
            coder.encode_reverse(gaps[start : ends[layer], i], _model(models[layer, i]))
    for layer in reversed(range(layers if cand.size else 0)):
        coder.encode_reverse(repeat[cand, layer].astype(np.int32), _flag_model(int(q[layer])))
    coder.encode_reverse(levels.ravel().astype(np.int32), _uniform(LEVEL_BITS))
    words = coder.get_compressed().astype("<u4")
    runs = _runs(~recorded)
    return b"".join((
        _U32.pack(len(runs) // 2), runs.astype("<u4").tobytes(), q.astype("<u2").tobytes(),
        _U32.pack(words.size), words.tobytes(),
    ))  # fmt: skip


def _decode_sets(body: bytes, shape: RoutingShape, pred: np.ndarray) -> np.ndarray:
    layers, k, experts = shape.layers, shape.top_k, shape.num_experts
    rows = pred.size
    (nruns,) = unpack_at(_U32, body, 0, "routing section's count of unrecorded runs")
    runs = _array(body, 4, "<u4", 2 * nruns, "unrecorded row runs").astype(np.int64).reshape(-1, 2)
    starts, lengths = runs[:, 0], runs[:, 1]
    apart = (starts[1:] > starts[:-1] + lengths[:-1]).all()
    if lengths.min(initial=1) < 1 or (starts + lengths).max(initial=0) > rows or not apart:
        raise RecordError("routing section's unrecorded rows are not ascending, disjoint runs inside the rows")
    recorded = np.ones(rows, bool)
    recorded[np.repeat(starts, lengths) + _ramp(lengths)] = False
    at = 4 + 8 * nruns
    q = _array(body, at, "<u2", layers, "repeat probabilities").astype(np.int64)
    (nwords,) = unpack_at(_U32, body, at + 2 * layers, "routing section's ANS word count")
    words = _array(body, at + 2 * layers + 4, "<u4", nwords, "ANS words")
    if at + 2 * layers + 4 + 4 * nwords != len(body):
        raise RecordError(f"routing section has {len(body) - at - 2 * layers - 4 - 4 * nwords} trailing bytes")
    coder = constriction.stream.stack.AnsCoder(words.astype(np.uint32))
    levels = coder.decode(_uniform(LEVEL_BITS), layers * experts).astype(np.int64).reshape(layers, experts)
    cand = np.flatnonzero(recorded & (pred >= 0) & recorded[np.maximum(pred, 0)])
    repeat = np.zeros((rows, layers), bool)
    if cand.size and (q.min() < 1 or q.max() > 65535):
        raise RecordError("routing section is corrupt: a repeat probability is outside 1..65535")
    for layer in range(layers if cand.size else 0):
        repeat[cand, layer] = coder.decode(_flag_model(int(q[layer])), cand.size).astype(bool)
    layer_of, row_of = np.nonzero((recorded[:, None] & ~repeat).T)
    counts = np.bincount(layer_of, minlength=layers)
    walk, weights = _walk(levels)
    models = _gap_models(weights, k)
    gaps = np.empty((layer_of.size, k), np.int64)
    first = 0
    for layer in range(layers):
        for i in range(k if counts[layer] else 0):
            gaps[first : first + counts[layer], i] = coder.decode(_model(models[layer, i]), int(counts[layer]))
        first += counts[layer]
    if not coder.is_empty():
        raise RecordError("routing section is corrupt: its ANS stream does not end where the sets do")
    positions = np.cumsum(gaps + 1, axis=1) - 1
    if positions.size and (positions[:, -1] >= (levels > 0).sum(1)[layer_of]).any():
        raise RecordError("routing section is corrupt: a gap walks past the layer's selected experts")
    out = np.full((rows, layers, k), -1, np.int16)
    out[row_of, layer_of] = np.sort(walk.astype(np.int32)[layer_of[:, None], positions], axis=1)
    source = np.where(repeat, pred[:, None], np.arange(rows)[:, None])
    column = np.arange(layers)
    while True:  # pointer jumping: each repeat reads the new set its chain of predecessors starts from
        jumped = source[source, column]
        if np.array_equal(jumped, source):
            break
        source = jumped
    return out[source, column]


def _levels(counts: np.ndarray, sets: np.ndarray) -> np.ndarray:
    """Per layer and expert, the level of its weight: the odds of its share of the layer's new sets, in
    quarter octaves below the layer's largest (0: in none)."""
    share = counts / np.maximum(sets, 1)[:, None]
    odds = share / np.maximum(1 - share, 0.5 / np.maximum(sets, 1)[:, None])
    top = np.maximum(odds.max(axis=1, keepdims=True), 1e-300)
    with np.errstate(divide="ignore"):
        level = np.round(4 * np.log2(np.where(counts > 0, odds, top) / top)) + (1 << LEVEL_BITS) - 1
    return np.where(counts > 0, np.clip(level, 1, (1 << LEVEL_BITS) - 1), 0).astype(np.int64)


def _walk(levels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each layer's experts by level, highest first (ties by id), and their weights in that order."""
    walk = np.argsort(-levels, axis=1, kind="stable")
    v = np.take_along_axis(levels, walk, axis=1)
    weights = np.ldexp(_LEVEL_BASE[(v - 1) % 4], (v - 1) // 4 - 31)
    return walk, np.where(v > 0, weights, 0.0)


def _gap_models(w: np.ndarray, k: int) -> np.ndarray:
    """Integer frequencies [layers, k, experts] of each rank's gap, from walk-ordered weights."""
    layers, experts = w.shape
    table = _Buckets(experts)
    span = 1 << table.lo_bits  # gaps per bucket
    pre = np.zeros((layers, experts + 1, k + 1))
    suf = np.zeros((layers, experts + 1, k + 1))
    pre[:, :, 0] = suf[:, :, 0] = 1.0
    for j in range(experts):
        pre[:, j + 1, 1:] = pre[:, j, 1:] + w[:, j, None] * pre[:, j, :-1]
        back = experts - 1 - j
        suf[:, back, 1:] = suf[:, back + 1, 1:] + w[:, back, None] * suf[:, back + 1, :-1]
    before = np.zeros((layers, k, 1, experts + 1))  # [.., i, 0, j]: rank i - 1 at walk position j - 1
    before[:, 0, 0, 0] = 1.0
    after = np.zeros((layers, k, 2 * experts + 2 * int(span.max())))  # [.., i, x]: rank i at position x
    for i in range(k):
        if i:
            before[:, i, 0, 1:] = pre[:, :experts, i - 1] * w
        after[:, i, :experts] = w * suf[:, 1:, k - 1 - i]
    window = {1: after}  # window[n][.., x] = after[.., x] + ... + after[.., x + n - 1]
    while 2 * max(window) <= span.max():
        n = max(window)
        window[2 * n] = window[n][..., :-n] + window[n][..., n:]
    reach = np.empty((layers, k, table.lo.size, experts + 1))  # [.., i, b, j]: rank i in bucket b after j - 1
    for b, (lo, n) in enumerate(zip(table.lo.tolist(), span.tolist())):
        reach[:, :, b, :] = window[n][..., lo : lo + experts + 1]
    mass = np.cumsum(before * reach, axis=-1)[..., -1]
    free = (1 << PRECISION) - experts
    total = np.cumsum(mass, axis=-1)[..., -1:]
    freq = np.floor(mass * (free / np.where(total > 0, total, 1.0))).astype(np.int64)
    freq = np.where(total > 0, freq, free // table.lo.size)
    top = np.argmax(freq, axis=-1)[..., None]
    np.put_along_axis(freq, top, np.take_along_axis(freq, top, -1) + free - freq.sum(-1, keepdims=True), -1)
    gaps = np.minimum(span, experts - table.lo)  # a bucket's share goes evenly to its gaps, the rest to its first
    share = freq // gaps
    spread = np.repeat(share, gaps, axis=-1)
    spread[..., table.lo] += freq - share * gaps
    return spread


class _Buckets:
    """The gap buckets of a layer of ``experts`` experts: each bucket's smallest gap and log2 of its span."""

    def __init__(self, experts: int) -> None:
        gaps = np.arange(experts)
        magnitude = np.array([max(int(g).bit_length() - 1, 0) for g in gaps], dtype=np.int64)
        bits = np.where(gaps >= 8, magnitude - 2, 0)
        bucket = np.where(gaps >= 8, 8 + 4 * (magnitude - 3) + ((gaps >> bits) & 3), gaps)
        self.lo = np.searchsorted(bucket, np.arange(int(bucket[-1]) + 1))  # buckets grow by one at most
        self.lo_bits = bits[self.lo]


def _model(freq: np.ndarray) -> constriction.stream.model.Categorical:
    return constriction.stream.model.Categorical(freq.astype(np.float64), perfect=False)


def _uniform(bits: int) -> constriction.stream.model.Categorical:
    """``bits`` bits: each of 2**bits symbols has frequency 2**(24 - bits) - 1 (+ 1)."""
    return _model(np.full(1 << bits, (1 << (PRECISION - bits)) - 1))


def _flag_model(q: int) -> constriction.stream.model.Categorical:
    one = q * 256 - 1
    return _model(np.array([(1 << PRECISION) - 2 - one, one]))


# ----------------------------------------------------------------------------- bytes


def _array(body: bytes, at: int, dtype: str, count: int, what: str) -> np.ndarray:
    size = np.dtype(dtype).itemsize * count
    if at + size > len(body):
        raise RecordError(f"truncated routing section: the {what} need {size} bytes, {len(body) - at} left")
    return np.frombuffer(body, dtype, count, at)


def _runs(mask: np.ndarray) -> np.ndarray:
    """(first, count) of each run of True in ``mask``, flattened."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return np.stack([edges[::2], edges[1::2] - edges[::2]], axis=1).ravel()


def _ramp(lengths: np.ndarray) -> np.ndarray:
    """0..n-1 for each n of ``lengths``, concatenated."""
    return np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)


# ----------------------------------------------------------------------------- measurement


def routing_entropy(routed_experts: np.ndarray, shape: RoutingShape) -> dict[str, float]:
    """Bits per row (token), summed over layers, of ``routed_experts`` ([rows, layers, top_k]); each layer's
    selected set (an all -1 row included) is one symbol, rows in storage order:

    * ``raw_bits``: the int16 array (16 * layers * top_k).
    * ``order0_bits``: plug-in entropy of each layer's sets.
    * ``order1_bits``: plug-in entropy of each layer's set given the previous row's set in that layer.
    * ``order0_adaptive_bits``, ``order1_adaptive_bits``: what a coder of those two models spends when it
      learns their tables as it goes (PPM method C: a symbol new to its context escapes, with probability
      distinct / (seen + distinct), to order 0, where a set never seen is named among the C(E, k) + 1
      symbols not yet seen). The plug-in figures assume a decoder that already knows the tables; on one
      group (a few thousand rows, sets of C(128, 8) ~ 2**40) nearly every set and context is seen once
      and they fall far below what any code reaches. The adaptive ones include the tables' cost.
    """
    rows = routed_experts.shape[0]
    log_symbols = math.log2(math.comb(shape.num_experts, shape.top_k) + 1)
    out = dict.fromkeys(("order0_bits", "order1_bits", "order0_adaptive_bits", "order1_adaptive_bits"), 0.0)
    for layer in range(shape.layers):
        x = np.unique(routed_experts[:, layer, :], axis=0, return_inverse=True)[1].reshape(-1).astype(np.int64)
        out["order0_bits"] += _plugin(np.bincount(x))
        pair = x[:-1] * (x.max(initial=0) + 1) + x[1:]
        out["order1_bits"] += _plugin(np.unique(pair, return_counts=True)[1]) - _plugin(np.bincount(x[:-1]))
        seen = _counts_before(x)
        distinct = np.cumsum(seen == 0) - (seen == 0)
        t = np.arange(rows)
        novel = np.log2(np.maximum(t + distinct, 1)) - np.log2(np.maximum(distinct, 1))
        novel += log_symbols + np.log2(np.maximum(1 - distinct / 2.0**log_symbols, 1e-300))
        bits0 = np.where(seen > 0, np.log2(np.maximum(t + distinct, 1)) - np.log2(np.maximum(seen, 1)), novel)
        bits0[0] = log_symbols
        out["order0_adaptive_bits"] += float(bits0.sum())
        context, pair_seen = _counts_before(x[:-1]), _counts_before(pair)
        first = pair_seen == 0
        order = np.argsort(x[:-1], kind="stable")
        grouped = np.cumsum(first[order])
        starts = np.r_[0, np.flatnonzero(np.diff(x[:-1][order])) + 1]
        within = grouped - np.repeat(grouped[starts] - first[order][starts], np.diff(np.r_[starts, rows - 1]))
        distinct1 = np.empty_like(within)
        distinct1[order] = within - first[order]
        denominator = np.log2(np.maximum(context + distinct1, 1))
        bits1 = np.where(
            pair_seen > 0,
            denominator - np.log2(np.maximum(pair_seen, 1)),
            np.where(context > 0, denominator - np.log2(np.maximum(distinct1, 1)), 0) + bits0[1:],
        )
        out["order1_adaptive_bits"] += float(bits0[0] + bits1.sum())
    return {"raw_bits": 16.0 * shape.layers * shape.top_k} | {name: v / max(rows, 1) for name, v in out.items()}


def _plugin(counts: np.ndarray) -> float:
    """Total bits of the symbols with these counts under their empirical distribution."""
    c = counts[counts > 0].astype(np.float64)
    return float(-(c * np.log2(c / c.sum())).sum())


def _counts_before(x: np.ndarray) -> np.ndarray:
    """How often each element's value occurred before it."""
    order = np.argsort(x, kind="stable")
    starts = np.r_[0, np.flatnonzero(np.diff(x[order])) + 1]
    rank = np.arange(x.size) - np.repeat(starts, np.diff(np.r_[starts, x.size]))
    out = np.empty_like(rank)
    out[order] = rank
    return out
