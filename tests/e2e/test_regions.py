"""A hub and two regions on one machine, end to end: `rlbus run configs/regions.toml` made short, with
shaped links, the far region cut off for a few seconds, and its replica filled out of order (the
replicator's shuffled order, as S3 replication keeps none). Nothing is lost, nothing is trained
twice, no worker loads a version that is not whole, the cut region comes back, and a version
crosses each link about once whatever the number of workers behind it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).parents[2]
CUT_AT_STEP, CUT_FOR_S = 40, 8
REGIONS = [
    {"name": "near", "workers": 2, "link": {"delay_ms": 20, "rate_mbit": 100}},
    {"name": "far", "workers": 2, "link": {"delay_ms": 60, "rate_mbit": 20, "cuts": [{"at_step": CUT_AT_STEP, "for_s": CUT_FOR_S}]},
     "replica": {"order": "shuffled", "shuffle_pause_s": 0.1}},
]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _far_story(run: Path) -> str:
    """What the far region's workers, replica and link said (their warnings and last lines): the
    message of an assertion about the far region, so that a failure says where it stuck."""
    out = []
    for log in sorted((run / "logs").glob("*far*.log")):
        lines = log.read_text(errors="replace").splitlines()
        said = [x for x in lines if re.search(r"WARNING|ERROR|assigned|revoked|stopp|cut|restored", x)]
        out.append(f"== {log.name}\n" + "\n".join(x[:300] for x in said[-25:] + ["..."] + lines[-5:]))
    supervisor = (run.parent / "run.log").read_text(errors="replace").splitlines()
    out.append("== run.log\n" + "\n".join(x[:300] for x in supervisor if re.search(r"WARNING|ERROR|killing", x)))
    return "\n".join(out)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    runs = tmp_path_factory.mktemp("runs")
    log = runs / "run.log"
    with open(log, "wb") as out:
        proc = subprocess.run(
            [sys.executable, "-m", "rlbus.cli", "run", str(ROOT / "configs/regions.toml"), "--plain",
             "--set", f"local.dir={runs}", "--set", "trainer.max_steps=130", "--set", "example.n_heldout=100",
             "--set", f"local.regions={json.dumps(REGIONS)}", "--set", "local.max_wall_s=900",
             # shorter than the cut: a far worker gives up on what it could not deliver and serves on
             "--set", "kafka.delivery_timeout_ms=4000"],
            stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"), cwd=ROOT, timeout=1200,
        )
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, text[-5000:]
    return Path(re.search(r"directory (\S+)", text).group(1))


def test_nothing_is_lost_or_trained_twice_across_the_regions_and_the_cut(run: Path) -> None:
    rows = _rows(run / "metrics.jsonl")
    trained = [g for r in rows for g in r["trained_group_ids"]]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert {"hub", "near", "far"} <= {region for r in rows for region in r["groups_by_region"]}
    link = json.loads((run / "regions/far/link.json").read_text())
    (cut_start, cut_end), = link["cuts"]
    # every prompt dispatched before the cut began was taken by the trainer (trained, dropped as too
    # stale, or skipped by a stage): those the far region held came back with the link, or went to others
    curator = _rows(run / "curator.jsonl")
    before_cut = max(r["dispatched"] for r in curator if r["time"] <= cut_start)
    taken = {p for r in rows for p in r.get("consumed_prompt_ids", [])}
    lost = [n for n in range(before_cut) if f"p{n}" not in taken]
    assert before_cut > 0 and not lost, f"{len(lost)} of {before_cut} prompts dispatched before the cut never taken"
    # the near region and the hub trained on through the cut; the far region trained again after it
    during = [r for r in rows if cut_start + 2 < r["time"] < cut_end]
    assert sum(r["groups_by_region"].get("near", 0) + r["groups_by_region"].get("hub", 0) for r in during) > 0
    assert sum(r["groups_by_region"].get("far", 0) for r in rows if r["time"] > cut_end) > 0, \
        f"the far region trained nothing after its cut ended at {cut_end:.1f} (last step at {rows[-1]['time']:.1f})\n" \
        + _far_story(run)
    # the cut workers rode it out: none died (giving up on deliveries that timed out is not dying)
    assert json.loads((run / "summary.json").read_text())["worker_restarts"] == 0


def test_workers_of_a_replica_filled_out_of_order_load_only_whole_versions(run: Path) -> None:
    waits = loads = 0
    for log in (run / "logs").glob("far-*.log"):
        text = log.read_text(errors="replace")
        assert "do not match" not in text and "IntegrityError" not in text, log
        loads += len(re.findall(r"weights v\d+ loaded via", text))
        waits += sum(int(n) for n in re.findall(r"(\d+) polls found the replica incomplete", text))
    assert loads > 10, _far_story(run)
    assert waits > 0, "the shuffled replica never showed a worker an incomplete version\n" + _far_story(run)


def test_a_version_crosses_each_link_about_once_whatever_the_workers_behind_it(run: Path) -> None:
    summary = json.loads((run / "summary.json").read_text())
    for name in ("near", "far"):
        link = json.loads((run / f"regions/{name}/link.json").read_text())
        s3 = next(r for r in link["routes"].values() if not r["kafka"])
        copied = summary["regions"][name]["replica"]["bytes_copied"]
        # two workers follow the replica; the link carried one copy (plus HTTP's headers and polls)
        assert copied <= s3["bytes_down"] < 1.5 * copied, (name, s3["bytes_down"], copied)
