"""The fleet model's shared resources (``benchmarks.fleet.sim`` uses them): CPU pools and network paths.

* **CPU**: each machine (``CpuPool``) shares its cores by weighted processor sharing, as Linux CFS
  does (a nice-10 worker weighs 110 against 1024), each job on one thread (at most one core);
  jobs of one Python ``process`` share its interpreter lock (together at most one core);
  ``background_cores`` are taken off the top; ``contention`` slows every job while more than
  one core is busy; ``busy_share`` caps each thread at that share of a core while the cores are
  all taken (Linux's per-core run queues).
* **Network**: a ``Link`` pays its round trip per transfer, then shares its bandwidth equally
  among the transfers in flight (each capped at the receiver's NIC); a ``Hop`` delivers a record
  at the reader's next fetch return after the hop's latency; a ``Cut`` stops a hop's records while
  its link is cut (sent then, they leave when it comes back; in flight, they arrive then).
"""

from __future__ import annotations

import heapq
import math
import random

import simpy

CFS_WEIGHT = {0: 1024.0, 10: 110.0}
"""Linux CFS load weight by nice level (kernel/sched/core.c sched_prio_to_weight)."""


def _water_fill(entities: list[tuple[list, float]], capacity: float, cap: float) -> tuple[dict[int, float], bool]:
    """Cores per entity: shares proportional to weight, at most ``cap`` each; and whether the
    cores ran out (some entity got less than ``cap``)."""
    rate: dict[int, float] = {}
    left, pending = capacity, entities
    while pending:
        total = sum(weight for _, weight in pending)
        capped = {id(e) for e in pending if left * e[1] / total >= cap}
        if not capped:
            rate.update((id(e), left * e[1] / total) for e in pending)
            return rate, True
        rate.update((i, cap) for i in capped)
        left -= cap * len(capped)
        pending = [e for e in pending if id(e) not in capped]
    return rate, False


class CpuPool:
    """Cores shared by weighted processor sharing; each job runs on one thread (≤ 1 core)."""

    def __init__(self, env: simpy.Environment, cores: float, background_cores: float = 0.0,
                 contention: float = 0.0, busy_share: float = 1.0) -> None:
        if background_cores >= cores:
            raise ValueError(f"background load {background_cores} cores leaves nothing of {cores}")
        self.env, self.cores, self.capacity = env, cores, cores - background_cores
        self.background, self.contention, self.busy_share = background_cores, contention, busy_share
        self.jobs: list[list] = []  # [remaining s, weight, event, rate]
        self._last, self._token, self.busy_core_s, self.free_core_s = env.now, 0, 0.0, 0.0

    def set_background(self, cores: float) -> None:
        """A background load that changes over the run (the embedded broker's, growing with its log)."""
        if cores >= self.cores:
            raise ValueError(f"background load {cores} cores leaves nothing of {self.cores}")
        self._advance()
        self.background, self.capacity = cores, self.cores - cores
        self._schedule()

    def busy_fraction(self) -> float:
        """The share of the free cores (after the background) the jobs have used so far."""
        self._advance()
        return self.busy_core_s / self.free_core_s if self.free_core_s else 0.0

    def run(self, work_s: float, *, nice: int = 0, process: str | None = None) -> simpy.Event:
        """An event that fires when ``work_s`` CPU-seconds have been served. Jobs of one ``process``
        are threads of one Python process: they share its interpreter lock, so together they get at
        most one core (and the weight of one thread), split equally among them."""
        event = self.env.event()
        if work_s <= 0:
            return event.succeed()
        self._advance()
        self.jobs.append([work_s, CFS_WEIGHT[nice], event, 0.0, process])
        self._schedule()
        return event

    def cancel(self, event: simpy.Event) -> None:
        self._advance()
        self.jobs = [j for j in self.jobs if j[2] is not event]
        self._schedule()

    def _advance(self) -> None:
        dt = self.env.now - self._last
        if dt > 0:
            self.free_core_s += self.capacity * dt
            for job in self.jobs:
                job[0] -= job[3] * dt
                self.busy_core_s += job[3] * dt
        self._last = self.env.now

    def _schedule(self) -> None:
        self._token += 1
        for job in [j for j in self.jobs if j[0] <= 1e-9]:  # a nanosecond: below float time's resolution
            job[2].succeed()
        self.jobs = [j for j in self.jobs if j[0] > 1e-9]
        if not self.jobs:
            return
        runnable: dict[object, list[list]] = {}  # one entry per thread, or per process's lock
        for job in self.jobs:
            runnable.setdefault(id(job) if job[4] is None else job[4], []).append(job)
        entities = [(members, max(m[1] for m in members)) for members in runnable.values()]
        rate, saturated = _water_fill(entities, self.capacity, 1.0)
        if saturated and self.busy_share < 1.0:
            rate, _ = _water_fill(entities, self.capacity, self.busy_share)
        for entity in entities:
            for job in entity[0]:
                job[3] = rate[id(entity)] / len(entity[0])
        busy = self.background + sum(j[3] for j in self.jobs)
        if self.contention and busy > 1.0:
            slower = 1.0 / (1.0 + self.contention * (busy - 1.0))
            for job in self.jobs:
                job[3] *= slower
        token = self._token
        due = min(j[0] / j[3] for j in self.jobs)
        self.env.timeout(due).callbacks.append(lambda _e: self._wake(token))

    def _wake(self, token: int) -> None:
        if token == self._token:
            self._advance()
            self._schedule()


class Link:
    """A network path: a transfer pays ``rtt_s`` (requests), then shares ``bytes_per_s`` equally
    with the transfers in flight, each at most ``per_transfer_bytes_per_s``."""

    def __init__(self, env: simpy.Environment, bytes_per_s: float, rtt_s: float = 0.0,
                 per_transfer_bytes_per_s: float = math.inf) -> None:
        self.env, self.bandwidth, self.rtt_s, self.cap = env, bytes_per_s, rtt_s, per_transfer_bytes_per_s
        self._heap: list[tuple[float, int, simpy.Event]] = []  # (finish in virtual bytes, seq, event)
        self._virtual, self._last, self._seq, self._token = 0.0, env.now, 0, 0
        self.bytes_moved = 0.0

    def _rate(self) -> float:
        n = len(self._heap)
        return min(self.cap, self.bandwidth / n) if n else 0.0

    def transfer(self, nbytes: float) -> simpy.Event:
        event = self.env.event()
        self.bytes_moved += nbytes
        self.env.timeout(self.rtt_s).callbacks.append(lambda _e: self._start(nbytes, event))
        return event

    def _start(self, nbytes: float, event: simpy.Event) -> None:
        if nbytes <= 0 or math.isinf(self.bandwidth) and math.isinf(self.cap):
            event.succeed()
            return
        self._advance()
        self._seq += 1
        heapq.heappush(self._heap, (self._virtual + nbytes, self._seq, event))
        self._schedule()

    def _advance(self) -> None:
        self._virtual += self._rate() * (self.env.now - self._last)
        self._last = self.env.now

    def _schedule(self) -> None:
        self._token += 1
        # Done when less than a nanosecond of transfer is left (float time cannot resolve less).
        while self._heap and (self._heap[0][0] - self._virtual) <= self._rate() * 1e-9 + 1e-6:
            heapq.heappop(self._heap)[2].succeed()
        if self._heap:
            token = self._token
            self.env.timeout((self._heap[0][0] - self._virtual) / self._rate()).callbacks.append(
                lambda _e: self._wake(token))

    def _wake(self, token: int) -> None:
        if token == self._token:
            self._advance()
            self._schedule()


class Cut:
    """Whether a region's link is cut: while ``down`` nothing crosses it; ``restored`` fires when it
    comes back; ``count`` (cuts so far) tells a transfer whether one hit it meanwhile."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env, self.down, self.count, self.restored = env, False, 0, env.event()

    def start(self) -> None:
        self.down, self.count = True, self.count + 1

    def end(self) -> None:
        self.down = False
        restored, self.restored = self.restored, self.env.event()
        restored.succeed()


class Hop:
    """One Kafka reader: a record produced at t is read at its first fetch return after
    t + ``latency_s``; fetches are held ``period_s`` each (0: answered at once). Across a link that
    can be ``cut``, records wait for it (``deliver``)."""

    def __init__(self, latency_s: float, period_s: float, rng: random.Random, cut: Cut | None = None) -> None:
        self.latency_s, self.period_s, self.cut = latency_s, period_s, cut
        self.phase = rng.uniform(0.0, period_s) if period_s > 0 else 0.0

    def delay(self, now: float) -> float:
        t = now + self.latency_s
        if self.period_s > 0:
            t = self.phase + math.ceil((t - self.phase) / self.period_s - 1e-12) * self.period_s
        return t - now


def deliver(env: simpy.Environment, hop: Hop, callback, *args) -> None:
    cut = hop.cut
    if cut is None:
        env.timeout(hop.delay(env.now)).callbacks.append(lambda _e: callback(*args))
    elif cut.down:  # produced while the link is cut: it crosses once the link is back
        cut.restored.callbacks.append(lambda _e: deliver(env, hop, callback, *args))
    else:
        def arrive(_e) -> None:
            if cut.down:  # in flight as the link went down: delivered when it comes back, as TCP does
                cut.restored.callbacks.append(lambda _e: callback(*args))
            else:
                callback(*args)

        env.timeout(hop.delay(env.now)).callbacks.append(arrive)
