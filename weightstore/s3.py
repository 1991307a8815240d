"""``ObjectStore`` on S3 or any S3-compatible server (MinIO, R2, Ceph, SeaweedFS), through boto3.

HTTP 412 becomes ``PreconditionFailed``, 404 ``NotFound``, and 304 (a conditional GET whose
etag still matches) ``None`` from ``get_if_changed``. Throttling, 5xx, 409 conflicts of
concurrent conditional writes and connection errors are retried with capped exponential
backoff; everything else is raised at once.
"""

from __future__ import annotations

import base64
import hashlib

import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionError as BotoConnectionError,
    HTTPClientError,
    NoCredentialsError,
)

from weightstore.errors import NotFound, PreconditionFailed, StoreError
from weightstore.objectstore import Blob, check_key

logger = logging.getLogger(__name__)

T = TypeVar("T")

_NOT_FOUND_CODES = {"404", "NoSuchKey", "NotFound"}
_PRECONDITION_CODES = {"412", "PreconditionFailed"}
_NOT_MODIFIED_CODES = {"304", "NotModified"}
_RETRIABLE_CODES = {
    "409", "ConditionalRequestConflict", "SlowDown", "Throttling", "ThrottlingException",
    "RequestTimeout", "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable",
    "500", "502", "503", "504",
}  # fmt: skip


class _NotModified(Exception):
    """Internal signal: a conditional GET answered 304."""


def _code(exc: ClientError) -> tuple[str, int]:
    err = exc.response.get("Error", {})
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return str(err.get("Code", status)), status


class S3Store:
    """An ``ObjectStore`` under ``s3://<bucket>/<prefix>``."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        *,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        max_pool_connections: int = 16,
        max_attempts: int = 5,
        addressing_style: str = "auto",
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        max_retry_s: float = 60.0,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 60.0,
    ) -> None:
        if not bucket:
            raise StoreError("S3Store needs a bucket name (s3://<bucket>/<prefix>)")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        self.max_attempts = max(1, max_attempts)
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_retry_s = max_retry_s
        config = Config(
            region_name=region,
            max_pool_connections=max_pool_connections,
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            s3={"addressing_style": addressing_style},
            # Our own loop below retries; one attempt per call here keeps the cap honest.
            retries={"mode": "standard", "total_max_attempts": 1},
            # boto3 >= 1.36 sends CRC checksums by default, which some S3-compatible servers reject.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self._client = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region,
            aws_access_key_id=access_key_id,
            aws_secret_access_key=secret_access_key,
            config=config,
        )

    def _full(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, key: str, fn: Callable[[], T]) -> T:
        """Run one request, retrying retriable failures with capped exponential backoff.

        Gives up after ``max_attempts`` attempts or once ``max_retry_s`` seconds have passed.
        """
        deadline = time.monotonic() + self.max_retry_s
        for attempt in range(1, self.max_attempts + 1):
            try:
                return fn()
            except ClientError as exc:
                code, status = _code(exc)
                if code in _NOT_MODIFIED_CODES or status == 304:
                    raise _NotModified() from exc
                if code in _NOT_FOUND_CODES or status == 404:
                    raise NotFound(f"no object {key!r} in {self.describe()}") from exc
                if code in _PRECONDITION_CODES or status == 412:
                    raise PreconditionFailed(
                        f"conditional {what} of {key!r} in {self.describe()} lost: "
                        "the object changed (or exists) since it was read"
                    ) from exc
                retriable = code in _RETRIABLE_CODES or status >= 500
                error: StoreError = StoreError(
                    f"S3 {what} of {key!r} in {self.describe()} failed: {code} "
                    f"(HTTP {status}): {exc.response.get('Error', {}).get('Message', '')}"
                    + ("" if retriable else self._hint(code, status)),
                    retriable=retriable,
                )
            except NoCredentialsError as exc:
                raise StoreError(
                    f"no S3 credentials for {self.describe()}: set AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY (or access_key_id/secret_access_key in the store config)"
                ) from exc
            except (BotoConnectionError, HTTPClientError) as exc:
                error = StoreError(
                    f"S3 {what} of {key!r} at {self.describe()} could not connect: {exc}",
                    retriable=True,
                )
            except BotoCoreError as exc:
                raise StoreError(f"S3 {what} of {key!r} in {self.describe()} failed: {exc}") from exc
            delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
            delay *= 0.5 + random.random() / 2
            out_of_time = time.monotonic() + delay > deadline
            if not error.retriable or attempt == self.max_attempts or out_of_time:
                raise error
            logger.warning(
                "retrying S3 %s of %s (attempt %s/%s) in %.2fs: %s",
                what, key, attempt, self.max_attempts, delay, error,
            )  # fmt: skip
            time.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    def _hint(self, code: str, status: int) -> str:
        if status == 403 or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return "; check the credentials and that they may read and write this bucket"
        if code == "NoSuchBucket":
            return f"; create bucket {self.bucket!r} or fix the store URL"
        return ""

    def get(self, key: str) -> Blob:
        blob = self.get_if_changed(key, None)
        assert blob is not None
        return blob

    def get_if_changed(self, key: str, etag: str | None) -> Blob | None:
        full = self._full(key)
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": full}
        if etag is not None:
            kwargs["IfNoneMatch"] = f'"{etag}"'

        def fetch() -> Blob:
            resp = self._client.get_object(**kwargs)
            with resp["Body"] as body:
                data = body.read()
            return Blob(data=data, etag=resp["ETag"].strip('"'))

        try:
            return self._call("GET", key, fetch)
        except _NotModified:
            return None

    def put(
        self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None
    ) -> str:
        # Content-MD5 makes the server refuse a body that did not arrive whole: SeaweedFS (4.48) otherwise
        # stores an empty object when a PUT's connection ends after its headers (Expect: 100-continue).
        md5 = base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self._full(key), "Body": data, "ContentMD5": md5}
        if if_none_match:
            kwargs["IfNoneMatch"] = "*"
        if if_match is not None:
            kwargs["IfMatch"] = f'"{if_match}"'

        def send() -> str:
            return str(self._client.put_object(**kwargs)["ETag"]).strip('"')

        try:
            return self._call("PUT", key, send)
        except NotFound as exc:
            # If-Match on an object that was deleted meanwhile: the compare-and-swap lost.
            raise PreconditionFailed(f"{key!r} vanished from {self.describe()} (If-Match)") from exc

    def download(self, key: str, dest: Path) -> None:
        # boto3's managed transfer streams in ranged parts to a temporary name and renames it.
        full = self._full(key)
        self._call("GET", key, lambda: self._client.download_file(self.bucket, full, str(dest)))

    def exists(self, key: str) -> bool:
        try:
            self._call(
                "HEAD", key, lambda: self._client.head_object(Bucket=self.bucket, Key=self._full(key))
            )
        except NotFound:
            return False
        return True

    def list(self, prefix: str) -> list[str]:
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0

        def list_all() -> list[str]:
            keys: list[str] = []
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=full
            )
            for page in pages:
                keys.extend(obj["Key"][strip:] for obj in page.get("Contents", []))
            return keys

        return sorted(self._call("LIST", prefix or "/", list_all))

    def delete(self, key: str) -> None:
        self._call(
            "DELETE", key, lambda: self._client.delete_object(Bucket=self.bucket, Key=self._full(key))
        )

    def describe(self) -> str:
        url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        return f"{url} at {self.endpoint_url}" if self.endpoint_url else url
