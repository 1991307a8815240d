"""LocalDirStore semantics, and the publish → follow protocol over a local directory."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from weightstore.config import (
    LocalStoreConfig, S3StoreConfig, WeightsConfig, build_store, store_config_from_url,
)  # fmt: skip
from weightstore.errors import NotFound, PreconditionFailed, StoreError, VersionConflict
from weightstore.follow import WeightFollower
from weightstore.inspect import list_policies, list_versions, show_version, verify_version
from weightstore.manifest import manifest_versions, read_manifest, weights_sha256
from weightstore.objectstore import LocalDirStore
from weightstore.publish import WeightPublisher


class Trainer:
    """A tiny real model trained with AdamW on a real loss; yields its fp32 state per step."""

    def __init__(self, seed: int = 0, lr: float = 1e-3) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(16, 48), torch.nn.Tanh(), torch.nn.Linear(48, 48), torch.nn.Tanh(),
            torch.nn.Linear(48, 4),
        )  # fmt: skip
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.x = torch.randn(64, 16)
        self.y = torch.randint(0, 4, (64,))

    def step(self) -> None:
        loss = torch.nn.functional.cross_entropy(self.model(self.x), self.y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().clone() for n, t in self.model.state_dict().items()}

    def states(self, n: int) -> Iterator[dict[str, torch.Tensor]]:
        """The initial weights, then the weights after each of n - 1 steps (copies)."""
        yield self.snapshot()
        for _ in range(n - 1):
            self.step()
            yield self.snapshot()


def as_bf16(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.detach().to(torch.bfloat16).clone() for n, t in state.items()}


def assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype
        assert torch.equal(got[name].view(torch.int16), want[name].view(torch.int16)), name


# --- LocalDirStore ------------------------------------------------------------------------


def test_conditional_writes(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    etag = store.put("p/LATEST", b"v1", if_none_match=True)
    with pytest.raises(PreconditionFailed):
        store.put("p/LATEST", b"v1-again", if_none_match=True)
    etag2 = store.put("p/LATEST", b"v2", if_match=etag)
    assert etag2 != etag
    with pytest.raises(PreconditionFailed):
        store.put("p/LATEST", b"v3", if_match=etag)  # stale etag: the CAS lost
    with pytest.raises(PreconditionFailed):
        store.put("p/absent", b"x", if_match=etag2)
    blob = store.get("p/LATEST")
    assert blob.data == b"v2" and blob.etag == etag2
    assert store.get_if_changed("p/LATEST", etag2) is None
    changed = store.get_if_changed("p/LATEST", etag)
    assert changed is not None and changed.data == b"v2"


def test_get_list_delete_and_bad_keys(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    for key in ["a/chunks/1", "a/chunks/2", "a/manifests/v1.json", "b/LATEST"]:
        store.put(key, key.encode())
    assert store.list("a/chunks/") == ["a/chunks/1", "a/chunks/2"]
    assert store.list("") == ["a/chunks/1", "a/chunks/2", "a/manifests/v1.json", "b/LATEST"]
    assert store.list("a/man") == ["a/manifests/v1.json"]
    assert store.exists("b/LATEST") and not store.exists("b/nothing")
    store.delete("a/chunks/1")
    store.delete("a/chunks/1")  # deleting twice is fine
    with pytest.raises(NotFound):
        store.get("a/chunks/1")
    store.download("a/chunks/2", tmp_path / "copy")
    assert (tmp_path / "copy").read_bytes() == b"a/chunks/2"
    with pytest.raises(NotFound):
        store.download("a/chunks/1", tmp_path / "gone")
    assert not (tmp_path / "gone").exists()
    for bad in ["", "/abs", "a/../../etc", "a//b", ".tmp/x"]:
        with pytest.raises(StoreError, match="invalid object key"):
            store.put(bad, b"x")


def test_compare_and_swap_loses_no_update_under_contention(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    store.put("counter", b"0", if_none_match=True)
    lost = []

    def increment(times: int) -> None:
        for _ in range(times):
            for _attempt in range(1000):
                blob = store.get("counter")
                try:
                    store.put("counter", str(int(blob.data) + 1).encode(), if_match=blob.etag)
                    break
                except PreconditionFailed:
                    lost.append(1)
            else:
                raise AssertionError("CAS never won")

    threads = [threading.Thread(target=increment, args=(25,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.get("counter").data == b"100"


def test_store_urls_and_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    s3 = store_config_from_url("s3://bucket/some/prefix/")
    assert isinstance(s3, S3StoreConfig)
    assert (s3.bucket, s3.prefix, s3.endpoint_url) == ("bucket", "some/prefix", "http://127.0.0.1:9")
    local = store_config_from_url(f"file://{tmp_path}/w")
    assert isinstance(local, LocalStoreConfig) and local.path == f"{tmp_path}/w"
    plain = store_config_from_url(str(tmp_path / "x"))
    assert isinstance(plain, LocalStoreConfig)
    assert isinstance(build_store(plain), LocalDirStore)
    with pytest.raises(StoreError, match="unsupported scheme"):
        store_config_from_url("gs://bucket")
    with pytest.raises(StoreError, match="no bucket"):
        store_config_from_url("s3:///prefix")


# --- publish → follow -----------------------------------------------------------------------


def test_publish_follow_25_versions_with_anchors_late_joiner_and_retention(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    config = WeightsConfig(anchor_every=5, keep_versions=3, chunk_bytes=4096)
    publisher = WeightPublisher(store, "policy-a", config)
    follower = WeightFollower(store, "policy-a", download_workers=3)
    assert follower.poll() is None and follower.latest_version() is None
    published: dict[int, dict[str, torch.Tensor]] = {}
    for version, state in enumerate(Trainer().states(25)):
        info = publisher.publish(version, state)
        published[version] = as_bf16(state)
        assert info.kind == ("anchor" if version % 5 == 0 else "delta"), version
        update = follower.poll()
        assert update is not None and update.version == version
        # A follower that is up to date takes the patch, also at anchors (their companion patch).
        assert update.path == ("anchor" if version == 0 else "delta")
        assert_bit_equal(update.state_dict, published[version])
        assert follower.poll() is None  # nothing new: no download
        if version > 0:
            assert update.bytes_downloaded < info.full_bytes

    late = WeightFollower(store, "policy-a")
    update = late.poll()
    assert update is not None and update.version == 24 and update.path == "anchor"
    assert_bit_equal(update.state_dict, published[24])

    # keep_versions=3 keeps v22..v24, plus v20 (anchor) and v21 that their chain needs.
    assert manifest_versions(store, "policy-a") == [20, 21, 22, 23, 24]
    kept = [read_manifest(store, "policy-a", v) for v in range(20, 25)]
    referenced = {c.key for m in kept for c in m.chunks + m.delta_chunks}
    assert set(store.list("policy-a/chunks/")) == referenced
    for version in range(20, 25):
        result = verify_version(store, "policy-a", version)
        assert result["ok"], result
        assert result["weights_sha256"] == weights_sha256(published[version])
    rows = list_versions(store, "policy-a")
    assert [r["version"] for r in rows] == [20, 21, 22, 23, 24] and rows[-1]["latest"]
    assert show_version(store, "policy-a", 20).kind == "anchor"
    assert list_policies(store) == ["policy-a"]


def test_restarted_publisher_diffs_only_against_matching_weights(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    config = WeightsConfig(anchor_every=100)
    states = [as_bf16(s) for s in Trainer().states(5)]
    first = WeightPublisher(store, "p", config)
    for version in range(3):
        first.publish(version, states[version])

    fresh = WeightPublisher(store, "p", config)  # restarted, no memory: must write an anchor
    assert fresh.publish(3, states[3]).kind == "anchor"

    resumed = WeightPublisher(store, "p", config)
    resumed.set_base(3, states[3])  # the checkpoint matches the store: a delta is safe
    assert resumed.publish(4, states[4]).kind == "delta"

    wrong = WeightPublisher(store, "p", config)
    wrong.set_base(4, states[0])  # weights that are not v4: must not diff against them
    assert wrong.publish(5, states[2]).kind == "anchor"

    follower = WeightFollower(store, "p")
    update = follower.poll()
    assert update is not None and update.version == 5
    assert_bit_equal(update.state_dict, states[2])


def test_second_publisher_of_a_version_gets_version_conflict(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    config = WeightsConfig()
    a = WeightPublisher(store, "p", config, publisher_id="trainer-a")
    b = WeightPublisher(store, "p", config, publisher_id="trainer-b")
    states = list(Trainer().states(3))
    a.publish(0, states[0])
    a.publish(1, states[1])
    with pytest.raises(VersionConflict, match="trainer-a"):
        b.publish(1, states[2])
    assert b.publish(1, states[1]).bytes_written == 0  # same weights again: idempotent
    follower = WeightFollower(store, "p")
    update = follower.poll()
    assert update is not None and update.version == 1
    assert_bit_equal(update.state_dict, as_bf16(states[1]))


def _verify(store_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlbus.cli", "weights", "verify", "--store", str(store_dir), *args],
                          capture_output=True, text=True, timeout=120)


def test_weights_verify_fails_on_a_corrupted_chunk(tmp_path: Path) -> None:
    """`rlbus weights verify` exits 1 when a chunk on the checked chain is damaged (it exited 0,
    printing ok: false); --all also checks versions off the latest's chain."""
    store = LocalDirStore(tmp_path)
    states = [as_bf16(s) for s in Trainer().states(4)]
    publisher = WeightPublisher(store, "p", WeightsConfig(anchor_every=3))
    for version in range(4):
        publisher.publish(version, states[version])  # v0 anchor, v1 and v2 deltas, v3 anchor
    assert _verify(tmp_path, "p").returncode == 0 and _verify(tmp_path, "p", "--all").returncode == 0
    key = read_manifest(store, "p", 2).chunks[0].key
    path = tmp_path / key
    data = path.read_bytes()
    path.write_bytes(data[:40] + bytes([data[40] ^ 1]) + data[41:])
    assert _verify(tmp_path, "p").returncode == 0  # latest (v3, an anchor) does not need v2's chunk
    broken = _verify(tmp_path, "p", "--version", "2")
    assert broken.returncode == 1 and "v2 FAILED" in broken.stderr and '"ok": false' in broken.stdout
    every = _verify(tmp_path, "p", "--all")
    assert every.returncode == 1 and "v2 FAILED" in every.stderr
    assert [r["ok"] for r in json.loads(every.stdout)] == [True, True, False, True]


def test_a_follower_backs_off_on_a_damaged_anchor_and_takes_the_next_one(tmp_path: Path, monkeypatch) -> None:
    """A chunk that fails its sha256 check is not fetched again at every poll until the publisher's
    next anchor repairs it: the waits between failed polls double (up to MAX_RETRY_WAIT_S)."""
    import weightstore.follow as follow

    store = LocalDirStore(tmp_path)
    states = [as_bf16(s) for s in Trainer().states(2)]
    publisher = WeightPublisher(store, "p", WeightsConfig(anchor_every=1))
    publisher.publish(0, states[0])
    path = tmp_path / read_manifest(store, "p", 0).chunks[0].key
    data = path.read_bytes()
    path.write_bytes(data[:40] + bytes([data[40] ^ 1]) + data[41:])

    clock = {"now": 0.0}
    waits: list[float] = []

    class FakeTime:
        perf_counter = staticmethod(lambda: clock["now"])
        monotonic = staticmethod(lambda: clock["now"])

        @staticmethod
        def sleep(seconds: float) -> None:
            waits.append(round(seconds, 6))
            clock["now"] += seconds

    monkeypatch.setattr(follow, "time", FakeTime)
    follower = WeightFollower(store, "p")
    assert follower.wait_for_version(0, timeout_s=30, poll_interval_s=0.2) is None
    assert "sha256" in str(follower.last_error)  # what prepare_local_model's error then names
    assert waits[:5] == [0.4, 0.8, 1.6, 3.2, follow.MAX_RETRY_WAIT_S]
    assert len(waits) <= 10  # at 0.2 s a poll it was 150 fetches of the damaged chunk
    publisher.publish(1, states[1])  # the next anchor: new chunks
    update = follower.wait_for_version(1, timeout_s=30, poll_interval_s=0.2)
    assert update is not None and update.version == 1
    assert_bit_equal(update.state_dict, states[1])


def test_a_new_worker_waits_past_a_damaged_anchor_while_versions_keep_coming(tmp_path: Path) -> None:
    """A worker that attaches while the only path to the newest weights runs through a damaged anchor
    waits for the publisher's next anchor as long as new versions keep appearing (a slow trainer can take
    longer than the wait to get there), and loads it; with nothing new it gives up, naming the damage."""
    from safetensors.torch import save_file

    from weightstore.modelfiles import prepare_local_model, publish_model_files

    store = LocalDirStore(tmp_path / "store")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    save_file({"w": torch.zeros(1)}, model / "model.safetensors")
    publish_model_files(store, "p", model)
    states = [as_bf16(s) for s in Trainer().states(6)]
    publisher = WeightPublisher(store, "p", WeightsConfig(anchor_every=5))
    publisher.publish(0, states[0])
    path = tmp_path / "store" / read_manifest(store, "p", 0).chunks[0].key
    data = path.read_bytes()
    path.write_bytes(data[:40] + bytes([data[40] ^ 1]) + data[41:])

    def trainer() -> None:  # a version every 0.4 s: the next anchor (v5) 2 s in, twice the worker's wait
        for version in range(1, 6):
            threading.Event().wait(0.4)
            publisher.publish(version, states[version])

    thread = threading.Thread(target=trainer)
    thread.start()
    try:
        _, _, version = prepare_local_model(store, "p", tmp_path / "cache", timeout_s=1.0)
    finally:
        thread.join()
    assert version == 5

    alone = LocalDirStore(tmp_path / "alone")
    publish_model_files(alone, "p", model)
    WeightPublisher(alone, "p", WeightsConfig(anchor_every=5)).publish(0, states[0])
    damaged = tmp_path / "alone" / read_manifest(alone, "p", 0).chunks[0].key
    damaged.write_bytes(damaged.read_bytes()[:40] + bytes([damaged.read_bytes()[40] ^ 1]) + damaged.read_bytes()[41:])
    with pytest.raises(NotFound, match="could not be loaded within"):
        prepare_local_model(alone, "p", tmp_path / "cache2", timeout_s=1.0)
