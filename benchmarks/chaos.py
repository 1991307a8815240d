"""Chaos, as a benchmark: one `rlbus run` of the CI-sized config through every fault rlbus claims to
survive, then what the trainer actually stepped on, read back.

    python -m benchmarks.chaos [--json] [--worker-kills 20] [--steps 1200] [--storage seaweedfs]

In one invocation, on a signed fleet (``RLBUS_SIGNING__KEY``):
1. two hand-attached workers (``rlbus worker --broker … --store …``) beside the run's own are
   SIGKILLed one at a time, every ``--kill-every-s``, each replaced by a new one, ``--worker-kills``
   times;
2. the trainer is SIGKILLed a few steps after its first checkpoint (`rlbus run` restarts it; it
   resumes from the checkpoint);
3. the embedded broker is SIGKILLed (`rlbus run` starts it again): on memory:// its log is gone;
   with ``--storage seaweedfs`` (the durable local stack: the broker's log and the weights on the
   run's SeaweedFS server, ``local.broker_storage`` and ``local.weight_store``) it comes back with
   it, and then the SeaweedFS server is SIGKILLed too (`rlbus run` starts it again on its data);
4. the bad-record corpus of ``tests/integration/test_bad_inputs.py`` (random bytes, truncations,
   huge declared lengths, out-of-vocabulary tokens, another run or policy, future versions,
   unsigned, forged, oversize, bad claim checks) plus a copy of a group already trained goes to the
   trajectory topic;
5. once the next anchor is published, a chunk of it in the store is corrupted, and a new worker
   attaches (its follower must build its weights from that anchor); this comes second, after 2., so
   that the anchor after the damaged one, which repairs it, is published within the run.

Counted from the run's own records, not from what should have happened: ``trained_group_ids`` and
``consumed_prompt_ids`` of every trainer step (``metrics.jsonl``), the curator's counters, the DLQ
topic, the run's summary and the exit status of every process. The weights' lineage is the steps
that the final weights descend from: steps of a trainer that died after its newest checkpoint are
a lost branch (they were trained again after the resume).

Keys: ``worker_kills``, ``prompts_lost`` (prompts no step of the lineage took that had been out at
the run's end longer than any prompt taken in the run's last quarter was, and a minute at least:
``lost_after_s``), ``groups_trained_twice`` (on the lineage),
``trainer_restarts``, ``groups_lost_on_resume`` (prompts the lost branch took that the lineage
never took), ``broker_restarts``, ``acked_records_lost`` (trajectory records on the log the broker lost,
past the trainer's committed offsets when it died, that the trainer neither took from that log nor
found again on the new one: workers publish again what no trainer announced taking; their prompts
are dispatched again too), ``redispatched``, ``bad_inputs_tried``, ``bad_inputs_rejected`` (in the DLQ with
a reason, or the duplicate dropped), ``bad_inputs_trained``, ``delta_chunks_corrupted``, ``followers_hit_by_the_damage``
(workers whose weight follower met the damaged chunk: one is started right after the damage),
``followers_recovered`` (of those, the ones that later loaded a newer version), ``repair_anchors``, ``role_crashes`` (processes that exited non-zero without being killed
here), ``storage_restarts``, ``versions_verified`` / ``versions_failing`` (``rlbus weights verify --all``
after the run; a version built on the anchor damaged in 5. is counted apart, in
``versions_on_the_damaged_anchor``), ``reward_start``, ``reward_end``, ``s_per_step_by_quarter`` (mean
seconds a step in each quarter of the run, faults included: a log that slows the run shows in the last
ones), ``wall_s``.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from tests.e2e.test_run import _cli, _cmdline, _pids_listening_on
from tests.fixtures.helpers import read_topic, wait_for

ROOT = Path(__file__).resolve().parents[1]
KEY = "fleet-key"  # the corpus signs its "valid but misplaced" groups with this key
LOST_AFTER_S = 60.0
"""The least time a prompt must have been out at the run's end, never taken, to count as lost; the
count uses the longest time a prompt taken in the run's last quarter was out, when that is longer
(a prompt younger than that may only be slow: a partition behind a slow or newly attached worker).
The last quarter, because the faults come earlier and stall everything while they last."""


def longest_out_s(curator_rows: list[dict], steps: list[dict]) -> float:
    """The longest any prompt a step took had been out: from the first curator row whose dispatch
    count had passed it (rows come every few seconds, so this is a little short) to the step."""
    times = [r["time"] for r in curator_rows]
    counts = [r["dispatched"] for r in curator_rows]
    longest = 0.0
    for step in steps:
        for prompt_id in step.get("consumed_prompt_ids", []):
            if not (prompt_id.startswith("p") and prompt_id[1:].isdigit()):
                continue  # the corpus's ids
            i = bisect.bisect_right(counts, int(prompt_id[1:]))
            if i < len(times):
                longest = max(longest, step["time"] - times[i])
    return longest


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _pids(match) -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and match(_cmdline(p))]


def pace_by_quarter(kept: list[dict]) -> list[float | None]:
    """Mean seconds a step in each quarter of the run (by step number, on the final lineage; a step's
    time is its row's ``time`` less the row before it, so the time lost to a fault counts where it fell)."""
    if not kept:
        return [None] * 4
    last = kept[-1]["step"]
    spans: list[list[float]] = [[], [], [], []]
    for before, row in zip(kept, kept[1:]):
        if "time" in row and "time" in before:
            quarter = min(3, 4 * (row["step"] - 1) // max(last, 1))
            spans[quarter].append((row["time"] - before["time"]) / max(1, row["step"] - before["step"]))
    return [round(sum(x) / len(x), 2) if x else None for x in spans]


def lineage(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the steps the final weights descend from, the steps of lost branches). A resumed trainer's
    first step is numbered one past its checkpoint: the earlier rows with a step at or past it
    belong to the branch that died."""
    kept: list[dict] = []
    lost: list[dict] = []
    for row in rows:
        while kept and kept[-1]["step"] >= row["step"]:
            lost.append(kept.pop())
        kept.append(row)
    return kept, lost


class Chaos:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args, self.workdir = args, workdir
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", RLBUS_SIGNING__KEY=KEY)
        self.rng = random.Random(args.seed)
        self.hand: list[tuple[subprocess.Popen, str]] = []
        self.hand_done: list[tuple[int, bool]] = []  # (exit status, killed here)
        self.worker_kills = 0
        self.events: dict[str, float] = {}
        self.acked_at_loss: set[tuple[str, str]] = set()  # (group id, sha256) on the log the broker lost
        self.new_log: set[str] | None = None  # sha256 of every record of the log after the loss
        self.bad_sent: dict[tuple[int, int], str] = {}
        self.duplicate_of: str | None = None
        self.chunks_corrupted = 0

    # -- the run ---------------------------------------------------------------------------
    def start(self) -> None:
        self.log = self.workdir / "run.log"
        sets = [f"local.dir={self.workdir}", f"trainer.max_steps={self.args.steps}", "trainer.checkpoint_every=50",
                "local.workers=1", "local.max_wall_s=3000"]
        if self.args.storage == "seaweedfs":
            sets += ["local.broker_storage=seaweedfs", "local.weight_store=seaweedfs"]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(_cli("run", str(ROOT / "configs/ci.toml"), *[a for s in sets for a in ("--set", s)]),
                                         stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)
        text = lambda: self.log.read_text(errors="replace")  # noqa: E731
        self.broker = wait_for(lambda: re.search(r"broker at (\S+)", text()), 300, "the broker address").group(1)
        self.run_dir = Path(wait_for(lambda: re.search(r"directory (\S+)", text()), 30, "the run dir").group(1))
        self.metrics = self.run_dir / "metrics.jsonl"
        self.store_url, self.store_env = str(self.run_dir / "store"), {}
        if self.args.storage == "seaweedfs":  # hand workers and this script reach the run's own server
            from weightstore.embedded import aws_environment

            endpoint, self.store_url = wait_for(lambda: re.search(r"weights on SeaweedFS at (\S+) \((\S+)\)", text()),
                                                 60, "the weights' server").groups()
            self.keys = json.loads((self.run_dir / "seaweedfs-credentials.json").read_text())
            self.store_env = aws_environment(endpoint, self.keys["access_key_id"], self.keys["secret_access_key"])
        wait_for(lambda: self.metrics.exists() or self.proc.poll() is not None, 600, "the first trainer step")

    def steps(self) -> int:
        rows = _rows(self.metrics)
        return rows[-1]["step"] if rows else 0

    def _spawn_worker(self) -> None:
        wid = f"chaos-{self.worker_kills + len(self.hand)}"
        log = open(self.workdir / f"{wid}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(_cli("worker", "--broker", self.broker, "--store", self.store_url, "--id", wid),
                                stdout=log, stderr=subprocess.STDOUT, env=self.env | self.store_env, cwd=ROOT)
        self.hand.append((proc, wid))

    def _kill_a_worker(self) -> None:
        proc, _ = self.hand.pop(self.rng.randrange(len(self.hand)))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            self.worker_kills += 1
        self.hand_done.append((proc.wait(), True))
        self._spawn_worker()

    def _kill_trainer(self) -> None:
        (pid,) = _pids(lambda c: "trainer" in c and "--run-dir" in c and str(self.run_dir) in " ".join(c))
        os.kill(pid, signal.SIGKILL)
        self.events["trainer_killed_at_step"] = self.steps()

    def _kill_broker(self) -> None:
        from broker.admin import committed_offsets
        from broker.settings import KafkaConfig
        from broker.topics import Topics

        kafka = KafkaConfig(bootstrap_servers=self.broker)
        topic = f"{self.run_dir.name}.trajectories.main"
        # Just before the kill: every record the broker holds past what the trainer committed.
        done = committed_offsets(kafka, Topics(self.run_dir.name).trainer_group("main"), topic)
        self.acked_at_loss = {(r.key.decode(), hashlib.sha256(r.value).hexdigest())
                              for r in read_topic(kafka, topic) if r.offset >= (done.get(r.partition) or 0)}
        (pid,) = _pids_listening_on(self.broker.rsplit(":", 1)[1])
        os.kill(pid, signal.SIGKILL)
        self.events["broker_killed_at_step"] = self.steps()

    def _kill_storage(self) -> None:
        """SIGKILL of the run's SeaweedFS server (the broker's log and the weights)."""
        (pid,) = _pids(lambda c: bool(c) and Path(c[0]).name == "weed" and any(str(self.run_dir) in a for a in c))
        os.kill(pid, signal.SIGKILL)
        self.events["storage_killed_at_step"] = self.steps()

    def store(self):
        """The run's weight store, as its roles reach it."""
        from weightstore.config import S3StoreConfig, build_store, store_config_from_url

        if not self.store_env:
            return build_store(store_config_from_url(self.store_url))
        bucket, prefix = self.store_url.removeprefix("s3://").split("/", 1)
        return build_store(S3StoreConfig(type="s3", bucket=bucket, prefix=prefix, region="us-east-1",
                                         endpoint_url=self.store_env["AWS_ENDPOINT_URL"], addressing_style="path",
                                         access_key_id=self.keys["access_key_id"],
                                         secret_access_key=self.keys["secret_access_key"]))

    def _bad_inputs(self) -> None:
        from broker.codec import decode_group
        from broker.producer import Producer
        from broker.reader import PartitionReader
        from broker.settings import KafkaConfig
        from broker.topics import Topics
        from tests.integration.test_bad_inputs import _corpus

        topics = Topics(self.run_dir.name)
        kafka = KafkaConfig(bootstrap_servers=self.broker)
        corpus = _corpus(SimpleNamespace(topics=topics), self.store(), kafka.max_message_bytes)
        topic = topics.trajectories("main")
        # A copy of a group the trainer has already trained on.
        trained = {g for r in _rows(self.metrics) for g in r["trained_group_ids"]}
        reader = PartitionReader(kafka, topic)
        copy = None
        try:
            deadline = time.monotonic() + 60
            while copy is None and time.monotonic() < deadline:
                for record in reader.read(64, 0.5):
                    group = decode_group(record.value, vocab_size=None, signing_key=KEY.encode())
                    if group.header.group_id in trained:
                        copy, self.duplicate_of = record.value, group.header.group_id
                        break
        finally:
            reader.close()
        producer = Producer(kafka.model_copy(update={"max_message_bytes": 3 * kafka.max_message_bytes}))
        sent = [(name, producer.produce(topic, value, key=f"bad{i}".encode())) for i, (name, value) in enumerate(corpus)]
        if copy is not None:
            sent.append(("a copy of a trained group", producer.produce(topic, copy, key=b"copy")))
        producer.flush(60)
        for name, delivery in sent:
            got = delivery.result()
            self.bad_sent[(got.partition, got.offset)] = name
        producer.close()
        self.events["bad_inputs_at_step"] = self.steps()

    def _corrupt_a_chunk(self) -> None:
        from weightstore.manifest import chunk_key, manifest_versions, read_manifest

        from weightstore.errors import NotFound

        store = self.store()

        def newest_anchor() -> int | None:
            try:
                return read_manifest(store, "main", max(manifest_versions(store, "main"))).anchor_version
            except NotFound:  # retention removed the manifest between the listing and the read
                return None

        # The first chunk of an anchor just published: every follower that starts before the next anchor
        # needs it, and the worker started below has a whole anchor interval to start up in (the newest
        # anchor at any moment may be replaced before a slow start-up reads it).
        before, deadline = newest_anchor(), time.monotonic() + 900
        while ((newest := newest_anchor()) is None or newest == before) and self.proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        if newest is None:
            return
        key = chunk_key("main", read_manifest(store, "main", newest).chunks[0].sha256)
        data = bytearray(store.get(key).data)
        data[len(data) // 2] ^= 0xFF
        store.put(key, bytes(data))
        self.chunks_corrupted += 1
        self.events["chunk_corrupted_version"] = newest
        self.events["chunk_corrupted_at_step"] = self.steps()
        self._spawn_worker()  # a new follower must build its weights through the damaged chunk

    def progress(self) -> int:
        """Trainer steps recorded so far, lost branches included (only grows)."""
        try:
            return self.metrics.read_bytes().count(b"\n")
        except OSError:
            return 0

    def drive(self) -> None:
        """The faults, one after the other as the run trains (each ``--gap`` steps after the one
        before, the broker's only once the killed trainer was restarted); worker kills all along."""
        for _ in range(2):
            self._spawn_worker()
        # The damage waits for the next anchor, and its repair for the one after: it comes early, so that
        # both fall within the run.
        plan = [self._kill_trainer, self._corrupt_a_chunk, self._kill_broker, self._bad_inputs, self._read_dlq]
        if self.args.storage == "seaweedfs":
            plan.insert(3, self._kill_storage)
        due = 60  # the first checkpoint is at step 50
        next_kill = time.monotonic() + self.args.kill_every_s
        while self.proc.poll() is None:
            time.sleep(0.5)
            restarted = "restarting it from its newest checkpoint" in self.log.read_text(errors="replace")
            if plan and self.progress() >= due and (restarted or plan[0] == self._kill_trainer):
                plan.pop(0)()
                due = self.progress() + self.args.gap
            if self.worker_kills < self.args.worker_kills and time.monotonic() >= next_kill:
                self._kill_a_worker()
                next_kill = time.monotonic() + self.args.kill_every_s
        # Workers leave by themselves when the trainers finish; one still there is stopped here
        # (the broker is gone with the run) and does not count as a crash.
        for proc, _ in self.hand:
            try:
                self.hand_done.append((proc.wait(timeout=30), False))
            except subprocess.TimeoutExpired:
                proc.kill()
                self.hand_done.append((proc.wait(), True))

    # -- the count -------------------------------------------------------------------------
    def _read_dlq(self) -> None:
        """The DLQ and the new trajectory log, read while the run's broker still runs (the trainer
        had ``--gap`` steps to reject)."""
        from broker.settings import KafkaConfig

        self.parked = self._dlq()
        kafka = KafkaConfig(bootstrap_servers=self.broker)
        self.new_log = {hashlib.sha256(r.value).hexdigest()
                        for r in read_topic(kafka, f"{self.run_dir.name}.trajectories.main")}

    parked: dict[tuple[int, int], str] | None = None

    def _dlq(self) -> dict[tuple[int, int], str]:
        from broker.reader import PartitionReader
        from broker.settings import KafkaConfig

        kafka = KafkaConfig(bootstrap_servers=self.broker)
        reader = PartitionReader(kafka, f"{self.run_dir.name}.dlq")
        parked: dict[tuple[int, int], str] = {}
        try:
            idle = 0
            while idle < 10:
                records = reader.read(256, 0.5)
                idle = 0 if records else idle + 1
                for r in records:
                    parked[(int(r.headers["rlbus-dlq-source-partition"]), int(r.headers["rlbus-dlq-source-offset"]))] = \
                        r.headers["rlbus-dlq-reason"]
        finally:
            reader.close()
        return parked

    def _followers(self) -> tuple[int, int]:
        """Workers whose follower met the damaged chunk, and those of them that later loaded a
        version past it."""
        damaged = self.events.get("chunk_corrupted_version")
        hit = recovered = 0
        if damaged is None:
            return 0, 0
        for log in [*self.workdir.glob("chaos-*.log"), *(self.run_dir / "logs").glob("worker-*.log")]:
            text = log.read_text(errors="replace")
            at = text.find("fails its sha256 check")
            if at < 0:
                continue
            hit += 1
            later = [int(v) for v in re.findall(r"weights v(\d+) loaded", text[at:])]
            recovered += any(v > damaged for v in later)
        return hit, recovered

    def _verified(self) -> dict[str, int]:
        """``rlbus weights verify --all`` on the run's store (its SeaweedFS server started again for it)."""
        server = None
        if self.store_env:
            from weightstore.embedded import EmbeddedS3

            server = EmbeddedS3(self.run_dir / "seaweedfs", access_key_id=self.keys["access_key_id"],
                                secret_access_key=self.keys["secret_access_key"], log_path=self.workdir / "seaweedfs.log")
            server.start()
            self.store_env = server.aws_environment()
        try:
            verify = subprocess.run(_cli("weights", "verify", "--store", self.store_url, "main", "--all"),
                                    capture_output=True, text=True, cwd=ROOT, env=self.env | self.store_env)
        finally:
            if server is not None:
                server.stop()
        try:
            versions = json.loads(verify.stdout)
        except json.JSONDecodeError:
            return {"versions_verified": 0, "versions_failing": -1}
        damaged = self.events.get("chunk_corrupted_version")
        on_damage = [v for v in versions if damaged is not None and v.get("anchor_version") == damaged]
        return {"versions_verified": sum(1 for v in versions if v["ok"]),
                "versions_failing": sum(1 for v in versions if not v["ok"] and v not in on_damage),
                "versions_on_the_damaged_anchor": len(on_damage)}

    def report(self, wall_s: float, rc: int) -> dict:
        rows = _rows(self.metrics)
        kept, lost = lineage(rows)
        trained = [g for r in kept for g in r["trained_group_ids"]]
        taken = {p for r in kept for p in r.get("consumed_prompt_ids", [])}
        lost_branch = {p for r in lost for p in r.get("consumed_prompt_ids", [])}
        curator = _rows(self.run_dir / "curator.jsonl")[-1]
        # Prompt ids count dispatches; the curator's rows say how many were out at each time. A
        # prompt out longer at the end than any taken prompt was out (LOST_AFTER_S at least) and
        # never taken is lost (one held by a killed worker is redelivered within the group's
        # session timeout).
        curator_rows = _rows(self.run_dir / "curator.jsonl")
        end = curator_rows[-1]["time"]
        lost_after_s = max(LOST_AFTER_S, longest_out_s(curator_rows, kept[len(kept) * 3 // 4:]))
        settled = max((r["dispatched"] for r in curator_rows if r["time"] <= end - lost_after_s), default=0)
        never_taken = sorted(n for n in range(curator["dispatched"]) if f"p{n}" not in taken)
        lost_prompts = [n for n in never_taken if n < settled]
        summary = json.loads((self.run_dir / "summary.json").read_text()) if (self.run_dir / "summary.json").exists() else {}
        dlq = self.parked or {}
        rejected = sum(1 for where in self.bad_sent if where in dlq)
        if self.duplicate_of is not None and trained.count(self.duplicate_of) == 1:
            rejected += 1  # the copy was dropped as a duplicate
        bad_trained = sum(1 for g in trained if g.startswith("p-"))  # the corpus's ids; real ones are p<n>
        text = self.log.read_text(errors="replace")
        # Deaths `rlbus run` reported (trainer, its own worker), less the trainer killed here; broker
        # restarts beyond the one killed here; hand workers that died unkilled; the run itself.
        reported = len(re.findall(r"warning: \S+ exited with -?\d+", text))
        crashed_roles = max(0, reported - ("trainer_killed_at_step" in self.events))
        crashed_roles += max(0, summary.get("broker_restarts", 0) - ("broker_killed_at_step" in self.events))
        crashed_roles += max(0, summary.get("storage_restarts", 0) - ("storage_killed_at_step" in self.events))
        crashed_roles += sum(1 for code, killed in self.hand_done if code != 0 and not killed)
        crashed_roles += int(rc != 0)
        hit, recovered = self._followers()
        # An acknowledged record on the lost log is lost unless the trainer took it from that log
        # (rows before it noticed the loss; later, the groups it lists as read from the lost log)
        # or its very bytes reached the new log (a worker published it again).
        from_old_log = {f"{p}/main" for r in rows if r.get("log_losses", 0) == 0 for p in r.get("consumed_prompt_ids", [])}
        from_old_log |= {g for r in rows for g in r.get("consumed_from_lost_log", [])}
        republished = {d for _, d in self.acked_at_loss} & (self.new_log or set())
        acked_lost = [g for g, d in self.acked_at_loss if g not in from_old_log and d not in republished]
        republished_logs = sum(int(n) for log in [*self.workdir.glob("chaos-*.log"), *(self.run_dir / "logs").glob("worker-*.log")]
                               for n in re.findall(r"publishing again the (\d+) groups", log.read_text(errors="replace")))
        return {
            "worker_kills": self.worker_kills,
            "prompts_lost": len(lost_prompts),
            "lost_after_s": round(lost_after_s, 1),
            "groups_trained_twice": len(trained) - len(set(trained)),
            "trainer_restarts": summary.get("trainer_restarts", 0),
            "groups_lost_on_resume": len(lost_branch - taken),
            "broker_restarts": summary.get("broker_restarts", 0),
            "acked_records_lost": len(acked_lost),
            "acked_records_on_the_lost_log": len(self.acked_at_loss),
            "acked_records_published_again": len(republished),
            "groups_published_again_by_workers": republished_logs,
            "new_log_read": self.new_log is not None,
            "redispatched": curator.get("redispatched", 0),
            "bad_inputs_tried": len(self.bad_sent),
            "bad_inputs_rejected": rejected,
            "dlq_read": self.parked is not None,
            "bad_inputs_trained": bad_trained,
            "delta_chunks_corrupted": self.chunks_corrupted,
            "followers_hit_by_the_damage": hit,
            "followers_recovered": recovered,
            "repair_anchors": rows[-1].get("repair_anchors", 0) if rows else 0,
            "role_crashes": crashed_roles,
            "storage_restarts": summary.get("storage_restarts", 0),
            **self._verified(),
            "reward_start": summary.get("reward_start"),
            "reward_end": summary.get("reward_end"),
            "steps": kept[-1]["step"] if kept else 0,
            "lost_branch_steps": len(lost),
            "s_per_step_by_quarter": pace_by_quarter(kept),
            "prompts_not_taken_at_end": len(never_taken) - len(lost_prompts),
            "lost_prompt_ids_first": [f"p{n}" for n in lost_prompts[:20]],
            "run_exit_status": rc,
            "events": self.events,
            "wall_s": round(wall_s, 1),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--worker-kills", type=int, default=20)
    parser.add_argument("--kill-every-s", type=float, default=6.0)
    parser.add_argument("--steps", type=int, default=600, help="trainer.max_steps of the run")
    parser.add_argument("--gap", type=int, default=60, help="trainer steps between two faults")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the run directory (printed)")
    parser.add_argument("--storage", choices=["memory", "seaweedfs"], default="memory",
                        help="the broker's log in memory and the weights in files, or both on the run's SeaweedFS")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="rlbus-chaos-"))
    started = time.monotonic()
    chaos = Chaos(args, workdir)
    chaos.start()
    try:
        chaos.drive()
        rc = chaos.proc.wait(timeout=3000)
    finally:
        if chaos.proc.poll() is None:
            chaos.proc.kill()
        for proc, _ in chaos.hand:
            if proc.poll() is None:
                proc.kill()
    result = chaos.report(time.monotonic() - started, rc)
    if args.keep:
        result["run_dir"] = str(chaos.run_dir)
    else:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>24}: {value}")
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
