"""`rlbus report`: one self-contained HTML file from a run directory, from a run directory left
without summary.json, or from the store alone; panels without data say so."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import torch
from typer.testing import CliRunner

from rlbus.cli import app
from rlbus.report import html as html_report
from rlbus.report.data import load_store
from weightstore.telemetry import StoreTelemetry
from weightstore.config import WeightsConfig
from weightstore.manifest import read_manifest
from weightstore.objectstore import LocalDirStore
from weightstore.publish import WeightPublisher

TITLES = {
    "reward": "Train reward and held-out accuracy",
    "wait": "Trainer wait fraction",
    "throughput": "Throughput per worker",
    "staleness": "Staleness of trained groups",
    "bytes": "Bytes published per weight version",
    "propagation": "Propagation of weight versions to the workers",
    "curator": "Curator: prompts dispatched, consumed, skipped",
    "region_throughput": "Completion tokens trained per second, per region",
    "region_propagation": "Propagation of weight versions, per region",
}
STEPS = 12


def publish(store: LocalDirStore, policy: str, versions: int = STEPS + 1) -> list:
    """Real versions 0..versions-1 of a tiny model trained a little between them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    publisher = WeightPublisher(store, policy, WeightsConfig(anchor_every=5))
    infos = []
    for version in range(versions):
        if version:
            loss = model(torch.randn(16, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        infos.append(publisher.publish(version, model.state_dict()))
    return infos


def rows_for(policy: str, infos: list, *, newer: bool = True) -> list[dict]:
    """Metrics rows of steps 1.. as the trainer writes them (``newer``: with the fleet keys)."""
    rows = []
    for info in infos[1:]:
        v = info.version
        row = {"policy": policy, "version": v, "step": v, "reward_mean": min(1.0, 0.2 + 0.05 * v), "groups": 4,
               "groups_trained": 4 * v, "groups_dropped_stale": v // 4, "groups_rejected": 1, "tokens": 400,
               "wait_s": 0.5, "step_wall_s": 2.0, "staleness_mean": 0.5, "staleness_max": 1, "wall_s": 2.0 * v,
               "time": 1000.0 + 2.0 * v, "workers_seen": ["w-0", "w-1"], "publish_bytes": info.bytes_written,
               "publish_full_bytes": info.full_bytes, "publish_kind": info.kind}
        if newer:
            row.update(staleness_counts={"0": 2, "1": 2}, groups_by_worker={"w-0": 3, "w-1": 1},
                       propagated_version=None if v < 3 else v - 1, propagation_s=None if v < 3 else 0.4,
                       groups_by_region={"local": 4}, tokens_by_region={"local": 300},
                       staleness_by_region={"local": 0.5}, dropped_stale_by_region={},
                       propagation_by_region={"local": None if v < 3 else [v - 1, 0.4]})
        rows.append(row)
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def panels(page: str) -> dict[str, str]:
    """Each panel's HTML by its key in TITLES."""
    found = {}
    for chunk in page.split('<div class="panel')[1:]:
        for key, title in TITLES.items():
            if f"<h2>{title}" in chunk:
                found[key] = chunk
    return found


def check_self_contained(page: str) -> None:
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(?!data:)[a-z]+:""", page)
    assert "<link" not in page and "<script" not in page
    for b64 in re.findall(r'src="data:image/png;base64,([^"]+)"', page):
        assert base64.b64decode(b64).startswith(b"\x89PNG")


def has_plot(panel: str) -> bool:
    return 'src="data:image/png;base64,' in panel


def make_run_dir(tmp_path: Path, *, summary: bool = True, newer: bool = True) -> Path:
    run_dir = tmp_path / "ci-20260101-000000"
    run_dir.mkdir()
    store = LocalDirStore(run_dir / "store")
    write_jsonl(run_dir / "metrics.jsonl", rows_for("main", publish(store, "main"), newer=newer))
    write_jsonl(run_dir / "metrics.critic.jsonl", rows_for("critic", publish(store, "critic"), newer=newer))
    write_jsonl(run_dir / "curator.jsonl", [{"time": 1000.0 + t, "dispatched": 10 * t, "consumed": 8 * t,
                                             "skipped": t} for t in range(1, 20)])
    if summary:
        (run_dir / "summary.json").write_text(json.dumps({
            "run": run_dir.name, "wall_s": 61.0, "workers": 2, "worker_ids": ["w-0", "w-1"],
            "policies": {"main": {"reward_start": 0.31, "reward_end": 0.87, "reward_end_version": STEPS},
                         "critic": {"reward_start": 0.5, "reward_end": 0.75, "reward_end_version": STEPS}}}))
    return run_dir


def report(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["report", *args])
    return result.exit_code, result.output


def test_a_finished_run_directory_gives_one_file_with_every_panel_plotted(tmp_path: Path) -> None:
    run_dir = make_run_dir(tmp_path)
    code, out = report(str(run_dir))
    assert code == 0, out
    assert out.strip() == f"report: {run_dir / 'report.html'}"
    page = (run_dir / "report.html").read_text()
    check_self_contained(page)
    found = panels(page)
    assert set(found) == set(TITLES)
    assert all(has_plot(p) for p in found.values()), [k for k, p in found.items() if not has_plot(p)]
    assert "no data" not in page
    # the header: the run, its wall time from summary.json, both policies' figures
    assert run_dir.name in page and "61 s (whole run)" in page
    assert "0.310 → 0.870" in page and "0.500 → 0.750" in page
    assert "25.0%" in page  # wait fraction 0.5 s of 2 s steps
    assert "<td class=num>200</td>" in page  # tokens/s: 400 tokens per 2 s step (a cell: "200" is in the PNGs too)
    # a run without regions: the fleet's one region ("local") on one line, both policies' groups together
    regions = page.split("<h2>Regions</h2>")[1].split("</table>")[0]
    assert regions.count("<tr>") == 2 and "<td>local</td>" in regions and "<td class=num>96</td>" in regions
    assert "link counters" not in page


def test_a_run_directory_without_summary_or_newer_keys_leaves_those_figures_out_with_a_note(tmp_path: Path) -> None:
    run_dir = make_run_dir(tmp_path, summary=False, newer=False)
    with open(run_dir / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"policy": "main", "version": 13, "reward_mean": "n/a", "wait_s": None, "time": "late",
                             "staleness_counts": [1, 2], "groups_by_worker": "w-0", "publish_bytes": {}}) + "\n")
        fh.write('{"policy": "ma')  # a trainer killed mid-write
    code, out = report(str(run_dir), "--out", str(tmp_path / "r.html"))
    assert code == 0, out
    page = (tmp_path / "r.html").read_text()
    check_self_contained(page)
    found = panels(page)
    assert set(found) == set(TITLES)
    assert "no summary.json" in page and "held-out accuracy" in page
    assert "metrics.jsonl: 1 unreadable line(s) skipped" in page
    for key in ("reward", "wait", "bytes", "curator"):
        assert has_plot(found[key]) and "no data" not in found[key], key
    for key in ("throughput", "propagation", "region_throughput", "region_propagation"):  # older rows: no
        assert not has_plot(found[key]) and "no data" in found[key], key  # groups_by_worker, propagation, regions
    assert "<h2>Regions</h2>" not in page
    assert has_plot(found["staleness"]) and "no data for the distribution" in found["staleness"]
    assert "trainer, first to last step" in page


def test_a_panel_that_fails_on_its_data_says_no_data_and_the_others_are_drawn(tmp_path: Path, monkeypatch) -> None:
    run_dir = make_run_dir(tmp_path)

    def throughput(data):
        raise ValueError("a worker name that is a list")

    monkeypatch.setattr(html_report, "PANELS", tuple(throughput if f.__name__ == "throughput" else f
                                                     for f in html_report.PANELS))
    code, out = report(str(run_dir))
    assert code == 0, out
    found = panels((run_dir / "report.html").read_text())
    assert "no data: values it could not plot (a worker name that is a list)" in found["throughput"]
    assert all(has_plot(p) for key, p in found.items() if key != "throughput")


def test_the_store_alone_gives_the_report_from_the_mirrored_rows_and_the_manifests(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path / "bucket")
    infos = publish(store, "main")
    telemetry = StoreTelemetry(store, "main", every_s=0.0)
    for row in rows_for("main", infos):
        telemetry.add(row)
    telemetry.close()
    publish(store, "idle", versions=2)  # a policy that published but whose trainer mirrored no rows
    code, out = report("--store", str(tmp_path / "bucket"), "--out", str(tmp_path / "store.html"))
    assert code == 0, out
    page = (tmp_path / "store.html").read_text()
    check_self_contained(page)
    found = panels(page)
    for key in ("reward", "wait", "throughput", "staleness", "bytes", "propagation", "region_throughput",
                "region_propagation"):
        assert has_plot(found[key]) and "no data" not in found[key], key
    assert not has_plot(found["curator"]) and "no data" in found["curator"]
    assert "read from the store only" in page and "idle" in page
    # version 0 has no metrics row: its size comes from its manifest
    data = load_store(store)
    assert data.publications("main")[0] == (0.0, "anchor", float(read_manifest(store, "main", 0).payload_bytes),
                                           float(read_manifest(store, "main", 0).payload_bytes))
    assert [p[0] for p in data.publications("idle")] == [0.0, 1.0] and data.rows["idle"] == []


def test_a_store_whose_rows_have_no_reward_says_no_data_in_every_row_panel(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path / "bucket")
    publish(store, "main", versions=3)
    code, out = report("--store", str(tmp_path / "bucket"), "--out", str(tmp_path / "r.html"))
    assert code == 0, out
    found = panels((tmp_path / "r.html").read_text())
    assert has_plot(found["bytes"])
    for key in ("reward", "wait", "throughput", "staleness", "propagation", "curator", "region_throughput",
                "region_propagation"):
        assert not has_plot(found[key]) and "no data" in found[key], key


def test_what_cannot_be_reported_on_exits_non_zero_saying_what_to_pass(tmp_path: Path) -> None:
    code, out = report(str(tmp_path / "missing"))
    assert code == 2 and "is not a directory" in out and "--store" in out
    (tmp_path / "empty").mkdir()
    code, out = report("--store", str(tmp_path / "empty"))
    assert code == 2 and "no policy" in out and "s3://bucket/prefix" in out
    code, out = report(str(tmp_path / "empty"))
    assert code == 2 and "no metrics.jsonl" in out
    code, out = report()
    assert code == 2 and "--store" in out
