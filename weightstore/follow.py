"""The follower a rollout worker runs: poll LATEST, fetch the cheapest path, verify, swap.

A poll is a conditional GET of LATEST (a 304 costs no payload bytes). To reach a newer version
the follower compares two paths in bytes: the deltas after its current version, and the newest
anchor of the target's chain plus the deltas after it. Every chunk's size and sha256 and the
final ``weights_sha256`` are checked; patches go to private copies of the tensors they change,
so a failure anywhere leaves the current weights as they were. A failed delta path falls back
to the anchor path; if that fails too, the error says which version and why.

A follower of a region's replica (``replica_wait_s`` set) reads a store filled by replication that
may lag and keeps no order (S3 cross-region replication, ``weed filer.sync``, ``rlbus replica``): a
manifest can arrive before its chunks, ``LATEST`` before its manifest. Such a version is not yet
published for it: before downloading, it checks that every object of its path is there, and while
one is missing it keeps its weights and waits (each poll that finds a version incomplete is
counted in ``replica_waits``). A version it has waited for longer than ``replica_wait_s`` (named
but incomplete, or needed by the caller's staleness bound and not in the replica at all) is
fetched from the hub's store when one is given (``hub_fetches``); without one it goes on waiting.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import torch

from weightstore.chain import ChainWalk, build_weights, prefetch_manifests, walk_chain
from weightstore.errors import IntegrityError, NotFound, StoreError
from weightstore.manifest import LatestPointer, Manifest, check_policy, latest_key, parse_latest, read_latest
from weightstore.objectstore import ObjectStore

logger = logging.getLogger(__name__)

MAX_PREFETCH = 64
"""Newest manifests read at once on the way to a version (a far store: one round trip for all, not one
each); reading hundreds of versions retention deleted would cost more than it saves."""
MAX_RETRY_WAIT_S = 5.0
"""The longest wait between polls after failed ones (``WeightFollower.wait_for_version``)."""


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

    def __init__(self, store: ObjectStore, policy: str, *, download_workers: int = 4,
                 replica_wait_s: float | None = None, hub: ObjectStore | None = None) -> None:
        """``replica_wait_s``: ``store`` is a region's replica (see the module docstring), and a version
        is waited for this long before it is fetched from ``hub`` (the hub's store, optional)."""
        self.store = store
        self.policy = check_policy(policy)
        self.download_workers = max(1, download_workers)
        self.replica_wait_s, self.hub = replica_wait_s, hub
        self.replica_waits = 0
        """Polls that found the replica's newest version incomplete."""
        self.hub_fetches = 0
        """Versions fetched from the hub's store because the replica lagged past ``replica_wait_s``."""
        self.hub_bytes = 0
        self._waiting: dict[int, float] = {}  # version -> when the follower first waited for it
        self._present: set[str] = set()  # chunk keys seen in the replica
        self.last_error: StoreError | None = None
        """The retriable error of ``wait_for_version``'s last poll, when that poll failed."""
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

    def poll(self, need: int | None = None) -> WeightUpdate | None:
        """Move to the newest version if LATEST is ahead of ours; None when there is nothing new (or,
        for a replica, nothing complete yet). ``need``: the oldest version the caller may generate
        with; a replica that has not had it for ``replica_wait_s`` sends the follower to the hub."""
        latest = self._refresh_latest()
        ahead = latest is not None and (self._version is None or latest.version > self._version)
        if self.replica_wait_s is None:
            return self._update_to(latest) if ahead else None
        now = time.monotonic()
        if ahead:
            if self._complete(latest):
                self._waiting = {v: t for v, t in self._waiting.items() if v > latest.version}
                return self._update_to(latest)
            self.replica_waits += 1
            self._waiting.setdefault(latest.version, now)
        if need is not None and (self._version is None or self._version < need) and (
                latest is None or latest.version < need):
            self._waiting.setdefault(need, now)
        overdue = [v for v, t in self._waiting.items() if now - t >= self.replica_wait_s]
        if not overdue:
            return None
        if self.hub is None:
            logger.warning("the replica %s has not had %s v%s complete for %.0fs (no hub store to fall back on); "
                           "waiting", self.store.describe(), self.policy, min(overdue), now - self._waiting[min(overdue)])
            for v in overdue:
                self._waiting[v] = now  # warn again after another replica_wait_s
            return None
        return self._from_hub(min(overdue), now)

    def _from_hub(self, version: int, now: float) -> WeightUpdate | None:
        hub_latest = read_latest(self.hub, self.policy)
        if hub_latest is None or hub_latest[0].version < version:
            return None
        logger.warning("the replica %s lags: %s v%s not complete after %.0fs; fetching v%s from the hub %s",
                       self.store.describe(), self.policy, version, now - self._waiting[version], hub_latest[0].version,
                       self.hub.describe())
        update = self._update_to(hub_latest[0], self.hub)
        self.hub_fetches += 1
        self.hub_bytes += update.bytes_downloaded
        self._waiting = {v: t for v, t in self._waiting.items() if v > update.version}
        return update

    def _complete(self, latest: LatestPointer) -> bool:
        """Whether every object the update to ``latest`` would read is in the store (a replica's
        manifests and chunks can arrive in any order)."""
        walk = walk_chain(self.store, self.policy, latest.version, self._manifests, current=self._version)
        options = self._choose(walk)
        if not options:
            return False  # a manifest of the chain is not there yet
        path, from_anchor = options[0]
        refs = [ref for m in path[int(from_anchor):] for ref in (m.patch_chunks or [])]
        if from_anchor:
            refs += path[0].chunks
        missing = [r.key for r in refs if r.key not in self._present and not self.store.exists(r.key)]
        self._present.update(r.key for r in refs if r.key not in missing)
        return not missing

    def wait_for_version(
        self, min_version: int, timeout_s: float, poll_interval_s: float = 0.2
    ) -> WeightUpdate | None:
        """Poll until the weights are at ``min_version`` or newer; None if ``timeout_s`` passes.

        When the follower is already there, the returned update describes the current weights
        with ``bytes_downloaded=0``. Retriable store errors are logged and polled through, the wait
        before the next poll doubling after each one in a row (up to ``MAX_RETRY_WAIT_S``): a damaged
        chunk is not fetched again several times a second until the publisher's next anchor.
        """
        deadline = time.monotonic() + timeout_s
        attempts = max(1, int(timeout_s / max(poll_interval_s, 1e-3)) + 2)
        failures = 0
        self.last_error = None
        for _ in range(attempts):
            if self._version is not None and self._version >= min_version:
                assert self._state is not None
                return WeightUpdate(self._version, dict(self._state), 0, self._path, 0.0)
            try:
                update = self.poll(need=min_version)
            except StoreError as exc:
                if not exc.retriable:
                    raise
                failures += 1
                self.last_error = exc
                logger.warning("poll of %s failed (%d in a row), retrying: %s", self.policy, failures, exc)
                update = None
            else:
                failures, self.last_error = 0, None
            if update is not None and update.version >= min_version:
                return update
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            wait = min(poll_interval_s * 2 ** failures, max(poll_interval_s, MAX_RETRY_WAIT_S))
            time.sleep(min(wait, remaining))
        return None

    def _choose(self, walk: ChainWalk) -> list[tuple[list[Manifest], bool]]:
        """The paths to the walk's target worth trying, cheapest first: (manifests, from an anchor)."""
        deltas = walk.delta_path() if self._state is not None else None
        anchored = walk.anchor_path()
        delta_cost = walk.cost(deltas, from_anchor=False)
        anchor_cost = walk.cost(anchored, from_anchor=True)
        options = []
        if deltas is not None and (anchor_cost is None or (delta_cost or 0) <= anchor_cost):
            options.append((deltas, False))
        if anchored is not None:
            options.append((anchored, True))
        return options

    def _update_to(self, latest: LatestPointer, store: ObjectStore | None = None) -> WeightUpdate:
        start = time.perf_counter()
        store = store or self.store
        target = latest.version
        first = latest.anchor_version if self._version is None else min(self._version + 1, latest.anchor_version)
        prefetch_manifests(store, self.policy, range(max(first, target - MAX_PREFETCH), target + 1), self._manifests,
                           self.download_workers)
        walk = walk_chain(store, self.policy, target, self._manifests, current=self._version)
        top = walk.manifests.get(target)
        if top is not None and top.weights_sha256 != latest.weights_sha256:
            raise IntegrityError(
                f"LATEST of {self.policy} in {store.describe()} names v{target} with a "
                "weights hash that differs from that version's manifest; the store is inconsistent"
            )
        options = self._choose(walk)
        if options and not options[0][1]:
            try:
                state, nbytes = self._build(store, options[0][0], self._state)
                return self._finish(target, state, nbytes, "delta", start)
            except (IntegrityError, NotFound) as exc:
                logger.warning(
                    "delta path v%s -> v%s of %s failed, rebuilding from the anchor: %s",
                    self._version, target, self.policy, exc,
                )  # fmt: skip
        anchored = next((path for path, from_anchor in options if from_anchor), None)
        if anchored is None:
            error = walk.error or IntegrityError(f"v{target} has no anchor")
            raise type(error)(
                f"cannot update {self.policy} to v{target} from {store.describe()}: "
                f"{error}. Weights stay at v{self._version}; the publisher's next anchor "
                "repairs this",
                retriable=True,
            )
        try:
            state, nbytes = self._build(store, anchored, None)
        except (IntegrityError, NotFound) as exc:
            raise type(exc)(
                f"cannot update {self.policy} to v{target} from {store.describe()} via the "
                f"anchor v{anchored[0].version}: {exc}. Weights stay at v{self._version}; the "
                "publisher's next anchor repairs this",
                retriable=True,
            ) from exc
        return self._finish(target, state, nbytes, "anchor", start)

    def _build(
        self, store: ObjectStore, manifests: list[Manifest], base: dict[str, torch.Tensor] | None
    ) -> tuple[dict[str, torch.Tensor], int]:
        with ThreadPoolExecutor(self.download_workers, thread_name_prefix="ws-fetch") as pool:
            return build_weights(store, manifests, base, pool)

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
