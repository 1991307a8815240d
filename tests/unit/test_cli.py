"""The command line stays light: --help and config validation import neither torch nor Kafka."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

PROBE = """
import runpy, sys
sys.argv = ["rlbus", *{args!r}]
try:
    runpy.run_module("rlbus.cli", run_name="__main__")
except SystemExit:
    pass
heavy = sorted(m for m in ("torch", "transformers", "aiokafka", "confluent_kafka") if m in sys.modules)
print("HEAVY:" + ",".join(heavy))
"""


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["worker", "--help"], ["weights", "--help"],
                                  ["config", "--help"]])
def test_help_does_not_import_heavy_modules(args: list[str]) -> None:
    out = subprocess.run([sys.executable, "-c", PROBE.format(args=args)], capture_output=True, text=True, timeout=60)
    assert "Usage" in out.stdout, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "HEAVY:", out.stdout


def test_bad_config_is_reported_with_the_key_and_exit_code_2(tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer]\ngroups_per_step = 0\n")
    out = subprocess.run([sys.executable, "-m", "rlbus.cli", "prepare", "--config", str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "trainer.groups_per_step" in out.stderr


def _rlbus(*args: str, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rlbus.cli", *args], capture_output=True, text=True, timeout=120,
                          env=env, cwd=ROOT)


def test_config_show_prints_the_resolved_config_typed_by_the_model_with_secrets_masked() -> None:
    env = dict(os.environ, RLBUS_KAFKA__CLIENT_ID="2024", RLBUS_RUN__NAME="1e3", RLBUS_KAFKA__SASL_USERNAME="u",
               RLBUS_KAFKA__SASL_PASSWORD="123456", RLBUS_KAFKA__SECURITY_PROTOCOL="SASL_SSL")
    out = _rlbus("config", "show", "configs/default.toml", "--set", "trainer.lr=0.001", env=env)
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["kafka"]["client_id"] == "2024" and shown["run"]["name"] == "1e3"
    assert shown["trainer"]["lr"] == 0.001 and shown["example"]["max_operand"] == 50  # file, then --set
    assert "123456" not in out.stdout and shown["kafka"]["sasl_password"] == "**********"


def test_config_show_refuses_a_key_that_names_no_setting() -> None:
    out = _rlbus("config", "show", "--set", "worker.nonexistent=1")
    assert out.returncode != 0
    assert "worker has no setting 'nonexistent'" in out.stderr and "max_unacked_bytes" in out.stderr


def test_config_schema_is_json_schema_of_every_section() -> None:
    out = _rlbus("config", "schema")
    assert out.returncode == 0, out.stderr
    schema = json.loads(out.stdout)
    assert {"run", "kafka", "store", "worker", "intake", "signing", "trainer"} <= set(schema["properties"])
    kafka = schema["$defs"]["KafkaConfig"]["properties"]
    assert kafka["partition_assignment_strategy"]["enum"] == ["range", "roundrobin", "cooperative-sticky"]
    assert kafka["client_id"]["description"]


def test_a_torchvision_built_for_another_torch_is_named_with_the_fix(tmp_path) -> None:
    broken = tmp_path / "torchvision"
    broken.mkdir()
    (broken / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    out = _rlbus("config", "show", "configs/default.toml", env=env)
    assert out.returncode == 1
    assert "pip uninstall torchvision torchaudio torchcodec" in out.stderr and "torchvision::nms" in out.stderr
    assert _rlbus("config", "show", "configs/default.toml").returncode == 0
