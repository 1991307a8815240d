"""Manifests, the LATEST pointer, the key layout and the weights hash.

Layout under ``<policy>/`` in a store:

* ``chunks/<sha256>``      immutable, content-addressed pieces of anchors and deltas
* ``manifests/v<N>.json``  one per version, written once (``If-None-Match: *``)
* ``LATEST``               pointer to the newest version, swapped with ``If-Match``
* ``telemetry/``           the trainer's metrics rows and status (``weightstore.telemetry``)
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Mapping
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from weightstore.errors import IntegrityError, NotFound, StoreError
from weightstore.objectstore import ObjectStore

MANIFEST_FORMAT = 1
ANCHOR_CODEC = "safetensors"
DELTA_CODEC = "rbdp2+safetensors"  # patches carry their own format version; v1 still decodes
_MANIFEST_RE = re.compile(r"^v(\d+)\.json$")


class ChunkRef(BaseModel):
    """One stored piece of an anchor or a delta."""

    model_config = ConfigDict(extra="forbid")

    key: str = Field(description="Object key, relative to the store root.")
    size: int = Field(ge=0, description="Size in bytes.")
    sha256: str = Field(description="Hex sha256 of the bytes.")


class TensorInfo(BaseModel):
    """Shape and dtype of one tensor of the full weights."""

    model_config = ConfigDict(extra="forbid")

    shape: list[int] = Field(description="Tensor shape.")
    dtype: str = Field(description="torch dtype name without the 'torch.' prefix, e.g. bfloat16.")


class Manifest(BaseModel):
    """Everything a follower needs to fetch, check and apply one version."""

    model_config = ConfigDict(extra="forbid")

    format: int = Field(default=MANIFEST_FORMAT, description="Manifest format version.")
    version: int = Field(ge=0, description="Weight version (trainer optimizer step).")
    policy: str = Field(min_length=1, description="Policy name.")
    kind: Literal["anchor", "delta"] = Field(description="Full weights or a patch from base.")
    base_version: int | None = Field(description="Version a delta patches; None for anchors.")
    anchor_version: int = Field(ge=0, description="Anchor at the root of this version's chain.")
    codec: str = Field(description="Payload encoding: 'safetensors' or 'rbdp1+safetensors'.")
    dtype: str = Field(description="Publish dtype of floating tensors.")
    chunks: list[ChunkRef] = Field(description="Payload pieces, in order (full weights or patch).")
    delta_chunks: list[ChunkRef] = Field(
        default_factory=list,
        description="Anchors only: the patch from v-1 too, so followers that are current can "
        "skip the full download. Empty when not written.",
    )
    tensors: dict[str, TensorInfo] = Field(description="Every tensor of the full weights.")
    weights_sha256: str = Field(description="weights_sha256() of the full weights of this version.")
    created_at: float = Field(default_factory=time.time, description="Unix seconds.")
    publisher_id: str = Field(description="Who wrote it (host:pid:random unless configured).")

    @property
    def payload_bytes(self) -> int:
        """Bytes of this version's main payload (the full weights of an anchor, or the patch)."""
        return sum(c.size for c in self.chunks)

    @property
    def patch_chunks(self) -> list[ChunkRef] | None:
        """Chunks of the patch from v-1 (a delta's payload, an anchor's companion), or None."""
        if self.kind == "delta":
            return self.chunks
        return self.delta_chunks or None

    @property
    def patch_bytes(self) -> int | None:
        """Bytes of the patch from v-1, or None when this version has none."""
        refs = self.patch_chunks
        return None if refs is None else sum(c.size for c in refs)


class LatestPointer(BaseModel):
    """Content of ``<policy>/LATEST``."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=0, description="Newest published version.")
    manifest_key: str = Field(description="Key of that version's manifest.")
    weights_sha256: str = Field(description="weights_sha256 of that version.")
    anchor_version: int = Field(ge=0, description="Anchor of that version's chain.")
    published_at: float = Field(default_factory=time.time, description="Unix seconds.")


_POLICY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=-]*$")


def check_policy(policy: str) -> str:
    """Policy names become key prefixes: letters, digits and ``._=-`` only."""
    if not _POLICY_RE.match(policy):
        raise StoreError(
            f"invalid policy name {policy!r}: use letters, digits and '._=-' (no slashes)"
        )
    return policy


def manifest_key(policy: str, version: int) -> str:
    return f"{policy}/manifests/v{version}.json"


def latest_key(policy: str) -> str:
    return f"{policy}/LATEST"


def chunk_key(policy: str, sha256: str) -> str:
    return f"{policy}/chunks/{sha256}"


def manifest_versions(store: ObjectStore, policy: str) -> list[int]:
    """Versions that have a manifest in the store, ascending."""
    prefix = f"{policy}/manifests/"
    versions = []
    for key in store.list(prefix):
        match = _MANIFEST_RE.match(key[len(prefix) :])
        if match:
            versions.append(int(match.group(1)))
    return sorted(versions)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_infos(state: Mapping[str, torch.Tensor]) -> dict[str, TensorInfo]:
    return {
        n: TensorInfo(shape=list(t.shape), dtype=dtype_name(t.dtype)) for n, t in sorted(state.items())
    }


def weights_sha256(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over the tensors in sorted name order: name, dtype, shape, then the raw bytes."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().contiguous()
        h.update(f"{name}\0{dtype_name(t.dtype)}\0{list(t.shape)}\0".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def encode_model(model: BaseModel) -> bytes:
    return json.dumps(model.model_dump(mode="json"), sort_keys=True, indent=1).encode()


def read_manifest(store: ObjectStore, policy: str, version: int) -> Manifest:
    """Read and validate ``manifests/v<version>.json``; raises ``NotFound`` or ``IntegrityError``."""
    key = manifest_key(policy, version)
    try:
        manifest = Manifest.model_validate_json(store.get(key).data)
    except ValidationError as exc:
        raise IntegrityError(f"manifest {key} in {store.describe()} is malformed: {exc}") from exc
    if manifest.version != version or manifest.policy != policy:
        raise IntegrityError(
            f"manifest {key} in {store.describe()} describes {manifest.policy} v{manifest.version}"
        )
    if manifest.kind == "delta" and manifest.base_version != version - 1:
        raise IntegrityError(
            f"manifest {key} in {store.describe()} is a delta from v{manifest.base_version}, "
            f"but deltas must patch v{version - 1}: it was written by an incompatible publisher"
        )
    if manifest.kind == "anchor" and (
        manifest.base_version is not None
        or manifest.anchor_version != version
        or (manifest.delta_chunks and version == 0)
    ):
        raise IntegrityError(f"anchor manifest {key} in {store.describe()} is inconsistent")
    if manifest.kind == "delta" and not manifest.anchor_version < version:
        raise IntegrityError(f"delta manifest {key} names anchor v{manifest.anchor_version}")
    return manifest


def parse_latest(data: bytes, where: str) -> LatestPointer:
    try:
        return LatestPointer.model_validate_json(data)
    except ValidationError as exc:
        raise IntegrityError(f"LATEST pointer {where} is malformed: {exc}") from exc


def read_latest(store: ObjectStore, policy: str) -> tuple[LatestPointer, str] | None:
    """The LATEST pointer and its etag, or None when nothing was published yet."""
    try:
        blob = store.get(latest_key(policy))
    except NotFound:
        return None
    return parse_latest(blob.data, f"{latest_key(policy)} in {store.describe()}"), blob.etag


def list_policies(store: ObjectStore) -> list[str]:
    """Policies that have a LATEST pointer in the store."""
    found = {k.rsplit("/", 1)[0] for k in store.list("") if k.endswith("/LATEST")}
    return sorted(p for p in found if p)

