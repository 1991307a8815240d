"""The curator's partition router, driven by feedback shaped as workers produce it."""

from __future__ import annotations

from collections import Counter

import pytest

from consumers.routing import KeyHashRouter, LeastDelayRouter, RoutingConfig, build_router


class Fleet:
    """Workers owning fixed partitions, each serving its backlog in batches at its own speed."""

    def __init__(self, router: LeastDelayRouter, owners: dict[int, str], seconds_per_group: dict[str, float]):
        self.router, self.owners, self.spg = router, owners, seconds_per_group
        self.queues: dict[str, list[str]] = {w: [] for w in seconds_per_group}
        self.busy_until = dict.fromkeys(seconds_per_group, 0.0)
        self.now, self.n = 0.0, 0

    def dispatch(self, count: int) -> Counter:
        got: Counter = Counter()
        for _ in range(count):
            p = self.router.choose(self.now)
            prompt_id = f"p{self.n}"
            self.n += 1
            self.router.dispatched(prompt_id, p, self.now)
            self.queues[self.owners[p]].append(prompt_id)
            got[self.owners[p]] += 1
        return got

    def serve_until(self, t: float, batch: int = 16) -> None:
        """Each worker takes up to ``batch`` prompts whenever idle; feedback arrives at batch end."""
        waiting = set(self.queues)
        while True:
            candidates = [(max(self.busy_until[w], self.now), w) for w in waiting if self.queues[w]]
            if not candidates:
                break
            start, worker = min(candidates)
            taken = self.queues[worker][:batch]
            end = start + self.spg[worker] * len(taken)
            if end > t:  # this worker's next batch is not done by t
                waiting.discard(worker)
                continue
            self.queues[worker] = self.queues[worker][batch:]
            self.busy_until[worker] = end
            for prompt_id in taken:
                self.router.returned(prompt_id, worker, created_at=start, published_at=end, now=end)
        self.now = t


def _fleet(partitions: int = 8) -> Fleet:
    owners = {p: ["fast-a", "fast-b", "half", "quarter"][p % 4] for p in range(partitions)}
    speeds = {"fast-a": 0.01, "fast-b": 0.01, "half": 0.02, "quarter": 0.04}
    return Fleet(LeastDelayRouter(partitions), owners, speeds)


def test_unknown_partitions_are_probed_evenly() -> None:
    fleet = _fleet()
    got = fleet.dispatch(8)
    assert got == Counter({"fast-a": 2, "fast-b": 2, "half": 2, "quarter": 2})


def test_prompts_follow_measured_speed() -> None:
    fleet = _fleet()
    for step in range(30):  # warm up the estimates with synchronous-style rounds
        fleet.dispatch(32)
        fleet.serve_until(fleet.now + 5.0)
    got = fleet.dispatch(55)
    # speeds 1 : 1 : 0.5 : 0.25 -> shares 20 : 20 : 10 : 5 of 55
    assert got["fast-a"] + got["fast-b"] >= 36
    assert got["quarter"] <= 8
    assert got["half"] > got["quarter"]
    assert fleet.router.report()["worker/quarter/rate"] == pytest.approx(25.0, rel=0.05)


def test_balanced_fleet_is_spread_evenly() -> None:
    owners = {p: f"w{p % 4}" for p in range(8)}
    fleet = Fleet(LeastDelayRouter(8), owners, {f"w{i}": 0.01 for i in range(4)})
    for _ in range(10):
        fleet.dispatch(32)
        fleet.serve_until(fleet.now + 5.0)
    got = fleet.dispatch(40)
    assert set(got.values()) == {10}


def test_silent_worker_stops_receiving_and_is_probed_again_later() -> None:
    cfg = RoutingConfig(suspect_after_s=10.0, suspect_batches=4.0)
    router = LeastDelayRouter(4, cfg)
    owners = {0: "a", 1: "b", 2: "c", 3: "dead"}
    fleet = Fleet(router, owners, {"a": 0.01, "b": 0.01, "c": 0.01, "dead": 0.01})
    fleet.dispatch(8)
    fleet.serve_until(1.0)
    fleet.spg["dead"] = 1e9  # the worker stops answering with prompts outstanding
    fleet.dispatch(8)
    fleet.serve_until(12.0)
    assert router.report()["worker/dead/outstanding"] > 0
    got = fleet.dispatch(30)
    assert got["dead"] == 0
    fleet.serve_until(25.0)  # silent for twice its patience: forgotten, its partition is probed again
    got = fleet.dispatch(12)
    assert "worker/dead/rate" not in router.report()
    assert router.owner[3] is None
    assert got["dead"] >= 1


def test_restart_feedback_for_unknown_prompts_only_teaches_speed() -> None:
    router = LeastDelayRouter(2)
    router.returned("p-before-restart", "w", created_at=0.0, published_at=0.5, now=1.0)
    assert router.outstanding == [0, 0]
    assert router.report()["worker/w/rate"] == pytest.approx(2.0)


def test_key_hash_router_leaves_partitioning_to_the_producer() -> None:
    router = build_router(RoutingConfig(type="key_hash"), 8)
    assert isinstance(router, KeyHashRouter)
    assert router.choose(0.0) is None
    assert isinstance(build_router(RoutingConfig(), 8), LeastDelayRouter)


def test_router_needs_a_partition() -> None:
    with pytest.raises(ValueError, match="partition"):
        LeastDelayRouter(0)


def test_the_report_counts_the_batches_a_worker_was_measured_on() -> None:
    router = LeastDelayRouter(2)
    for prompt, created, published in (("a", 0.0, 0.5), ("b", 0.0, 0.6), ("c", 1.0, 1.2), ("d", 2.0, 2.1)):
        router.returned(prompt, "w", created_at=created, published_at=published, now=published)
    # Batches of two and one groups are closed by the next batch's first group; the last one is open.
    assert router.report()["worker/w/batches"] == 2.0
    assert router.report()["worker/w/served"] == 4.0
