"""Start one real ``rlbus run`` for a benchmark and find its run directory."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def launch_run(config: Path, out: Path, name: str, sets: dict[str, str], extra: list[str], label: str = "") -> Path:
    """Run ``rlbus run config`` with ``sets`` then ``extra`` (KEY=VALUE) as ``--set`` overrides, its
    output in ``out/<name>.out``; returns its run directory, or exits with the output's tail."""
    cmd = [sys.executable, "-m", "rlbus.cli", "run", str(config)]
    for item in [*(f"{key}={value}" for key, value in sets.items()), *extra]:
        cmd += ["--set", item]
    log = out / f"{name}.out"
    print(f"[{name}] {label}{' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
    text = log.read_text()
    match = re.search(r"^rlbus run \S+: directory (.+)$", text, re.M)
    if proc.returncode != 0 or match is None:
        raise SystemExit(f"run {name} failed (exit {proc.returncode}); see {log}:\n{text[-3000:]}")
    return Path(match.group(1))
