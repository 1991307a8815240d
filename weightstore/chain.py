"""Planning how to reach a version, and rebuilding verified weights along the plan.

Two kinds of path lead to version T:

* the **anchor path**: the newest anchor A ≤ T of T's chain, then the patches of A+1 … T;
* the **delta path** from a version C the caller holds: the patches of C+1 … T, where a
  version's patch is a delta's payload or an anchor's companion patch.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from weightstore.errors import IntegrityError, NotFound, StoreError
from weightstore.manifest import ChunkRef, Manifest, read_manifest, weights_sha256
from weightstore.objectstore import ObjectStore
from weightstore.payload import apply_delta, fetch_payloads, load_anchor

logger = logging.getLogger(__name__)


@dataclass
class ChainWalk:
    """Manifests read walking down from ``target``, and which paths they make possible."""

    target: int
    manifests: dict[int, Manifest] = field(default_factory=dict)
    anchor_version: int | None = None
    from_version: int | None = None  # the delta path starts after this version, if viable
    error: StoreError | None = None

    def anchor_path(self) -> list[Manifest] | None:
        if self.anchor_version is None:
            return None
        return [self.manifests[v] for v in range(self.anchor_version, self.target + 1)]

    def delta_path(self) -> list[Manifest] | None:
        if self.from_version is None:
            return None
        versions = range(self.from_version + 1, self.target + 1)
        if not versions or any(v not in self.manifests for v in versions):
            return None
        return [self.manifests[v] for v in versions]

    @staticmethod
    def cost(path: list[Manifest] | None, *, from_anchor: bool) -> int | None:
        """Bytes to download along ``path`` (None when there is no such path)."""
        if path is None:
            return None
        if from_anchor:
            return path[0].payload_bytes + sum(m.patch_bytes or 0 for m in path[1:])
        return sum(m.patch_bytes or 0 for m in path)


def get_manifest(
    store: ObjectStore, policy: str, version: int, cache: dict[int, Manifest]
) -> Manifest:
    """Manifests never change once written, so a cached copy is always current."""
    manifest = cache.get(version)
    if manifest is None:
        manifest = cache[version] = read_manifest(store, policy, version)
    return manifest


def prefetch_manifests(store: ObjectStore, policy: str, versions: range, cache: dict[int, Manifest],
                       workers: int = 8) -> None:
    """Read the manifests of ``versions`` that are not in ``cache`` at once (a far store pays one round
    trip for all, not one each); those missing or unreadable are left for ``walk_chain`` to report."""
    wanted = [v for v in versions if v not in cache]
    if len(wanted) < 2:
        return

    def read(version: int) -> None:
        try:
            get_manifest(store, policy, version, cache)
        except (NotFound, IntegrityError):
            pass  # walk_chain reads it again and says why

    with ThreadPoolExecutor(min(workers, len(wanted)), thread_name_prefix="ws-manifest") as pool:
        list(pool.map(read, wanted))


def walk_chain(
    store: ObjectStore,
    policy: str,
    target: int,
    cache: dict[int, Manifest],
    *,
    current: int | None = None,
) -> ChainWalk:
    """Read manifests from ``target`` down to its anchor, and down to ``current`` + 1 while a
    patch path from ``current`` stays possible and cheaper than the anchor path."""
    start = current if current is not None and current < target else None
    walk = ChainWalk(target, from_version=start)
    delta_cost = 0
    anchor_sum = 0
    for version in range(target, -1, -1):
        need_anchor = walk.anchor_version is None
        need_delta = walk.from_version is not None and version > walk.from_version
        if not (need_anchor or need_delta):
            break
        try:
            manifest = get_manifest(store, policy, version, cache)
        except (NotFound, IntegrityError) as exc:
            reason = f"v{version} of the chain of v{target} is unusable: {exc}"
            walk.error = type(exc)(reason, retriable=True)
            break
        walk.manifests[version] = manifest
        if need_anchor:
            anchor_sum += manifest.payload_bytes  # the anchor's full weights, or a delta's patch
            if manifest.kind == "anchor":
                walk.anchor_version = version
        if need_delta:
            patch = manifest.patch_bytes
            delta_cost += patch or 0
            dearer = walk.anchor_version is not None and delta_cost > anchor_sum
            if patch is None or dearer:
                walk.from_version = None  # no patch here, or already dearer than the anchor path
    if walk.anchor_version is None and walk.error is None:
        walk.error = IntegrityError(f"the chain of v{target} has no anchor", retriable=True)
    return walk


def build_weights(
    store: ObjectStore,
    path: list[Manifest],
    base: dict[str, torch.Tensor] | None,
    pool: ThreadPoolExecutor,
) -> tuple[dict[str, torch.Tensor], int]:
    """Download and apply ``path``: from its first manifest's anchor when ``base`` is None, else
    every manifest's patch on top of ``base`` (which is never modified).

    Returns the weights of the last manifest, checked against its ``weights_sha256``, and the
    bytes downloaded.
    """
    refs: list[list[ChunkRef]] = []
    if base is None:
        if path[0].kind != "anchor":
            raise ValueError("a path without base weights must start at an anchor")
        refs.append(path[0].chunks)
        patched = path[1:]
    else:
        patched = path
    for manifest in patched:
        patch = manifest.patch_chunks
        if patch is None:
            raise IntegrityError(f"v{manifest.version} has no patch from v{manifest.version - 1}")
        refs.append(patch)
    payloads, nbytes = fetch_payloads(store, refs, pool)
    if base is None:
        state = load_anchor(payloads[0], path[0])
        owned = set(state)
        payloads = payloads[1:]
    else:
        state, owned = dict(base), set()
    for manifest, payload in zip(patched, payloads, strict=True):
        apply_delta(state, owned, payload, manifest)
    target = path[-1]
    if weights_sha256(state) != target.weights_sha256:
        raise IntegrityError(
            f"rebuilt weights of {target.policy} v{target.version} do not match the manifest's "
            f"weights_sha256 ({'anchor' if base is None else 'delta'} path from v{path[0].version})"
        )
    return state, nbytes
