"""Read-only views of a store for the ``rlbus weights ls|show|verify`` commands."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from weightstore.chain import build_weights, walk_chain
from weightstore.errors import IntegrityError, NotFound
from weightstore.manifest import (
    Manifest, manifest_versions, read_latest, read_manifest,
    list_policies as _list_policies,
)  # fmt: skip
from weightstore.objectstore import ObjectStore
from weightstore.payload import fetch_payloads


def list_policies(store: ObjectStore) -> list[str]:
    """Policies with a LATEST pointer in the store."""
    return _list_policies(store)


def list_versions(store: ObjectStore, policy: str) -> list[dict[str, Any]]:
    """One row per stored manifest, oldest first; unreadable manifests are reported, not skipped."""
    latest = read_latest(store, policy)
    latest_version = None if latest is None else latest[0].version
    rows: list[dict[str, Any]] = []
    for version in manifest_versions(store, policy):
        row: dict[str, Any] = {"version": version, "latest": version == latest_version}
        try:
            m = read_manifest(store, policy, version)
        except (NotFound, IntegrityError) as exc:
            rows.append(row | {"error": str(exc)})
            continue
        rows.append(
            row
            | {
                "kind": m.kind,
                "base_version": m.base_version,
                "anchor_version": m.anchor_version,
                "bytes": m.payload_bytes,
                "chunks": len(m.chunks),
                "tensors": len(m.tensors),
                "dtype": m.dtype,
                "created_at": m.created_at,
                "publisher_id": m.publisher_id,
            }
        )
    return rows


def show_version(store: ObjectStore, policy: str, version: int) -> Manifest:
    """The manifest of one version."""
    return read_manifest(store, policy, version)


def load_version(
    store: ObjectStore, policy: str, version: int, *, download_workers: int = 4
) -> dict[str, torch.Tensor]:
    """The weights of a retained ``version``, rebuilt from its anchor and checked against its hash."""
    path = walk_chain(store, policy, version, {}).anchor_path()
    if path is None:
        raise NotFound(f"{policy} v{version} cannot be rebuilt (retention removed its chain, or it was never published)")
    with ThreadPoolExecutor(download_workers, thread_name_prefix="ws-load") as pool:
        state, _ = build_weights(store, path, None, pool)
    return state


def verify_version(
    store: ObjectStore, policy: str, version: int, *, download_workers: int = 4
) -> dict[str, Any]:
    """Rebuild ``version`` from its anchor, checking every chunk and the final weights hash."""
    start = time.perf_counter()
    result: dict[str, Any] = {"policy": policy, "version": version, "ok": False}
    walk = walk_chain(store, policy, version, {})
    path = walk.anchor_path()
    result["chain"] = sorted(walk.manifests)
    if path is None:
        return result | {"error": str(walk.error), "seconds": time.perf_counter() - start}
    try:
        with ThreadPoolExecutor(download_workers, thread_name_prefix="ws-verify") as pool:
            state, nbytes = build_weights(store, path, None, pool)
            # The anchor's companion patch is not on this path; check its chunks too.
            _, companion_bytes = fetch_payloads(store, [path[0].delta_chunks], pool)
            nbytes += companion_bytes
    except (NotFound, IntegrityError) as exc:
        return result | {"error": str(exc), "seconds": time.perf_counter() - start}
    target = path[-1]
    return result | {
        "ok": True,
        "anchor_version": path[0].version,
        "bytes_downloaded": nbytes,
        "full_bytes": sum(t.numel() * t.element_size() for t in state.values()),
        "tensors": len(state),
        "weights_sha256": target.weights_sha256,
        "seconds": time.perf_counter() - start,
    }
