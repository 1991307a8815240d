"""What the patch codec derives from the old weights and the change statistics: exponent
contexts, the hot class, the gap shift and the magnitude table (see ``weightstore.patch.codec``).

The scans over whole tensors work in slices of ``SLICE`` elements so their temporaries stay in
cache; everything else touches only the changed (or hot) elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from weightstore.patch.bitcodes import varint_sizes

SLICE = 1 << 18
MAX_HOT_FRACTION = 0.02  # a hot class costs the reader a scan and a sort of this many elements
MIN_HOT_GAIN = 0.03  # ... so it has to save at least this fraction of the position bits
MIN_HOT_GAIN_BITS = 4096
MIN_HOT_NUMEL = 1 << 16  # smaller tensors are not worth the statistics
_SAMPLE = 1 << 16
_SMALL_SAMPLE = 1 << 14
_RUN = 1 << 10


@dataclass(frozen=True)
class FloatLayout:
    """Where the exponent field sits in a float's bit pattern."""

    mantissa_bits: int
    exp_bits: int

    def context(self, bits: np.ndarray) -> np.ndarray:
        """The biased exponent field of every element (uint8, or uint16 for float64)."""
        field = (bits >> bits.dtype.type(self.mantissa_bits)) & bits.dtype.type((1 << self.exp_bits) - 1)
        return field.astype(np.uint8 if self.exp_bits <= 8 else np.uint16)

    def hot_limit(self, bits_dtype: np.dtype, threshold: int) -> np.generic:
        """Elements are hot when ``bits + bits`` (the sign shifted out) is below this."""
        return bits_dtype.type(threshold << (self.mantissa_bits + 1))

    def is_hot(self, bits: np.ndarray, threshold: int) -> np.ndarray:
        return (bits + bits) < self.hot_limit(bits.dtype, threshold)


_LAYOUTS = {
    torch.bfloat16: FloatLayout(7, 8), torch.float16: FloatLayout(10, 5),
    torch.float32: FloatLayout(23, 8), torch.float64: FloatLayout(52, 11),
}  # fmt: skip


def layout_of(dtype: torch.dtype) -> FloatLayout | None:
    """The float layout of ``dtype``; None for integer and bool dtypes."""
    return _LAYOUTS.get(dtype)


@dataclass
class Scan:
    """Positions found in one pass over a tensor, with the bits gathered there while the slice
    was in cache (gathering sparse positions afterwards would read the whole tensor again)."""

    cold: np.ndarray  # sorted positions of the changed elements that are not hot
    cold_old: np.ndarray
    cold_new: np.ndarray | None  # None when scanning for a reader
    hot: np.ndarray  # sorted positions of the hot elements
    hot_old: np.ndarray
    hot_new: np.ndarray | None


def scan_changes(a: np.ndarray, b: np.ndarray, lay: FloatLayout | None, threshold: int) -> Scan:
    """The writer's pass: where ``a`` and ``b`` differ, and (``threshold`` > 0) the hot class."""
    return _scan(a, b, lay, threshold, None)


def scan_hot(bits: np.ndarray, lay: FloatLayout, threshold: int, cold: np.ndarray) -> Scan:
    """The reader's pass: the hot class of ``bits``, and its bits at the given sorted positions."""
    return _scan(bits, None, lay, threshold, cold)


def _scan(
    a: np.ndarray, b: np.ndarray | None, lay: FloatLayout | None, threshold: int,
    given: np.ndarray | None,
) -> Scan:  # fmt: skip
    hot = threshold > 0
    if hot:
        assert lay is not None
        limit = lay.hot_limit(a.dtype, threshold)
    total = a.size
    step = min(SLICE, max(total, 1))
    doubled = np.empty(step, dtype=a.dtype)
    hot_mask = np.empty(step, dtype=bool)
    diff_mask = np.empty(step, dtype=bool)
    if given is not None:
        bounds = np.searchsorted(given, np.arange(0, total + step, step)).tolist()
        given_old = np.empty(given.size, dtype=a.dtype)
    keys = ("cold", "cold_old", "cold_new", "hot", "hot_old", "hot_new")
    parts: dict[str, list[np.ndarray]] = {k: [] for k in keys}
    for k, start in enumerate(range(0, total, step)):
        n = min(step, total - start)
        x = a[start : start + n]
        y = None if b is None else b[start : start + n]
        if hot:
            np.add(x, x, out=doubled[:n])  # the sign bit shifted out
            np.less(doubled[:n], limit, out=hot_mask[:n])
            found = hot_mask[:n].nonzero()[0]
            if found.size:
                parts["hot"].append(found + start)
                parts["hot_old"].append(np.take(x, found))
                if y is not None:
                    parts["hot_new"].append(np.take(y, found))
        if y is not None:
            np.not_equal(x, y, out=diff_mask[:n])
            if hot:
                np.greater(diff_mask[:n], hot_mask[:n], out=diff_mask[:n])  # changed and not hot
            found = diff_mask[:n].nonzero()[0]
            if found.size:
                parts["cold"].append(found + start)
                parts["cold_old"].append(np.take(x, found))
                parts["cold_new"].append(np.take(y, found))
        elif given is not None and bounds[k + 1] > bounds[k]:
            i, j = bounds[k], bounds[k + 1]
            np.take(x, given[i:j] - start, out=given_old[i:j])

    def joined(key: str, dtype: np.dtype) -> np.ndarray:
        return np.concatenate(parts[key]) if parts[key] else np.zeros(0, dtype=dtype)

    pos, bits = np.dtype(np.int64), a.dtype
    if given is not None:
        return Scan(given, given_old, None, joined("hot", pos), joined("hot_old", bits), None)
    return Scan(
        joined("cold", pos), joined("cold_old", bits), joined("cold_new", bits),
        joined("hot", pos), joined("hot_old", bits), None if b is None else joined("hot_new", bits),
    )  # fmt: skip


def _binary_entropy_bits(k: np.ndarray, n: np.ndarray) -> np.ndarray:
    """n * H_b(k / n) in bits, elementwise, 0 where k is 0 or n."""
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(n > 0, k / np.maximum(n, 1), 0.0)
        h = -(p * np.log2(np.where(p > 0, p, 1)) + (1 - p) * np.log2(np.where(p < 1, 1 - p, 1)))
    return n * h


def _sample(x: np.ndarray) -> np.ndarray:
    """A fixed sample of about ``_SAMPLE`` elements: evenly spaced runs of contiguous ones (runs,
    so that reading it is cheap and regular strides cannot alias with a tensor's rows)."""
    if x.size <= _SAMPLE:
        return x
    starts = np.linspace(0, x.size - _RUN, _SAMPLE // _RUN).astype(np.int64)
    return np.concatenate([x[s : s + _RUN] for s in starts.tolist()])


def choose_hot_threshold(a: np.ndarray, b: np.ndarray, lay: FloatLayout) -> int:
    """The exponent threshold T of the hot class (0: none) that minimises the estimated position
    bits, estimated from a sample of the elements: per exponent a bitmap for the hot class, one
    gap-coded class for the rest. A hot class that would be large, or would save little, is
    not worth the reader's scan."""
    n = a.size
    if n < MIN_HOT_NUMEL:
        return 0
    old, new = _sample(a), _sample(b)
    contexts = 1 << lay.exp_bits
    scale = n / max(old.size, 1)
    ctx = lay.context(old)
    k = np.bincount(ctx[old != new], minlength=contexts) * scale
    m = np.bincount(ctx, minlength=contexts) * scale
    changed = float(k.sum())
    hot_bits = np.cumsum(_binary_entropy_bits(k, m))
    hot_n, hot_k = np.cumsum(m), np.cumsum(k)
    cold_bits = _binary_entropy_bits(np.maximum(changed - hot_k, 0), np.full(contexts, float(n)))
    cost = hot_bits + cold_bits  # cost[t]: threshold t + 1
    cost[hot_n > MAX_HOT_FRACTION * n] = np.inf
    best = int(np.argmin(cost))
    base = float(_binary_entropy_bits(np.float64(changed), np.float64(n)))
    if best + 1 >= contexts or base - cost[best] < max(MIN_HOT_GAIN * base, MIN_HOT_GAIN_BITS):
        return 0
    return best + 1


def gap_shift(gaps: np.ndarray) -> int:
    """How many low bits of each gap to store raw: the shift that minimises, on a sample, the
    order-0 entropy of the byte symbols ``min(g >> s, 255)`` plus ``s`` raw bits plus the
    escapes' varint bytes."""
    if gaps.size == 0:
        return 0
    sample = gaps[:: max(1, gaps.size // _SMALL_SAMPLE)]
    best, best_bits = 0, np.inf
    for shift in range(int(sample.max()).bit_length() + 1):
        high = sample >> np.uint64(shift)
        counts = np.bincount(np.minimum(high, 255).astype(np.intp), minlength=256)
        p = counts[counts > 0] / sample.size
        escaped = high[high >= 255]
        escape_bits = 8 * int(varint_sizes(escaped - np.uint64(255)).sum()) if escaped.size else 0
        bits = sample.size * (float(-(p * np.log2(p)).sum()) + shift) + escape_bits
        if bits < best_bits:
            best, best_bits = shift, bits
        elif escaped.size * 64 < sample.size:
            break  # few escapes left: larger shifts mostly add raw bits
    return best


def magnitude_table(magnitude: np.ndarray, contexts: np.ndarray) -> dict[int, int]:
    """Per context, the most frequent change magnitude (from a strided sample), where not 1."""
    step = max(1, magnitude.size // _SMALL_SAMPLE)
    mags = np.minimum(magnitude[::step], np.uint64(0xFFFFFFFF))
    keys = (contexts[::step].astype(np.uint64) << np.uint64(32)) | mags
    unique, counts = np.unique(keys, return_counts=True)
    ctx = unique >> np.uint64(32)
    order = np.lexsort((counts, ctx))
    last = np.ones(order.size, dtype=bool)
    last[:-1] = ctx[order][1:] != ctx[order][:-1]
    best = unique[order][last]
    return {
        int(c): int(v)
        for c, v in zip(best >> np.uint64(32), best & np.uint64(0xFFFFFFFF), strict=True)
        if int(v) != 1
    }
