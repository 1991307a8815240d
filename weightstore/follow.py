"""The follower a rollout worker runs: poll LATEST, fetch the cheapest path, verify, swap.

A poll is a conditional GET of LATEST (a 304 costs no payload bytes). To reach a newer version
the follower compares two paths in bytes: the deltas after its current version, and the newest
anchor of the target's chain plus the deltas after it. Every chunk's size and sha256 and the
final ``weights_sha256`` are checked; patches go to private copies of the tensors they change,
so a failure anywhere leaves the current weights as they were. A failed delta path falls back
to the anchor path; if that fails too, the error says which version and why.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import torch

from weightstore.chain import build_weights, walk_chain
from weightstore.errors import IntegrityError, NotFound, StoreError
from weightstore.manifest import LatestPointer, Manifest, check_policy, latest_key, parse_latest
from weightstore.objectstore import ObjectStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightUpdate:
    """Verified full weights of one version. Treat ``state_dict`` as read-only."""

    version: int
    state_dict: dict[str, torch.Tensor]
    bytes_downloaded: int
    path: Literal["delta", "anchor"]
    seconds: float
    published_at: float | None = None
    """When the version's manifest was written (the publisher's clock), None when not fetched now."""


class WeightFollower:
    """Keeps a verified copy of the newest published weights of one policy.

    Not thread-safe: call it from one thread at a time (a worker polls in one background task).
    """

    def __init__(self, store: ObjectStore, policy: str, *, download_workers: int = 4) -> None:
        self.store = store
        self.policy = check_policy(policy)
        self.download_workers = max(1, download_workers)
        self._state: dict[str, torch.Tensor] | None = None
        self._version: int | None = None
        self._path: Literal["delta", "anchor"] = "anchor"
        self._latest: LatestPointer | None = None
        self._latest_etag: str | None = None
        self._manifests: dict[int, Manifest] = {}

    @property
    def current_version(self) -> int | None:
        """Version of the weights this follower holds; None before the first update."""
        return self._version

    @property
    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """The verified weights of ``current_version`` (read-only), or None."""
        return None if self._state is None else dict(self._state)

    def _refresh_latest(self) -> LatestPointer | None:
        key = latest_key(self.policy)
        try:
            blob = self.store.get_if_changed(key, self._latest_etag)
        except NotFound:
            self._latest, self._latest_etag = None, None
            return None
        if blob is not None:
            self._latest = parse_latest(blob.data, f"{key} in {self.store.describe()}")
            self._latest_etag = blob.etag
        return self._latest

    def latest_version(self) -> int | None:
        """Version LATEST points to (a conditional GET; no payload is downloaded)."""
        latest = self._refresh_latest()
        return None if latest is None else latest.version

    def poll(self) -> WeightUpdate | None:
        """Move to the newest version if LATEST is ahead of ours; None when there is nothing new."""
        latest = self._refresh_latest()
        if latest is None or (self._version is not None and latest.version <= self._version):
            return None
        return self._update_to(latest)

    def wait_for_version(
        self, min_version: int, timeout_s: float, poll_interval_s: float = 0.2
    ) -> WeightUpdate | None:
        """Poll until the weights are at ``min_version`` or newer; None if ``timeout_s`` passes.

        When the follower is already there, the returned update describes the current weights
        with ``bytes_downloaded=0``. Retriable store errors are logged and polled through.
        """
        deadline = time.monotonic() + timeout_s
        attempts = max(1, int(timeout_s / max(poll_interval_s, 1e-3)) + 2)
        for _ in range(attempts):
            if self._version is not None and self._version >= min_version:
                assert self._state is not None
                return WeightUpdate(self._version, dict(self._state), 0, self._path, 0.0)
            try:
                update = self.poll()
            except StoreError as exc:
                if not exc.retriable:
                    raise
                logger.warning("poll of %s failed, retrying: %s", self.policy, exc)
                update = None
            if update is not None and update.version >= min_version:
                return update
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            time.sleep(min(poll_interval_s, remaining))
        return None

    def _update_to(self, latest: LatestPointer) -> WeightUpdate:
        start = time.perf_counter()
        target = latest.version
        walk = walk_chain(self.store, self.policy, target, self._manifests, current=self._version)
        top = walk.manifests.get(target)
        if top is not None and top.weights_sha256 != latest.weights_sha256:
            raise IntegrityError(
                f"LATEST of {self.policy} in {self.store.describe()} names v{target} with a "
                "weights hash that differs from that version's manifest; the store is inconsistent"
            )
        deltas = walk.delta_path() if self._state is not None else None
        anchored = walk.anchor_path()
        delta_cost = walk.cost(deltas, from_anchor=False)
        anchor_cost = walk.cost(anchored, from_anchor=True)
        if deltas is not None and (anchor_cost is None or (delta_cost or 0) <= anchor_cost):
            try:
                state, nbytes = self._build(deltas, self._state)
                return self._finish(target, state, nbytes, "delta", start)
            except (IntegrityError, NotFound) as exc:
                logger.warning(
                    "delta path v%s -> v%s of %s failed, rebuilding from the anchor: %s",
                    self._version, target, self.policy, exc,
                )  # fmt: skip
        if anchored is None:
            error = walk.error or IntegrityError(f"v{target} has no anchor")
            raise type(error)(
                f"cannot update {self.policy} to v{target} from {self.store.describe()}: "
                f"{error}. Weights stay at v{self._version}; the publisher's next anchor "
                "repairs this",
                retriable=True,
            )
        try:
            state, nbytes = self._build(anchored, None)
        except (IntegrityError, NotFound) as exc:
            raise type(exc)(
                f"cannot update {self.policy} to v{target} from {self.store.describe()} via the "
                f"anchor v{anchored[0].version}: {exc}. Weights stay at v{self._version}; the "
                "publisher's next anchor repairs this",
                retriable=True,
            ) from exc
        return self._finish(target, state, nbytes, "anchor", start)

    def _build(
        self, manifests: list[Manifest], base: dict[str, torch.Tensor] | None
    ) -> tuple[dict[str, torch.Tensor], int]:
        with ThreadPoolExecutor(self.download_workers, thread_name_prefix="ws-fetch") as pool:
            return build_weights(self.store, manifests, base, pool)

    def _finish(
        self,
        version: int,
        state: dict[str, torch.Tensor],
        nbytes: int,
        path: Literal["delta", "anchor"],
        start: float,
    ) -> WeightUpdate:
        manifest = self._manifests[version]
        self._state, self._version, self._path = state, version, path
        # Older manifests are no longer needed to plan a path from here.
        for old in [v for v in self._manifests if v < manifest.anchor_version]:
            del self._manifests[old]
        update = WeightUpdate(version, dict(state), nbytes, path, time.perf_counter() - start, manifest.created_at)
        logger.info(
            "%s now at v%s via %s (%s bytes in %.2fs)", self.policy, version, path, nbytes, update.seconds
        )
        return update
