"""rlbus.supervisor.CpuMeter: the CPU of a run's processes, by role, from /proc."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlbus.supervisor import CpuMeter

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")

SPIN = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\n"


def test_it_counts_a_busy_process_and_not_an_idle_one_and_keeps_what_ended(tmp_path: Path) -> None:
    meter = CpuMeter(tmp_path / "cpu.jsonl", every_s=0.0)
    busy = subprocess.Popen([sys.executable, "-c", SPIN])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    while busy.poll() is None or idle.poll() is None:
        meter.sample({"busy": [busy.pid], "idle": [idle.pid]})  # a child is read until it is reaped
        time.sleep(0.05)
    meter.sample({}, force=True)  # both gone: their last readings stay
    rows = [json.loads(line) for line in (tmp_path / "cpu.jsonl").read_text().splitlines()]
    last = rows[-1]["cpu_s"]
    assert 0.4 <= last["busy"] <= 1.5, last  # its 0.6 s of spinning, less what ended between samples
    assert last["idle"] < last["busy"] / 2
    assert all(b["cpu_s"].get(k, 0) <= a["cpu_s"][k] for b, a in zip(rows, rows[1:]) for k in b["cpu_s"])


def test_restarted_processes_of_a_role_add_up(tmp_path: Path) -> None:
    meter = CpuMeter(tmp_path / "cpu.jsonl", every_s=0.0)
    pids = []
    for _ in range(2):
        proc = subprocess.Popen([sys.executable, "-c", SPIN])
        pids.append(proc.pid)
        while proc.poll() is None:
            meter.sample({"trainer": [proc.pid]})
            time.sleep(0.05)
    meter.sample({}, force=True)
    last = json.loads((tmp_path / "cpu.jsonl").read_text().splitlines()[-1])["cpu_s"]
    assert last["trainer"] >= 0.8  # both runs of it, not the newest only
