"""Keeps a worker's engine on recent weights (``weightstore.follow.WeightFollower`` fetches and
verifies them; ``EngineFollower`` moves the engine to them): background following, refresh before a
generation, in-flight updates, and the staleness guard (guard 2)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator

from broker import metrics
from producers.engines import Engine
from weightstore.errors import StoreError
from weightstore.follow import WeightFollower

logger = logging.getLogger(__name__)


class StaleWeightsError(RuntimeError):
    """The worker could not reach fresh-enough weights in time."""

    retriable = True


class EngineFollower:
    """Owns the follower; moves the engine to new versions between generations or during them."""

    def __init__(
        self,
        follower: WeightFollower,
        engine: Engine,
        *,
        poll_interval_s: float,
        sync_timeout_s: float,
        refresh_before_generation: bool = False,
    ) -> None:
        """``refresh_before_generation=True``: the caller refreshes before each generation, so the
        background loop moves the engine only while a generation runs (in-flight updates)."""
        self.follower, self.engine = follower, engine
        self.poll_interval_s, self.sync_timeout_s = poll_interval_s, sync_timeout_s
        self.refresh_before_generation = refresh_before_generation
        self.latest_seen: int = engine.version
        self.syncs = 0
        self.idle_skips = 0
        self.bytes_downloaded = 0
        self._lock = asyncio.Lock()
        self._generating = 0
        self._next_warning = 0.0

    @contextlib.contextmanager
    def generating(self) -> Iterator[None]:
        """Mark a generation in flight: the background loop follows new versions meanwhile."""
        self._generating += 1
        try:
            yield
        finally:
            self._generating -= 1

    async def poll_once(self, need: int | None = None) -> bool:
        """Fetch and load the newest version if there is one. True when the engine moved. ``need``:
        the oldest version the worker may generate with (a replica that lags for it sends the
        follower to the hub's store)."""
        async with self._lock:
            update = await asyncio.to_thread(self.follower.poll, need)
            if update is None:
                return False
            await self.engine.load_weights(update.state_dict, update.version)
            self.latest_seen = max(self.latest_seen, update.version)
            policy = {"policy": self.follower.policy}
            metrics.gauge("rlbus.worker.version", "{version}", "Weight version loaded").set(update.version, policy)
            if update.published_at is not None:
                metrics.histogram("rlbus.weights.follow.duration", "s", "From a version's manifest to its load").record(
                    max(0.0, time.time() - update.published_at), {**policy, "path": update.path})
            self.syncs += 1
            self.bytes_downloaded += update.bytes_downloaded
            logger.info(
                "weights v%d loaded via %s (%d bytes, %.3fs)",
                update.version,
                update.path,
                update.bytes_downloaded,
                update.seconds,
            )
            return True

    async def refresh(self) -> None:
        """Move to the newest published version now, if there is one (a conditional GET of
        LATEST: nothing is downloaded when nothing changed)."""
        try:
            await self.poll_once()
        except StoreError as exc:
            # The store may blip; the staleness guard stops generation if it lasts.
            logger.warning("weight refresh failed (%s); staying on v%d", exc, self.engine.version)

    async def follow(self, stop: asyncio.Event, announced: asyncio.Event) -> None:
        """Poll every interval, or at once when the control topic announces a version."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(announced.wait(), timeout=self.poll_interval_s)
            except TimeoutError:
                pass
            announced.clear()
            if self.refresh_before_generation and not self._generating:
                self.idle_skips += 1  # nothing runs on these weights; the next generation refreshes first
                continue
            await self.refresh()

    async def ensure_fresh(self, required_version: int, max_staleness: int) -> None:
        """Guard 2: never start a generation with weights older than (newest known − η)."""
        deadline = time.monotonic() + self.sync_timeout_s
        while self.engine.version < (need := max(required_version, self.latest_seen) - max_staleness):
            if time.monotonic() > deadline:
                raise StaleWeightsError(
                    f"worker holds weights v{self.engine.version} but needs ≥ "
                    f"v{max(required_version, self.latest_seen) - max_staleness}; the store did "
                    f"not provide them within {self.sync_timeout_s:.0f}s — check the store URL "
                    "and that the trainer is publishing"
                )
            try:
                moved = await self.poll_once(need)
            except StoreError as exc:
                if not exc.retriable:
                    raise
                # E.g. a damaged chunk on the way to the newest version: the trainer republishes
                # its weights as an anchor when the fleet stops sending fresh groups.
                if time.monotonic() >= self._next_warning:
                    logger.warning("cannot move to the newest weights (%s); staying on v%d and retrying",
                                   exc, self.engine.version)
                    self._next_warning = time.monotonic() + 30
                moved = False
                await asyncio.sleep(max(0.5, self.poll_interval_s))
            if not moved:
                await asyncio.sleep(min(0.05, self.poll_interval_s))
