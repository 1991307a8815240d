"""Regions in the fleet model (benchmarks.fleet.sim): the relay's copies and a cut link."""

from __future__ import annotations

import pytest

from benchmarks.fleet.sim import RELAY_PREFETCH, Region, Scenario, Sim, WorkerSpec

DELTA, FULL, RTT, RATE = 1_000.0, 20_000.0, 0.2, 100_000.0
CUT_AT, CUT_S = 10, 30.0


def two_regions(*, cut: bool) -> Scenario:
    """A hub worker and one worker in each of two regions behind relayed links, each on its own
    machine; the far region's link is cut at step ``CUT_AT`` for ``CUT_S``."""
    regions = {"local": Region("local"),
               "near": Region("near", rtt_s=RTT, wan_bytes_per_s=RATE, reads_across=True, replication="relay"),
               "far": Region("far", rtt_s=RTT, wan_bytes_per_s=RATE, reads_across=True, replication="relay",
                             cuts=[(CUT_AT, CUT_S)] if cut else [])}
    workers = [WorkerSpec(1.0, f"w{i}", region=r, nice=0) for i, r in enumerate(regions)]
    return Scenario(groups_per_step=4, max_staleness=2, workers=workers,
                    cores={"trainer": 2.0, **{f"w{i}": 1.0 for i in range(3)}}, trainer_pool="trainer",
                    curator_pool="trainer", broker_pool="trainer", trainer_step_s=0.3, publish_s=0.1,
                    gen_batch_s=0.2, gen_group_s=0.05, max_prompts_per_poll=4, delta_bytes=DELTA, full_bytes=FULL,
                    anchor_every=10, regions=regions, rebalance_s=2.0, steps=120, warmup_steps=0, max_time_s=1000.0)


def test_a_cut_link_stops_the_regions_groups_and_copies_and_the_replica_catches_up_from_an_anchor():
    sim = Sim(two_regions(cut=True))
    reached_trainer = []
    arrive = sim.trainer.arrive
    sim.trainer.arrive = lambda g: (reached_trainer.append((sim.env.now, sim.workers[g.worker].spec.region)), arrive(g))
    sim.run()
    (start, end), = sim.cut_times["far"]
    assert end - start == pytest.approx(CUT_S)
    store = sim.store
    far = store.arrivals["far"]
    # Nothing crosses the cut link: no version reaches the far replica, no far group the trainer.
    assert not [v for v, t in far.items() if start < t < end]
    assert not [t for t, region in reached_trainer if region == "far" and start < t < end]
    assert [t for t, region in reached_trainer if region == "near" and start < t < end]  # the other region goes on
    # After it the replica catches up in one pass from the newest anchor (after ending the pass the cut
    # broke, if one was under way), skipping the deltas it missed.
    at_restore = max(v for v, t in store.published_at.items() if t <= end)
    caught_at = far[at_restore]
    caught_up = sorted(v for v, t in far.items() if t == caught_at)
    before = max(v for v, t in far.items() if t < caught_at)
    assert caught_up[0] % 10 == 0 and caught_up[0] > before + 1 and before <= CUT_AT
    assert caught_at - end < 10.0
    assert store.latest["far"] >= max(store.published_at) - 2  # and follows again to the end
    # Its worker is back in the group and trained from again.
    assert any(sim.workers[g.worker].spec.region == "far" for r in sim.trainer.rows if r["time"] > caught_at
               for g in r["groups"])


def test_a_version_crosses_each_link_once_after_the_relays_round_trips():
    sim = Sim(two_regions(cut=False))
    sim.run()
    store = sim.store
    for name in ("near", "far"):
        arrived = [v for v in store.arrivals[name] if v > 0]
        assert arrived == list(range(1, max(arrived) + 1))  # every version, in order
        # One copy: the link moved each version's bytes once (a delta; an anchor's full weights and patch).
        assert store.wan[name].bytes_moved == pytest.approx(sum(store.version_bytes(v) for v in arrived))
        # A version is in after the announcement (half a round trip) and the pass's manifest and chunk
        # round trips, its bytes at the link's rate: not the bytes alone.
        for v in arrived:
            lag = store.arrivals[name][v] - store.published_at[v]
            assert lag >= RTT / 2 + 2 * RTT + store.version_bytes(v) / RATE - 1e-9


def test_the_relay_reads_as_many_manifests_at_once_as_weightstore_does():
    from weightstore.replica import MAX_PREFETCH

    assert RELAY_PREFETCH == MAX_PREFETCH


def test_a_simulated_run_reads_back_as_the_regions_benchmark_reads_a_measured_one(tmp_path):
    from benchmarks.fleet_regions import compare, settle, write_run
    from benchmarks.regions import by_region

    sim = Sim(two_regions(cut=True))
    sim.run()
    settle(sim)  # the last version published and in both replicas, as the run ends
    write_run(sim, {"startup_s": 5.0, "startup_wait_s": 4.0, "tokens_per_group": 10.0}, tmp_path)
    figures = by_region(tmp_path, "far")
    assert figures["regions"] == ["far", "hub", "near"]
    assert figures["cut_s"] == pytest.approx(CUT_S, abs=0.1)
    assert figures["catch_up_s"] is not None and figures["replica_catch_up_s"] is not None
    # One copy of each version, version 0's full weights (copied in the start-up) included.
    assert figures["copies_per_version_by_region"]["near"] == pytest.approx(1.0, abs=0.02)
    assert figures["copies_per_version_by_region"]["far"] < 0.9  # the deltas the cut skipped never crossed
    doubled = figures | {"catch_up_s": 2 * figures["catch_up_s"]}
    rows = {(r["figure"], r["region"]): r for r in compare(figures, doubled)}
    assert rows[("catch_up_s", None)]["error"] == pytest.approx(0.5)
    assert rows[("replica_lag_p50_s", "near")]["error"] == 0


def test_the_inputs_are_read_from_the_run_directory_with_cumulative_counters_and_the_new_processes_cpu(tmp_path):
    import json

    from benchmarks.fleet_regions import run_inputs

    regions = [{"name": "far", "workers": 2, "replica": {"copy_workers": 3, "poll_interval_s": 0.5}}]
    config = {"local": {"workers": 1, "worker_nice": 10, "regions": regions}, "trainer": {"groups_per_step": 4},
              "run": {"max_staleness": 2}, "weights": {"anchor_every": 10, "chunk_bytes": 1024}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    # groups_trained and the stage's drops are counts since the start of the run; tokens and groups per step.
    rows = [{"publish_kind": "delta", "publish_bytes": 100, "publish_full_bytes": 5000, "tokens": 40, "groups": 4,
             "groups_trained": 4, "stage/dynamic_sampling/dropped": 2, "step_wall_s": 9.0, "wait_s": 8.0},
            {"publish_kind": "anchor", "publish_bytes": 5100, "publish_full_bytes": 5000, "tokens": 60, "groups": 4,
             "groups_trained": 8, "stage/dynamic_sampling/dropped": 4, "step_wall_s": 1.0, "wait_s": 0.5},
            {"publish_kind": "delta", "publish_bytes": 300, "publish_full_bytes": 5000, "tokens": 20, "groups": 4,
             "groups_trained": 12, "stage/dynamic_sampling/dropped": 8, "step_wall_s": 1.0, "wait_s": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cpu = [{"time": 0.0, "cpu_s": {"trainer": 1.0, "link-far": 0.0, "replica-far": 1.0, "broker": 5.0}},
           {"time": 10.0, "cpu_s": {"trainer": 4.0, "link-far": 1.0, "replica-far": 2.0, "broker": 50.0}}]
    (tmp_path / "cpu.jsonl").write_text("".join(json.dumps(r) + "\n" for r in cpu))
    inputs = run_inputs(tmp_path)
    assert inputs["delta_bytes"] == 200  # the deltas' mean; the anchor is not a delta
    assert inputs["full_bytes"] == 5000 and inputs["tokens_per_group"] == 10
    assert inputs["informative_fraction"] == pytest.approx(12 / 20)
    assert inputs["startup_s"] == 9.0 and inputs["startup_wait_s"] == 8.0
    assert inputs["extra_cores"] == pytest.approx(0.2)  # the link's and the relay's, not the broker's
    assert inputs["trainer_cpu_s_per_version"] == pytest.approx(1.0)
    assert inputs["region_workers"] == {"far": 2} and inputs["copy_workers"] == {"far": 3}
