"""A checkpoint kept in S3-compatible storage is fetched over HTTP and loads like a local one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlbus.examples.scratch import build_checkpoint, train_bpe_tokenizer
from trainer.model import check_checkpoint, load_policy
from weightstore.config import build_store
from weightstore.errors import NotFound
from weightstore.modelfiles import fetch_checkpoint

pytestmark = pytest.mark.integration


def test_a_checkpoint_in_a_bucket_is_fetched_whole(s3_store_config, tmp_path: Path) -> None:
    tokenizer = train_bpe_tokenizer(["What is 2 plus 3? 5"] * 20, vocab_size=300)
    local = build_checkpoint(tmp_path / "local", tokenizer, arch="mistral", hidden_size=32, layers=1, heads=4)
    store = build_store(s3_store_config)
    with pytest.raises(NotFound, match="no config.json"):
        fetch_checkpoint(store, tmp_path / "empty")
    for path in local.rglob("*"):
        if path.is_file():
            store.put(path.relative_to(local).as_posix(), path.read_bytes())
    fetched = fetch_checkpoint(store, tmp_path / "fetched")
    assert check_checkpoint(fetched) == "mistral"
    ours, theirs = load_policy(local)[0].state_dict(), load_policy(fetched)[0].state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert not list(fetched.rglob("*.partial"))


def test_download_streams_large_objects_in_parts(s3_store_config, tmp_path: Path) -> None:
    store = build_store(s3_store_config)
    data = bytes(range(256)) * (40 * 1024 + 7)  # ~10 MB: above boto3's multipart threshold
    store.put("shard.safetensors", data)
    store.download("shard.safetensors", tmp_path / "shard")
    assert (tmp_path / "shard").read_bytes() == data
    with pytest.raises(NotFound):
        store.download("missing.bin", tmp_path / "missing")
    assert not (tmp_path / "missing").exists()
