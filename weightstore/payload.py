"""Payloads of a version (anchor or delta bytes) and their chunked transfer.

An anchor payload is the safetensors file of the full weights. A delta payload is a
safetensors file of sparse patches (``weightstore.patch``) stored as uint8 arrays; unchanged
tensors and buckets are left out. A large tensor has a patch of its own, under its name. Small
tensors of one dtype (norms, biases, the matrices of a small model) are patched together as a
*bucket*: the concatenation of their flattened elements in the order listed, under a key
``@bucket/<i>`` whose member names are in the file's metadata (``rlbus.buckets``, a JSON object
of key -> names). One patch per bucket instead of one per tensor saves the per-patch header,
zstd frames and decode calls, which dominate for small tensors (measured on versions 252-300
of a default run, 27 tensors: 14-19% fewer bytes, encode 2.8-3.1x and apply 1.6-2.5x faster). Larger matrices stay alone: a
bucket shares one hot threshold and magnitude table, which fits tensors of different scales less
well (bucketing up to 2**20 elements made the 124.7M model's deltas 3% larger). Payloads written before buckets
existed (per-tensor patches only, no metadata) still apply.

Payloads are cut into chunks of ``chunk_bytes`` stored under content-addressed keys, so a chunk,
once written, never changes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import safetensors.numpy
import safetensors.torch
import torch

from weightstore.errors import CorruptPatch, IntegrityError
from weightstore.manifest import ChunkRef, Manifest, TensorInfo, chunk_key, dtype_name
from weightstore.objectstore import ObjectStore
from weightstore.patch.codec import apply_patch, encode_patch, patch_info

logger = logging.getLogger(__name__)
T = TypeVar("T")

BUCKET_PREFIX = "@bucket/"
BUCKETS_METADATA = "rlbus.buckets"
BUCKET_TENSOR_MAX = 1 << 16
"""Tensors with more elements than this get a patch of their own."""
BUCKET_MAX = 1 << 22
"""A bucket closes before it would exceed this many elements (keeps several units to run in parallel)."""


def anchor_payload(state: Mapping[str, torch.Tensor]) -> bytes:
    return safetensors.torch.save(dict(state))


def codec_workers() -> int:
    """Threads that encode or apply patches of different tensors at once: numpy and zstd release
    the GIL for the heavy work, but the codec is memory-bound, so half the cores (the trainer
    or the inference engine keeps the rest busy), at most 8."""
    return max(1, min(8, (os.cpu_count() or 1) // 2))


def plan_buckets(state: Mapping[str, torch.Tensor]) -> dict[str, list[str]]:
    """Group the small tensors of ``state`` into buckets: per dtype, in name order, each bucket
    at most ``BUCKET_MAX`` elements. Returns bucket key -> member names (buckets of one tensor
    are left out: that tensor is patched under its own name)."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name in sorted(state):
        if state[name].numel() <= BUCKET_TENSOR_MAX:
            by_dtype.setdefault(state[name].dtype, []).append(name)
    groups: list[list[str]] = []
    for _, names in sorted(by_dtype.items(), key=lambda item: str(item[0])):
        current: list[str] = []
        size = 0
        for name in names:
            numel = state[name].numel()
            if current and size + numel > BUCKET_MAX:
                groups.append(current)
                current, size = [], 0
            current.append(name)
            size += numel
        groups.append(current)
    return {f"{BUCKET_PREFIX}{i}": names for i, names in enumerate(g for g in groups if len(g) > 1)}


def _flat(state: Mapping[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    """The elements of ``names`` concatenated, in a new contiguous buffer."""
    return torch.cat([state[name].reshape(-1) for name in names])


def delta_payload(
    old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *, level: int = 3
) -> bytes:
    """Patches from ``old`` to ``new`` (same names, shapes and dtypes) as one safetensors file:
    small tensors in buckets, large ones alone (module docstring)."""
    if any(name.startswith(BUCKET_PREFIX) for name in new):
        raise ValueError(f"tensor names may not start with {BUCKET_PREFIX!r} (reserved for buckets)")
    buckets = plan_buckets(new)
    bucketed = {name for names in buckets.values() for name in names}
    sizes = {key: sum(new[n].numel() for n in names) for key, names in buckets.items()}
    sizes |= {name: new[name].numel() for name in new if name not in bucketed}

    def encode(key: str) -> tuple[str, bytes]:
        if key in buckets:
            return key, encode_patch(_flat(old, buckets[key]), _flat(new, buckets[key]), level=level)
        return key, encode_patch(old[key], new[key], level=level)

    encoded = dict(_in_parallel(encode, sizes))
    patches = {
        key: np.frombuffer(patch, dtype=np.uint8)
        for key, patch in sorted(encoded.items())
        if patch_info(patch).changed
    }
    used = {key: names for key, names in buckets.items() if key in patches}
    return safetensors.numpy.save(patches, metadata={BUCKETS_METADATA: json.dumps(used)} if used else None)


def _in_parallel(work: Callable[[str], T], sizes: Mapping[str, int]) -> list[T]:
    """``work`` over the keys of ``sizes``, largest first, on ``codec_workers()`` threads."""
    ordered = sorted(sizes, key=lambda k: (-sizes[k], k))
    workers = codec_workers()
    if workers == 1:
        return [work(key) for key in ordered]
    with ThreadPoolExecutor(workers, thread_name_prefix="ws-codec") as pool:
        return list(pool.map(work, ordered))


def load_anchor(data: bytes, manifest: Manifest) -> dict[str, torch.Tensor]:
    try:
        state = safetensors.torch.load(data)
    except Exception as exc:  # safetensors raises its own error type for malformed files
        raise IntegrityError(f"anchor v{manifest.version} is not a valid safetensors file: {exc}") from exc
    check_tensors(state, manifest)
    return state


def apply_delta(
    state: dict[str, torch.Tensor], owned: set[str], data: bytes, manifest: Manifest
) -> None:
    """Apply a delta payload to ``state``: a tensor patched alone is cloned the first time it
    changes (``owned`` names those already private to ``state``; it grows), a bucket is patched
    in a new buffer whose slices replace its members.
    """
    try:
        patches = safetensors.numpy.load(data)
    except Exception as exc:  # safetensors raises its own error type for malformed files
        raise IntegrityError(f"delta v{manifest.version} is not a valid safetensors file: {exc}") from exc
    buckets = _read_buckets(data, patches, state, manifest)
    unknown = sorted(set(patches) - set(state) - set(buckets))
    if unknown:
        raise CorruptPatch(f"delta v{manifest.version} patches unknown tensors {unknown[:5]}")
    sizes = {key: sum(state[n].numel() for n in buckets.get(key, [key])) for key in patches}

    def apply(key: str) -> list[tuple[str, torch.Tensor]]:
        if key not in buckets:
            tensor = state[key] if key in owned else state[key].clone()
            apply_patch(tensor, memoryview(patches[key]))
            return [(key, tensor)]
        names = buckets[key]
        flat = _flat(state, names)
        apply_patch(flat, memoryview(patches[key]))
        out, at = [], 0
        for name in names:
            numel = state[name].numel()
            out.append((name, flat[at : at + numel].view(state[name].shape)))
            at += numel
        return out

    for pieces in _in_parallel(apply, sizes):
        for name, tensor in pieces:
            state[name] = tensor
            owned.add(name)
    check_tensors(state, manifest)


def payload_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors payload's header (empty when it has none)."""
    header_len = int.from_bytes(data[:8], "little")
    return json.loads(bytes(data[8 : 8 + header_len])).get("__metadata__") or {}


def _read_buckets(
    data: bytes, patches: Mapping[str, np.ndarray], state: Mapping[str, torch.Tensor], manifest: Manifest
) -> dict[str, list[str]]:
    """The payload's bucket table, checked against its patches and the weights it applies to."""
    where = f"delta v{manifest.version}"
    try:
        metadata = payload_metadata(data)
        buckets = json.loads(metadata[BUCKETS_METADATA]) if BUCKETS_METADATA in metadata else {}
    except (ValueError, TypeError) as exc:
        raise CorruptPatch(f"{where} has an unreadable bucket table: {exc}") from exc
    if not isinstance(buckets, dict) or not all(
        isinstance(k, str) and isinstance(v, list) and v and all(isinstance(n, str) for n in v)
        for k, v in buckets.items()
    ):
        raise CorruptPatch(f"{where}: the bucket table must map keys to non-empty lists of names")
    members = Counter(name for names in buckets.values() for name in names)
    problems = [
        *(f"bucket {k} has no patch" for k in buckets if k not in patches),
        *(f"bucket key {k} is not under {BUCKET_PREFIX}" for k in buckets if not k.startswith(BUCKET_PREFIX)),
        *(f"{n} is not in the weights" for n in members if n not in state),
        *(f"{n} is patched twice" for n, times in members.items() if times > 1 or n in patches),
        *(f"bucket {k} mixes dtypes" for k, v in buckets.items()
          if all(n in state for n in v) and len({state[n].dtype for n in v}) > 1),
    ]  # fmt: skip
    if problems:
        raise CorruptPatch(f"{where} bucket table does not fit the weights: {'; '.join(sorted(problems)[:5])}")
    return buckets


def check_tensors(state: Mapping[str, torch.Tensor], manifest: Manifest) -> None:
    """The weights have exactly the tensors (names, shapes, dtypes) the manifest lists."""
    got = {n: TensorInfo(shape=list(t.shape), dtype=dtype_name(t.dtype)) for n, t in state.items()}
    if got != manifest.tensors:
        missing = sorted(set(manifest.tensors) - set(got))[:5]
        extra = sorted(set(got) - set(manifest.tensors))[:5]
        raise IntegrityError(
            f"v{manifest.version} tensors disagree with its manifest (missing {missing}, "
            f"unexpected {extra}, or a shape/dtype differs)"
        )


def upload_chunks(
    store: ObjectStore, policy: str, data: bytes, chunk_bytes: int, pool: ThreadPoolExecutor
) -> list[ChunkRef]:
    """Store ``data`` as content-addressed chunks (at least one) and return their refs."""
    view = memoryview(data)
    pieces = [view[i : i + chunk_bytes] for i in range(0, max(len(view), 1), chunk_bytes)]
    refs = []
    for piece in pieces:
        sha = hashlib.sha256(piece).hexdigest()
        refs.append(ChunkRef(key=chunk_key(policy, sha), size=len(piece), sha256=sha))
    futures = [pool.submit(_put_piece, store, r.key, p) for r, p in zip(refs, pieces, strict=True)]
    for future in futures:
        future.result()
    return refs


def _put_piece(store: ObjectStore, key: str, piece: memoryview) -> None:
    store.put(key, bytes(piece))  # copied here, one chunk per worker at a time


def fetch_chunk(store: ObjectStore, ref: ChunkRef) -> bytes:
    """Download one chunk and check its size and sha256; raises ``IntegrityError``."""
    data = store.get(ref.key).data
    if len(data) != ref.size:
        raise IntegrityError(
            f"chunk {ref.key} in {store.describe()} is {len(data)} bytes, manifest says {ref.size}"
        )
    if hashlib.sha256(data).hexdigest() != ref.sha256:
        raise IntegrityError(f"chunk {ref.key} in {store.describe()} fails its sha256 check")
    return data


def fetch_payloads(
    store: ObjectStore, payloads: list[list[ChunkRef]], pool: ThreadPoolExecutor
) -> tuple[list[bytes], int]:
    """Download the chunks of several payloads in parallel; return each payload and the bytes."""
    futures = [[pool.submit(fetch_chunk, store, ref) for ref in refs] for refs in payloads]
    try:
        joined = [b"".join(f.result() for f in group) for group in futures]
    finally:
        for group in futures:
            for f in group:
                f.cancel()
    return joined, sum(ref.size for refs in payloads for ref in refs)
