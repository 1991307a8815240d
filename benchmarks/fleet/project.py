"""Projections: (a) the calibrated costs with each worker, the trainer and the services on machines of
their own; (b) fleets in four regions, preempted, moving a 7B-class model's weights, on stated assumptions
(``FleetAssumptions``)."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

from benchmarks.fleet.model import MIX, background_cores, base_scenario, predict
from benchmarks.fleet.sim import Region, Scenario, Sim, WorkerSpec

GBIT = 1e9 / 8


def dedicated_scenario(c: dict, eta: int, n: int, *, steps: int = 220, seed: int = 0) -> Scenario:
    """Projection (a): each worker on a one-core machine of its own; trainer and services apart."""
    workers = [WorkerSpec(MIX[i % 4], f"w{i}", nice=0) for i in range(n)]
    # The broker's idle polling grows with the readers (background_cores): the services machine is given
    # those cores on top of 4, so that it never limits.
    cores = {"trainer": 2.0, "services": 4.0 + background_cores(c, n), **{f"w{i}": 1.0 for i in range(n)}}
    # The embedded broker's growth with its log (broker_growth_cores_per_prompt) is left out: the services
    # machine's spare cores absorb it.
    return base_scenario(c, eta, workers, cores=cores, background_cores={"services": background_cores(c, n)},
                         prompt_partitions=max(32, n), broker_growth_cores_per_prompt=0.0, trainer_pool="trainer",
                         curator_pool="services", broker_pool="services", steps=steps, seed=seed)


def compare(sync: dict, asyn: dict) -> float:
    return round(sync["time_to_target_s"] / asyn["time_to_target_s"], 3)


def projection_a(c: dict, sizes=(4, 16, 64), steps: int = 220) -> list[dict]:
    out = []
    for n in sizes:
        sync, asyn = (predict(c, dedicated_scenario(c, eta, n, steps=steps)) for eta in (0, 4))
        out.append({"workers": n, "sync": _public(sync), "async": _public(asyn), "speedup_time_to_target": compare(sync, asyn)})
    return out


def _public(r: dict) -> dict:
    return {k: v for k, v in r.items() if not k.startswith("_") and k != "groups_by_worker"}


@dataclass(frozen=True)
class FleetAssumptions:
    """Projection (b). None of these is measured by rlbus: they are stated, and printed."""

    params: float = 7.6e9  # a 7B-class model (Qwen2.5-7B's 7.6B parameters)
    groups_per_step: int = 1024
    max_staleness: int = 4
    trainer_step_s: float = 60.0  # one optimizer step on its own cluster
    gen_batch_s: float = 120.0  # long reasoning rollouts on one GPU: the batch's longest sequence...
    gen_group_s: float = 10.0  # ...plus 10 s of decode throughput per group of 8 samples
    encode_gb_per_s: float = 0.59  # README, one core: publish cost per GB of weights
    apply_gb_per_s: float = 0.98  # README, one core: a worker's apply cost per GB
    regions: tuple = (("us", 0.10, 10.0), ("eu", 0.15, 5.0), ("ap", 0.20, 2.5), ("sa", 0.30, 1.0))  # (name, RTT s, Gbit/s)
    mirror_s: float = 1.0  # MirrorMaker 2 lag each way
    replication_lag_s: float = 5.0  # object-store replication lag before the copy starts
    replica_gbps: float = 100.0  # a regional replica bucket's aggregate bandwidth
    worker_gbps: float = 10.0  # a worker's NIC
    preempted_per_hour: float = 0.10
    replace_s: float = 300.0  # a new spot machine boots and starts its engine
    rebalance_s: float = 10.0
    hop_latency_s: float = 0.01  # Apache Kafka answers a fetch at once: linger + network
    steps: int = 30
    warmup_steps: int = 8


def fleet_scenario(c: dict, a: FleetAssumptions, n: int, *, eta: int | None = None, full_weights: bool = False,
                   preempt: bool = True, seed: int = 0) -> Scenario:
    regions = {"local": Region("local")}
    for name, rtt, gbps in a.regions:
        regions[name] = Region(name, rtt_s=rtt, wan_bytes_per_s=gbps * GBIT, mirror_s=a.mirror_s,
                               replication_lag_s=a.replication_lag_s, replica_bytes_per_s=a.replica_gbps * GBIT,
                               worker_bytes_per_s=a.worker_gbps * GBIT, store_rtt_s=0.01)
    names = [r[0] for r in a.regions]
    # Two "cores" per worker machine: its GPU generates, one host core applies deltas.
    workers = [WorkerSpec(MIX[i % 4], f"w{i}", region=names[(i // 4) % len(names)], nice=0, throttled=False)
               for i in range(n)]  # every region gets the whole speed mix
    full = a.params * c["full_bytes_per_param"]
    return Scenario(
        groups_per_step=a.groups_per_step, max_staleness=a.max_staleness if eta is None else eta, workers=workers,
        cores={"trainer": 2.0, "services": 16.0, **{f"w{i}": 2.0 for i in range(n)}},
        trainer_step_s=a.trainer_step_s, publish_s=full / 1e9 / a.encode_gb_per_s,
        gen_batch_s=a.gen_batch_s, gen_group_s=a.gen_group_s, informative_fraction=c["informative_fraction"],
        follow_s=full / 1e9 / a.apply_gb_per_s, trainer_pool="trainer", curator_pool="services",
        broker_pool="services", max_prompts_per_poll=c["max_prompts_per_poll"], hop_latency_s=a.hop_latency_s,
        prompt_partitions=max(32, n),  # kafka.prompt_partitions: one per worker at least
        assignment="sticky",  # infra/: Apache Kafka with cooperative-sticky assignment
        regions=regions, delta_bytes=a.params * c["delta_bytes_per_param"], full_bytes=full,
        anchor_every=c["anchor_every"], full_weights=full_weights, rebalance_s=a.rebalance_s, replace_s=a.replace_s,
        preempt_per_worker_per_s=a.preempted_per_hour / 3600 if preempt else 0.0,
        steps=a.steps, warmup_steps=a.warmup_steps, seed=seed, max_time_s=a.steps * 20 * a.trainer_step_s)


def _fleet_row(sc: Scenario, r: dict) -> dict:
    per_region = {}
    for name, region in sc.regions.items():
        if name == "local":
            continue
        prop = r["propagation"].get(name, {})
        per_region[name] = {"wan_gb_per_version": round(r["wan_bytes_per_version"][name] / 1e9, 3),
                            "to_workers_gb_per_version": round(r["replica_bytes_per_version"][name] / 1e9, 2),
                            "p99_reach_s": None if not prop else round(prop["p99_reach_s_median"], 1),
                            "p99_reach_s_max": None if not prop else round(prop["p99_reach_s_max"], 1)}
    amortized = sc.full_bytes if sc.full_weights else sc.delta_bytes + sc.full_bytes / sc.anchor_every
    return {"workers": len(sc.workers), "full_weights": sc.full_weights, "eta": sc.max_staleness,
            "wan_gb_per_version_with_anchors": round(amortized / 1e9, 3),
            "steps": r["steps"], "time_per_version_s": round(r["time_per_version_s"], 1),
            "trainer_wait_fraction": round(r["trainer_wait_fraction"], 3), "mean_staleness": round(r["mean_staleness"], 2),
            "stale_dropped_fraction": round(r["stale_dropped_fraction"], 4), "preemptions": r["preemptions"],
            "regions": per_region}


def projection_b(c: dict, a: FleetAssumptions, sizes=(125, 250, 500, 1000, 2000)) -> dict:
    def one(n: int, **kw) -> dict:
        sc = fleet_scenario(c, a, n, **kw)
        row = _fleet_row(sc, Sim(sc).run())
        print(f"[fleet] {n} workers {kw}: wait {row['trainer_wait_fraction']:.2f}, "
              f"{row['time_per_version_s']:.0f} s/version", file=sys.stderr, flush=True)
        return row

    return {"assumptions": dataclasses.asdict(a) | {"delta_bytes": a.params * c["delta_bytes_per_param"],
                                                    "full_bytes": a.params * c["full_bytes_per_param"],
                                                    "informative_fraction": c["informative_fraction"]},
            "by_fleet_size": [one(n) for n in sizes],
            "full_weights_1000": one(1000, full_weights=True),
            "sync_1000": one(1000, eta=0)}
