"""Every config file in the repository parses; layers apply in the documented order, typed by the
model; unknown keys, missing keys and bad values are errors that name the key."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import SecretStr

from producers.tasks.registry import TASKS
from rlbus.config import (
    WORKER_SECTIONS,
    ConfigError,
    RunConfig,
    load_config,
    secret_environment,
    without_secrets,
    worker_descriptor,
)
from weightstore.config import LocalStoreConfig, S3StoreConfig

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.toml"))


def test_there_are_configs() -> None:
    assert {p.name for p in CONFIGS} >= {"default.toml", "ci.toml", "compose.toml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_file_parses(path: Path) -> None:
    cfg = load_config(path, environ={})
    assert isinstance(cfg, RunConfig)
    from producers.tasks import load_task

    load_task(cfg.run.task, cfg.run.task_params)  # the task each config names exists and builds


def test_precedence_descriptor_then_file_then_env_then_cli(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[trainer]\nlr = 0.1\nmax_steps = 7\n[run]\nname = "a"\n[sampling]\ngroup_size = 3\n')
    env = {"RLBUS_TRAINER__LR": "0.2", "RLBUS_RUN__NAME": "from-env", "UNRELATED": "x", "RLBUS_LOG_LEVEL": "DEBUG"}
    base = {"sampling": {"group_size": 5, "max_new_tokens": 11}, "run": {"seed": 9}}
    cfg = load_config(path, ["trainer.lr=0.3"], environ=env, base=base)
    assert cfg.trainer.lr == 0.3  # CLI beats environment
    assert cfg.run.name == "from-env"  # environment beats file
    assert cfg.trainer.max_steps == 7  # file beats defaults
    assert cfg.sampling.group_size == 3  # file beats the descriptor ...
    assert (cfg.sampling.max_new_tokens, cfg.run.seed) == (11, 9)  # ... key by key, not section by section


def test_values_are_typed_by_the_model_not_guessed() -> None:
    env = {"RLBUS_KAFKA__CLIENT_ID": "2024", "RLBUS_RUN__NAME": "1e3", "RLBUS_KAFKA__SASL_USERNAME": "true",
           "RLBUS_KAFKA__SASL_PASSWORD": "123456", "RLBUS_KAFKA__ENABLE_IDEMPOTENCE": "true"}
    cfg = load_config(None, ["trainer.lr=1e-4", "local.workers=3", "local.bench_worker_speeds=[1, 0.5, 0.25]"],
                      environ=env)
    assert (cfg.kafka.client_id, cfg.run.name, cfg.kafka.sasl_username) == ("2024", "1e3", "true")
    assert cfg.kafka.sasl_password.get_secret_value() == "123456"
    assert cfg.kafka.enable_idempotence is True and cfg.trainer.lr == 1e-4
    assert cfg.local.bench_worker_speeds == [1, 0.5, 0.25]
    cfg = load_config(None, ['kafka.client_id="quoted"', "local.dir='runs/x'"], environ={})
    assert (cfg.kafka.client_id, cfg.local.dir) == ("quoted", "runs/x")  # a TOML string is its text
    cfg = load_config(None, ['run.name="2024"'], environ={"RLBUS_KAFKA__CLIENT_ID": '"env"'})
    assert (cfg.run.name, cfg.kafka.client_id) == ("2024", '"env"')  # the environment is taken as it is
    for bad in ('local.dir="runs/x', 'local.dir="a" "b"', "local.dir='x"):
        with pytest.raises(ConfigError, match="one TOML string"):
            load_config(None, [bad], environ={})


def test_values_of_free_form_tables_are_typed_as_json_or_toml_values() -> None:
    """``run.task_params`` is a table no model types: ``--set`` and the environment give its keys
    numbers, booleans, lists and tables as written, text otherwise (not the text "8" for 8)."""
    cfg = load_config(None, ["run.task_params.max_turns=8", "run.task_params.brief=true",
                             "run.task_params.ratio=0.5", 'run.task_params.games=[{"name": "coin"}]',
                             "run.task_params.mode=fast", 'run.task_params.tag="8"', "run.task_params.limits={a = 1}"],
                      environ={"RLBUS_RUN__TASK_PARAMS__N_TRAIN": "200"})
    assert cfg.run.task_params == {"max_turns": 8, "brief": True, "ratio": 0.5, "games": [{"name": "coin"}],
                                   "mode": "fast", "tag": "8", "limits": {"a": 1}, "n_train": 200}


@pytest.mark.parametrize(
    ("sets", "env", "names"),
    [
        (["worker.nonexistent=1"], {}, ["worker", "'nonexistent'", "max_unacked_bytes"]),
        (["intake.no_such=1"], {}, ["intake", "'no_such'", "queue_max_groups"]),
        ([], {"RLBUS_WORKER__NONEXISTENT": "1"}, ["RLBUS_WORKER__NONEXISTENT", "'nonexistent'"]),
        ([], {"RLBUS_NOPE__X": "1"}, ["RLBUS_NOPE__X", "'nope'", "kafka"]),
        (["kafka.client_id.deeper=1"], {}, ["kafka.client_id", "single value"]),
    ],
)
def test_a_key_that_names_no_setting_is_an_error_naming_it(sets, env, names) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, sets, environ=env)
    assert all(name in str(info.value) for name in names), str(info.value)


@pytest.mark.parametrize("section", ["worker", "intake", "curator", "store", "signing", "local", "example"])
def test_unknown_keys_in_a_file_are_errors_in_every_section(tmp_path: Path, section: str) -> None:
    path = tmp_path / "bad.toml"
    body = 'type = "local"\npath = "/tmp/s"\n' if section == "store" else ""
    path.write_text(f"[{section}]\n{body}typo_key = 1\n")
    with pytest.raises(ConfigError, match=rf"{section}\.(local\.)?typo_key"):
        load_config(path, environ={})


def test_bad_values_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trainer.groups_per_step"):
        load_config(None, ["trainer.groups_per_step=0"], environ={})
    with pytest.raises(ConfigError, match=r"kafka.partition_assignment_strategy.*'range', 'roundrobin' or 'cooperative-sticky'"):
        load_config(None, ["kafka.partition_assignment_strategy=sticky"], environ={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", environ={})
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(None, ["trainer.lr"], environ={})
    with pytest.raises(ConfigError, match="run.task = 'chess' is unknown"):
        load_config(None, ["run.task=chess"], environ={})
    with pytest.raises(ConfigError, match="reasoning_gym: generates 'leg_counting'|set run.task = 'reasoning_gym:leg_counting'"):
        load_config(None, ["data.reasoning_gym.dataset=leg_counting"], environ={})
    gym = load_config(None, ["run.task=reasoning_gym:leg_counting", "data.reasoning_gym.dataset=leg_counting"], environ={})
    assert (gym.run.task, gym.run.task_params) == ("producers.tasks.gym:ReasoningGymTask", {"dataset": "leg_counting"})
    assert load_config(None, [], environ={}).run.task == "rlbus.examples.addition:AdditionTask"  # the default, resolved


@pytest.mark.parametrize("short", sorted(TASKS))
def test_a_short_task_name_resolves_to_a_task_class(short: str) -> None:
    """Each short name of producers/tasks/registry.py becomes the import path of a class its module defines."""
    ref = load_config(None, [f"run.task={short}"], environ={}).run.task
    assert ref == TASKS[short]
    module, _, attr = ref.partition(":")
    assert isinstance(getattr(importlib.import_module(module), attr, None), type), f"{short}: {ref} names no class"


def test_validating_a_config_imports_no_task_module() -> None:
    """The registry holds import paths, so a config naming any task validates without importing it."""
    probe = ("import sys\n"
             "from rlbus.config import load_config\n"
             f"for task in {[*sorted(TASKS), 'reasoning_gym:leg_counting']!r}:\n"
             "    load_config(None, ['run.task=' + task], environ={})\n"
             "print(sorted(m for m in sys.modules if m.startswith('producers.tasks.')))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "['producers.tasks.registry']"


def test_store_is_a_table_or_a_url_with_secrets_kept_secret(tmp_path: Path) -> None:
    path = tmp_path / "s3.toml"
    path.write_text('[store]\ntype = "s3"\nbucket = "b"\nprefix = "runs/x"\nendpoint_url = "http://minio:9000"\n'
                    'region = "eu-west-1"\naddressing_style = "path"\nmax_attempts = 3\n'
                    'access_key_id = "AK"\nsecret_access_key = "very-secret"\n')
    cfg = load_config(path, environ={})
    assert isinstance(cfg.store, S3StoreConfig) and cfg.store.addressing_style == "path"
    assert isinstance(cfg.store.secret_access_key, SecretStr)
    assert "very-secret" not in cfg.model_dump_json() and "very-secret" not in repr(cfg)
    url = load_config(None, ["store=s3://bucket/some/prefix"], environ={"AWS_REGION": "x"}).store
    assert isinstance(url, S3StoreConfig) and (url.bucket, url.prefix) == ("bucket", "some/prefix")
    local = load_config(None, [], environ={"RLBUS_STORE": str(tmp_path / "w")}).store
    assert isinstance(local, LocalStoreConfig) and local.path == str(tmp_path / "w")
    assert isinstance(load_config(None, environ={}).store_config(tmp_path), LocalStoreConfig)
    with pytest.raises(ConfigError, match="store.*no bucket"):
        load_config(None, ["store=s3://"], environ={})


def test_kafka_properties_take_dotted_keys_and_refuse_managed_ones() -> None:
    cfg = load_config(None, ["kafka.properties.ssl.key.location=/k.pem", "kafka.properties.linger.ms=7"], environ={})
    assert cfg.kafka.properties == {"ssl.key.location": "/k.pem", "linger.ms": "7"}
    cfg = load_config(None, environ={"RLBUS_KAFKA__PROPERTIES": '{"sasl.oauthbearer.method": "oidc"}'})
    assert cfg.kafka.properties == {"sasl.oauthbearer.method": "oidc"}
    with pytest.raises(ConfigError, match=r"'session.timeout.ms'.*kafka.session_timeout_ms"):
        load_config(None, ["kafka.properties.session.timeout.ms=100"], environ={})


def test_require_signature_needs_a_key_and_takes_one_from_a_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="require_signature.*signing.key_file.*RLBUS_SIGNING__KEY"):
        load_config(None, ["intake.require_signature=true"], environ={})
    key = tmp_path / "fleet.key"
    key.write_bytes(b"s3cr3t\n")
    cfg = load_config(None, ["intake.require_signature=true", f"signing.key_file={key}"], environ={})
    assert cfg.signing.load_key() == b"s3cr3t"
    cfg = load_config(None, ["intake.require_signature=true"], environ={"RLBUS_SIGNING__KEY": "k"})
    assert cfg.signing.load_key() == b"k"
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(None, [f"signing.key_file={tmp_path / 'missing'}"], environ={})
    with pytest.raises(ConfigError, match="not both"):
        load_config(None, [f"signing.key_file={key}"], environ={"RLBUS_SIGNING__KEY": "k"})


def test_a_worker_inherits_the_run_not_the_trainers_client_settings_or_secrets() -> None:
    trainer = load_config(None, ["kafka.partition_assignment_strategy=cooperative-sticky",
                                 "kafka.enable_idempotence=true", "kafka.sasl_username=u", "kafka.sasl_password=p",
                                 "kafka.security_protocol=SASL_SSL", "signing.key=k", "sampling.group_size=5",
                                 "store=s3://b/p"], environ={})
    descriptor = worker_descriptor(trainer)
    assert set(descriptor) == set(WORKER_SECTIONS)
    worker = load_config(None, ["kafka.bootstrap_servers=regional:9092"], environ={}, base=descriptor)
    assert worker.kafka.partition_assignment_strategy == "range" and worker.kafka.sasl_password is None
    assert worker.sampling.group_size == 5 and worker.signing.key is None and worker.store is None


def test_secrets_travel_in_the_environment_not_in_files(tmp_path: Path) -> None:
    cfg = load_config(None, ["kafka.sasl_username=u", "kafka.sasl_password=pw", "kafka.security_protocol=SASL_SSL",
                             "signing.key=k"], environ={})
    data = without_secrets(cfg)
    assert "pw" not in json.dumps(data) and data["kafka"]["sasl_password"] is None
    env = secret_environment(cfg)
    assert env == {"RLBUS_KAFKA__SASL_PASSWORD": "pw", "RLBUS_SIGNING__KEY": "k"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    again = load_config(path, environ=env)
    assert again.kafka.sasl_password.get_secret_value() == "pw" and again.signing.load_key() == b"k"


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
    cfg = load_config(None, ['curator_stages=[{"type": "skip_solved", "params": {"threshold": 0.8}}]'], environ={})
    assert cfg.curator_stages[0].params == {"threshold": 0.8}


def test_curator_settings_are_the_curators_own_model(tmp_path: Path) -> None:
    path = tmp_path / "curator.toml"
    path.write_text('[curator]\nepochs = 2\n[curator.routing]\ntype = "key_hash"\n[[curator_stages]]\ntype = "skip_solved"\n')
    cfg = load_config(path, environ={})
    assert cfg.curator.routing.type == "key_hash" and cfg.curator.epochs == 2
    path.write_text('[[curator_stages]]\ntype = "dynamic_sampling"\n')
    with pytest.raises(ConfigError, match="not a PromptStage"):
        load_config(path, environ={})


def test_bench_worker_speeds_need_one_factor_per_local_worker() -> None:
    with pytest.raises(ConfigError, match="one factor per worker"):
        load_config(None, ["local.workers=2", "local.bench_worker_speeds=[1, 0.5, 0.25]"], environ={})
    with pytest.raises(ConfigError, match=r"\(0, 1\]"):
        load_config(None, ["local.workers=1", "local.bench_worker_speeds=[2]"], environ={})


def _two_policies(extra: str = "") -> str:
    return """
[trainer]
lr = 1e-4
groups_per_step = 8
[[policies]]
name = "solver"
[[policies]]
name = "verifier"
max_staleness = 1
trainer = { lr = 5e-4 }
sampling = { max_new_tokens = 1 }
""" + extra


WORKFLOW = """
[[workflows]]
name = "solve"
type = "solver_verifier"
roles = { solver = "solver", verifier = "verifier" }
"""


def test_each_policy_lays_its_settings_over_the_runs(tmp_path: Path) -> None:
    path = tmp_path / "two.toml"
    path.write_text(_two_policies(WORKFLOW))
    cfg = load_config(path, ["trainer.max_steps=7"], environ={})
    solver, verifier = cfg.policy_list()
    assert (solver.name, verifier.name) == ("solver", "verifier") and cfg.policy().name == "solver"
    assert solver.trainer.lr == 1e-4 and verifier.trainer.lr == 5e-4
    assert solver.trainer.max_steps == verifier.trainer.max_steps == 7  # [trainer] holds what they share
    assert verifier.trainer.groups_per_step == 8
    assert solver.sampling.max_new_tokens == 8 and verifier.sampling.max_new_tokens == 1
    assert solver.max_staleness == 4 and verifier.max_staleness == 1
    assert verifier.trainer.loss_norm_tokens == 1 and solver.trainer.loss_norm_tokens == 8


def test_algorithm_presets_compose_with_the_fields_given(tmp_path: Path) -> None:
    path = tmp_path / "two.toml"
    path.write_text(_two_policies(WORKFLOW).replace("trainer = { lr = 5e-4 }",
                                                    'trainer = { lr = 5e-4, algorithm = "grpo", kl_coef = 0.01 }'))
    cfg = load_config(path, ["trainer.algorithm=dr_grpo", "trainer.clip_high=0.3"], environ={})
    solver, verifier = cfg.policy_list()
    assert (solver.trainer.advantage_scale, solver.trainer.loss_agg, solver.trainer.clip_high) == ("none", "constant", 0.3)
    # The verifier names GRPO: GRPO's preset under its own fields and the run's explicit ones.
    assert verifier.trainer.algorithm == "grpo" and verifier.trainer.loss_agg == "sequence"
    assert (verifier.trainer.advantage_scale, verifier.trainer.kl_coef, verifier.trainer.clip_high) == ("std", 0.01, 0.3)
    vapo = load_config(None, ["trainer.algorithm=vapo", "trainer.value.pretrain_steps=3"], environ={}).trainer
    assert vapo.value.pretrain_steps == 3 and vapo.value.lambda_alpha == 0.05 and vapo.lm_loss_coef == 0.1
    assert [w.name for w in cfg.workflow_list()] == ["solve"] and cfg.workflow().policies == ["solver", "verifier"]
    assert cfg.metrics_file(tmp_path, "solver") == tmp_path / "metrics.jsonl"
    assert cfg.metrics_file(tmp_path, "verifier") == tmp_path / "metrics.verifier.jsonl"
    # Workers get the policies and workflows from the run descriptor.
    assert load_config(None, [], environ={}, base=worker_descriptor(cfg)).policy("verifier").max_staleness == 1
    with pytest.raises(ConfigError, match="no policy 'judge'; its policies: solver, verifier"):
        cfg.policy("judge")


def test_a_single_policy_config_is_one_policy_and_one_workflow() -> None:
    cfg = load_config(None, ["run.policy=p1"], environ={})
    (policy,) = cfg.policy_list()
    assert policy.name == "p1" and policy.sampling == cfg.sampling
    # Dr. GRPO's constant normaliser, when not given, is the policy's generation budget.
    assert policy.trainer == cfg.trainer.model_copy(update={"loss_norm_tokens": cfg.sampling.max_new_tokens})
    (workflow,) = cfg.workflow_list()
    assert (workflow.name, workflow.type, workflow.roles) == ("p1", "single", {"policy": "p1"})


@pytest.mark.parametrize("extra, message", [
    ("", "needs \\[\\[workflows\\]\\] that say which policy plays which role"),
    (WORKFLOW + WORKFLOW, "each workflow name may appear once"),
    (WORKFLOW.replace('verifier = "verifier"', 'verifier = "judge"'), "binds policy 'judge', which the run does not"),
    (WORKFLOW + WORKFLOW.replace('"solve"', '"again"'), "policy 'solver' is used by workflows 'solve' and 'again'"),
    (WORKFLOW.replace('verifier = "verifier"', 'verifier = "solver"'), "policies \\['verifier'\\] are in no workflow"),
    (WORKFLOW + '[[policies]]\nname = "solver"\n', "each policy name may appear once"),
    (WORKFLOW.replace("[[policies]]", "") + "\n[[policies]]\nname = \"x\"\ntrainer = { lr = -1 }\n",
     "policies.2 \\(x\\).trainer: lr: Input should be greater than 0"),
])
def test_policies_and_workflows_that_do_not_fit_are_named(tmp_path: Path, extra: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(_two_policies(extra))
    with pytest.raises(ConfigError, match=message):
        load_config(path, [], environ={})
