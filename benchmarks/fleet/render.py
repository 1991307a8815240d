"""The calibration and the projections as markdown tables and figures."""

from __future__ import annotations

import statistics
from pathlib import Path


def markdown(cal: dict, pa: list[dict], pb: dict) -> str:
    lines = ["| setting | predicted | measured | error |", "|---|---|---|---|",
             f"| 2 cores, speed-up to target | {cal['predicted_speedup_time_to_target']:.2f}× | "
             f"{cal['target_speedup_time_to_target']['median']:.2f}× (runs {', '.join(map(str, cal['target_speedup_time_to_target']['runs']))}) | "
             f"{cal['calibration_speedup_error']:.0%} |",
             f"| 2 cores, async trainer wait | {cal['predicted_async_trainer_wait_fraction']:.0%} | "
             f"{cal['target_async_trainer_wait_fraction']['median']:.1%} | {cal['calibration_wait_error']:.0%} |", "",
             "| workers, own machines | sync s/version | async s/version | async wait | async staleness | "
             "sync / async time to target |", "|---|---|---|---|---|---|"]
    for row in pa:
        lines.append(f"| {row['workers']} | {row['sync']['time_per_version_s']:.3f} | {row['async']['time_per_version_s']:.3f} "
                     f"| {row['async']['trainer_wait_fraction']:.0%} | {row['async']['mean_staleness']:.2f}"
                     f"{'*' if row['async']['staleness_extrapolated'] else ''} | "
                     f"{row['sync']['time_to_target_s']:.0f} s / {row['async']['time_to_target_s']:.0f} s = "
                     f"{row['speedup_time_to_target']:.2f}× |")
    names = [r[0] for r in pb["assumptions"]["regions"]]
    lines += ["", "| workers (4 regions) | weights | s/version | trainer wait | mean staleness | GB per version "
              "over each region's WAN (anchors amortized) | GB per version, replica to a region's workers (mean) | "
              f"s to 99% of workers ({', '.join(names)}) |", "|---|---|---|---|---|---|---|---|"]
    for row in [*pb["by_fleet_size"], pb["full_weights_1000"], pb["sync_1000"]]:
        kind = ("full" if row["full_weights"] else "deltas") + (", sync (η = 0)" if row["eta"] == 0 else "")
        regions = row["regions"].values()
        reach = " / ".join("—" if g["p99_reach_s"] is None else f"{g['p99_reach_s']:.0f}" for g in regions)
        to_workers = statistics.fmean(g["to_workers_gb_per_version"] for g in regions)
        lines.append(f"| {row['workers']} | {kind} | {row['time_per_version_s']:.0f} | {row['trainer_wait_fraction']:.0%} "
                     f"| {row['mean_staleness']:.2f} | {row['wan_gb_per_version_with_anchors']:.2f} | {to_workers:.0f} "
                     f"| {reach} |")
    return "\n".join(lines)


def plots(cal: dict, pa: list[dict], pb: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    n = [r["workers"] for r in pa]
    ax1.plot(n, [r["sync"]["time_to_target_s"] for r in pa], "o-", label="synchronous (η = 0)")
    ax1.plot(n, [r["async"]["time_to_target_s"] for r in pa], "o-", label="asynchronous (η = 4)")
    ax1.axhline(cal["predicted"]["async"]["time_to_target_s"], ls=":", c="grey", label="async, 4 workers on 2 shared cores")
    ax1.set(xscale="log", xlabel="workers, each on its own machine", ylabel="predicted time to target (s)",
            title="(a) the default task, own machines")
    ax1.set_xticks(n, [str(x) for x in n])
    ax1.minorticks_off()
    ax1.legend()
    rows = pb["by_fleet_size"]
    ax2.plot([r["workers"] for r in rows], [r["trainer_wait_fraction"] for r in rows], "o-")
    ax2.set(xscale="log", xlabel="workers (4 regions, 10%/h preempted)", ylabel="trainer wait fraction",
            title=f"(b) {pb['assumptions']['params'] / 1e9:.1f}B model, B = {pb['assumptions']['groups_per_step']}, η = 4")
    ax2.set_xticks([r["workers"] for r in rows], [str(r["workers"]) for r in rows])
    ax2.minorticks_off()
    fig.tight_layout()
    first = out / "fleet_time_to_target_and_wait.png"
    fig.savefig(first, dpi=110)
    plt.close(fig)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    delta, full = pb["by_fleet_size"][[r["workers"] for r in rows].index(1000)], pb["full_weights_1000"]
    names = list(delta["regions"])
    x = range(len(names))
    for shift, row, label in ((-0.2, delta, "deltas"), (0.2, full, "full weights")):
        ax1.bar([i + shift - 0.1 for i in x], [row["wan_gb_per_version_with_anchors"]] * len(names), 0.2,
                label=f"{label}: over the WAN (anchors amortized)")
        ax1.bar([i + shift + 0.1 for i in x], [row["regions"][r]["to_workers_gb_per_version"] for r in names], 0.2,
                label=f"{label}: replica to the region's workers", alpha=0.6)
    ax1.set(yscale="log", ylabel="GB per version", title="weight bytes per region per step, 1,000 workers")
    ax1.set_xticks(list(x), names)
    ax1.legend(fontsize=7)
    for row, label in ((delta, "deltas"), (full, "full weights")):
        ax2.plot(names, [row["regions"][r]["p99_reach_s"] or float("nan") for r in names], "o-", label=label)
    ax2.set(yscale="log", ylabel="s from publication to 99% of the region's workers", title="version propagation, 1,000 workers")
    ax2.legend()
    fig.tight_layout()
    second = out / "fleet_weights_by_region.png"
    fig.savefig(second, dpi=110)
    plt.close(fig)
    return [str(first), str(second)]
