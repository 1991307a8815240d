"""`rlbus run` end to end, in a subprocess: the loop trains, a hand-attached worker joins and is
killed mid-run, the run goes on, and the summary reports what happened."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from broker.topics import Topics
from tests.fixtures.helpers import wait_for
from trainer.checkpoint import load_latest_checkpoint

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).parents[2]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlbus.cli", *args]


@contextmanager
def _killed_if_left_running(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """``proc``, SIGKILLed if it still runs when the block ends (a failed check or a timeout)."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()


def _summary_of_a_good_end(proc: subprocess.Popen, log: Path, run_dir: Path) -> dict:
    """The run's summary.json once ``proc`` (`rlbus run`) has ended (15 minutes at most), checking it
    ended well; else the tail of its ``log``."""
    rc = proc.wait(timeout=900)
    assert rc == 0, log.read_text(errors="replace")[-5000:]
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    runs = tmp_path_factory.mktemp("runs")
    log = runs / "run.log"
    traces = runs / "traces.jsonl"  # every process of the run appends its spans here
    env = dict(os.environ, PYTHONUNBUFFERED="1", RLBUS_TRACES_FILE=str(traces))
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            # Re-scoring on: the trainer checks every worker's rewards, the hand-attached one's too.
            _cli("run", str(ROOT / "configs/ci.toml"), "--set", f"local.dir={runs}", "--set", "intake.rescore=count"),
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
        )
    with _killed_if_left_running(proc):
        text = lambda: log.read_text(errors="replace")  # noqa: E731
        broker = wait_for(lambda: re.search(r"broker at (\S+)", text()), 120, "the broker address").group(1)
        run_dir = Path(wait_for(lambda: re.search(r"directory (\S+)", text()), 10, "the run dir").group(1))
        wait_for(lambda: (run_dir / "metrics.jsonl").exists(), 400, "the first trainer step")
        # Attach a worker by hand, as a user would, then SIGKILL it once its groups were trained on.
        hand_log = runs / "hand-worker.log"
        metrics_port = _free_port()
        with open(hand_log, "wb") as out:
            hand = subprocess.Popen(
                _cli("worker", "--broker", broker, "--store", str(run_dir / "store"), "--id", "hand-1",
                     "--metrics-port", str(metrics_port)),
                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
            )

        def hand_trained() -> bool:
            rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
            return any("hand-1" in r["workers_seen"] for r in rows)

        killed_at_version = None
        try:
            wait_for(lambda: hand_trained() or proc.poll() is not None, 300, "the hand-attached worker's groups")
            # What an operator sees of the running fleet: the hand worker's metrics and `rlbus status`.
            scraped = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).read().decode()
            status = subprocess.run(_cli("status", "--broker", broker, "--store", str(run_dir / "store"), "--json"),
                                    capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
        finally:
            if hand.poll() is None:
                hand.send_signal(signal.SIGKILL)
                rows = (run_dir / "metrics.jsonl").read_text().splitlines()
                killed_at_version = json.loads(rows[-1])["version"]
            hand.wait(timeout=30)
        local = _worker_pids("local-0", run_dir)  # one of the run's own workers dies too: the run starts it again
        for pid in local:
            os.kill(pid, signal.SIGKILL)
        summary = _summary_of_a_good_end(proc, log, run_dir)
    return {"summary": summary, "run_dir": run_dir, "killed_at_version": killed_at_version, "log": log.read_text(),
            "traces": traces, "scraped": scraped, "status": status, "killed_local": local}


def _worker_pids(worker_id: str, run_dir: Path) -> list[int]:
    """The processes of the rlbus worker with ``worker_id`` of the run in ``run_dir`` (from /proc;
    other tests may run workers of the same id meanwhile)."""
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
            and {"rlbus.cli", "worker", worker_id} <= set(cmd := _cmdline(p)) and any(str(run_dir) in a for a in cmd)]


def test_reward_rises(finished_run: dict) -> None:
    """The policy learns: its reward on the groups it trained rises by 0.1 from the first 50 steps to
    the last 50, and the newest version's greedy held-out score ends above where RL started. That score
    moves between runs whose reward curves match (three runs of this one ended at 0.47, 0.48 and 0.595
    from 0.4), so its margin is 0.05."""
    s = finished_run["summary"]
    rows = [json.loads(x) for x in (finished_run["run_dir"] / "metrics.jsonl").read_text().splitlines() if x.strip()]
    first, last = (sum(r["reward_mean"] for r in part) / len(part) for part in (rows[:50], rows[-50:]))
    assert last >= first + 0.1, (first, last)
    assert s["reward_end"] >= s["reward_start"] + 0.05, s


def test_summary_and_artifacts(finished_run: dict) -> None:
    s, run_dir = finished_run["summary"], finished_run["run_dir"]
    for key in ("reward_start", "reward_end", "wall_s", "workers", "versions_published", "groups_trained",
                "groups_dropped_stale"):
        assert key in s
    assert s["workers"] >= 2
    assert s["groups_trained"] > 0
    assert (run_dir / "reward.png").stat().st_size > 1000
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == list(range(1, len(rows) + 1))
    assert s["versions_published"] == len(rows) + 1  # version 0 is the base model
    assert (run_dir / "logs" / "trainer.log").exists() and (run_dir / "logs" / "broker.log").exists()
    # Where the CPU went, by process: cumulative, so it never falls, and every role used some.
    cpu = [json.loads(x)["cpu_s"] for x in (run_dir / "cpu.jsonl").read_text().splitlines()]
    assert {"trainer", "curator", "broker", "worker-0", "worker-1"} <= set(cpu[-1])
    assert all(cpu[-1][role] > 0 for role in ("trainer", "curator", "broker", "worker-0"))
    assert all(later.get(k, 0) >= v for before, later in zip(cpu, cpu[1:]) for k, v in before.items())


def test_hand_attached_worker_was_trained_on_and_its_death_did_not_stop_the_run(finished_run: dict) -> None:
    s = finished_run["summary"]
    assert "hand-1" in s["worker_ids"], s["worker_ids"]
    assert finished_run["killed_at_version"] is not None
    assert finished_run["killed_at_version"] < s["versions_published"] - 1, "the run ended before the kill"


def test_a_local_worker_that_dies_is_started_again(finished_run: dict) -> None:
    assert len(finished_run["killed_local"]) == 1
    assert finished_run["summary"]["worker_restarts"] == 1, finished_run["summary"]
    assert "worker-0 exited with -9" in finished_run["log"] and "starting it again (restart 1 of" in finished_run["log"]
    text = (finished_run["run_dir"] / "logs" / "worker-0.log").read_text(errors="replace")
    serving = set(re.findall(r"worker\[(\d+)\] INFO .*worker local-0 serving", text))
    assert len(serving) == 2 and finished_run["killed_local"][0] in {int(p) for p in serving}, serving


def test_the_trainer_finds_every_workers_rewards_true(finished_run: dict) -> None:
    """The trainer, from its own dataset file and tokenizer, gives each group of a real fleet the
    rewards its worker claimed: no disagreement, nothing it could not re-score."""
    rows = [json.loads(x) for x in (finished_run["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert last["groups_rescored"] >= last["groups_trained"] > 0
    assert last["reward_disagreements"] == {} and last["groups_unscored"] == {}, last
    assert "hand-1" in last["rescored_by_worker"] and "local-0" in last["rescored_by_worker"], last


def test_one_trace_per_prompt_links_the_trainer_step_to_the_worker_and_the_curator(finished_run: dict) -> None:
    spans = [json.loads(x) for x in finished_run["traces"].read_text().splitlines() if x.strip()]
    by_id = {s["span_id"]: s for s in spans}
    services = {s["name"]: s["service.name"] for s in spans}
    assert services["curator.dispatch"] == "rlbus-curator" and services["trainer.step"] == "rlbus-trainer"
    assert services["worker.generate"] == services["worker.publish"] == "rlbus-worker"
    dispatched = {s["trace_id"]: s for s in spans if s["name"] == "curator.dispatch"}
    rows = [json.loads(x) for x in (finished_run["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    trained = {g for r in rows for g in r["trained_group_ids"]}
    assert trained
    linked = set()
    for step in (s for s in spans if s["name"] == "trainer.step"):
        for link in step["links"]:
            publish = by_id.get(link["span_id"])
            if publish is None or publish["name"] != "worker.publish":
                continue
            generate = by_id.get(publish["parent"])
            curator = dispatched.get(publish["trace_id"])
            if (generate is not None and generate["name"] == "worker.generate" and curator is not None
                    and generate["parent"] == curator["span_id"]
                    and curator["attributes"]["rlbus.prompt_id"] == publish["attributes"]["rlbus.prompt_id"]
                    and publish["attributes"]["rlbus.group_id"] in step["attributes"]["rlbus.group_ids"]):
                linked.add(publish["attributes"]["rlbus.group_id"])
    assert len(linked & trained) >= 0.9 * len(trained), (len(linked & trained), len(trained))


def test_an_attached_worker_serves_its_metrics_for_prometheus(finished_run: dict) -> None:
    text = finished_run["scraped"]
    for name in ("rlbus_worker_groups_total", "rlbus_worker_tokens_total", "rlbus_worker_generate_duration_seconds",
                 "rlbus_worker_version", "rlbus_weights_follow_duration_seconds"):
        assert name in text, name
    assert 'service_name="rlbus-worker"' in text


def test_rlbus_status_reports_the_running_fleet(finished_run: dict) -> None:
    status = finished_run["status"]
    assert status.returncode == 0, status.stderr[-3000:]
    doc = json.loads(status.stdout)
    assert doc["trainer_version"] >= 1 and 0.0 <= doc["trainer_wait_fraction"] <= 1.0
    workers = {w["worker_id"]: w for w in doc["workers"]}
    assert "hand-1" in workers and "local-0" in workers, workers
    assert all(w["groups_per_s"] > 0 and w["region"] for w in workers.values())
    assert doc["lag"] and doc["recommendation"]["action"] in ("add", "remove", "hold")
    assert doc["recommendation"]["workers"] == len(workers)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _pids_listening_on(port: str) -> list[int]:
    """Processes whose command line names the listener on ``port`` (the embedded Tansu broker)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--listener-url" in cmd and any(arg.endswith(f":{port}".encode()) for arg in cmd):
            pids.append(int(proc.name))
    return pids


def _start_run(log: Path, *sets: str) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(_cli("run", str(ROOT / "configs/ci.toml"), *[a for s in sets for a in ("--set", s)]),
                                stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                                cwd=ROOT)


def _kill_broker_after(log: Path, steps: int) -> Path:
    """SIGKILL the run's embedded broker once its trainer made ``steps`` steps; the run directory."""
    text = lambda: log.read_text(errors="replace")  # noqa: E731
    broker = wait_for(lambda: re.search(r"broker at (\S+)", text()), 120, "the broker address").group(1)
    run_dir = Path(wait_for(lambda: re.search(r"directory (\S+)", text()), 10, "the run dir").group(1))
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= steps, 400, f"{steps} steps")
    (pid,) = _pids_listening_on(broker.rsplit(":", 1)[1])
    os.kill(pid, signal.SIGKILL)
    return run_dir


def test_a_broker_that_loses_its_log_costs_no_prompt(tmp_path: Path) -> None:
    """SIGKILL of the embedded broker (memory://: every record, offset and announcement gone)
    mid-run: the run starts it again, the roles ride through, the curator dispatches again every
    prompt no trainer announced taking, and the run ends well. Before, the run stopped (and without
    the stop, the curator's window stayed full of lost prompts and nothing moved again)."""
    log = tmp_path / "run.log"
    steps = 120  # the loss at step 40, then as many steps again and more on the new log
    proc = _start_run(log, f"local.dir={tmp_path}", f"trainer.max_steps={steps}")
    with _killed_if_left_running(proc):
        run_dir = _kill_broker_after(log, 40)
        summary = _summary_of_a_good_end(proc, log, run_dir)
    assert summary["broker_restarts"] == 1
    curator = json.loads((run_dir / "curator.jsonl").read_text().splitlines()[-1])
    assert curator["broker_losses"] == 1 and curator["redispatched"] > 0, curator
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert rows[-1]["step"] == summary["versions_published"] - 1 == steps
    trained = [gid for r in rows for gid in r["trained_group_ids"]]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    # Every prompt was taken by the trainer (trained, or dropped by a gate) except those still in
    # flight when the run ended: lost prompts would hold the window (dispatched - consumed) for good.
    taken = {int(p[1:]) for r in rows for p in r["consumed_prompt_ids"]}
    never_taken = set(range(curator["dispatched"])) - taken
    groups_per_step = rows[-1]["groups"]
    assert len(never_taken) <= curator["dispatched"] - curator["consumed"] + groups_per_step, sorted(never_taken)[:50]


def test_the_durable_local_stack_rides_through_its_storage_and_its_broker_dying(tmp_path: Path) -> None:
    """The broker's log and the weights on the run's SeaweedFS server (local.broker_storage,
    local.weight_store): SIGKILL of SeaweedFS mid-run, later of the broker. The run starts each again
    on the same storage, every role rides through on the same log (the curator sees no loss and
    dispatches nothing again), no group is trained twice, the run ends well, and every published
    version verifies."""
    log = tmp_path / "run.log"
    # Short: Tansu's s3:// engine reads slower as its log grows (benchmarks/kafka_layer.py).
    proc = _start_run(log, f"local.dir={tmp_path}", "local.broker_storage=seaweedfs", "local.weight_store=seaweedfs",
                      "trainer.max_steps=60")
    with _killed_if_left_running(proc):
        run_dir = Path(wait_for(lambda: re.search(r"directory (\S+)", log.read_text()), 60, "the run dir").group(1))
        metrics = run_dir / "metrics.jsonl"
        wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 20, 400, "20 steps")
        (pid,) = [p for p in _pids_listening_on_any_of(run_dir) if Path(_cmdline(Path(f"/proc/{p}"))[0]).name == "weed"]
        os.kill(pid, signal.SIGKILL)
        _kill_broker_after(log, 40)
        summary = _summary_of_a_good_end(proc, log, run_dir)
    text = log.read_text(errors="replace")
    assert "broker log on SeaweedFS at http://127.0.0.1:" in text and "its log stays in s3://tansu/" in text
    assert (summary["storage_restarts"], summary["broker_restarts"]) == (1, 1), summary
    curator = json.loads((run_dir / "curator.jsonl").read_text().splitlines()[-1])
    assert curator["broker_losses"] == 0 and curator["redispatched"] == 0, curator
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert rows[-1]["step"] == summary["versions_published"] - 1 == 60
    assert all(not r["consumed_from_lost_log"] for r in rows)
    trained = [gid for r in rows for gid in r["trained_group_ids"]]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert not (run_dir / "store").exists(), "the weights go to SeaweedFS"
    cpu = [json.loads(x)["cpu_s"] for x in (run_dir / "cpu.jsonl").read_text().splitlines() if x.strip()]
    assert cpu[-1].get("seaweedfs", 0) > 0 and cpu[-1].get("broker", 0) > 0, cpu[-1]  # the servers' CPU is counted
    from weightstore.embedded import EmbeddedS3

    keys = json.loads((run_dir / "seaweedfs-credentials.json").read_text())
    s3 = EmbeddedS3(run_dir / "seaweedfs", access_key_id=keys["access_key_id"],
                    secret_access_key=keys["secret_access_key"], log_path=tmp_path / "seaweedfs.log")
    s3.start()
    try:
        verify = subprocess.run(_cli("weights", "verify", "--store", f"s3://weights/{run_dir.name}", "main", "--all"),
                                capture_output=True, text=True, cwd=ROOT, timeout=300,
                                env=dict(os.environ, **s3.aws_environment()))
    finally:
        s3.stop()
    checked = json.loads(verify.stdout) if verify.returncode == 0 else []
    assert checked and checked[-1]["version"] == 60 and all(v["ok"] for v in checked), \
        verify.stdout[-2000:] + verify.stderr[-2000:]


def test_a_broker_that_dies_past_its_restarts_ends_the_run_with_the_reason(tmp_path: Path) -> None:
    """With no restart left, SIGKILL of the embedded broker stops the run and says why (it went on for
    minutes, then died of whatever client error came first)."""
    log = tmp_path / "run.log"
    proc = _start_run(log, f"local.dir={tmp_path}", "trainer.max_steps=100000", "local.broker_restarts=0")
    with _killed_if_left_running(proc):
        _kill_broker_after(log, 1)
        rc = proc.wait(timeout=300)
    text = log.read_text(errors="replace")
    assert rc != 0
    assert "the embedded broker exited unexpectedly with -9 after 0 restarts" in text and "memory://" in text, \
        text[-3000:]


def test_a_killed_trainer_is_resumed_from_its_checkpoint_and_the_run_ends_well(tmp_path: Path) -> None:
    """SIGKILL of the trainer after a checkpoint (it ended the run): the run restarts it; it resumes
    at the checkpoint's step, publishes the next version as a delta on the stored latest (it
    published a full anchor), and the run reaches max_steps in optimizer steps (versions, which
    only move forward, jumped past them and ended it early). The trainer runs VAPO: its value
    model is checkpointed and restored with the policy, and value pretraining goes on from the
    checkpoint's step."""
    log = tmp_path / "run.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    steps, every, pretrain = 40, 10, 15
    with open(log, "wb") as out:
        proc = subprocess.Popen(_cli("run", str(ROOT / "configs/ci.toml"), "--set", f"local.dir={tmp_path}",
                                     "--set", f"trainer.max_steps={steps}", "--set", f"trainer.checkpoint_every={every}",
                                     "--set", "trainer.groups_per_step=8", "--set", "trainer.algorithm=vapo",
                                     "--set", f"trainer.value.pretrain_steps={pretrain}"),
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    with _killed_if_left_running(proc):
        run_dir, rows = _started(log)
        wait_for(lambda: len(rows()) >= every + 3, 600, "steps past the first checkpoint")
        (pid,) = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline(p).count("trainer")
                  and str(run_dir) in _cmdline(p)]
        os.kill(pid, signal.SIGKILL)
        summary = _summary_of_a_good_end(proc, log, run_dir)
    assert summary["trainer_restarts"] == 1
    history = rows()
    resumed = next(i for i in range(1, len(history)) if history[i]["step"] <= history[i - 1]["step"])
    before, after = history[resumed - 1], history[resumed]
    ckpt = max(s for s in range(every, before["step"] + 1, every))
    # A step on the checkpoint, published after every version the store held (the killed trainer may
    # have published one more than its metrics show).
    assert after["step"] == ckpt + 1 and after["version"] > before["version"]
    # Before its first step the resumed trainer published the checkpoint's weights: a delta on the
    # stored latest, not a full anchor.
    resumed_publish = re.findall(rf"published main v{after['version'] - 1} \((\w+),", (run_dir / "logs/trainer.log").read_text())
    assert resumed_publish == ["delta"], resumed_publish
    assert history[-1]["step"] == steps and history[-1]["version"] == steps + after["version"] - after["step"]
    assert [r["step"] for r in history[resumed:]] == list(range(ckpt + 1, steps + 1))
    # On the weights' lineage (steps up to the checkpoint, then after the resume) no group is trained
    # twice: the steps lost with the trainer do not count.
    lineage = [r for r in history[:resumed] if r["step"] <= ckpt] + history[resumed:]
    trained = [gid for r in lineage for gid in r["trained_group_ids"]]
    assert len(trained) == len(set(trained)) == 8 * steps
    # The value model came back from the checkpoint: pretraining ends at its step, not 15 steps later.
    assert "holds no value model" not in (run_dir / "logs/trainer.log").read_text()
    from trainer.checkpoint import Checkpoint

    assert all(Checkpoint(p, 0, {}).has_value for p in (run_dir / "checkpoints/main").glob("v*"))
    assert [r["step"] for r in history if r.get("loss_policy_frozen")] == \
        [s for s in [r["step"] for r in history] if s <= pretrain]
    assert all("loss_value_loss" in r for r in history)
    verify = subprocess.run(_cli("weights", "verify", "--store", str(run_dir / "store"), "main", "--all"),
                            capture_output=True, text=True, cwd=ROOT)
    assert verify.returncode == 0, verify.stderr[-2000:]


def _started(log: Path) -> tuple[Path, Callable[[], list[dict]]]:
    """The directory of the run writing ``log``, once it says it, and a reader of its metrics rows."""
    run_dir = Path(wait_for(lambda: re.search(r"directory (\S+)", log.read_text(errors="replace")), 120,
                            "the run dir").group(1))

    def rows() -> list[dict]:
        path = run_dir / "metrics.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []

    return run_dir, rows


def _cmdline(proc: Path) -> list[str]:
    try:
        return [a.decode(errors="replace") for a in (proc / "cmdline").read_bytes().split(b"\0")]
    except OSError:
        return []


def test_a_crashed_run_resumes_from_its_directory(tmp_path: Path) -> None:
    """SIGKILL of `rlbus run` itself (its broker, trainer, curator and workers die with it): the same
    command again refuses the directory and names --resume; `rlbus run --resume DIR` takes the run up
    at its trainer's newest checkpoint on a new embedded broker and finishes it."""
    log = tmp_path / "run.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    steps, every = 30, 10
    sets = ["--set", f"local.dir={tmp_path}", "--set", f"trainer.max_steps={steps}", "--set",
            f"trainer.checkpoint_every={every}", "--set", "trainer.groups_per_step=8", "--set", "run.name=crashy",
            "--set", "local.unique_suffix=false"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(_cli("run", str(ROOT / "configs/ci.toml"), *sets), stdout=out,
                                stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    run_dir = tmp_path / "crashy"
    rows = lambda: [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()] \
        if (run_dir / "metrics.jsonl").exists() else []  # noqa: E731
    with _killed_if_left_running(proc):
        # A malformed record ahead of the first group: the trainer rejects it, and its checkpoints
        # carry the count past the crash.
        text = lambda: log.read_text(errors="replace")  # noqa: E731
        broker = wait_for(lambda: re.search(r"broker at (\S+)", text()), 120, "the broker address").group(1)
        wait_for(lambda: "base model ready" in text(), 300, "the topics and the base model")
        _produce_garbage(broker, Topics("crashy").trajectories("main"))
        wait_for(lambda: len(rows()) >= every + 2, 600, "steps past the first checkpoint")
        for pid in _worker_pids("local-1", run_dir):  # a worker restart before the crash: the summary counts it
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: "starting it again" in log.read_text(errors="replace"), 120, "the worker's restart")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        wait_for(lambda: not _pids_listening_on_any_of(run_dir), 60, "the run's processes to die with it")
    crashed_rows = rows()
    crashed_at = crashed_rows[-1]["step"]
    # The row of a checkpoint's step is written while that checkpoint is being saved: a kill in between
    # leaves the one before it as the newest complete checkpoint, and the resume starts from there.
    newest = load_latest_checkpoint(run_dir / "checkpoints" / "main")
    assert newest is not None
    assert newest.extra["step"] in (every * (crashed_at // every), every * (crashed_at // every) - every)
    assert newest.extra["step"] >= every
    again = subprocess.run(_cli("run", str(ROOT / "configs/ci.toml"), *sets), capture_output=True, text=True,
                           env=env, cwd=ROOT, timeout=120)
    assert again.returncode != 0 and f"--resume {run_dir}" in again.stderr, again.stderr[-2000:]
    resumed = subprocess.run(_cli("run", "--resume", str(run_dir)), capture_output=True, text=True, env=env,
                             cwd=ROOT, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    history = rows()
    first = len(crashed_rows)  # the resumed run's rows follow the crashed run's (a kill right after a
    # checkpoint leaves nothing to redo: the resumed steps then go on without a step taken twice)
    assert history[:first] == crashed_rows and history[first]["step"] == newest.extra["step"] + 1
    assert [r["step"] for r in history[first:]] == list(range(history[first]["step"], steps + 1))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["reward_end"] is not None and summary["versions_published"] == history[-1]["version"] + 1
    # Counts of the whole run, not of the last invocation: the restart before the crash, the resume,
    # and the stale drops of the checkpoint's lineage counted on from it.
    assert (summary["worker_restarts"], summary["resumes"], summary["trainer_restarts"]) == (1, 1, 0), summary
    at_checkpoint = next(r for r in history[:first] if r["step"] == history[first]["step"] - 1)
    assert at_checkpoint["groups_rejected"] == 1
    assert all(r["groups_rejected"] == 1 for r in history[first:])  # counted on, not from zero
    assert summary["groups_rejected"] == 1
    # The new curator went on from what the trainer had consumed instead of flooding the new broker.
    curator = (run_dir / "logs" / "curator.log").read_text()
    assert "dispatching on from" in curator, curator[-2000:]


def _produce_garbage(bootstrap: str, topic: str) -> None:
    from broker.producer import Producer
    from broker.settings import KafkaConfig

    producer = Producer(KafkaConfig(bootstrap_servers=bootstrap))
    try:
        producer.send_and_wait(topic, b"not a trajectory record", key=b"garbage")
    finally:
        producer.close()


def _pids_listening_on_any_of(run_dir: Path) -> list[int]:
    """Processes of the run (their command line names its directory)."""
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
            and any(str(run_dir) in a for a in _cmdline(p))]
