"""The regions of a local run (``local.regions``), as the supervisor starts them.

Each region gets, in ``<run dir>/regions/<name>/``:

* an emulated WAN link (``rlbus link``, log ``link-<name>``) with two routes: one in front of the
  hub's broker (a Kafka route: the broker's advertised address is rewritten to the link's, so the
  region's clients never go around it) and one in front of the hub's S3 endpoint; its counters in
  ``link.json``;
* with ``replication = "relay"``, a replicator (``rlbus replica``) that fills the region's store
  (``store/``, a directory standing for the region's bucket) from the hub's across the link, and
  logs each version's arrival in ``arrivals.jsonl``;
* its workers (``rlbus worker --config worker.json``): broker and hub store reached only through the
  link, weights followed on the replica (or, with ``replication = "none"``, on the hub's store
  across the link).

What a region needs is configuration: the processes are the same ``rlbus`` roles a deployment runs
(``infra/deploy-region.sh``); only the files differ.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlbus.config import LocalRegion, RunConfig, secret_environment, without_secrets
from weightstore.config import LocalStoreConfig, S3StoreConfig

REGION_SECTIONS = ("kafka", "signing", "store", "worker", "replica")
"""The sections a region's processes take from their own file (the rest from the run descriptor)."""


@dataclass
class Region:
    """One region's processes: the ``rlbus`` arguments of each, and the secrets they get."""

    spec: LocalRegion
    directory: Path
    replica_args: list[str] | None = None
    workers: dict[str, list[str]] = field(default_factory=dict)  # log name -> args
    env: dict[str, str] = field(default_factory=dict)



def link_args(spec: LocalRegion, broker: str, s3_endpoint: str, stats_file: Path) -> list[str]:
    """``rlbus link`` for the region: a Kafka route to the broker and a route to the S3 endpoint, each on a
    free port of 127.0.0.1 that the link picks and writes into its stats file."""
    shape = spec.link
    args = ["link", "--name", spec.name, "--route", f"kafka:127.0.0.1:0={broker}",
            "--route", f"127.0.0.1:0={s3_endpoint.removeprefix('http://').rstrip('/')}",
            "--delay-ms", str(shape.delay_ms), "--drops-per-min", str(shape.drops_per_min),
            "--stats-file", str(stats_file), "--control-port", "0"]
    if shape.rate_mbit is not None:
        args += ["--rate-mbit", str(shape.rate_mbit)]
    for cut in shape.cuts:
        if cut.at_s is not None:  # the link keeps these itself; the supervisor drives those at a step
            args += ["--cut", f"{cut.at_s}:{cut.for_s}"]
    return args


def last_step(metrics: Path) -> int | None:
    """The step of the newest row of a trainer's ``metrics.jsonl`` (None before its first)."""
    try:
        with open(metrics, "rb") as fh:
            fh.seek(max(0, fh.seek(0, 2) - (1 << 18)))
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue  # a line being written, or the cut-off first one
    return None


class StepCuts:
    """The cuts of the regions' links that start at a trainer step: the supervisor calls ``tick`` with
    the step reached, and this cuts and restores links through their control ports."""

    def __init__(self) -> None:
        self.pending: list[tuple[str, int, int, float]] = []  # region, control port, step, seconds
        self.active: list[tuple[str, int, float]] = []  # region, control port, restore at (monotonic)

    def add(self, spec: LocalRegion, control_port: int) -> None:
        self.pending += [(spec.name, control_port, c.at_step, c.for_s) for c in spec.link.cuts if c.at_step is not None]

    def tick(self, step: int | None) -> None:
        now = time.monotonic()
        for item in [a for a in self.active if now >= a[2]]:
            if self._control(item[0], item[1], "restore"):
                self.active.remove(item)
                print(f"region {item[0]}: link restored", flush=True)
        for item in [p for p in self.pending if step is not None and step >= p[2]]:
            if not self._control(item[0], item[1], "cut"):
                continue
            self.pending.remove(item)
            self.active.append((item[0], item[1], now + item[3]))
            print(f"region {item[0]}: link cut at step {step} for {item[3]:g}s", flush=True)

    @staticmethod
    def _control(region: str, port: int, action: str) -> bool:
        from rlbus.link import control

        try:
            control(port, action)
            return True
        except OSError as exc:  # the link's process is essential: if it died, the supervisor stops the run
            print(f"warning: region {region}: {action} of its link failed ({exc}); trying again", flush=True)
            return False


def wait_for_link(stats_file: Path, proc, timeout_s: float = 30.0) -> tuple[dict[str, str], int]:
    """The link's route addresses once it listens (target -> listening address), and its control port."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the link exited with {proc.returncode} before it listened")
        try:
            stats = json.loads(stats_file.read_text())
            if stats["control_port"] is None:
                raise KeyError("control_port")
            return {r["target"]: listen for listen, r in stats["routes"].items()}, stats["control_port"]
        except (OSError, ValueError, KeyError):
            time.sleep(0.1)
    raise RuntimeError(f"the link did not write {stats_file} within {timeout_s:.0f}s")


def region_files(cfg: RunConfig, spec: LocalRegion, directory: Path, *, kafka: str,
                 hub_store: S3StoreConfig) -> tuple[dict, dict, dict[str, str]]:
    """(the workers' file, the replicator's file, the secrets both get) of a region whose link listens
    at ``kafka`` for the broker and whose hub store is ``hub_store`` (through the link)."""
    replica = LocalStoreConfig(type="local", path=str(directory / "store"))
    relay = spec.replication == "relay"

    def config(store, hub) -> RunConfig:
        region = cfg.model_copy(deep=True)
        region.kafka = cfg.kafka.with_broker(kafka)
        region.store = store
        region.worker = cfg.worker.model_copy(update={
            "region": spec.name, "hub_store": hub, "replica_wait_s": spec.replica_wait_s if relay else None})
        region.replica = spec.replica.model_copy(update={"arrivals_file": str(directory / "arrivals.jsonl")})
        return region

    def sections(c: RunConfig) -> dict:
        return {k: v for k, v in without_secrets(c).items() if k in REGION_SECTIONS}

    workers = config(replica if relay else hub_store, hub_store if relay and spec.hub_fallback else None)
    replicator = config(replica, hub_store)
    env = {k: v for c in (workers, replicator) for k, v in secret_environment(c).items()
           if k.split("__")[0].removeprefix("RLBUS_").lower() in REGION_SECTIONS}
    return sections(workers), sections(replicator), env


def plan_region(cfg: RunConfig, spec: LocalRegion, run_dir: Path, *, links: dict[str, str],
                hub_store: S3StoreConfig) -> Region:
    """The region's processes once its link listens (``links``: target -> the link's address)."""
    directory = run_dir / "regions" / spec.name
    broker = cfg.kafka.bootstrap_servers.split(",")[0]
    s3 = hub_store.endpoint_url.removeprefix("http://").rstrip("/")
    far = hub_store.model_copy(update={"endpoint_url": f"http://{links[s3]}"})
    worker_file, replica_file, env = region_files(cfg, spec, directory, kafka=links[broker], hub_store=far)
    (directory / "worker.json").write_text(json.dumps(worker_file, indent=1))
    region = Region(spec, directory, env=env)
    if spec.replication == "relay":
        (directory / "replica.json").write_text(json.dumps(replica_file, indent=1))
        region.replica_args = ["replica", "--config", str(directory / "replica.json")]
    for i in range(spec.workers):
        speed = [] if spec.worker_speeds is None else ["--set", f"worker.bench_speed={spec.worker_speeds[i]}"]
        region.workers[f"{spec.name}-{i}"] = ["worker", "--config", str(directory / "worker.json"),
                                              "--id", f"{spec.name}-{i}", *speed]
    return region
