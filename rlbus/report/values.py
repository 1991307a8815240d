"""Small helpers every report view shares: a metrics value as a number, a byte count as text."""

from __future__ import annotations

import math


def num(row: dict, key: str) -> float | None:
    """``row[key]`` as a finite float, or None (missing, None, a string, NaN)."""
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def fmt_bytes(n: float, _pos: object = None) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"
