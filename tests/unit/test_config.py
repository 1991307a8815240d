"""Every config file in the repository parses; overrides apply in the documented order."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlbus.config import ConfigError, RunConfig, load_config

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.toml"))


def test_there_are_configs() -> None:
    assert {p.name for p in CONFIGS} >= {"default.toml", "ci.toml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_file_parses(path: Path) -> None:
    cfg = load_config(path, environ={})
    assert isinstance(cfg, RunConfig)
    # The admission window must hold at least one batch.
    assert cfg.trainer.groups_per_step >= 1


def test_precedence_file_then_env_then_cli(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[trainer]\nlr = 0.1\nmax_steps = 7\n[run]\nname = "a"\n')
    env = {"RLBUS_TRAINER__LR": "0.2", "RLBUS_RUN__NAME": "from-env", "UNRELATED": "x"}
    cfg = load_config(path, ["trainer.lr=0.3"], environ=env)
    assert cfg.trainer.lr == 0.3  # CLI beats environment
    assert cfg.run.name == "from-env"  # environment beats file
    assert cfg.trainer.max_steps == 7  # file beats defaults


def test_env_booleans_and_strings() -> None:
    cfg = load_config(None, environ={"RLBUS_KAFKA__ENABLE_IDEMPOTENCE": "true", "RLBUS_KAFKA__BOOTSTRAP_SERVERS": "k:9092"})
    assert cfg.kafka.enable_idempotence is True
    assert cfg.kafka_config().bootstrap_servers == "k:9092"


def test_unknown_key_is_an_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[trainer]\nlearning_rate = 0.1\n")
    with pytest.raises(ConfigError, match="trainer.learning_rate"):
        load_config(path, environ={})


def test_bad_values_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trainer.groups_per_step"):
        load_config(None, ["trainer.groups_per_step=0"], environ={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", environ={})
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(None, ["trainer.lr"], environ={})


def test_kafka_config_requires_bootstrap() -> None:
    with pytest.raises(ConfigError, match="--broker"):
        load_config(None, environ={}).kafka_config()


def test_trainer_stages_are_built_at_load_time(tmp_path: Path) -> None:
    path = tmp_path / "stages.toml"
    path.write_text('[[trainer_stages]]\ntype = "dynamic_sampling"\n[[trainer_stages]]\ntype = "pods"\nparams = {keep = 4}\n')
    assert [s.type for s in load_config(path, environ={}).trainer_stages] == ["dynamic_sampling", "pods"]
    path.write_text('[[trainer_stages]]\ntype = "no_such_stage"\n')
    with pytest.raises(ConfigError, match="no_such_stage"):
        load_config(path, environ={})
    path.write_text('[[trainer_stages]]\ntype = "pods"\nparams = {keep = 1}\n')
    with pytest.raises(ConfigError, match="keep"):
        load_config(path, environ={})


def test_curator_stages_and_routing_reach_the_curator_config(tmp_path: Path) -> None:
    path = tmp_path / "curator.toml"
    path.write_text('[curator.routing]\ntype = "key_hash"\n[[curator_stages]]\ntype = "skip_solved"\n'
                    'params = {threshold = 0.8}\n')
    cfg = load_config(path, environ={})
    curator = cfg.curator_config("train.jsonl", "curator.jsonl")
    assert curator.routing.type == "key_hash" and curator.metrics_path == "curator.jsonl"
    assert [s.type for s in curator.stages] == ["skip_solved"]
    path.write_text('[[curator_stages]]\ntype = "dynamic_sampling"\n')
    with pytest.raises(ConfigError, match="not a PromptStage"):
        load_config(path, environ={})


def test_worker_throttles_need_one_factor_per_worker() -> None:
    cfg = load_config(None, ["run.workers=3", "run.worker_throttles=[1, 0.5, 0.25]"], environ={})
    assert cfg.run.worker_throttles == [1, 0.5, 0.25]
    with pytest.raises(ConfigError, match="one factor per worker"):
        load_config(None, ["run.workers=2", "run.worker_throttles=[1, 0.5, 0.25]"], environ={})
    with pytest.raises(ConfigError, match=r"\(0, 1\]"):
        load_config(None, ["run.workers=1", "run.worker_throttles=[2]"], environ={})
