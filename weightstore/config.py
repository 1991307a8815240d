"""Configuration of the weight store backend and of weight publication."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import unquote, urlparse

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from weightstore.errors import StoreError
from weightstore.objectstore import LocalDirStore, ObjectStore

MIB = 1024 * 1024


class LocalStoreConfig(BaseModel):
    """Weights in a local or shared directory."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["local"] = Field(description="Backend selector: a directory on this machine.")
    path: str = Field(description="Directory that holds the store; created when missing.")


class S3StoreConfig(BaseModel):
    """Weights in an S3-compatible bucket."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["s3"] = Field(description="Backend selector: S3 or an S3-compatible server.")
    bucket: str = Field(min_length=1, description="Bucket name.")
    prefix: str = Field(default="", description="Key prefix inside the bucket, without slashes.")
    endpoint_url: str | None = Field(
        default=None, description="Endpoint of a non-AWS server (MinIO, R2); None for AWS."
    )
    region: str | None = Field(default=None, description="Region; None uses boto's default chain.")
    access_key_id: str | None = Field(
        default=None, description="Access key; None uses boto's environment/credential chain."
    )
    secret_access_key: SecretStr | None = Field(
        default=None, description="Secret key (never logged); None uses boto's environment/credential chain."
    )
    addressing_style: Literal["auto", "path", "virtual"] = Field(
        default="auto",
        description="'path' (http://host/bucket/key) for most self-hosted servers (MinIO, Ceph); 'virtual' "
        "(http://bucket.host/key) where the server requires it; 'auto' lets boto choose.",
    )
    max_pool_connections: int = Field(
        default=16, ge=1, description="HTTP connections kept open (at least the download workers)."
    )
    max_attempts: int = Field(
        default=5, ge=1, description="Attempts per request for retriable failures (5xx, throttling)."
    )


StoreConfig = Annotated[LocalStoreConfig | S3StoreConfig, Field(discriminator="type")]
"""A store backend: ``type = "local"`` or ``type = "s3"``."""


class WeightsConfig(BaseModel):
    """How a trainer publishes weights and how followers fetch them."""

    model_config = ConfigDict(extra="forbid")

    anchor_every: int = Field(
        default=10, ge=1, description="Write a full anchor every this many versions."
    )
    keep_versions: int = Field(
        default=20, ge=1, description="Manifests kept (plus the anchors their delta chains need)."
    )
    chunk_bytes: int = Field(
        default=32 * MIB,
        ge=1024,
        le=1024 * MIB,
        description="Size of one stored object of an anchor or delta (single PUT, no multipart).",
    )
    publish_dtype: Literal["bfloat16", "float16", "float32"] = Field(
        default="bfloat16", description="Floating tensors are cast to this dtype before publishing."
    )
    download_workers: int = Field(
        default=4, ge=1, description="Parallel chunk downloads of a follower."
    )
    anchor_with_delta: bool = Field(
        default=True,
        description="Also store each anchor's patch from the previous version, so followers "
        "that are up to date never download full weights.",
    )
    upload_workers: int = Field(default=4, ge=1, description="Parallel chunk uploads of a publisher.")
    zstd_level: int = Field(
        default=3, ge=1, le=22, description="zstd level of delta patches (higher: smaller, slower)."
    )


class ReplicaConfig(BaseModel):
    """How ``rlbus replica`` keeps a region's store a copy of the hub's."""

    model_config = ConfigDict(extra="forbid")

    poll_interval_s: float = Field(default=0.2, gt=0, description="How often the hub's LATEST is asked (a "
                                   "conditional GET: a few hundred bytes over the link when nothing changed).")
    keep_versions: int = Field(default=8, ge=1, description="Versions the replica keeps (plus the anchors their "
                               "chains need).")
    copy_workers: int = Field(default=4, ge=1, description="Objects copied at once (a long link needs several in "
                              "flight to fill it).")
    status_every_s: float = Field(default=2.0, gt=0, description="How often the status document is written to the "
                                  "hub's store.")
    order: Literal["publication", "shuffled"] = Field(
        default="publication",
        description="'publication': chunks, then manifests, then LATEST, so the replica only ever names complete "
        "versions. 'shuffled' (for tests of followers): a pass's objects in random order, copy_workers at once, "
        "as replication that keeps no order (S3 cross-region replication) delivers them.")
    shuffle_pause_s: float = Field(default=0.2, ge=0, description="With order = 'shuffled': the pause after each "
                                   "object a copier puts.")
    arrivals_file: str | None = Field(
        default=None, description="Append each version's arrival in the replica here (JSON lines: version, "
        "published_at, arrived_at, bytes copied so far), for reports and benchmarks; None: only the status keeps "
        "the recent ones.")


def store_config_from_url(url: str) -> LocalStoreConfig | S3StoreConfig:
    """Parse ``s3://bucket/prefix``, ``file:///abs/path`` or a plain path into a store config.

    For ``s3://`` the endpoint comes from ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT``) when set,
    and the region from ``AWS_REGION``/``AWS_DEFAULT_REGION``.
    """
    if not url:
        raise StoreError("empty store URL: use s3://bucket/prefix, file:///abs/path or a path")
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise StoreError(f"store URL {url!r} has no bucket: use s3://bucket/prefix")
        endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT") or None
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None
        return S3StoreConfig(
            type="s3",
            bucket=parsed.netloc,
            prefix=parsed.path.strip("/"),
            endpoint_url=endpoint,
            region=region,
        )
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise StoreError(f"store URL {url!r} names a host; use file:///absolute/path")
        return LocalStoreConfig(type="local", path=unquote(parsed.path))
    if parsed.scheme and len(parsed.scheme) > 1:
        raise StoreError(
            f"store URL {url!r} has unsupported scheme {parsed.scheme!r}: "
            "use s3://bucket/prefix, file:///abs/path or a plain directory path"
        )
    return LocalStoreConfig(type="local", path=str(Path(url).expanduser().resolve()))


def store_url_field(data: Any, key: str, label: str) -> Any:
    """For a model validator run before parsing: ``data`` with its ``key``, when a string, read as a store URL
    (``store_config_from_url``). A URL it cannot read fails as a ValueError naming the field by ``label``."""
    if isinstance(data, dict) and isinstance(data.get(key), str):
        try:
            return {**data, key: store_config_from_url(data[key]).model_dump()}
        except StoreError as exc:
            raise ValueError(f"{label}: {exc}") from None
    return data


def build_store(config: LocalStoreConfig | S3StoreConfig) -> ObjectStore:
    """Create the backend a store config names."""
    if isinstance(config, LocalStoreConfig):
        return LocalDirStore(Path(config.path))
    from weightstore.s3 import S3Store  # boto3 is only imported when S3 is used

    return S3Store(
        config.bucket,
        config.prefix,
        endpoint_url=config.endpoint_url,
        region=config.region,
        access_key_id=config.access_key_id,
        secret_access_key=None if config.secret_access_key is None else config.secret_access_key.get_secret_value(),
        max_pool_connections=config.max_pool_connections,
        max_attempts=config.max_attempts,
        addressing_style=config.addressing_style,
    )
