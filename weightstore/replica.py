"""A region's replica of the hub's weight store, filled by a relay of rlbus's own (``rlbus replica``).

The hub's store is the authority; each region has a store of its own that its workers follow, so a
version crosses the region's WAN link once whatever the number of workers there (INTELLECT-2's
SHARDCAST and SparrowRL relay versions the same way). The replicator polls the hub's ``LATEST``
(a conditional GET), and for each new version copies what the replica lacks:

1. every chunk the version's manifest names that the replica does not have yet (content-addressed:
   a chunk crosses once), each checked against the manifest's size and sha256 before it is written;
2. then the manifest (as the publisher encoded it);
3. then, once every version of the pass is in, ``LATEST``.

A replicator that hears the hub's version announcements (``announce``; the ``rlbus replica`` role
reads the control topic) starts a pass at once and reads the announced version's manifest without
asking ``LATEST`` first: on a far link that is the poll's wait and a round trip less. Polling
``LATEST`` goes on beside it, so a missed announcement costs only time.

So the replica never names a version whose objects are not all there. It copies the versions after
the one it has (the delta path) or, when that is dearer or broken, the newest anchor of the target's
chain and the versions after it, as a follower would choose. It keeps the newest ``keep_versions``
(``weightstore.retention``), and copies the run descriptor and each policy's model files.

Replication by other means (S3 cross-region replication, ``weed filer.sync``) keeps no such order;
followers are written for that case too (``WeightFollower`` with ``replica_wait_s``).
``order = "shuffled"`` makes this replicator write a pass's objects in random order, with a pause
between them, to test followers against such replication.

Status: a JSON document per region in the hub's store (``regions/<region>.json``): for each policy the
replica's version, the hub's, the seconds from each version's publication to its arrival in the
replica (newest first), bytes and objects copied. ``rlbus status`` and reports read it.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from weightstore.chain import prefetch_manifests, walk_chain
from weightstore.config import ReplicaConfig
from weightstore.errors import IntegrityError, NotFound, StoreError
from weightstore.manifest import (
    ChunkRef,
    LatestPointer,
    Manifest,
    encode_model,
    latest_key,
    manifest_key,
    parse_latest,
)
from weightstore.modelfiles import RUN_DESCRIPTOR_KEY
from weightstore.objectstore import ObjectStore
from weightstore.payload import fetch_chunk
from weightstore.retention import apply_retention

logger = logging.getLogger(__name__)

RECENT = 200
"""Versions whose arrival times a status keeps."""
MAX_PREFETCH = 64
"""Newest manifests read at once when the replica is behind (a far hub: one round trip for all); a
replica further behind than this (a long cut) reads the few it needs below them one by one."""


def status_key(region: str) -> str:
    return f"regions/{region}.json"


def read_region_status(store: ObjectStore) -> dict[str, dict]:
    """Every region's replica status in the hub's ``store``: region -> document."""
    out = {}
    for key in store.list("regions/"):
        if key.endswith(".json"):
            try:
                doc = json.loads(store.get(key).data)
            except (NotFound, ValueError):
                continue  # replaced or half-written meanwhile: the next read has it
            out[doc.get("region", key.removeprefix("regions/").removesuffix(".json"))] = doc
    return out


@dataclass
class _PolicyState:
    version: int | None = None
    hub_version: int | None = None
    etag: str | None = None
    manifests: dict[int, Manifest] = field(default_factory=dict)
    arrivals: deque = field(default_factory=lambda: deque(maxlen=RECENT))  # (version, seconds after publication)
    announced: int | None = None  # the newest version the hub announced
    files_copied: bool = False


class Replicator:
    """Copies the hub's published versions of ``policies`` into ``replica``. Not thread-safe."""

    def __init__(self, hub: ObjectStore, replica: ObjectStore, policies: list[str], *, region: str,
                 config: ReplicaConfig | None = None, clock: Callable[[], float] = time.time) -> None:
        self.hub, self.replica, self.region = hub, replica, region
        self.config = config or ReplicaConfig()
        self.clock = clock
        self.state = {p: _PolicyState() for p in policies}
        self.bytes_copied = 0
        self.objects_copied = 0
        self.chunks_skipped = 0
        self.versions_copied = 0
        self.errors = 0
        self._descriptor_etag: str | None = None
        self._have: set[str] = set()  # chunk keys known to be in the replica
        self._rng = random.Random()
        self._lock = threading.Lock()  # the status thread reads what a pass writes
        self._wake = threading.Event()  # set by an announcement: the next pass starts at once

    # ------------------------------------------------------------------ one pass

    def sync(self) -> list[tuple[str, int]]:
        """One pass: copy what is new for every policy; returns the (policy, version) pairs now in.
        The run descriptor, which a worker attaching to the replica reads first, is copied once every
        policy's model files and a version of its weights are in."""
        done = []
        for policy, st in self.state.items():
            if not st.files_copied:
                st.files_copied = self._copy_model_files(policy)
            done += [(policy, v) for v in self._sync_policy(policy, st)]
        if all(st.files_copied and st.version is not None for st in self.state.values()):
            self._copy_descriptor()
        return done

    def _copy_descriptor(self) -> None:
        try:
            blob = self.hub.get_if_changed(RUN_DESCRIPTOR_KEY, self._descriptor_etag)
        except NotFound:
            return
        if blob is not None:
            self._put(RUN_DESCRIPTOR_KEY, blob.data)
            self._descriptor_etag = blob.etag

    def _copy_model_files(self, policy: str) -> bool:
        index_key = f"{policy}/model/files.json"
        try:
            index = self.hub.get(index_key).data
        except NotFound:
            return False  # the trainer has not published them yet
        for digest in json.loads(index)["files"].values():
            key = f"{policy}/model/blobs/{digest}"
            if not self.replica.exists(key):
                self._put(key, self.hub.get(key).data)
        self._put(index_key, index)
        return True

    def announce(self, policy: str, version: int) -> None:
        """The hub announced ``version`` of ``policy`` (its control topic): the next pass starts at once
        and reads that version's manifest without asking LATEST first (a round trip less). Thread-safe."""
        st = self.state.get(policy)
        if st is not None:
            st.announced = max(version, st.announced or -1)
            self._wake.set()

    def _sync_policy(self, policy: str, st: _PolicyState) -> list[int]:
        planned = None
        if st.version is not None and st.announced is not None and st.announced > st.version:
            planned = self._plan(policy, st, st.announced)  # None: not readable yet; LATEST decides
        if planned is None:
            try:
                blob = self.hub.get_if_changed(latest_key(policy), st.etag)
            except NotFound:
                return []
            if blob is None:
                return []
            latest = parse_latest(blob.data, f"{latest_key(policy)} in {self.hub.describe()}")
            st.hub_version = max(latest.version, st.hub_version or 0)
            st.etag = blob.etag
            if st.version is not None and latest.version <= st.version:
                return []
            planned = self._plan(policy, st, latest.version, anchor=latest.anchor_version, strict=True)
        path, target = planned
        top = st.manifests[target]
        pointer = encode_model(LatestPointer(version=target, manifest_key=manifest_key(policy, target),
                                             weights_sha256=top.weights_sha256, anchor_version=top.anchor_version,
                                             published_at=top.created_at))
        st.hub_version = max(target, st.hub_version or 0)
        try:
            self._copy_versions(policy, path, pointer)
        except NotFound as exc:
            if path[0].kind != "delta":
                raise  # the anchor itself went: the next pass plans from the hub's newer LATEST
            # The replica fell further behind than the hub keeps (a cut link, a slow one): the deltas
            # from its version are gone, and copying them again would fail every pass. As a follower
            # does, it takes the target's anchor and the deltas after it instead.
            logger.warning("region %s: %s's deltas from v%s are gone from the hub (%s); copying v%d from its anchor",
                           self.region, policy, st.version, exc, target)
            path, _ = self._plan(policy, st, target, strict=True, from_anchor=True)
            self._copy_versions(policy, path, pointer)
        now = self.clock()
        with self._lock:
            for m in path:
                st.arrivals.append((m.version, round(max(0.0, now - m.created_at), 3)))
            st.version = target
        if self.config.arrivals_file:
            with open(self.config.arrivals_file, "a") as fh:
                fh.writelines(json.dumps({"policy": policy, "version": m.version, "published_at": m.created_at,
                                          "arrived_at": now, "bytes_copied": self.bytes_copied}) + "\n" for m in path)
        self.versions_copied += len(path)
        for old in [v for v in st.manifests if v < path[0].anchor_version]:
            del st.manifests[old]
        try:
            apply_retention(self.replica, policy, self.config.keep_versions, latest_version=target)
        except StoreError as exc:  # the copy is complete; retention runs again after the next one
            logger.warning("retention in the replica of %s failed: %s", policy, exc)
        else:
            self._have = {k for k in self._have if not k.startswith(f"{policy}/chunks/")} | set(
                self.replica.list(f"{policy}/chunks/"))
        return [m.version for m in path]

    def _plan(self, policy: str, st: _PolicyState, target: int, *, anchor: int | None = None,
              strict: bool = False, from_anchor: bool = False) -> tuple[list[Manifest], int] | None:
        """The versions to copy to reach ``target``: the delta path from the replica's version, or the
        newest anchor and what follows when that is cheaper (as a follower chooses) or ``from_anchor``.
        None (``strict``: an error) when the hub's manifests do not make a path."""
        first = (anchor if anchor is not None else target) if st.version is None else st.version + 1
        if anchor is not None:
            first = min(first, anchor)
        prefetch_manifests(self.hub, policy, range(max(first, target - MAX_PREFETCH), target + 1), st.manifests,
                           self.config.copy_workers)
        walk = walk_chain(self.hub, policy, target, st.manifests, current=st.version)
        path = walk.delta_path() if st.version is not None and not from_anchor else None
        delta_cost, anchor_cost = walk.cost(path, from_anchor=False), walk.cost(walk.anchor_path(), from_anchor=True)
        if path is None or (anchor_cost is not None and (delta_cost or 0) > anchor_cost):
            path = walk.anchor_path()
        if path is None:
            if strict:
                raise walk.error or IntegrityError(f"{policy} v{target} has no anchor in {self.hub.describe()}")
            return None
        return path, target

    def _copy_versions(self, policy: str, path: list[Manifest], latest: bytes) -> None:
        chunks: dict[str, ChunkRef] = {}
        for m in path:
            for ref in m.chunks + m.delta_chunks:
                if ref.key not in self._have and ref.key not in chunks:
                    chunks[ref.key] = ref
        missing = [ref for ref in chunks.values() if not self.replica.exists(ref.key)]
        self.chunks_skipped += len(chunks) - len(missing)
        self._have.update(k for k in chunks if k not in {r.key for r in missing})
        manifests = [(manifest_key(policy, m.version), encode_model(m)) for m in path]  # as the publisher wrote it
        if self.config.order == "shuffled":
            objects = [("chunk", ref) for ref in missing] + [("object", m) for m in manifests] + \
                      [("object", (latest_key(policy), latest))]
            self._rng.shuffle(objects)

            def copy(item: tuple) -> None:
                kind, what = item
                self._copy_chunk(what) if kind == "chunk" else self._put(*what)
                time.sleep(self.config.shuffle_pause_s)

            # several at once, as in publication order: one at a time over a long link, a round trip
            # each, a replica falls behind a trainer that publishes a few versions a second
            with ThreadPoolExecutor(self.config.copy_workers, thread_name_prefix="replica") as pool:
                for _ in pool.map(copy, objects):
                    pass
            return
        with ThreadPoolExecutor(self.config.copy_workers, thread_name_prefix="replica") as pool:
            for _ in pool.map(self._copy_chunk, missing):
                pass
        for key, data in manifests:
            self._put(key, data)
        self._put(latest_key(policy), latest)

    def _copy_chunk(self, ref: ChunkRef) -> None:
        data = fetch_chunk(self.hub, ref)  # size and sha256 checked against the manifest
        self._put(ref.key, data)
        self._have.add(ref.key)

    def _put(self, key: str, data: bytes) -> None:
        self.replica.put(key, data)
        with self._lock:  # copies run on several threads
            self.bytes_copied += len(data)
            self.objects_copied += 1

    # ------------------------------------------------------------------ running, status

    def status(self) -> dict:
        policies = {}
        for policy, st in self.state.items():
            with self._lock:
                arrivals = list(st.arrivals)
            lags = sorted(s for _, s in arrivals)
            policies[policy] = {
                "replica_version": st.version, "hub_version": st.hub_version,
                "lag_versions": None if st.version is None or st.hub_version is None else st.hub_version - st.version,
                "arrival_s": [list(a) for a in arrivals[-20:]],
                "arrival_p50_s": _quantile(lags, 0.5), "arrival_p99_s": _quantile(lags, 0.99),
            }
        return {"region": self.region, "time": self.clock(), "replica": self.replica.describe(),
                "bytes_copied": self.bytes_copied, "objects_copied": self.objects_copied,
                "chunks_skipped": self.chunks_skipped, "versions_copied": self.versions_copied,
                "errors": self.errors, "policies": policies}

    def write_status(self) -> None:
        try:
            self.hub.put(status_key(self.region), json.dumps(self.status()).encode())
        except StoreError as exc:  # status is advisory: the copies go on
            logger.warning("writing the status of region %s to the hub failed: %s", self.region, exc)

    def run(self, should_stop: Callable[[], bool]) -> None:
        """Sync every ``poll_interval_s`` until ``should_stop()``; a failed pass (the hub unreachable,
        a link cut) is logged, counted and tried again, with a backoff up to 5 s. The status is
        written on a thread of its own (a far hub: its round trips stay off the copies' path)."""
        stopped = threading.Event()

        def report() -> None:
            while not stopped.wait(self.config.status_every_s):
                self.write_status()

        reporter = threading.Thread(target=report, name="replica-status", daemon=True)
        reporter.start()
        backoff = self.config.poll_interval_s
        try:
            while not should_stop():
                try:
                    for policy, version in self.sync():
                        logger.info("region %s: %s v%d is in the replica", self.region, policy, version)
                    backoff = self.config.poll_interval_s
                except StoreError as exc:
                    self.errors += 1
                    backoff = min(5.0, backoff * 2)
                    logger.warning("region %s: replication pass failed (%s); again in %.1fs", self.region, exc,
                                   backoff)
                self._wake.wait(backoff)
                self._wake.clear()
        finally:
            stopped.set()
            reporter.join(30)
            self.write_status()


def _quantile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]
