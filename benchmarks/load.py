"""Load held: the highest rate of 8 × 1,000-token groups the trainer's intake takes with bounded lag.

    .venv/bin/python -m benchmarks.load --json [--workers 200] [--max-rate 1200] [--step-s 10]

On an embedded Tansu broker (memory storage, loopback) with the run's topics (``ensure_run_topics``):

* ``--workers`` synthetic rollout workers, each its own ``broker.producer.Producer`` (its own
  client and connections), spread over ``--procs`` processes, publish trajectory groups keyed by
  group id, open loop at an offered rate. Each group is G = 8 completions of 1,000 tokens after a
  256-token prompt: token ids drawn from a Zipf law over a 151,936-token vocabulary, log-probs
  mostly near 0 with a heavy tail (float32, as a sampler returns them). Before each step every
  process encodes its share (``broker.codec.encode_group``, once per group, each with its own
  group id), so encoding is not part of the offered load.
* the trainer's intake (``consumers.intake.TrainerIntake``, in its own process) is read as the
  trainer reads it: ``next_batch`` until ``--batch`` groups, then announce the consumed count on
  the control topic and commit, on a thread of their own (the trainer's publish queue). No model:
  the trainer's version stays 0, so every group is fresh.
* the real curator (``consumers.curator.Curator``, its own process, a 64-prompt dataset) dispatches
  prompts as the announcements free its window ((η + 1) × batch) and reads the trajectory topic
  for feedback, so the broker carries prompt traffic and a second reader of the groups.

Offered rates rise in steps (100, 200, then every 200 up to ``--max-rate``), each held ``--step-s``
seconds, after a warm-up that sends one group through every worker. Between steps the workers
encode the next step's groups and the intake drains. Per step: ``offered``; ``achieved`` (groups
the broker acknowledged, per second); ``delivered`` (groups ``next_batch`` returned, per second);
``lag_start`` / ``lag_end`` (groups published, i.e. handed to a producer, minus groups delivered:
the mean over the step's second second and over its last one); latency ``p50`` / ``p99`` (from the
worker's send call to ``next_batch`` returning the group, one clock, matched by group id; the
intake side takes what arrived every 10 ms, so the time a trainer batch takes to fill is not in
it); ``cpu_cores`` per role (``others``: the rest of the machine, processes not started here). A
step holds when the publishers achieved 95 % of the offered rate and lag grew by at most 3 % of
the groups offered between the two readings, or two trainer batches; stepping stops at the first
step that does not hold.

``sustained_groups_per_s`` (and ``sustained_tokens_per_s``, completion tokens) is the delivered rate
of the highest step that held, with its latencies. ``records_lost``: group ids the broker
acknowledged that the intake never delivered, counted from ids after a final drain (copies the
intake dropped are counted apart). The baseline, measured in the same invocation:
``baseline_decode_groups_per_s``, one thread doing only ``decode_group`` on the same groups.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import queue
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from benchmarks.options import JsonOption

POLICY = "main"
VOCAB = 151_936
G, T, PROMPT = 8, 1_000, 256
STALENESS = 4
RECEIPT_POLL_S = 0.01
"""Longest the intake side waits in next_batch before taking what arrived (bounds the receipt-time error)."""
_CPU_TICK = os.sysconf("SC_CLK_TCK")


class Synth:
    """Trajectory groups with realistic token ids and log-probs, cut from long pre-drawn streams
    at random places (every group's columns differ)."""

    def __init__(self, seed: int, stream: int = 1 << 20) -> None:
        self.rng = np.random.default_rng(seed)
        cdf = np.cumsum(1.0 / (np.arange(VOCAB) + 2.7))  # Zipf-Mandelbrot over token ranks
        ranks = np.searchsorted(cdf / cdf[-1], self.rng.random(stream))
        self.ids = self.rng.permutation(VOCAB)[np.minimum(ranks, VOCAB - 1)].astype(np.int32)
        u = self.rng.random(stream)  # 75 % confident tokens, 20 % hesitant, 5 % long tail
        scale = np.where(u < 0.75, 0.01, np.where(u < 0.95, 0.5, 3.0))
        self.logprobs = (-self.rng.exponential(scale)).astype(np.float32)

    def group(self, run: str, group_id: str, prompt_id: str, worker_id: str):
        from broker.schema import SamplingParams, TrajectoryGroup, TrajectoryHeader

        n = G * T
        a, b, c = self.rng.integers(0, len(self.ids) - n, size=3)
        header = TrajectoryHeader(
            run=run, policy=POLICY, group_id=group_id, prompt_id=prompt_id, task="math", worker_id=worker_id,
            sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=T),
            rewards=self.rng.integers(0, 2, G).astype(float).tolist(), finish_reasons=["length"] * G,
            min_version=0, max_version=0, vocab_size=VOCAB, created_at=time.time(),
        )
        return TrajectoryGroup(
            header=header, prompt_tokens=self.ids[c:c + PROMPT].copy(), completion_tokens=self.ids[a:a + n].copy(),
            completion_offsets=np.arange(0, n + 1, T, dtype=np.int32), behaviour_logprobs=self.logprobs[b:b + n].copy(),
            token_versions=np.zeros(n, np.int32),
        )


def _watch_parent() -> None:
    """End this process when the benchmark that started it is gone (it never outlives a killed run)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


# ------------------------------------------------------------------------------------- roles


def _worker_proc(p: int, nprocs: int, producers: int, address: str, run: str, cmds, events, counts, halt,
                 out: str) -> None:
    """``producers`` synthetic workers; sends its share (every ``nprocs``-th group) of each step."""
    _watch_parent()
    from broker.codec import encode_group
    from broker.headers import group_headers
    from broker.producer import Producer
    from broker.settings import KafkaConfig
    from broker.topics import Topics

    kafka, topic = KafkaConfig(bootstrap_servers=address), Topics(run).trajectories(POLICY)
    clients = [Producer(kafka, name=f"worker{p}-{i}") for i in range(producers)]
    synth, lock, log = Synth(seed=1000 + p), threading.Lock(), []  # log: [group id, step, sent, acked, ok]
    tally = {"sent": 0, "acked": 0, "failed": 0}  # also in counts[2p], counts[2p + 1] for the coordinator
    events.put(("ready", p))
    pool: list = []
    try:
        while True:
            cmd, *arg = cmds.get(timeout=900)
            if cmd == "exit":
                break
            if cmd == "prepare":  # encode this process's share of the step: (offset s, producer, id, bytes, headers)
                step, rate, seconds = arg
                pool = []
                for j in range(p, int(rate * seconds), nprocs):
                    w = (j // nprocs) % producers
                    g = synth.group(run, f"{run}-s{step}-{j}", f"lp-s{step}-{j}", f"load-{p}-{w}")
                    pool.append((j / rate, w, g.header.group_id, encode_group(g), group_headers(g.header, None), step))
                events.put(("prepared", p))
            elif cmd == "go":
                (start,) = arg
                for offset, w, gid, value, headers, step in pool:
                    if halt.is_set():
                        break
                    if (wait := start + offset - time.time()) > 0:
                        time.sleep(wait)
                    entry = [gid, step, time.time(), None, False]

                    def acked(future, entry=entry) -> None:  # on the producer's delivery thread
                        entry[3], entry[4] = time.time(), future.exception() is None
                        with lock:
                            tally["acked" if entry[4] else "failed"] += 1
                            counts[2 * p + 1] = tally["acked"]

                    with lock:
                        log.append(entry)
                        tally["sent"] += 1
                    future = clients[w].produce(topic, value, key=gid.encode(), headers=headers)
                    counts[2 * p] = tally["sent"]
                    future.add_done_callback(acked)
                pool = []
                events.put(("sent", p))
    finally:
        for client in clients:
            client.close(30)
        Path(out).write_text(json.dumps({"log": log, **tally}))


def _intake_proc(address: str, run: str, batch_size: int, events, delivered, halt, out: str) -> None:
    """The trainer's side: next_batch until a batch is full, then announce and commit it off-thread."""
    _watch_parent()
    from broker.control import ControlAnnouncer
    from broker.settings import KafkaConfig
    from broker.topics import Topics
    from consumers.intake import IntakeConfig, TrainerIntake

    kafka, topics = KafkaConfig(bootstrap_servers=address), Topics(run)
    intake = TrainerIntake(kafka, topics, POLICY, IntakeConfig(), max_staleness=STALENESS, vocab_size=VOCAB)
    announcer = ControlAnnouncer(kafka, topics)
    publish = ThreadPoolExecutor(1, thread_name_prefix="publish")  # the trainer's publish → announce → commit
    ids: list[str] = []
    times: list[float] = []
    dropped = {"duplicates": 0, "rejected": 0, "dropped_stale": 0}
    steps = 0
    intake.start()
    try:
        while intake.cluster_id is None and not halt.is_set():  # until it holds the topic's partitions
            time.sleep(0.1)
        events.put(("ready", "intake"))
        pending_ids, offsets, consumed = [], {}, 0
        while not halt.is_set():
            # A short wait: a group's receipt is when the intake could hand it out, not when the
            # trainer's batch happens to fill (a step takes B groups however long they take to come).
            batch = intake.next_batch(batch_size - len(pending_ids), 0, timeout_s=RECEIPT_POLL_S)
            if batch is None:
                continue
            now = time.time()
            for group in batch.groups:
                ids.append(group.header.group_id)
                times.append(now)
            delivered.value = len(ids)
            for key in dropped:
                dropped[key] += getattr(batch, key)
            pending_ids += batch.consumed_ids
            offsets.update(batch.offsets)
            if len(pending_ids) >= batch_size:  # one "step": announce what was consumed, then commit
                consumed += len(pending_ids)
                step_ids, step_offsets, pending_ids, offsets = pending_ids, offsets, [], {}
                steps += 1
                publish.submit(announcer.version, POLICY, 0, consumed, step_ids).add_done_callback(
                    lambda f, o=step_offsets: f.exception() is None and intake.commit(o))
    finally:
        publish.shutdown(wait=True)
        stats = intake.stats
        intake.close()
        announcer.close()
        Path(out).write_text(json.dumps({"ids": ids, "times": times, **dropped, "steps": steps,
                                         "received": stats.received, "rejected_reasons": dict(stats.rejected_reasons)}))


def _curator_proc(address: str, run: str, batch_size: int, events, halt, out: str) -> None:
    """The real curator on a 64-prompt dataset: dispatches as the trainer's announcements allow."""
    _watch_parent()
    from broker.settings import KafkaConfig
    from broker.topics import Topics
    from consumers.curator import Curator, CuratorConfig
    from consumers.dataset import Row

    # Here groups do not come from the curator's prompts, so the trainer may announce more consumed
    # than it dispatched, which it takes for a resume on a new broker (it catches up, and says so
    # each time): quiet that one message.
    logging.getLogger("consumers.curator").addFilter(
        lambda r: not r.getMessage().startswith("curator: the trainers consumed"))
    rows = [Row(key=f"q{i}", prompt=f"What is {i} * {i + 7}?", answer=str(i * (i + 7))) for i in range(64)]
    curator = Curator(KafkaConfig(bootstrap_servers=address), Topics(run), POLICY, CuratorConfig(), rows=rows,
                      task="math", group_size=G, windows={POLICY: (STALENESS + 1) * batch_size})
    events.put(("ready", "curator"))
    stats = curator.run(halt.is_set)
    Path(out).write_text(json.dumps({"dispatched": stats.dispatched, "consumed": stats.consumed,
                                     "feedback_groups": stats.feedback}))


# ------------------------------------------------------------------------------------- measurement


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) of a process so far; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _CPU_TICK


def _machine_busy_s() -> float:
    """CPU seconds every core of the machine spent busy so far (all processes, ours and others')."""
    values = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(values) - values[3] - values[4]) / _CPU_TICK


def _baseline_decode(seconds: float = 2.0) -> float:
    """Groups per second one thread decodes (``decode_group`` with the intake's checks), nothing else."""
    from broker.codec import decode_group, encode_group

    synth = Synth(seed=7)
    values = [encode_group(synth.group("base", f"g{i}", f"p{i}", "w")) for i in range(64)]
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        decode_group(values[n % len(values)], vocab_size=VOCAB)
        n += 1
    return n / (time.perf_counter() - start)


class Bench:
    """The coordinator: starts every role, drives the steps, samples the counters."""

    def __init__(self, address: str, broker_pid: int, run: str, workers: int, procs: int, batch: int,
                 tmp: Path) -> None:
        self.ctx, self.broker_pid = mp.get_context("spawn"), broker_pid
        self.tmp, self.run, self.batch, self.procs = tmp, run, batch, procs
        self.events, self.halt = self.ctx.Queue(), self.ctx.Event()
        self.counts = self.ctx.RawArray("q", 2 * procs)
        self.delivered = self.ctx.RawValue("q", 0)
        self.cmds = [self.ctx.Queue() for _ in range(procs)]
        shares = [workers // procs + (p < workers % procs) for p in range(procs)]
        self.workers = [self.ctx.Process(target=_worker_proc, name=f"load-worker{p}", args=(
            p, procs, shares[p], address, run, self.cmds[p], self.events, self.counts, self.halt,
            str(tmp / f"worker{p}.json"))) for p in range(procs)]
        self.intake = self.ctx.Process(target=_intake_proc, name="load-intake", args=(
            address, run, batch, self.events, self.delivered, self.halt, str(tmp / "intake.json")))
        self.curator = self.ctx.Process(target=_curator_proc, name="load-curator", args=(
            address, run, batch, self.events, self.halt, str(tmp / "curator.json")))

    def start(self, timeout_s: float = 180) -> None:
        for proc in [self.intake, self.curator, *self.workers]:
            proc.start()
        self._await("ready", self.procs + 2, timeout_s)

    def _await(self, kind: str, n: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        got = 0
        while got < n:
            try:
                event = self.events.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
                got += event[0] == kind
            except queue.Empty:
                pass
            dead = [p.name for p in [self.intake, self.curator, *self.workers] if p.exitcode is not None]
            if dead or time.monotonic() > deadline:
                raise SystemExit(f"waiting for {n} '{kind}' events, got {got}; exited: {dead}; see {self.tmp}")

    def totals(self) -> tuple[int, int, int]:
        counts = list(self.counts)
        return sum(counts[0::2]), sum(counts[1::2]), self.delivered.value

    def cpu(self) -> dict[str, float]:
        return {"intake": _cpu_s(self.intake.pid), "curator": _cpu_s(self.curator.pid),
                "workers": sum(_cpu_s(p.pid) for p in self.workers), "broker": _cpu_s(self.broker_pid),
                "machine": _machine_busy_s()}

    def step(self, index: int, rate: float, seconds: float) -> dict:
        for q in self.cmds:
            q.put(("prepare", index, rate, seconds))
        self._await("prepared", self.procs, 600)
        start = time.time() + 0.5
        for q in self.cmds:
            q.put(("go", start))
        time.sleep(max(0.0, start - time.time()))
        cpu0, samples = self.cpu(), []
        while (now := time.time()) < start + seconds:
            samples.append((now - start, *self.totals()))
            time.sleep(0.1)
        cpu1 = self.cpu()
        samples.append((time.time() - start, *self.totals()))
        self._await("sent", self.procs, 120)
        base = samples[0]
        lag = [(t, sent - base[1] - (got - base[3])) for t, sent, _, got in samples]
        first = statistics.mean(v for t, v in lag if 1.0 <= t < 2.0)  # after the first second's ramp
        last = statistics.mean(v for t, v in lag if t >= seconds - 1.0)
        elapsed = samples[-1][0]
        used = {k: round((cpu1[k] - cpu0[k]) / elapsed, 2) for k in cpu0}
        used["others"] = round(max(0.0, used.pop("machine") - sum(used.values())), 2)
        return {"offered": rate, "achieved": round((samples[-1][2] - base[2]) / elapsed, 1),
                "delivered": round((samples[-1][3] - base[3]) / elapsed, 1), "lag_start": round(first),
                "lag_end": round(last), "cpu_cores": used, "_step": index}

    def drain(self, timeout_s: float) -> bool:
        """Wait until the intake delivered every acknowledged group (True) or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            sent, acked, got = self.totals()
            if acked == sent and got >= acked:
                return True
            time.sleep(0.1)
        return False

    def stop(self) -> None:
        for q in self.cmds:
            q.put(("exit",))
        for proc in self.workers:
            proc.join(60)
        self.halt.set()
        for proc in [self.intake, self.curator, *self.workers]:
            proc.join(60)
            if proc.exitcode is None:
                proc.kill()
                proc.join(10)


def _held(step: dict, seconds: float, batch: int) -> bool:
    """The publishers achieved 95 % of the offered rate, and lag grew by at most two trainer batches
    or 3 % of what was offered between the two lag readings (1.5 s and ``seconds`` - 0.5 s in)."""
    grew = step["lag_end"] - step["lag_start"]
    bound = max(2 * batch, 0.03 * step["offered"] * (seconds - 2))
    return step["achieved"] >= 0.95 * step["offered"] and grew <= bound


def _latencies(tmp: Path, procs: int) -> tuple[dict, dict]:
    """Per step: [latency s, ...] by group id; and the id counts (acked, delivered, lost, ...)."""
    intake = json.loads((tmp / "intake.json").read_text())
    received: dict[str, float] = {}
    twice = 0
    for gid, t in zip(intake["ids"], intake["times"]):
        twice += gid in received
        received.setdefault(gid, t)
    per_step: dict[int, list[float]] = {}
    acked: set[str] = set()
    failed = 0
    for p in range(procs):
        for gid, step, sent, _, ok in json.loads((tmp / f"worker{p}.json").read_text())["log"]:
            if not ok:
                failed += 1
                continue
            acked.add(gid)
            if gid in received:
                per_step.setdefault(step, []).append(received[gid] - sent)
    counts = {"records_acked": len(acked), "records_delivered": len(received),
              "records_lost": len(acked - set(received)), "delivered_twice": twice,
              "delivered_unacked": len(set(received) - acked), "records_failed": failed,
              "intake_duplicates_dropped": intake["duplicates"], "intake_rejected": intake["rejected"],
              "intake_dropped_stale": intake["dropped_stale"], "trainer_steps": intake["steps"]}
    return per_step, counts


def main(
    workers: Annotated[int, typer.Option(help="Synthetic rollout workers (one producer client each).")] = 200,
    max_rate: Annotated[float, typer.Option(help="Highest offered rate, groups/s.")] = 1200,
    step_s: Annotated[float, typer.Option(help="Seconds each offered rate is held.")] = 10.0,
    procs: Annotated[int, typer.Option(help="Processes the workers are spread over.")] = 4,
    batch: Annotated[int, typer.Option(help="Groups per trainer step (trainer.groups_per_step).")] = 32,
    rates: Annotated[str | None, typer.Option(help="Comma-separated offered rates instead of the ramp.")] = None,
    json_out: JsonOption = False,
) -> None:
    """Highest rate of 8 × 1,000-token groups the intake takes with bounded lag, and its latency."""
    from broker.admin import ensure_run_topics
    from broker.embedded import EmbeddedBroker, EmbeddedBrokerConfig, resolve_tansu_binary
    from broker.settings import KafkaConfig
    from broker.topics import Topics

    if step_s < 4:
        raise typer.BadParameter("at least 4 s: lag is read over the step's second second and over its last one")
    procs = max(1, min(procs, workers))
    ladder = [float(r) for r in rates.split(",")] if rates else \
        [float(r) for r in [100, 200, *range(400, int(max_rate) + 1, 200)] if r <= max_rate]
    baseline = _baseline_decode()
    print(f"[baseline] decode_group alone: {baseline:.0f} groups/s on one thread", file=sys.stderr, flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="rlbus-load-"))
    binary = resolve_tansu_binary(None)
    broker = EmbeddedBroker(EmbeddedBrokerConfig(binary=binary, storage_url="memory://"), tmp / "tansu.log")
    bench = None
    steps, drained, wall = [], True, time.monotonic()
    try:
        address = broker.start()
        run = f"load{uuid.uuid4().hex[:8]}"
        ensure_run_topics(KafkaConfig(bootstrap_servers=address), Topics(run), [POLICY], [POLICY])
        bench = Bench(address, broker.pid, run, workers, procs, batch, tmp)
        bench.start()
        bench.step(-1, max(100.0, workers / 2.0), 2.0)  # warm-up: every worker sends a group
        bench.drain(60)
        for i, rate in enumerate(ladder):
            step = bench.step(i, rate, step_s)
            step["held"] = _held(step, step_s, batch)
            drained = bench.drain(120)
            steps.append(step)
            print(f"[{rate:g}/s] {json.dumps(step)}", file=sys.stderr, flush=True)
            if not step["held"] or not drained:
                break
    finally:
        if bench is not None:
            bench.stop()
        broker.stop()
    per_step, counts = _latencies(tmp, procs)
    for step in steps:
        lat = sorted(per_step.get(step.pop("_step"), [0.0]))
        step["p50"] = round(1000 * lat[len(lat) // 2], 1)
        step["p99"] = round(1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))], 1)
    held = [s for s in steps if s["held"]]
    best = max(held, key=lambda s: s["delivered"]) if held else None
    curator = json.loads((tmp / "curator.json").read_text()) if (tmp / "curator.json").exists() else {}
    out = {
        "sustained_groups_per_s": best["delivered"] if best else 0.0,
        "sustained_tokens_per_s": round(best["delivered"] * G * T) if best else 0,
        "p50_latency_ms": best["p50"] if best else None,
        "p99_latency_ms": best["p99"] if best else None,
        **counts,
        "drained": drained,
        "baseline_decode_groups_per_s": round(baseline, 1),
        "steps": steps,
        "curator": curator,
        "config": {"workers": workers, "procs": procs, "group_size": G, "completion_tokens": T,
                   "prompt_tokens": PROMPT, "vocab": VOCAB, "batch": batch, "step_s": step_s,
                   "encoded_bytes": _encoded_size(), "broker": f"{Path(binary).name} memory:// on loopback"},
        "machine": {"cpus": os.cpu_count(), "cpu_model": _cpu_model(),
                    "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
                    "others_cores_max": max((s["cpu_cores"]["others"] for s in steps), default=None),
                    "python": sys.version.split()[0]},
        "wall_s": round(time.monotonic() - wall, 1),
    }
    shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(out, indent=None if json_out else 1))
    if counts["records_lost"]:
        raise typer.Exit(1)


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


def _encoded_size() -> int:
    from broker.codec import encode_group

    return len(encode_group(Synth(seed=3).group("size", "g", "p", "w")))


if __name__ == "__main__":
    typer.run(main)
