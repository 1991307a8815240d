"""The object-store interface the weightstore is written against, and a local-directory backend.

Keys are ``/``-separated relative paths (``policy/manifests/v3.json``). Both backends give the
same guarantees: whole-object writes are atomic, ``put(..., if_none_match=True)`` creates only
when absent, ``put(..., if_match=etag)`` replaces only the exact version that was read, and
``get_if_changed`` is a conditional read (HTTP 304 on S3).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from weightstore.errors import NotFound, PreconditionFailed, StoreError

logger = logging.getLogger(__name__)

_TMP_DIR = ".tmp"
_LOCK_FILE = ".lock"


@dataclass(frozen=True)
class Blob:
    """An object's bytes and the etag of exactly those bytes."""

    data: bytes
    etag: str


@runtime_checkable
class ObjectStore(Protocol):
    """What the publisher, the follower and the tools need from S3 or a directory."""

    def get(self, key: str) -> Blob:
        """Read a whole object; raises ``NotFound``."""
        ...

    def get_if_changed(self, key: str, etag: str | None) -> Blob | None:
        """Read the object unless its etag is still ``etag`` (then ``None``); raises ``NotFound``."""
        ...

    def put(
        self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None
    ) -> str:
        """Write a whole object and return its etag; raises ``PreconditionFailed`` on a lost CAS."""
        ...

    def download(self, key: str, dest: Path) -> None:
        """Write the object to the file ``dest`` without holding it in memory (multi-GB
        checkpoint shards); ``dest`` appears whole or not at all. Raises ``NotFound``."""
        ...

    def exists(self, key: str) -> bool:
        """Whether the object exists."""
        ...

    def list(self, prefix: str) -> list[str]:
        """Keys starting with ``prefix``, sorted."""
        ...

    def delete(self, key: str) -> None:
        """Delete an object; deleting a missing object is not an error."""
        ...

    def describe(self) -> str:
        """A URL a person can read in a log line (``s3://bucket/prefix``, ``file:///path``)."""
        ...


def content_etag(data: bytes) -> str:
    """Etag of a local object: the sha256 of its bytes (hex)."""
    return hashlib.sha256(data).hexdigest()


def check_key(key: str) -> str:
    """Reject keys that are empty, absolute, or climb out of the store with ``..``."""
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise StoreError(f"invalid object key {key!r}: use a relative path like 'policy/LATEST'")
    if parts[0] in (_TMP_DIR, _LOCK_FILE):
        raise StoreError(f"invalid object key {key!r}: {parts[0]!r} is reserved by LocalDirStore")
    return key


class LocalDirStore:
    """An ``ObjectStore`` in a local (or shared network) directory.

    Writes go to a temporary file under ``<root>/.tmp`` and are renamed into place, so a reader
    sees the old object or the new one, never a torn one. Conditional writes hold an exclusive
    ``fcntl`` lock on ``<root>/.lock`` between the check and the rename. The etag is the sha256
    of the content.
    """

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).expanduser().resolve()
        try:
            (self.root / _TMP_DIR).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(
                f"cannot create the weight store directory {self.root}: {exc}; "
                "choose a writable path"
            ) from exc

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.root / _LOCK_FILE, "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def get(self, key: str) -> Blob:
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError as exc:
            raise NotFound(f"no object {key!r} in {self.describe()}") from exc
        except IsADirectoryError as exc:
            raise NotFound(f"{key!r} in {self.describe()} is a directory, not an object") from exc
        return Blob(data=data, etag=content_etag(data))

    def get_if_changed(self, key: str, etag: str | None) -> Blob | None:
        blob = self.get(key)
        return None if etag is not None and blob.etag == etag else blob

    def put(
        self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None
    ) -> str:
        path = self._path(key)
        tmp = self.root / _TMP_DIR / f"{uuid.uuid4().hex}.part"
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if if_none_match or if_match is not None:
                with self._locked():
                    self._check_conditions(key, path, if_none_match, if_match)
                    os.replace(tmp, path)
            else:
                os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return content_etag(data)

    def _check_conditions(
        self, key: str, path: Path, if_none_match: bool, if_match: str | None
    ) -> None:
        current: str | None
        try:
            current = content_etag(path.read_bytes())
        except FileNotFoundError:
            current = None
        if if_none_match and current is not None:
            raise PreconditionFailed(f"{key!r} already exists in {self.describe()} (If-None-Match)")
        if if_match is not None and current != if_match:
            raise PreconditionFailed(
                f"{key!r} in {self.describe()} changed since it was read (If-Match {if_match})"
            )

    def download(self, key: str, dest: Path) -> None:
        source = self._path(key)
        if not source.is_file():
            raise NotFound(f"no object {key!r} in {self.describe()}")
        partial = Path(dest).with_name(Path(dest).name + ".partial")
        shutil.copyfile(source, partial)
        partial.replace(dest)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str) -> list[str]:
        keys: list[str] = []
        # Walk only the deepest directory the prefix names, not the whole tree.
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root / base if base else self.root
        if not start.is_dir():
            return []
        for dirpath, dirnames, filenames in os.walk(start):
            if Path(dirpath) == self.root:
                dirnames[:] = [d for d in dirnames if d != _TMP_DIR]
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                key = name if rel == "." else f"{rel}/{name}"
                if key != _LOCK_FILE and key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> None:
        # Empty directories are left in place: removing them races with a concurrent put.
        self._path(key).unlink(missing_ok=True)

    def describe(self) -> str:
        return self.root.as_uri()
