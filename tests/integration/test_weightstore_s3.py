"""Publish → follow over a real S3 server (SeaweedFS on loopback), including damaged and racing stores.

Every scenario ends in bit-exact weights or a clear error, never in wrong weights.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest
import torch

from tests.fixtures.s3 import s3_client
from weightstore.config import S3StoreConfig, WeightsConfig, build_store
from weightstore.errors import (
    IntegrityError,
    NotFound,
    PreconditionFailed,
    StoreError,
    VersionConflict,
)
from weightstore.follow import WeightFollower
from weightstore.inspect import verify_version
from weightstore.manifest import (
    latest_key,
    manifest_key,
    manifest_versions,
    read_manifest,
)
from weightstore.objectstore import ObjectStore
from weightstore.publish import WeightPublisher
from weightstore.s3 import S3Store

pytestmark = pytest.mark.integration

POLICY = "math"


class Trainer:
    """A tiny real model trained with AdamW on a real loss."""

    def __init__(self, seed: int = 0, lr: float = 1e-3) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Embedding(50, 24), torch.nn.Flatten(), torch.nn.Linear(24 * 6, 64),
            torch.nn.GELU(), torch.nn.Linear(64, 50),
        )  # fmt: skip
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.x = torch.randint(0, 50, (96, 6))
        self.y = (self.x.sum(dim=1) % 50).long()

    def states(self, n: int) -> Iterator[dict[str, torch.Tensor]]:
        """The initial weights, then the weights after each of n - 1 AdamW steps (copies)."""
        for i in range(n):
            if i:
                loss = torch.nn.functional.cross_entropy(self.model(self.x), self.y)
                self.opt.zero_grad()
                loss.backward()
                self.opt.step()
            yield {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def bf16(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.to(torch.bfloat16) for n, t in state.items()}


def assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name].view(torch.int16), want[name].view(torch.int16)), name


@pytest.fixture
def store(s3_store_config: S3StoreConfig) -> ObjectStore:
    return build_store(s3_store_config)


def publish_run(
    store: ObjectStore, n: int, config: WeightsConfig, seed: int = 0
) -> tuple[WeightPublisher, dict[int, dict[str, torch.Tensor]]]:
    publisher = WeightPublisher(store, POLICY, config, publisher_id=f"trainer-{seed}")
    weights = {}
    for version, state in enumerate(Trainer(seed).states(n)):
        publisher.publish(version, state)
        weights[version] = bf16(state)
    return publisher, weights


def raw_put(config: S3StoreConfig, key: str, data: bytes) -> None:
    """Overwrite an object behind the store's back, as damaged storage would."""
    s3_client(config.endpoint_url or "").put_object(
        Bucket=config.bucket, Key=f"{config.prefix}/{key}", Body=data
    )


def test_s3_store_semantics(store: ObjectStore, s3_store_config: S3StoreConfig) -> None:
    etag = store.put("p/LATEST", b"one", if_none_match=True)
    with pytest.raises(PreconditionFailed):
        store.put("p/LATEST", b"two", if_none_match=True)
    assert store.get_if_changed("p/LATEST", etag) is None  # HTTP 304
    etag2 = store.put("p/LATEST", b"two", if_match=etag)
    with pytest.raises(PreconditionFailed):
        store.put("p/LATEST", b"three", if_match=etag)
    with pytest.raises(PreconditionFailed):
        store.put("p/missing", b"x", if_match=etag2)
    blob = store.get_if_changed("p/LATEST", etag)
    assert blob is not None and blob.data == b"two" and blob.etag == etag2
    with pytest.raises(NotFound):
        store.get("p/nothing")
    store.put("p/chunks/a", b"a")
    assert store.list("p/") == ["p/LATEST", "p/chunks/a"] and store.exists("p/chunks/a")
    store.delete("p/chunks/a")
    store.delete("p/chunks/a")
    assert not store.exists("p/chunks/a")
    assert store.describe().startswith(f"s3://{s3_store_config.bucket}/runs/test")


def test_s3_errors_are_clear(s3_store_config: S3StoreConfig) -> None:
    missing = S3Store(
        "no-such-bucket-rlbus", endpoint_url=s3_store_config.endpoint_url, region="us-east-1",
        access_key_id="k", secret_access_key="s", max_attempts=2, backoff_s=0.01,
    )  # fmt: skip
    with pytest.raises(StoreError, match="no-such-bucket-rlbus") as info:
        missing.put("p/x", b"x")
    assert not info.value.retriable
    closed = S3Store(
        "b", endpoint_url="http://127.0.0.1:9", region="us-east-1", access_key_id="k",
        secret_access_key="s", max_attempts=2, backoff_s=0.01, connect_timeout_s=1.0,
    )  # fmt: skip
    with pytest.raises(StoreError, match="could not connect") as info:
        closed.get("p/LATEST")
    assert info.value.retriable


def test_publish_follow_bit_exact_and_304(store: ObjectStore, s3_store_config: S3StoreConfig) -> None:
    config = WeightsConfig(anchor_every=4, keep_versions=50, chunk_bytes=8192)
    publisher = WeightPublisher(store, POLICY, config)
    follower = WeightFollower(store, POLICY, download_workers=4)
    for version, state in enumerate(Trainer().states(10)):
        info = publisher.publish(version, state)
        assert info.kind == ("anchor" if version % 4 == 0 else "delta")
        update = follower.poll()
        assert update is not None and update.version == version
        assert update.path == ("anchor" if version == 0 else "delta")
        assert_bit_equal(update.state_dict, bf16(state))
    assert follower.latest_version() == 9
    # Nothing new: poll is a conditional GET answered 304 and touches no payload. Deleting every
    # chunk and manifest proves it: a poll that downloaded anything would now fail.
    for key in store.list(f"{POLICY}/chunks/") + store.list(f"{POLICY}/manifests/"):
        store.delete(key)
    assert follower.poll() is None
    assert follower.current_version == 9


def test_late_follower_starts_from_the_newest_anchor(store: ObjectStore) -> None:
    config = WeightsConfig(anchor_every=4, chunk_bytes=8192)
    _, weights = publish_run(store, 11, config)
    late = WeightFollower(store, POLICY)
    update = late.poll()
    assert update is not None and update.version == 10 and update.path == "anchor"
    assert_bit_equal(update.state_dict, weights[10])
    anchor = read_manifest(store, POLICY, 8)
    patches = [read_manifest(store, POLICY, v).payload_bytes for v in (9, 10)]
    assert update.bytes_downloaded == anchor.payload_bytes + sum(patches)


def test_damaged_companion_patch_falls_back_to_the_anchor(
    store: ObjectStore, s3_store_config: S3StoreConfig
) -> None:
    config = WeightsConfig(anchor_every=3)
    publisher = WeightPublisher(store, POLICY, config)
    states = [bf16(s) for s in Trainer().states(4)]
    follower = WeightFollower(store, POLICY)
    for version in range(3):
        publisher.publish(version, states[version])
        assert follower.poll() is not None
    publisher.publish(3, states[3])  # an anchor, with its patch from v2 beside it
    companion = read_manifest(store, POLICY, 3).delta_chunks[0]
    data = store.get(companion.key).data
    raw_put(s3_store_config, companion.key, data[: len(data) // 2])  # truncated chunk
    update = follower.poll()
    assert update is not None and update.version == 3 and update.path == "anchor"
    assert_bit_equal(update.state_dict, states[3])


@pytest.mark.parametrize("damage", ["flipped_byte", "truncated", "deleted"])
def test_damaged_delta_gives_a_clear_error_then_recovers(
    store: ObjectStore, s3_store_config: S3StoreConfig, damage: str
) -> None:
    config = WeightsConfig(anchor_every=100)
    states = [bf16(s) for s in Trainer().states(4)]
    publisher = WeightPublisher(store, POLICY, config)
    follower = WeightFollower(store, POLICY)
    for version in range(2):
        publisher.publish(version, states[version])
        follower.poll()
    publisher.publish(2, states[2])
    chunk = read_manifest(store, POLICY, 2).chunks[0]
    data = store.get(chunk.key).data
    if damage == "flipped_byte":
        raw_put(s3_store_config, chunk.key, data[:40] + bytes([data[40] ^ 1]) + data[41:])
    elif damage == "truncated":
        raw_put(s3_store_config, chunk.key, data[:-1])
    else:
        store.delete(chunk.key)
    with pytest.raises((IntegrityError, NotFound), match="Weights stay at v1") as info:
        follower.poll()
    assert info.value.retriable and chunk.key in str(info.value)
    assert follower.current_version == 1
    assert_bit_equal(follower.state_dict or {}, states[1])
    assert verify_version(store, POLICY, 2)["ok"] is False
    # A restarted publisher has no base in memory and writes an anchor: the follower recovers.
    WeightPublisher(store, POLICY, config).publish(3, states[3])
    update = follower.poll()
    assert update is not None and update.version == 3 and update.path == "anchor"
    assert_bit_equal(update.state_dict, states[3])


def test_missing_delta_manifest_and_unknown_base(store: ObjectStore) -> None:
    config = WeightsConfig(anchor_every=100)
    publisher, weights = publish_run(store, 3, config)
    follower = WeightFollower(store, POLICY)
    assert follower.poll() is not None
    publisher.publish(3, Trainer(seed=1).states(1).__next__())
    publisher.publish(4, Trainer(seed=2).states(1).__next__())
    store.delete(manifest_key(POLICY, 3))  # a missing delta in the middle of the chain
    with pytest.raises(NotFound, match="v3 of the chain of v4"):
        follower.poll()
    assert follower.current_version == 2
    assert_bit_equal(follower.state_dict or {}, weights[2])

    # A manifest that names a base that is not v-1 is refused, not applied.
    manifest = json.loads(store.get(manifest_key(POLICY, 4)).data)
    manifest["base_version"] = 17
    store.put(manifest_key(POLICY, 3), json.dumps(manifest | {"version": 3}).encode())
    with pytest.raises(IntegrityError, match="deltas must patch v2"):
        follower.poll()
    assert follower.current_version == 2


def test_stale_latest_never_moves_anything_backwards(store: ObjectStore) -> None:
    config = WeightsConfig(anchor_every=3)
    publisher, weights = publish_run(store, 4, config)
    follower = WeightFollower(store, POLICY)
    assert follower.poll() is not None and follower.current_version == 3
    v1_pointer = json.loads(store.get(latest_key(POLICY)).data) | {"version": 1}
    v1_pointer |= {"manifest_key": manifest_key(POLICY, 1)}
    v1_pointer["weights_sha256"] = read_manifest(store, POLICY, 1).weights_sha256
    v1_pointer["anchor_version"] = 0
    store.put(latest_key(POLICY), json.dumps(v1_pointer).encode())  # LATEST restored from old
    assert follower.poll() is None and follower.current_version == 3  # never goes back
    newcomer = WeightFollower(store, POLICY)
    update = newcomer.poll()
    assert update is not None and update.version == 1
    assert_bit_equal(update.state_dict, weights[1])
    # A publisher that is behind LATEST is refused; the real one moves LATEST forward again.
    with pytest.raises(VersionConflict, match="already published with different weights"):
        WeightPublisher(store, POLICY, config).publish(1, Trainer(seed=5).states(1).__next__())
    new_state = Trainer(seed=3).states(1).__next__()
    publisher.publish(4, new_state)
    for f in (follower, newcomer):
        update = f.poll()
        assert update is not None and update.version == 4
        assert_bit_equal(update.state_dict, bf16(new_state))


def test_second_publisher_of_a_version_is_fenced(store: ObjectStore) -> None:
    config = WeightsConfig(anchor_every=5)
    a, weights = publish_run(store, 3, config, seed=0)
    # b read LATEST at v1 before a swapped it to v2: only the manifest's If-None-Match stops it.
    pointer = store.get(latest_key(POLICY)).data
    store.put(latest_key(POLICY), pointer.replace(b'"version": 2', b'"version": 1'))
    b = WeightPublisher(store, POLICY, config, publisher_id="trainer-b")
    with pytest.raises(VersionConflict, match="trainer-0"):
        b.publish(2, Trainer(seed=9).states(1).__next__())
    assert read_manifest(store, POLICY, 2).publisher_id == "trainer-0"
    assert verify_version(store, POLICY, 2)["ok"]


def test_two_concurrent_publishers_never_yield_wrong_weights(store: ObjectStore) -> None:
    config = WeightsConfig(anchor_every=5)
    candidates = {
        name: [bf16(s) for s in Trainer(seed=seed).states(2)] for name, seed in (("a", 0), ("b", 1))
    }
    barrier = threading.Barrier(2)
    outcome: dict[str, str] = {}

    def run(name: str) -> None:
        publisher = WeightPublisher(store, POLICY, config, publisher_id=name)
        barrier.wait()
        try:
            publisher.publish(0, candidates[name][0])
            outcome[name] = "published"
        except VersionConflict:
            outcome[name] = "conflict"

    threads = [threading.Thread(target=run, args=(n,)) for n in candidates]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert "published" in outcome.values()
    winner = read_manifest(store, POLICY, 0).publisher_id
    assert outcome[winner] == "published"
    update = WeightFollower(store, POLICY).poll()
    assert update is not None
    assert_bit_equal(update.state_dict, candidates[winner][0])


def test_retention_over_40_versions_keeps_every_chain_whole(store: ObjectStore) -> None:
    config = WeightsConfig(anchor_every=7, keep_versions=5, chunk_bytes=16384)
    publisher = WeightPublisher(store, POLICY, config)
    eager = WeightFollower(store, POLICY)
    lagging = WeightFollower(store, POLICY)
    weights = {}
    for version, state in enumerate(Trainer().states(40)):
        publisher.publish(version, state)
        weights[version] = bf16(state)
        update = eager.poll()
        assert update is not None and update.version == version
        assert_bit_equal(update.state_dict, weights[version])
        if version % 9 == 0:  # falls behind the retention window between polls
            update = lagging.poll()
            assert update is not None
            assert_bit_equal(update.state_dict, weights[update.version])
    # Newest 5 are v35..v39; their chain starts at the anchor v35 (anchors at 0, 7, ..., 35).
    assert manifest_versions(store, POLICY) == [35, 36, 37, 38, 39]
    for version in range(35, 40):
        assert verify_version(store, POLICY, version)["ok"]
    kept = [read_manifest(store, POLICY, v) for v in range(35, 40)]
    assert set(store.list(f"{POLICY}/chunks/")) == {
        c.key for m in kept for c in m.chunks + m.delta_chunks
    }
    update = lagging.poll()  # at v36, behind by 3: patches
    assert update is not None and update.version == 39
    assert_bit_equal(update.state_dict, weights[39])


def test_the_local_s3_server_keeps_every_published_version_through_a_sigkill(tmp_path) -> None:
    """SeaweedFS (weightstore.embedded) killed with SIGKILL after 7 publications and started again
    on its directory: every version rebuilds bit-exact and verifies, and a second publisher of a
    stored version is still fenced by the conditional write."""
    from tests.fixtures.s3 import ACCESS_KEY_ID, REGION, SECRET_ACCESS_KEY
    from weightstore.embedded import EmbeddedS3

    server = EmbeddedS3(tmp_path / "seaweedfs", access_key_id=ACCESS_KEY_ID, secret_access_key=SECRET_ACCESS_KEY)
    endpoint = server.start()
    try:
        s3_client(endpoint).create_bucket(Bucket="rlbus-durable")
        config = S3StoreConfig(type="s3", bucket="rlbus-durable", prefix="run", endpoint_url=endpoint, region=REGION,
                               access_key_id=ACCESS_KEY_ID, secret_access_key=SECRET_ACCESS_KEY, max_attempts=3)
        _, weights = publish_run(build_store(config), 7, WeightsConfig(anchor_every=3, chunk_bytes=8192))
        server.kill()
        assert server.restart() == endpoint
        store = build_store(config)
        assert manifest_versions(store, POLICY) == list(range(7))
        for version in range(7):
            assert verify_version(store, POLICY, version)["ok"], version
        update = WeightFollower(store, POLICY).poll()
        assert update is not None and update.version == 6
        assert_bit_equal(update.state_dict, weights[6])
        with pytest.raises(VersionConflict):
            WeightPublisher(store, POLICY, WeightsConfig(), publisher_id="late").publish(
                6, Trainer(seed=5).states(1).__next__())
    finally:
        server.stop()


def test_the_local_s3_server_takes_a_write_in_each_of_many_buckets(tmp_path) -> None:
    """Each bucket takes volumes of its own. Left to itself ``weed mini`` allowed free disk / volume size
    volumes (17 with 17.6 GiB free), and the next bucket's first write failed with a bare InternalError:
    the local server sets its own cap, so 40 buckets each take a write whatever the disk's free space."""
    from tests.fixtures.s3 import ACCESS_KEY_ID, SECRET_ACCESS_KEY
    from weightstore.embedded import EmbeddedS3

    server = EmbeddedS3(tmp_path / "seaweedfs", access_key_id=ACCESS_KEY_ID, secret_access_key=SECRET_ACCESS_KEY)
    client = s3_client(server.start())
    try:
        for i in range(40):
            client.create_bucket(Bucket=f"rlbus-bucket-{i}")
            client.put_object(Bucket=f"rlbus-bucket-{i}", Key="k", Body=str(i).encode())
        assert [client.get_object(Bucket=f"rlbus-bucket-{i}", Key="k")["Body"].read() for i in (0, 39)] == [b"0", b"39"]
    finally:
        server.stop()


def test_a_put_whose_body_never_arrives_stores_nothing(s3_store_config: S3StoreConfig) -> None:
    """A connection that ends after a PUT's headers (its body lost on the way, the sender gone) must not
    leave an object behind: SeaweedFS stored an empty one until the store sent Content-MD5."""
    import socket

    host, port = s3_store_config.endpoint_url.removeprefix("http://").split(":")
    listener = socket.create_server(("127.0.0.1", 0))

    def swallow_bodies() -> None:  # forwards each request's headers, then half-closes towards the server
        listener.settimeout(30)
        try:
            while True:
                client, _ = listener.accept()
                with client, socket.create_connection((host, int(port))) as server:
                    head = b""
                    while b"\r\n\r\n" not in head:
                        if not (data := client.recv(65536)):
                            break
                        head += data
                    server.sendall(head.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n")
                    server.settimeout(5)
                    try:
                        client.sendall(server.recv(65536))  # 100 Continue
                    except OSError:
                        pass
                    server.shutdown(socket.SHUT_WR)
                    try:
                        client.sendall(server.recv(65536))
                    except OSError:
                        pass
        except OSError:
            return  # the listener closed, or no one came within 30 s

    threading.Thread(target=swallow_bodies, daemon=True).start()
    lossy = build_store(s3_store_config.model_copy(update={"endpoint_url": f"http://127.0.0.1:{listener.getsockname()[1]}",
                                                           "max_attempts": 2}))
    try:
        with pytest.raises(StoreError):
            lossy.put("p/status.json", b'{"a": 1}' * 200)
    finally:
        listener.close()
    with pytest.raises(NotFound):
        build_store(s3_store_config).get("p/status.json")
