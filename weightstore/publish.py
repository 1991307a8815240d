"""The publisher: turns a trainer's state dict into an anchor or a delta, a manifest, and LATEST.

Order of writes for version N: chunks (immutable, content-addressed), then the manifest with
``If-None-Match: *`` (a second publisher of N loses here), then LATEST with ``If-Match`` on the
etag read (created with ``If-None-Match`` when absent), then retention. A crash at any point
leaves the store consistent: followers only read what LATEST and complete manifests name.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import torch

from weightstore.config import WeightsConfig
from weightstore.errors import NotFound, PreconditionFailed, StoreError, VersionConflict
from weightstore.manifest import (
    ANCHOR_CODEC, DELTA_CODEC, LatestPointer, Manifest, check_policy, encode_model, latest_key,
    manifest_key, read_latest, read_manifest, tensor_infos, weights_sha256,
)  # fmt: skip
from weightstore.objectstore import ObjectStore
from weightstore.payload import anchor_payload, delta_payload, upload_chunks
from weightstore.retention import apply_retention

logger = logging.getLogger(__name__)

_LATEST_ATTEMPTS = 8


@dataclass(frozen=True)
class PublishInfo:
    """Outcome of one ``publish`` call."""

    version: int
    kind: Literal["anchor", "delta"]
    bytes_written: int
    full_bytes: int
    manifest_key: str
    seconds: float


@dataclass
class _Base:
    version: int
    state: dict[str, torch.Tensor]
    sha256: str
    anchor_version: int | None  # None: not yet checked against the store's manifest


class WeightPublisher:
    """Publishes successive versions of one policy's weights to an object store."""

    def __init__(
        self,
        store: ObjectStore,
        policy: str,
        config: WeightsConfig,
        publisher_id: str | None = None,
    ) -> None:
        self.store = store
        self.policy = check_policy(policy)
        self.config = config
        self.publisher_id = publisher_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.dtype: torch.dtype = getattr(torch, config.publish_dtype)
        """What floating tensors are published as."""
        self._base: _Base | None = None
        self._manifests: dict[int, Manifest] = {}

    def cast(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Private CPU copies, floating tensors in the publish dtype."""
        out = {}
        for name, tensor in state_dict.items():
            t = tensor.detach()
            dtype = self.dtype if t.is_floating_point() else t.dtype
            out[name] = t.to(device="cpu", dtype=dtype, copy=True).contiguous()
        return out

    def set_base(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Tell a restarted publisher which weights ``version`` had (e.g. from a checkpoint).

        The next ``publish(version + 1)`` writes a delta from them only if their hash equals the
        stored manifest of ``version``; otherwise it writes an anchor.
        """
        state = self.cast(state_dict)
        self._base = _Base(version, state, weights_sha256(state), anchor_version=None)

    def publish(self, version: int, state_dict: Mapping[str, torch.Tensor], *, anchor: bool = False,
                owned: bool = False) -> PublishInfo:
        """Publish ``state_dict`` as ``version`` (``anchor``: as full weights, whatever the cadence);
        raises ``VersionConflict`` if it exists differently. ``owned``: the tensors are private CPU copies
        in ``dtype`` (as ``cast`` makes them) that the publisher may keep as its next base."""
        if version < 0:
            raise ValueError(f"weight versions start at 0; got {version}")
        start = time.perf_counter()
        state = dict(state_dict) if owned else self.cast(state_dict)
        sha = weights_sha256(state)
        full_bytes = sum(t.numel() * t.element_size() for t in state.values())
        key = manifest_key(self.policy, version)
        latest = read_latest(self.store, self.policy)
        if latest is not None and latest[0].version >= version:
            existing = self._existing(version)
            if existing is None or existing.weights_sha256 != sha:
                raise VersionConflict(self._conflict_message(version, existing, latest[0].version))
            logger.info("%s v%s is already published with these weights", self.policy, version)
            self._base = _Base(version, state, sha, existing.anchor_version)
            return PublishInfo(version, existing.kind, 0, full_bytes, key, time.perf_counter() - start)

        manifest, payload_bytes = self._write_payload(version, state, sha, anchor)
        manifest_bytes = encode_model(manifest)
        try:
            self.store.put(key, manifest_bytes, if_none_match=True)
        except PreconditionFailed:
            existing = self._existing(version)
            if existing is None or existing.weights_sha256 != sha:
                raise VersionConflict(self._conflict_message(version, existing, None)) from None
            logger.info("%s v%s manifest already written with these weights; reusing it", self.policy, version)
            manifest, manifest_bytes = existing, b""
        self._manifests[version] = manifest
        latest_bytes = self._swap_latest(manifest)
        self._base = _Base(version, state, sha, manifest.anchor_version)
        self._retain(version)
        info = PublishInfo(
            version=version,
            kind=manifest.kind,
            bytes_written=payload_bytes + len(manifest_bytes) + latest_bytes,
            full_bytes=full_bytes,
            manifest_key=key,
            seconds=time.perf_counter() - start,
        )
        logger.info(
            "published %s v%s (%s, %s of %s bytes) to %s in %.2fs",
            self.policy, version, info.kind, info.bytes_written, full_bytes,
            self.store.describe(), info.seconds,
        )  # fmt: skip
        return info

    def _existing(self, version: int) -> Manifest | None:
        try:
            return read_manifest(self.store, self.policy, version)
        except NotFound:
            return None

    def _conflict_message(self, version: int, existing: Manifest | None, latest: int | None) -> str:
        where = f"{self.policy} in {self.store.describe()}"
        if existing is not None:
            return (
                f"v{version} of {where} was already published with different weights by "
                f"{existing.publisher_id}: two trainers are publishing this policy, or this one "
                f"restarted from an older checkpoint. Stop the other publisher, or resume from the "
                f"latest version, or publish to a fresh policy/prefix"
            )
        return (
            f"LATEST of {where} is already at v{latest}, past v{version}: another publisher is "
            f"ahead, or this trainer resumed from an older checkpoint. Resume from v{latest}"
        )

    def _delta_base(self, version: int, state: Mapping[str, torch.Tensor]) -> _Base | None:
        """The in-memory base to diff against, or None when an anchor must be written."""
        base = self._base
        if base is None or base.version != version - 1:
            return None
        if tensor_infos(base.state) != tensor_infos(state):
            logger.info("%s v%s changes the set or shapes of tensors: writing an anchor", self.policy, version)
            return None
        if base.anchor_version is None:
            stored = self._existing(base.version)
            if stored is None or stored.weights_sha256 != base.sha256:
                logger.warning(
                    "%s: the given weights of v%s differ from the store's (or it is missing): "
                    "writing an anchor", self.policy, base.version,
                )  # fmt: skip
                self._base = None
                return None
            base.anchor_version = stored.anchor_version
        return base

    def _write_payload(
        self, version: int, state: dict[str, torch.Tensor], sha: str, anchor: bool = False
    ) -> tuple[Manifest, int]:
        """Upload the version's chunks; return its manifest (not yet written) and the bytes sent."""
        base = None if anchor else self._delta_base(version, state)
        full_bytes = sum(t.numel() * t.element_size() for t in state.values())
        patch: bytes | None = None
        if base is not None:
            patch = delta_payload(base.state, state, level=self.config.zstd_level)
            if len(patch) >= full_bytes:
                logger.info("%s v%s patch is no smaller than the weights", self.policy, version)
                patch = None
        anchor_due = (
            base is None
            or patch is None
            or base.anchor_version is None
            or version - base.anchor_version >= self.config.anchor_every
        )
        kind: Literal["anchor", "delta"]
        if anchor_due:
            kind, base_version, anchor_version = "anchor", None, version
        else:
            assert base is not None and base.anchor_version is not None and patch is not None
            kind, base_version, anchor_version = "delta", base.version, base.anchor_version
        cb = self.config.chunk_bytes
        with ThreadPoolExecutor(self.config.upload_workers, thread_name_prefix="ws-upload") as pool:
            if anchor_due:
                payload = anchor_payload(state)
                chunks = upload_chunks(self.store, self.policy, payload, cb, pool)
                companion = patch if self.config.anchor_with_delta else None
                delta_chunks = (
                    [] if companion is None else upload_chunks(self.store, self.policy, companion, cb, pool)
                )
                written = len(payload) + (0 if companion is None else len(companion))
            else:
                assert patch is not None
                chunks = upload_chunks(self.store, self.policy, patch, cb, pool)
                delta_chunks, written = [], len(patch)
        manifest = Manifest(
            version=version,
            policy=self.policy,
            kind=kind,
            base_version=base_version,
            anchor_version=anchor_version,
            codec=ANCHOR_CODEC if anchor_due else DELTA_CODEC,
            dtype=self.config.publish_dtype,
            chunks=chunks,
            delta_chunks=delta_chunks,
            tensors=tensor_infos(state),
            weights_sha256=sha,
            publisher_id=self.publisher_id,
        )
        return manifest, written

    def _swap_latest(self, manifest: Manifest) -> int:
        """Point LATEST at ``manifest`` unless it already points at a newer version."""
        pointer = LatestPointer(
            version=manifest.version,
            manifest_key=manifest_key(self.policy, manifest.version),
            weights_sha256=manifest.weights_sha256,
            anchor_version=manifest.anchor_version,
        )
        data = encode_model(pointer)
        for attempt in range(1, _LATEST_ATTEMPTS + 1):
            current = read_latest(self.store, self.policy)
            if current is not None and current[0].version >= manifest.version:
                logger.warning(
                    "LATEST of %s is at v%s, not moving it back to v%s",
                    self.policy, current[0].version, manifest.version,
                )  # fmt: skip
                return 0
            try:
                if current is None:
                    self.store.put(latest_key(self.policy), data, if_none_match=True)
                else:
                    self.store.put(latest_key(self.policy), data, if_match=current[1])
                return len(data)
            except PreconditionFailed:
                logger.info("LATEST of %s moved meanwhile (attempt %s); re-reading", self.policy, attempt)
                time.sleep(min(1.0, 0.05 * 2**attempt))
        raise StoreError(
            f"could not update LATEST of {self.policy} in {self.store.describe()} after "
            f"{_LATEST_ATTEMPTS} attempts: something else keeps rewriting it",
            retriable=True,
        )

    def _retain(self, version: int) -> None:
        try:
            apply_retention(
                self.store, self.policy, self.config.keep_versions,
                latest_version=version, cache=self._manifests,
            )  # fmt: skip
        except StoreError as exc:
            # The version is published; retention will run again after the next one.
            logger.warning("retention for %s failed (will retry next publish): %s", self.policy, exc)
