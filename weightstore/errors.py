"""Domain errors of the weightstore.

Every error carries ``retriable``: ``True`` when trying the same operation again later can
succeed (a network blip, a throttled request, a publication that is still being written),
``False`` when something has to change first (credentials, a second publisher, a bad key).
"""

from __future__ import annotations


class StoreError(RuntimeError):
    """Base class of weightstore errors."""

    retriable: bool = False

    def __init__(self, message: str, *, retriable: bool | None = None) -> None:
        super().__init__(message)
        if retriable is not None:
            self.retriable = retriable


class NotFound(StoreError):
    """The object (or the version) does not exist in the store."""


class PreconditionFailed(StoreError):
    """A conditional write lost: ``If-None-Match`` found an object, or ``If-Match`` a newer one."""


class VersionConflict(StoreError):
    """A version was already published with different weights (a second publisher)."""


class IntegrityError(StoreError):
    """Downloaded bytes do not match the size or the sha256 the manifest promises."""

    retriable = True


class CorruptPatch(IntegrityError):
    """A sparse patch is malformed or does not fit the tensor it is applied to."""
