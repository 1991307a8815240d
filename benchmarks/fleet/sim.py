"""The fleet as a discrete-event simulation (SimPy): curator, workers, broker, trainer and store.

``benchmarks.fleet.calibrate``, ``benchmarks.fleet.project`` and ``benchmarks.fleet_regions`` build the
scenarios and read the results; this module is the mechanism, one class per role, each doing what its
rlbus counterpart does:

* **Curator**: keeps dispatched − consumed ≤ (η + 1)·B (guard 1), learning "consumed" from the
  trainer's announcements on the control topic; routes each prompt with rlbus's own
  ``consumers.routing.LeastDelayRouter`` over ``prompt_partitions`` partitions, fed the groups
  that come back with the times in their headers (``created_at`` = the batch's start,
  ``published_at`` = its end, the throttling sleep included), so it learns each worker's rate as
  the curator does: a worker sent few prompts runs small batches, whose fixed cost makes it look
  slower still. It produces prompts one at a time (``curator_prompt_s`` of CPU each), sent once
  the first waiting has lingered ``linger_s`` and when the window is full, so a burst reaches the
  workers in pieces. The partitions are spread over the live workers as Kafka's range assignor
  does (or cooperative-sticky: only freed and surplus partitions move); a preempted worker's
  partitions move after ``rebalance_s`` and its prompts go with them.
* **Worker**: takes up to ``max_prompts_per_poll`` prompts from its partition, moves to the newest
  version its region's store holds (``refresh_before_generation``), waits while older than the
  newest dispatch version − η (guard 2), generates the batch (CPU work ``gen_batch_s +
  gen_group_s·n`` at speed 1, then sleeps the wall time × (1/speed − 1), as ``worker.bench_speed``
  does), packs and publishes one group per prompt. While it generates it follows announced
  versions in the background; idle, it follows none. A preempted worker loses its batch and
  partition; its prompts are redelivered after ``rebalance_s``; a replacement joins after
  ``replace_s`` and downloads a full anchor.
* **Broker**: a hop to one reader delivers a record at that reader's next fetch return after
  the hop's latency (Tansu holds every fetch ``period_s``; Apache Kafka answers at once: period 0).
  Each prompt record and each group record costs it half of ``broker_group_s``. The embedded
  broker's polling load grows with its log (``broker_growth_cores_per_prompt`` per prompt
  dispatched so far: Tansu's memory engine walks a partition's batches on every fetch); with
  ``broker_polling`` that load runs on nice-0 threads of its own, competing with the trainer and
  the workers, and a record is readable only once the broker has done its work for it.
* **Curator feedback**: the groups the curator's feedback consumer fetched reach the router when
  its loop next polls (a control record wakes it, else ``curator_poll_s``), partition by
  partition as a fetch lists them.
* **Trainer**: takes groups until B passed the data stages (each passes with probability
  ``informative_fraction``: DAPO dynamic sampling), drops groups staler than η (guard 3) and
  copies of a prompt's group it already took (the intake's dedupe: after a cut, two workers
  generated it), announces every drop at once (queued behind a publication in flight), trains,
  waits for the previous publication (at most one in flight), and publishes on its queue: publish
  CPU, store write, then the version announcement (version, groups consumed).
* **Store**: a version is published centrally and copied to each region over that region's WAN
  link (one copy per version: a delta, or a full anchor every ``anchor_every`` versions or always
  with ``full_weights``); workers download from their region over links shared by the transfers
  in flight (equal shares, each capped at the worker's NIC). A region's copy is either the object
  store's replication (each version on its own, ``replication_lag_s`` after its publication) or
  rlbus's relay (``replication = "relay"``, ``rlbus replica``): woken by the version's announcement,
  one pass at a time, each the round trips of weightstore/replica.py (``Store._relay``).
* **Cuts** (``Region.cuts``): once the trainer logged a step, a region's link carries nothing for a
  while: records across it wait (prompts, groups, announcements), the relay's passes fail, and the
  rollout group drops the region's workers (their prompts move after ``rebalance_s``, the session
  timeout); they keep generating what they hold, and rejoin a rebalance (``rebalance_s``) after the
  link is back, while the relay catches their replica up (``Sim._cut``).
* **CPU and network**: ``benchmarks.fleet.resources`` (processor sharing by nice level, one
  interpreter lock per Python process, contention and a thread's share of a busy core, links and
  held fetches). The trainer is one Python process: its step, its publication thread and its
  intake's decoding share one interpreter lock (``TRAINER_PROCESS``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import simpy

from benchmarks.fleet.resources import CpuPool, Cut, Hop, Link, deliver
from consumers.routing import LeastDelayRouter

TRAINER_PROCESS = "trainer"
RELAY_PREFETCH = 64
"""``weightstore.replica.MAX_PREFETCH`` (not imported: that module loads torch): the newest manifests a
relay pass reads at once."""


@dataclass
class Region:
    """Where workers run: their WAN link to the central store and broker, and their store replica."""

    name: str
    rtt_s: float = 0.0
    wan_bytes_per_s: float = math.inf
    mirror_s: float = 0.0  # MirrorMaker 2 lag, each way
    replication_lag_s: float = 0.0  # store replication lag before the copy starts
    replica_bytes_per_s: float = math.inf  # the regional replica's aggregate bandwidth to its workers
    worker_bytes_per_s: float = math.inf  # each worker's NIC
    store_rtt_s: float = 0.0  # a worker's requests to its replica (LATEST, manifest)
    reads_across: bool = False  # its readers fetch from the hub's broker over the link (no MirrorMaker)
    replication: str = "copy"  # "copy": the object store's, each version on its own; "relay": rlbus replica
    copy_workers: int = 4  # the relay's requests in flight at once (replica.copy_workers)
    relay_poll_s: float = 0.2  # with no announcement, the relay asks LATEST this often (replica.poll_interval_s)
    cuts: list[tuple[int, float]] = field(default_factory=list)  # (trainer step, seconds): the link carries nothing


@dataclass
class WorkerSpec:
    speed: float
    pool: str
    region: str = "local"
    nice: int = 10
    throttled: bool = True
    """True: speed emulated as ``worker.bench_speed`` does (generate at full speed, then sleep
    outside the generation); False: slower hardware (the generation itself takes 1/speed as long)."""


@dataclass
class Scenario:
    """Everything one simulation needs. Times in seconds (CPU work at speed 1), sizes in bytes."""

    groups_per_step: int
    max_staleness: int
    workers: list[WorkerSpec]
    cores: dict[str, float]  # pool → cores
    trainer_step_s: float  # CPU work of one optimizer step (trainer pool)
    publish_s: float  # CPU work of one publication (trainer pool, its own thread)
    gen_batch_s: float  # per generated batch, at speed 1
    gen_group_s: float  # per group of a batch, at speed 1
    informative_fraction: float = 1.0
    worker_group_s: float = 0.0  # pack, score, encode, produce, per group (worker pool)
    broker_group_s: float = 0.0  # per prompt record and its group record, half each (broker pool)
    curator_prompt_s: float = 0.0  # per dispatched prompt (curator pool)
    follow_s: float = 0.0  # apply one version on a worker (worker pool)
    intake_group_s: float = 0.0  # decode and check one arriving group (trainer process, its intake thread)
    store_write_s: float = 0.0  # wall time of a publication's writes (no CPU)
    background_cores: dict[str, float] = field(default_factory=dict)
    # The embedded broker's idle load grows with its log (Tansu's memory engine walks a partition's
    # batches on each fetch): this many cores per prompt dispatched so far, on the broker pool's
    # background (or on its polling, below).
    broker_growth_cores_per_prompt: float = 0.0
    # The broker's polling as work of its own: its load (``broker_idle_cores``, not in
    # ``background_cores`` then, plus the growth above) runs each fetch period on ``broker_threads``
    # nice-0 threads that compete with the other processes, and a record is readable once the broker
    # has done its work for it. Off: the polling load is taken off the top of the pool's cores.
    broker_polling: bool = False
    broker_idle_cores: float = 0.0
    broker_threads: int = 2
    broker_poll_period_s: float = 0.02  # its polling load is charged in slices this long (a held fetch)
    pool_contention: dict[str, float] = field(default_factory=dict)  # pool → s (see CpuPool)
    pool_busy_share: dict[str, float] = field(default_factory=dict)  # pool → a thread's share of a core when saturated
    trainer_pool: str = "trainer"
    curator_pool: str = "trainer"
    broker_pool: str = "trainer"
    max_prompts_per_poll: int = 16
    prompt_partitions: int = 32  # kafka.prompt_partitions: at least the number of workers
    trajectory_partitions: int = 8  # kafka.trajectory_partitions
    linger_s: float = 0.005  # kafka.linger_ms of the curator's producer
    curator_poll_s: float = 0.05  # curator.poll_interval_s: its loop reads feedback once per control poll
    assignment: str = "range"  # the rollout group's assignor: "range" (the embedded broker) or "sticky" (cooperative-sticky)
    hop_latency_s: float = 0.0  # produce → readable
    fetch_period_s: float = 0.0  # readers on the critical path
    listener_period_s: float = 0.0  # the workers' control listeners
    regions: dict[str, Region] = field(default_factory=lambda: {"local": Region("local")})
    delta_bytes: float = 0.0
    full_bytes: float = 0.0
    anchor_every: int = 50
    full_weights: bool = False
    chunk_bytes: float = 32 * 2**20  # weights.chunk_bytes: the relay copies one object per chunk
    rebalance_s: float = 10.0
    replace_s: float = 0.0
    preempt_per_worker_per_s: float = 0.0
    preempt_at: list[tuple[float, int]] = field(default_factory=list)  # (time, worker index)
    steps: int = 200
    warmup_steps: int = 20
    seed: int = 0
    max_time_s: float = math.inf


@dataclass
class Prompt:
    pid: int
    dispatch_version: int
    partition: int = 0


@dataclass
class Group:
    prompt: Prompt
    min_version: int
    worker: int
    created_at: float = 0.0  # the batch's generation started
    published_at: float = 0.0  # ... and ended (the header's times)
    partition: int = 0  # its trajectory-topic partition (the producer hashes the group id)


class Sim:
    """One run of a scenario: ``Sim(scenario).run()`` returns its figures."""

    def __init__(self, sc: Scenario) -> None:
        self.sc, self.env, self.rng = sc, simpy.Environment(), random.Random(sc.seed)
        self.cuts = {name: Cut(self.env) for name, r in sc.regions.items() if r.cuts}
        self.cut_times: dict[str, list[list[float]]] = {}  # region -> [start, end] of each cut
        bg = sc.background_cores
        self.pools = {name: CpuPool(self.env, cores, bg.get(name, 0.0), sc.pool_contention.get(name, 0.0),
                                    sc.pool_busy_share.get(name, 1.0)) for name, cores in sc.cores.items()}
        self.store = Store(self)
        self.trainer = Trainer(self)
        self.curator = Curator(self)
        self.workers = [Worker(self, i, spec) for i, spec in enumerate(sc.workers)]
        self.curator.start()

    def hop(self, region: str, period: float, *, reader_there: bool = False) -> Hop:
        """A record's way from the hub's broker to a reader in ``region`` (``reader_there``) or from a producer
        there to a reader at the hub. A reader that fetches across the link (``reads_across``) has its held
        fetch travel it too: its fetches return at the broker every wait plus a round trip."""
        r = self.sc.regions[region]
        if reader_there and r.reads_across:
            period += r.rtt_s
        return Hop(self.sc.hop_latency_s + r.rtt_s / 2 + r.mirror_s, period, self.rng, self.cuts.get(region))

    def stepped(self, step: int) -> None:
        """The trainer logged ``step``: the cuts due then start."""
        for name, r in self.sc.regions.items():
            for at, seconds in r.cuts:
                if at == step:
                    self.env.process(self._cut(name, seconds))

    def _cut(self, region: str, seconds: float):
        """Nothing crosses the region's link for ``seconds``. The rollout group drops its workers (the
        prompts they hold but did not deliver are uncommitted: they move with the partitions after
        ``rebalance_s``, the session timeout), though each keeps generating what it holds, its groups
        waiting in its producer; a rebalance after the link is back, they rejoin."""
        cut, curator = self.cuts[region], self.curator
        members = [w for w in self.workers if w.spec.region == region and w.alive and w.index in curator.live]
        cut.start()
        for w in members:
            curator.leave(w, w.batch + list(w.queue.items))
        start = self.env.now
        yield self.env.timeout(seconds)
        cut.end()
        self.cut_times.setdefault(region, []).append([start, self.env.now])
        yield self.env.timeout(self.sc.rebalance_s)
        for w in members:
            if w.alive:
                curator.join(w)

    def run(self) -> dict:
        sc = self.sc
        for t, i in sc.preempt_at:
            self.env.timeout(t).callbacks.append(lambda _e, i=i: self.workers[i].preempt())
        if sc.preempt_per_worker_per_s > 0:
            self.env.process(self._preemptions())
        if sc.broker_polling:
            self.env.process(self._broker_polling())
        done = self.env.process(self.trainer.run())
        if math.isfinite(sc.max_time_s):
            done = simpy.AnyOf(self.env, [done, self.env.timeout(sc.max_time_s)])
        self.env.run(until=done)
        return self.results()

    def broker_load(self) -> float:
        """Cores the broker spends polling now: its log has grown with every prompt dispatched."""
        return self.sc.broker_growth_cores_per_prompt * self.curator.dispatched

    def through_broker(self, work_s: float, *deliveries) -> None:
        """Records produced: the broker does ``work_s`` of CPU for them, then each ``(hop, callback,
        *args)`` of ``deliveries`` reads them at its reader's next fetch (at once, the broker's work
        aside, unless ``broker_polling``: then the records wait for it)."""
        sc, env = self.sc, self.env
        done = self.pools[sc.broker_pool].run(work_s)

        def read(_e=None) -> None:
            for hop, callback, *args in deliveries:
                deliver(env, hop, callback, *args)

        if sc.broker_polling and not done.triggered:
            done.callbacks.append(read)
        else:
            read()

    def _broker_polling(self):
        sc = self.sc
        pool, period = self.pools[sc.broker_pool], sc.broker_poll_period_s
        while True:  # the readers fetch again when answered: a slow broker is polled less often
            start, n = self.env.now, sc.broker_threads
            work = (sc.broker_idle_cores + self.broker_load()) * period / n
            yield simpy.AllOf(self.env, [pool.run(work) for _ in range(n)])
            yield self.env.timeout(max(0.0, start + period - self.env.now))

    def dispatched(self) -> None:
        """A prompt went into the log: without ``broker_polling`` its growth adds to the background."""
        sc = self.sc
        if sc.broker_growth_cores_per_prompt > 0 and not sc.broker_polling:
            self.pools[sc.broker_pool].set_background(sc.background_cores.get(sc.broker_pool, 0.0) + self.broker_load())

    def _preemptions(self):
        rate = self.sc.preempt_per_worker_per_s * len(self.workers)
        while True:
            yield self.env.timeout(self.rng.expovariate(rate))
            self.rng.choice(self.workers).preempt()

    def results(self) -> dict:
        sc, rows = self.sc, self.trainer.rows
        measured = rows[sc.warmup_steps:] or rows
        wall = sum(r["step_wall_s"] for r in measured)
        lags = [lag for r in measured for lag in r["lags"]]
        stale, passed = self.trainer.dropped_stale, self.trainer.groups_trained
        return {
            "steps": len(rows),
            "time_per_version_s": wall / max(1, len(measured)),
            "trainer_wait_fraction": sum(r["wait_s"] for r in measured) / wall if wall else 0.0,
            "mean_staleness": sum(lags) / len(lags) if lags else 0.0,
            "staleness_counts": {str(k): lags.count(k) for k in sorted(set(lags))},
            "stale_dropped_fraction": stale / max(1, stale + passed),
            "groups_by_worker": [w.groups for w in self.workers],
            "prompts_per_batch": [w.groups / max(1, w.batches) for w in self.workers],
            # The share of steps that trained a group of each worker (``groups_by_worker`` in metrics.jsonl).
            "steps_with_worker": [sum(w.index in r["workers"] for r in measured) / max(1, len(measured))
                                  for w in self.workers],
            "cpu_busy_fraction": {n: p.busy_fraction() for n, p in self.pools.items()},
            "preemptions": sum(w.preemptions for w in self.workers),
            "max_in_flight": self.curator.max_in_flight,
            "step_times": [r["time"] for r in rows],
            "sim_time_s": self.env.now,
            "propagation": self.store.propagation(self.workers, measured),
            "wan_bytes_per_version": self.store.per_version(self.store.wan),
            "replica_bytes_per_version": self.store.per_version(self.store.replica),
            "replica_arrivals": self.store.arrivals,
            "duplicates": self.trainer.duplicates,
        }


class Store:
    """Published versions, their copies in each region, and the links they travel."""

    def __init__(self, sim: Sim) -> None:
        self.sim, env, sc = sim, sim.env, sim.sc
        self.published_at: dict[int, float] = {0: 0.0}
        self.latest = {name: 0 for name in sc.regions}
        self.arrived = {name: env.event() for name in sc.regions}  # fires at each arrival
        self.arrivals: dict[str, dict[int, float]] = {name: {} for name in sc.regions}  # version -> in the replica
        # The relay pays its round trips pass by pass (_relay); an object store's copy, one per version.
        self.wan = {n: Link(env, r.wan_bytes_per_s, 0.0 if r.replication == "relay" else r.rtt_s)
                    for n, r in sc.regions.items()}
        self.replica = {n: Link(env, r.replica_bytes_per_s, 2 * r.store_rtt_s, r.worker_bytes_per_s)
                        for n, r in sc.regions.items()}
        relays = [n for n, r in sc.regions.items() if r.replication == "relay"]
        # The relay hears of a version on the control topic, across its link (a held fetch, as a listener's).
        self.relay_hop = {n: sim.hop(n, sc.listener_period_s, reader_there=True) for n in relays}
        self.announced = {n: 0 for n in relays}
        self._wake = {n: env.event() for n in relays}
        for name in relays:
            env.process(self._relay(name))

    def version_bytes(self, version: int) -> float:
        sc = self.sim.sc
        if sc.full_weights:
            return sc.full_bytes
        return sc.full_bytes + sc.delta_bytes if version % sc.anchor_every == 0 else sc.delta_bytes

    def fetch_bytes(self, have: int, want: int) -> float:
        """The follower's cheapest path from ``have`` to ``want``: the delta chain or a full anchor."""
        sc = self.sim.sc
        return sc.full_bytes if sc.full_weights or have < 0 else min(sc.full_bytes, (want - have) * sc.delta_bytes)

    def publish(self, version: int) -> None:
        self.published_at[version] = self.sim.env.now
        for name in self.sim.sc.regions:
            if name in self.relay_hop:
                deliver(self.sim.env, self.relay_hop[name], self._announce, name, version)
            else:
                self.sim.env.process(self._replicate(name, version))

    def _replicate(self, region: str, version: int):
        r = self.sim.sc.regions[region]
        if r.replication_lag_s:
            yield self.sim.env.timeout(r.replication_lag_s)
        yield self.wan[region].transfer(self.version_bytes(version))
        self._arrive(region, [version])

    def _arrive(self, region: str, versions: list[int]) -> None:
        for v in versions:
            self.arrivals[region].setdefault(v, self.sim.env.now)
        if versions[-1] > self.latest[region]:
            self.latest[region] = versions[-1]
            event, self.arrived[region] = self.arrived[region], self.sim.env.event()
            event.succeed()

    def _announce(self, region: str, version: int) -> None:
        self.announced[region] = max(self.announced[region], version)
        if not self._wake[region].triggered:
            self._wake[region].succeed()

    def _relay(self, region: str):
        """``rlbus replica`` filling the region's replica (weightstore/replica.py), one pass at a time,
        each started by an announcement or, when none came for ``relay_poll_s``, by asking LATEST (a
        round trip). A pass reads the manifests it lacks (the newest ``RELAY_PREFETCH`` at once,
        ``copy_workers`` at a time, older ones one by one), then copies the chunks of its path,
        ``copy_workers`` at a time: one round trip a round of requests, the bytes at the link's rate;
        its versions are in when their chunks are. Then it checks the run descriptor (one more round
        trip) before the next pass. A pass that a cut hits fails, and the next starts once the link is
        back."""
        env, r, cut = self.sim.env, self.sim.sc.regions[region], self.sim.cuts.get(region)
        have = polled = 0
        while True:
            while max(self.announced[region], polled) <= have:
                wake = self._wake[region] = env.event()
                yield wake | env.timeout(r.relay_poll_s)
                if not wake.triggered and (cut is None or not cut.down):  # no announcement: it asks LATEST
                    yield env.timeout(r.rtt_s / 2)
                    polled = max(self.published_at)  # LATEST as the hub's store has it then
                    yield env.timeout(r.rtt_s / 2)
            if cut is not None and cut.down:
                yield cut.restored
            target, cuts = max(self.announced[region], polled), cut.count if cut is not None else 0
            start, lowest = self._relay_path(have, target)
            path = list(range(start, target + 1))
            prefetched = target - max(have + 1, target - RELAY_PREFETCH) + 1
            reads = (math.ceil(prefetched / r.copy_workers) if prefetched > 1 else prefetched) + \
                max(0, target - RELAY_PREFETCH - max(lowest, have + 1))
            chunks = sum(self._chunks(v) for v in path)
            yield env.timeout(r.rtt_s * (reads + math.ceil(chunks / r.copy_workers)))
            if cut is None or cut.count == cuts:
                yield self.wan[region].transfer(sum(self.version_bytes(v) for v in path))
            if cut is not None and cut.count != cuts:
                continue  # the link went down meanwhile: the pass failed
            self._arrive(region, path)
            have = target
            yield env.timeout(r.rtt_s)  # the run descriptor's conditional GET

    def _is_anchor(self, version: int) -> bool:
        return self.sim.sc.full_weights or version % self.sim.sc.anchor_every == 0

    def _chunks(self, version: int) -> int:
        """Objects of a version's chunks: a delta's, or an anchor's full weights and its companion patch."""
        sc = self.sim.sc
        delta = 0 if sc.full_weights else math.ceil(sc.delta_bytes / sc.chunk_bytes)
        return delta + (math.ceil(sc.full_bytes / sc.chunk_bytes) if self._is_anchor(version) else 0)

    def _relay_path(self, have: int, target: int) -> tuple[int, int]:
        """``weightstore.chain.walk_chain`` over the versions' sizes: the first version of the path the
        relay copies to reach ``target`` from ``have`` (the patches after ``have``, or the newest anchor
        and those after it when they cost fewer bytes), and the lowest manifest it reads."""
        sc = self.sim.sc
        anchor, from_ok, delta_cost, anchor_sum, lowest = None, not sc.full_weights, 0.0, 0.0, target
        for v in range(target, -1, -1):
            need_anchor, need_delta = anchor is None, from_ok and v > have
            if not (need_anchor or need_delta):
                break
            lowest = v
            if need_anchor:
                anchor_sum += sc.full_bytes if self._is_anchor(v) else sc.delta_bytes
                anchor = v if self._is_anchor(v) else None
            if need_delta:
                delta_cost += sc.delta_bytes  # a delta's payload, or an anchor's companion patch
                from_ok = not (anchor is not None and delta_cost > anchor_sum)
        return (have + 1 if from_ok else anchor), lowest

    def per_version(self, links: dict[str, Link]) -> dict[str, float]:
        """Bytes each region's links moved, per published version."""
        n = max(1, len(self.published_at) - 1)
        return {name: link.bytes_moved / n for name, link in links.items()}

    def propagation(self, workers: list[Worker], rows: list[dict]) -> dict:
        """Per region, the median over measured versions of the time from publication until 99% of
        the region's workers that lived through it had loaded it (or a newer one)."""
        out = {}
        versions = [r["version"] for r in rows][:-5]  # the last ones may not have spread yet
        for region in self.sim.sc.regions:
            members = [w for w in workers if w.spec.region == region]
            if not members or not versions:
                continue
            times = []
            for v in versions:
                t_pub = self.published_at.get(v)
                # Over the workers that lived through the publication and went on to load it (one preempted
                # before it loaded the version is not among them: its replacement starts from the newest
                # anchor and counts for later versions): an idle
                # worker follows nothing until it has work (refresh_before_generation).
                reach = [] if t_pub is None else sorted(
                    t for w in members if w.alive_since <= t_pub and math.isfinite(t := w.reached(v))
                    and not any(t_pub < x <= t for x in w.preempted_at))
                if not reach:
                    continue
                k = max(0, math.ceil(0.99 * len(reach)) - 1)
                times.append(reach[k] - t_pub)
            if times:
                times.sort()
                out[region] = {"p99_reach_s_median": times[len(times) // 2], "p99_reach_s_max": times[-1]}
        return out


class Trainer:
    def __init__(self, sim: Sim) -> None:
        self.sim, env = sim, sim.env
        self.intake = simpy.Store(env)
        self.queue = simpy.Resource(env, 1)  # the publication queue: one thread, in order
        self.version = self.consumed = self.groups_trained = self.dropped_stale = 0
        self.dropped_by_region: dict[str, int] = {}
        self.seen: set[int] = set()  # prompts whose group passed the stale gate: a later copy is a duplicate
        self.duplicates = 0
        self.rows: list[dict] = []
        self.hop = sim.hop("local", sim.sc.fetch_period_s)

    def arrive(self, group: Group) -> None:
        sc = self.sim.sc
        self.sim.pools[sc.trainer_pool].run(sc.intake_group_s, process=TRAINER_PROCESS)
        self.intake.put(group)

    def run(self):
        sc, env = self.sim.sc, self.sim.env
        pool = self.sim.pools[sc.trainer_pool]
        previous = env.event().succeed()
        while len(self.rows) < sc.steps:
            t0, lags, sources, trained = env.now, [], set(), []
            while len(lags) < sc.groups_per_step:
                # intake.next_batch(need): blocks until `need` groups arrived (or 1 s passed), then
                # the stale gate and the data stages; what they dropped is announced at once.
                batch = yield from self._next_batch(sc.groups_per_step - len(lags), timeout_s=1.0)
                dropped = 0
                for group in batch:
                    lag = self.version - group.min_version
                    if group.prompt.pid in self.seen:  # a group id (its prompt's) already taken: the intake's dedupe
                        self.duplicates += 1
                        dropped += 1
                    elif lag > sc.max_staleness:
                        self.dropped_stale += 1
                        region = self.sim.workers[group.worker].spec.region
                        self.dropped_by_region[region] = self.dropped_by_region.get(region, 0) + 1
                        dropped += 1
                    else:
                        self.seen.add(group.prompt.pid)
                        if self.sim.rng.random() < sc.informative_fraction:
                            lags.append(lag)
                            sources.add(group.worker)
                            trained.append(group)
                        else:
                            dropped += 1
                if dropped:
                    self.consumed += dropped
                    env.process(self._announce(self.version, self.consumed))
            t_train = env.now
            yield pool.run(sc.trainer_step_s, process=TRAINER_PROCESS)
            self.version += 1
            self.consumed += len(lags)
            self.groups_trained += len(lags)
            yield previous  # drain: at most one publication in flight
            self.rows.append({"version": self.version, "wait_s": t_train - t0, "step_wall_s": env.now - t0,
                              "lags": lags, "time": env.now, "workers": sources, "groups": trained,
                              "dropped_stale_by_region": dict(self.dropped_by_region)})
            previous = env.process(self._publish(self.version, self.consumed))
            self.sim.stepped(len(self.rows))

    def _next_batch(self, size: int, timeout_s: float):
        env, batch = self.sim.env, []
        deadline = env.now + timeout_s
        while len(batch) < size:
            if self.intake.items:
                batch.append(self.intake.items.pop(0))
                continue
            remaining = deadline - env.now
            if remaining <= 0:
                if batch:
                    break
                deadline = env.now + timeout_s  # nothing at all: ask again
                continue
            get = self.intake.get()
            outcome = yield get | env.timeout(remaining)
            if get in outcome:
                batch.append(outcome[get])
            else:
                get.cancel()
        return batch

    def _publish(self, version: int, consumed: int):
        sc, env = self.sim.sc, self.sim.env
        with self.queue.request() as turn:
            yield turn
            yield self.sim.pools[sc.trainer_pool].run(sc.publish_s, process=TRAINER_PROCESS)
            if sc.store_write_s:
                yield env.timeout(sc.store_write_s)
            self.sim.store.publish(version)
            self._send(version, consumed, workers=True)

    def _announce(self, version: int, consumed: int):
        with self.queue.request() as turn:  # queued behind a publication in flight
            yield turn
            self._send(version, consumed, workers=False)

    def _send(self, version: int, consumed: int, *, workers: bool) -> None:
        sim = self.sim
        deliver(sim.env, sim.curator.control_hop, sim.curator.on_control, version, consumed)
        if workers:
            for worker in sim.workers:
                deliver(sim.env, worker.listener_hop, worker.on_announcement, version)


class Curator:
    def __init__(self, sim: Sim) -> None:
        self.sim, sc = sim, sim.sc
        if sc.prompt_partitions < len(sc.workers):
            raise ValueError(f"{len(sc.workers)} workers share {sc.prompt_partitions} prompt partitions: "
                             "give each worker one at least (prompt_partitions)")
        self.window = (sc.max_staleness + 1) * sc.groups_per_step
        self.dispatched = self.consumed = self.version = self.max_in_flight = 0
        self.control_hop = sim.hop("local", sc.fetch_period_s)
        self.router = LeastDelayRouter(sc.prompt_partitions)
        # The rollout group's assignment: partition -> (worker, its incarnation), so that a replacement
        # gets partitions only at the next rebalance.
        self.owner: list[tuple[int, int] | None] = [None] * sc.prompt_partitions
        self.live: set[int] = set()
        self.rebalance_at = -math.inf
        self.held: list[Prompt] = []  # sent to a partition nobody owns: delivered at the next assignment
        self.inbox: list[Group] = []  # fetched by its feedback consumer, not yet read by its loop
        self._wake = sim.env.event()

    def start(self) -> None:
        self.live = {w.index for w in self.sim.workers}
        self._assign()
        self.sim.env.process(self.run())

    def _assign(self) -> None:
        """The rollout group's assignment over the live members (ordered by index): Kafka's range
        assignor (every partition may move), or cooperative-sticky (``sc.assignment``): members keep
        what they own up to their fair share, and only freed and surplus partitions move."""
        members, n = sorted(self.live), self.sim.sc.prompt_partitions
        me = {m: (m, self.sim.workers[m].preemptions) for m in members}
        quota = {m: n // len(members) + (k < n % len(members)) for k, m in enumerate(members)}  # the first get the rest
        if self.sim.sc.assignment == "range" or not members:
            self.owner, start = [None] * n, 0
            for member in members:
                self.owner[start:start + quota[member]] = [me[member]] * quota[member]
                start += quota[member]
        else:
            owned: dict[int, list[int]] = {m: [] for m in members}
            free = []
            for p, owner in enumerate(self.owner):
                if owner is not None and me.get(owner[0]) == owner and len(owned[owner[0]]) < quota[owner[0]]:
                    owned[owner[0]].append(p)
                else:
                    free.append(p)
            for m in members:
                while len(owned[m]) < quota[m]:
                    p = free.pop(0)
                    owned[m].append(p)
                    self.owner[p] = me[m]
        held, self.held = self.held, []
        self.deliver(held)

    def join(self, worker: Worker) -> None:
        """A replacement joins the group: it gets partitions at the rebalance under way, or now."""
        self.live.add(worker.index)
        if self.sim.env.now >= self.rebalance_at:
            self._assign()

    def leave(self, worker: Worker, lost: list[Prompt]) -> None:
        """A preempted worker: when the group notices (``rebalance_s``) its partitions move, and the
        prompts it had not finished go with them."""
        self.live.discard(worker.index)
        self.held += lost
        self.rebalance_at = self.sim.env.now + self.sim.sc.rebalance_s
        self.sim.env.timeout(self.sim.sc.rebalance_s).callbacks.append(lambda _e: self._assign())

    def send(self, prompts: list[Prompt]) -> None:
        now = self.sim.env.now
        for prompt in prompts:
            prompt.partition = self.router.choose(now)
            self.router.dispatched(str(prompt.pid), prompt.partition, now)
        self.deliver(prompts)

    def deliver(self, prompts: list[Prompt]) -> None:
        for prompt in prompts:
            owner = self.owner[prompt.partition]
            worker = self.sim.workers[owner[0]] if owner is not None else None
            if worker is None or not worker.alive or worker.preemptions != owner[1] or owner[0] not in self.live:
                self.held.append(prompt)  # its partition moves at the next rebalance
            else:
                self.sim.through_broker(self.sim.sc.broker_group_s / 2, (worker.prompt_hop, worker.receive, prompt))

    def returned(self, group: Group) -> None:
        """A group fetched by the curator's feedback consumer: the router learns of it only when the
        curator's loop next reads its feedback (``_feedback``)."""
        self.inbox.append(group)

    def _feedback(self) -> None:
        """What the feedback consumer has fetched, partition by partition (a fetch lists its records so,
        not in the order they were published): a worker's consecutive batches can reach the router
        interleaved."""
        fetched, self.inbox = sorted(self.inbox, key=lambda g: g.partition), []
        for group in fetched:
            self.router.returned(str(group.prompt.pid), str(group.worker), group.created_at, group.published_at,
                                 self.sim.env.now)

    def on_control(self, version: int, consumed: int) -> None:
        self.version, self.consumed = max(self.version, version), max(self.consumed, consumed)
        if not self._wake.triggered:
            self._wake.succeed()

    def run(self):
        sc = self.sim.sc
        pool = self.sim.pools[sc.curator_pool]
        pending: list[Prompt] = []
        first = 0.0
        while True:
            if self.window - (self.dispatched - self.consumed) > 0:
                # One prompt at a time, each produced when its stages and routing are done; the producer
                # sends what it holds once the first has waited ``linger_s``, and flushes when the window
                # is full, so a long burst reaches the workers in pieces.
                yield pool.run(sc.curator_prompt_s)
                if not pending:
                    first = self.sim.env.now
                pending.append(Prompt(self.dispatched, self.version))
                self.dispatched += 1
                self.sim.dispatched()
                self.max_in_flight = max(self.max_in_flight, self.dispatched - self.sim.trainer.consumed)
                if self.sim.env.now - first >= sc.linger_s:
                    self.send(pending)
                    pending = []
                continue
            if pending:
                self.send(pending)
                pending = []
            # control.poll(curator_poll_s): a control record (a version, a drop) wakes it, else the timeout
            yield self._wake | self.sim.env.timeout(sc.curator_poll_s)
            if self._wake.triggered:
                self._wake = self.sim.env.event()
            self._feedback()  # once per pass of its loop, before it dispatches


class Worker:
    def __init__(self, sim: Sim, index: int, spec: WorkerSpec) -> None:
        self.sim, self.index, self.spec = sim, index, spec
        sc = sim.sc
        self.prompt_hop = sim.hop(spec.region, sc.fetch_period_s, reader_there=True)
        self.listener_hop = sim.hop(spec.region, sc.listener_period_s, reader_there=True)
        self.back_hop = sim.hop(spec.region, sc.fetch_period_s)  # to the trainer and the curator's feedback
        self.queue = simpy.Store(sim.env)
        self.version, self.groups, self.batches = 0, 0, 0
        self.preempted_at: list[float] = []
        self.loads: list[tuple[float, int]] = [(0.0, 0)]  # (time, version loaded)
        self.alive, self.alive_since, self.generating, self.following = True, 0.0, False, False
        self.batch: list[Prompt] = []
        self._cpu: simpy.Event | None = None
        self._get: simpy.Event | None = None
        self.proc = sim.env.process(self.run())

    @property
    def preemptions(self) -> int:
        return len(self.preempted_at)

    @property
    def pool(self) -> CpuPool:
        return self.sim.pools[self.spec.pool]

    def receive(self, prompt: Prompt) -> None:
        if self.alive and self.index in self.sim.curator.live:
            self.queue.put(prompt)
        else:  # its partition is being moved (or it is out of the group, cut off): the prompt goes with it
            self.sim.curator.deliver([prompt])

    def reached(self, version: int) -> float:
        return next((t for t, v in self.loads if v >= version), math.inf)

    def _load(self, version: int):
        """Download the cheapest path to ``version`` from the region's replica, then apply it."""
        store = self.sim.store
        yield store.replica[self.spec.region].transfer(store.fetch_bytes(self.version, version))
        yield self.pool.run(self.sim.sc.follow_s, nice=self.spec.nice)
        if version > self.version:
            self.version = version
            self.loads.append((self.sim.env.now, version))

    def on_announcement(self, version: int) -> None:
        if self.alive and self.generating and version > self.version and not self.following:
            self.following = True  # the follower's lock: one load at a time, the newest each time
            self.sim.env.process(self._follow(version))

    def _follow(self, version: int):
        store, region = self.sim.store, self.spec.region
        try:
            while store.latest[region] < version:
                yield store.arrived[region]
            while self.alive and self.generating and store.latest[region] > self.version:
                yield from self._load(store.latest[region])
        finally:
            self.following = False

    def run(self):
        sc, env = self.sim.sc, self.sim.env
        while True:
            try:
                self._get = self.queue.get()
                first = yield self._get
                self._get = None
                self.batch = [first] + self.queue.items[: sc.max_prompts_per_poll - 1]
                del self.queue.items[: sc.max_prompts_per_poll - 1]
                store, region = self.sim.store, self.spec.region
                if store.latest[region] > self.version:  # refresh_before_generation
                    yield from self._load(store.latest[region])
                need = max(p.dispatch_version for p in self.batch) - sc.max_staleness
                while self.version < need:  # guard 2
                    if store.latest[region] < need:
                        yield store.arrived[region]
                    yield from self._load(store.latest[region])
                start, v0, n = env.now, self.version, len(self.batch)
                self.batches += 1
                self.generating = True
                work = sc.gen_batch_s + sc.gen_group_s * n
                self._cpu = self.pool.run(work if self.spec.throttled else work / self.spec.speed, nice=self.spec.nice)
                yield self._cpu
                self.generating = False
                if self.spec.throttled and self.spec.speed < 1.0:
                    yield env.timeout((env.now - start) * (1.0 / self.spec.speed - 1.0))
                ended = env.now
                self._cpu = self.pool.run(sc.worker_group_s * n, nice=self.spec.nice)
                yield self._cpu
                self._cpu = None
                done, self.batch = self.batch, []
                for prompt in done:
                    self._publish(Group(prompt, v0, self.index, start, ended,
                                        self.sim.rng.randrange(sc.trajectory_partitions)))
            except simpy.Interrupt:
                yield from self._preempted()

    def _publish(self, group: Group) -> None:
        sim = self.sim
        self.groups += 1
        # broker_group_s covers a prompt record and its group record: half each
        sim.through_broker(sim.sc.broker_group_s / 2, (self.back_hop, sim.trainer.arrive, group),
                           (self.back_hop, sim.curator.returned, group))

    def preempt(self) -> None:
        if self.alive:
            self.proc.interrupt()

    def _preempted(self):
        sim, env = self.sim, self.sim.env
        self.alive, self.generating = False, False
        self.preempted_at.append(env.now)
        if self._get is not None:
            self._get.cancel()
            self._get = None
        if self._cpu is not None and not self._cpu.triggered:
            self.pool.cancel(self._cpu)
        self._cpu = None
        lost = self.batch + list(self.queue.items)
        self.batch, self.queue.items[:] = [], []
        sim.curator.leave(self, lost)
        if sim.sc.replace_s:
            yield env.timeout(sim.sc.replace_s)
        self.version = -1  # a new machine: a full anchor first
        self.loads.append((env.now, -1))
        yield from self._load(sim.store.latest[self.spec.region])
        self.alive, self.alive_since = True, env.now
        sim.curator.join(self)
