"""The bookkeeping of benchmarks.replication: what a version needs in a replica, and when a look at
the replica counts it complete or named too early."""

from __future__ import annotations

from benchmarks.replication import Tracker, needed_keys, percentile
from weightstore.manifest import ChunkRef, Manifest


def _manifest(version: int, anchor: int, chunks: list[str], delta_chunks: tuple[str, ...] = ()) -> Manifest:
    refs = lambda keys: [ChunkRef(key=f"main/chunks/{k}", size=1, sha256=k) for k in keys]  # noqa: E731
    return Manifest(version=version, policy="main", kind="anchor" if version == anchor else "delta",
                    base_version=None if version == anchor else version - 1, anchor_version=anchor, codec="x",
                    dtype="bfloat16", chunks=refs(chunks), delta_chunks=refs(delta_chunks), tensors={},
                    weights_sha256="h", publisher_id="p")


def test_a_version_needs_its_anchor_path_and_its_own_patch() -> None:
    anchor = _manifest(10, 10, ["full"], delta_chunks=("patch10",))
    chain = [anchor, _manifest(11, 10, ["patch11"]), _manifest(12, 10, ["patch12"])]
    assert needed_keys(chain) == {"main/manifests/v10.json", "main/manifests/v11.json", "main/manifests/v12.json",
                                  "main/chunks/full", "main/chunks/patch11", "main/chunks/patch12"}
    # An anchor alone: its full weights and the patch from v-1 a current follower takes.
    assert needed_keys([anchor]) == {"main/manifests/v10.json", "main/chunks/full", "main/chunks/patch10"}


def test_a_version_named_before_its_chunks_is_counted_once_and_arrives_later() -> None:
    tracker = Tracker()
    need = needed_keys([_manifest(0, 0, ["a", "b"])])
    tracker.published(0, "main/manifests/v0.json", created_at=100.0, need=need)
    tracker.look(100.1, set(), None, {"main/chunks/a"})  # not named: not early
    tracker.look(100.2, {"main/manifests/v0.json"}, None, {"main/chunks/a"})  # manifest before chunk b
    tracker.look(100.3, {"main/manifests/v0.json"}, 0, {"main/chunks/a"})
    tracker.look(100.5, {"main/manifests/v0.json"}, 0, {"main/chunks/a", "main/chunks/b"})
    tracker.look(100.6, set(), None, set())  # retention later: arrival stands
    assert tracker.named_early == {0} and tracker.early_polls == 2 and tracker.polls == 5
    assert tracker.arrived == {0: 100.5}
    assert [round(s, 3) for s in tracker.propagation_s()] == [0.5]


def test_nearest_rank_percentile() -> None:
    values = [float(i) for i in range(1, 101)]
    assert percentile(values, 0.5) == 50.0 and percentile(values, 0.99) == 99.0 and percentile(values, 1.0) == 100.0
    assert percentile([3.0], 0.99) == 3.0 and percentile([], 0.5) is None
