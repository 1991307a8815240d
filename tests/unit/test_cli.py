"""The command line stays light: --help and config validation import neither torch nor Kafka."""

from __future__ import annotations

import subprocess
import sys

import pytest

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


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["worker", "--help"], ["weights", "--help"]])
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
