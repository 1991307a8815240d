"""Retention: drop old manifests and the chunks nothing references, never breaking a chain.

Kept: the newest ``keep_versions`` manifests, the manifest LATEST points to, and every manifest
on the delta chain (back to its anchor) of a kept version. Chunks are deleted only when no
remaining manifest references them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from weightstore.chain import get_manifest
from weightstore.errors import IntegrityError, NotFound
from weightstore.manifest import Manifest, manifest_key, manifest_versions
from weightstore.objectstore import ObjectStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionResult:
    """What one retention pass kept and removed."""

    kept_versions: list[int]
    deleted_versions: list[int]
    deleted_chunks: int


def apply_retention(
    store: ObjectStore,
    policy: str,
    keep_versions: int,
    *,
    latest_version: int | None = None,
    cache: dict[int, Manifest] | None = None,
) -> RetentionResult:
    """Delete what the newest ``keep_versions`` versions (and LATEST) do not need."""
    cache = {} if cache is None else cache
    versions = manifest_versions(store, policy)
    existing = set(versions)
    roots = set(versions[-keep_versions:])
    if latest_version is not None and latest_version in existing:
        roots.add(latest_version)
    keep: set[int] = set()
    unreadable: set[int] = set()
    for root in sorted(roots, reverse=True):
        version: int | None = root
        while version is not None and version not in keep:
            if version not in existing:
                logger.warning("chain of %s v%s is already broken: v%s is missing", policy, root, version)
                break
            keep.add(version)
            try:
                manifest = get_manifest(store, policy, version, cache)
            except (NotFound, IntegrityError) as exc:
                # Keep what cannot be read: deleting it could break a chain we cannot see.
                logger.warning("retention keeps unreadable manifest %s v%s: %s", policy, version, exc)
                unreadable.add(version)
                break
            version = manifest.base_version if manifest.kind == "delta" else None
    deleted = [v for v in versions if v not in keep]
    if unreadable:
        # An unreadable manifest may reference any chunk: delete no chunks this time.
        deleted = []
    for version in deleted:
        store.delete(manifest_key(policy, version))
        cache.pop(version, None)
    referenced: set[str] = set()
    for version in keep - unreadable:
        manifest = get_manifest(store, policy, version, cache)
        referenced.update(c.key for c in manifest.chunks + manifest.delta_chunks)
    removed_chunks = 0
    if not unreadable:
        for key in store.list(f"{policy}/chunks/"):
            if key not in referenced:
                store.delete(key)
                removed_chunks += 1
    if deleted or removed_chunks:
        logger.info(
            "retention for %s in %s: kept %s versions, deleted %s manifests and %s chunks",
            policy, store.describe(), len(keep), len(deleted), removed_chunks,
        )  # fmt: skip
    return RetentionResult(sorted(keep), deleted, removed_chunks)
