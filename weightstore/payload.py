"""Payloads of a version (anchor or delta bytes) and their chunked transfer.

An anchor payload is the safetensors file of the full weights. A delta payload is a
safetensors file mapping each changed tensor's name to its sparse patch (``weightstore.delta``)
stored as a uint8 array; unchanged tensors are left out. Payloads are cut into chunks of
``chunk_bytes`` stored under content-addressed keys, so a chunk, once written, never changes.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import safetensors.numpy
import safetensors.torch
import torch

from weightstore.delta import apply_patch, encode_patch, patch_info
from weightstore.errors import CorruptPatch, IntegrityError
from weightstore.manifest import ChunkRef, Manifest, TensorInfo, chunk_key, dtype_name
from weightstore.objectstore import ObjectStore

logger = logging.getLogger(__name__)
T = TypeVar("T")


def anchor_payload(state: Mapping[str, torch.Tensor]) -> bytes:
    return safetensors.torch.save(dict(state))


def codec_workers() -> int:
    """Threads that encode or apply patches of different tensors at once: numpy and zstd release
    the GIL for the heavy work, but the codec is memory-bound, so half the cores (the trainer
    or the inference engine keeps the rest busy), at most 8."""
    return max(1, min(8, (os.cpu_count() or 1) // 2))


def _per_tensor(work: Callable[[str], T], state: Mapping[str, torch.Tensor], names: Iterable[str]) -> list[T]:
    """``work`` over ``names``, largest tensors first, on ``codec_workers()`` threads."""
    ordered = sorted(names, key=lambda n: (-state[n].numel(), n))
    workers = codec_workers()
    if workers == 1:
        return [work(name) for name in ordered]
    with ThreadPoolExecutor(workers, thread_name_prefix="ws-codec") as pool:
        return list(pool.map(work, ordered))


def delta_payload(
    old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *, level: int = 3
) -> bytes:
    """Patches from ``old`` to ``new`` (same names, shapes and dtypes) as one safetensors file."""

    def encode(name: str) -> tuple[str, bytes]:
        return name, encode_patch(old[name], new[name], level=level)

    encoded = dict(_per_tensor(encode, new, new))
    patches = {
        name: np.frombuffer(patch, dtype=np.uint8)
        for name, patch in sorted(encoded.items())
        if patch_info(patch).changed
    }
    return safetensors.numpy.save(patches)


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
    """Apply a delta payload to ``state`` in place, cloning a tensor the first time it changes.

    ``owned`` names the tensors already private to ``state`` (no clone needed); it grows.
    """
    try:
        patches = safetensors.numpy.load(data)
    except Exception as exc:  # safetensors raises its own error type for malformed files
        raise IntegrityError(f"delta v{manifest.version} is not a valid safetensors file: {exc}") from exc
    unknown = sorted(set(patches) - set(state))
    if unknown:
        raise CorruptPatch(f"delta v{manifest.version} patches unknown tensors {unknown[:5]}")

    def apply(name: str) -> tuple[str, torch.Tensor]:
        tensor = state[name] if name in owned else state[name].clone()
        apply_patch(tensor, memoryview(patches[name]))
        return name, tensor

    for name, tensor in _per_tensor(apply, state, patches):
        state[name] = tensor
        owned.add(name)
    check_tensors(state, manifest)


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
