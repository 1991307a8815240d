"""What a trim may remove (``broker.retention``): the floors of the holders, lowest wins, and a
partition some holder has no offset for is held whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from broker.retention import LogConfig, TansuS3Trimmer, TrimFailed, build_trimmer, lowest
from broker.settings import KafkaConfig
from trainer.checkpoint import kept_offsets


def _checkpoint(root: Path, version: int, offsets: dict[str, dict[int, int]]) -> None:
    (root / f"v{version:08d}").mkdir(parents=True)
    (root / f"v{version:08d}" / "meta.json").write_text(json.dumps(
        {"version": version, "offsets": {t: {str(p): o for p, o in parts.items()} for t, parts in offsets.items()}}))


def test_the_checkpoints_hold_the_lowest_offset_any_of_them_resumes_at(tmp_path: Path):
    assert kept_offsets(tmp_path / "absent") is None
    assert kept_offsets(tmp_path) is None
    _checkpoint(tmp_path, 50, {"t": {0: 500, 1: 90}, "eu.t": {0: 7}})
    _checkpoint(tmp_path, 100, {"t": {0: 900, 1: 80}})
    assert kept_offsets(tmp_path) == {("t", 0): 500, ("t", 1): 80, ("eu.t", 0): 7}


def test_a_checkpoint_that_cannot_be_read_stops_the_trim(tmp_path: Path):
    _checkpoint(tmp_path, 50, {"t": {0: 5}})
    (tmp_path / "v00000060").mkdir()
    (tmp_path / "v00000060" / "meta.json").write_text('{"version": 60}')
    with pytest.raises(TrimFailed, match="v00000060"):
        kept_offsets(tmp_path)


def test_lowest_floor_wins_and_a_partition_without_one_is_held():
    committed = {("t", 0): 40, ("t", 1): 10, ("t", 2): 3}
    held = {("t", 0): 25, ("t", 1): 30}
    assert lowest(committed, held) == {("t", 0): 25, ("t", 1): 10}
    assert lowest(committed) == committed
    assert lowest() == {}


def test_trim_settings():
    assert build_trimmer(LogConfig(), KafkaConfig()) is None  # "auto" outside `rlbus run`: off
    assert build_trimmer(LogConfig(trim="off"), KafkaConfig()) is None
    with pytest.raises(ValueError, match="s3://BUCKET/"):
        TansuS3Trimmer(LogConfig(trim="tansu_s3", tansu_storage="memory://tansu/"))
    with pytest.raises(ValueError, match="bucket's root"):
        TansuS3Trimmer(LogConfig(trim="tansu_s3", tansu_storage="s3://logs/kafka/"))
    trimmer = TansuS3Trimmer(LogConfig(trim="tansu_s3", tansu_storage="s3://logs", tansu_cluster="c1",
                                       endpoint_url="http://127.0.0.1:1"))
    assert (trimmer.bucket, trimmer.root) == ("logs", "clusters/c1/topics")
    with pytest.raises(ValueError, match="trim"):
        LogConfig(trim="retention")
