"""The policy's static files (architecture config, tokenizer) and the run descriptor in the store.

A remote rollout worker is given only a broker address and a store URL. Everything else it needs
comes from the store: the run descriptor (run name, policies, sampling, staleness bound) and, per
policy, the files that ``from_pretrained`` needs besides the weights. Weights themselves travel as
versions (anchors and deltas) and are loaded into the model after it is built from these files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from weightstore.errors import NotFound, PreconditionFailed
from weightstore.objectstore import ObjectStore

logger = logging.getLogger(__name__)

RUN_DESCRIPTOR_KEY = "rlbus-run.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def _files_key(policy: str) -> str:
    return f"{policy}/model/files.json"


def publish_model_files(store: ObjectStore, policy: str, model_dir: Path) -> int:
    """Upload the non-weight files of ``model_dir`` (config, tokenizer). Returns the file count.

    Re-publishing identical files is a no-op; different files for an existing policy are an error,
    since running workers would otherwise mix tokenizers.
    """
    files: dict[str, str] = {}
    for path in sorted(p for p in Path(model_dir).iterdir() if p.is_file()):
        if path.name.endswith(_WEIGHT_SUFFIXES):
            continue
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        key = f"{policy}/model/blobs/{digest}"
        if not store.exists(key):
            store.put(key, data)
        files[path.name] = digest
    index = json.dumps({"files": files}, sort_keys=True).encode()
    try:
        store.put(_files_key(policy), index, if_none_match=True)
    except PreconditionFailed:
        existing = store.get(_files_key(policy)).data
        if existing != index:
            raise PreconditionFailed(
                f"the store already holds different model files for policy {policy!r} "
                f"({store.describe()}); use a fresh store prefix or run name for a new model"
            ) from None
    logger.info("model files for %s: %d files in %s", policy, len(files), store.describe())
    return len(files)


def fetch_model_files(store: ObjectStore, policy: str, dest: Path) -> Path:
    """Download the policy's non-weight files into ``dest`` (verified by sha256); returns ``dest``."""
    try:
        index = json.loads(store.get(_files_key(policy)).data)
    except NotFound:
        raise NotFound(
            f"no model files for policy {policy!r} in {store.describe()}: start the trainer for "
            "this run first (it publishes them), or check --store and the policy name"
        ) from None
    dest.mkdir(parents=True, exist_ok=True)
    for name, digest in index["files"].items():
        data = store.get(f"{policy}/model/blobs/{digest}").data
        if hashlib.sha256(data).hexdigest() != digest:
            raise NotFound(f"model file {name} of {policy!r} is corrupt in {store.describe()}")
        (dest / name).write_bytes(data)
    return dest


def write_run_descriptor(store: ObjectStore, descriptor: dict[str, Any]) -> None:
    """Write (or replace) the run descriptor that workers read on attach."""
    store.put(RUN_DESCRIPTOR_KEY, json.dumps(descriptor, indent=1, sort_keys=True).encode())


def read_run_descriptor(store: ObjectStore, *, wait_s: float = 0.0) -> dict[str, Any]:
    """The run descriptor; waits up to ``wait_s`` for a trainer that has not written it yet."""
    deadline = time.monotonic() + wait_s
    delay = 0.1
    while True:
        try:
            return json.loads(store.get(RUN_DESCRIPTOR_KEY).data)
        except NotFound:
            if time.monotonic() + delay > deadline:
                raise NotFound(
                    f"{store.describe()} holds no rlbus run (no {RUN_DESCRIPTOR_KEY} after "
                    f"{wait_s:.0f}s): check --store, or start the trainer of the run first"
                ) from None
        time.sleep(delay)
        delay = min(delay * 2, 2.0)


def prepare_local_model(store: ObjectStore, policy: str, cache_dir: Path, *, timeout_s: float,
                        replica_wait_s: float | None = None, hub: ObjectStore | None = None):
    """Make a from_pretrained-loadable directory from the store: model files + newest weights.
    ``replica_wait_s`` and ``hub``: ``store`` is a region's replica (``WeightFollower``).

    Returns (model_dir, a ``WeightFollower`` positioned at that version, version).
    """
    from safetensors.torch import save_file

    from weightstore.follow import WeightFollower

    model_dir = fetch_model_files(store, policy, cache_dir / policy)
    follower = WeightFollower(store, policy, replica_wait_s=replica_wait_s, hub=hub)
    update = follower.wait_for_version(0, timeout_s=timeout_s)
    # Versions it could not load (a damaged chunk on the only path: the publisher's next anchor repairs it)
    # while newer ones keep coming: the run is alive, so it waits on, until timeout_s passes with none new.
    seen = follower.latest_version() if update is None and follower.last_error is not None else None
    while update is None and follower.last_error is not None and seen is not None:
        logger.warning("policy %r: v%d cannot be loaded yet (%s); the publisher is publishing, waiting for a version "
                       "that can", policy, seen, follower.last_error)
        update = follower.wait_for_version(0, timeout_s=timeout_s)
        newest = follower.latest_version()
        seen = newest if update is None and newest is not None and newest > seen else None
    if update is None and follower.last_error is not None:
        raise NotFound(f"the weights of policy {policy!r} in {store.describe()} could not be loaded within "
                       f"{timeout_s:.0f}s: {follower.last_error}")
    if update is None:
        raise NotFound(
            f"no weights for policy {policy!r} appeared in {store.describe()} within "
            f"{timeout_s:.0f}s; is the trainer running?"
        )
    save_file({k: v.contiguous() for k, v in update.state_dict.items()}, model_dir / "model.safetensors")
    return model_dir, follower, update.version


def fetch_checkpoint(store: ObjectStore, dest: Path) -> Path:
    """Copy every object of ``store`` (a checkpoint directory kept in object storage, e.g.
    ``s3://bucket/models/qwen3``) into ``dest``; returns ``dest``. Objects are streamed to a
    temporary name and renamed, so ``dest`` never holds a half-written file and a multi-GB shard
    never sits in memory."""
    keys = store.list("")
    if "config.json" not in keys:
        raise NotFound(f"{store.describe()} holds no config.json: not a checkpoint directory (upload one made with "
                       "save_pretrained)")
    dest = Path(dest)
    for key in keys:
        path = dest / key
        if ".." in Path(key).parts:
            raise ValueError(f"refusing object key {key!r} from {store.describe()}: it leaves the directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        store.download(key, path)
    logger.info("fetched checkpoint %s (%d files) to %s", store.describe(), len(keys), dest)
    return dest
