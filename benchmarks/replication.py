"""Filling a region's replica of the weight store: rlbus's relay (``rlbus replica``) against SeaweedFS's
``weed filer.sync``, on the same publications over the same emulated WAN link.

    .venv/bin/python -m benchmarks.replication --json

Weights: the default config's model (``rlbus.examples.addition``, built from scratch), trained
``--versions`` real AdamW steps (``trainer.lr``) on teacher-forced cross-entropy over ``a+b=c<eos>``
strings (the example's warm-up loss), before anything is timed; each step's weights are one
version. Both mechanisms get these same versions, published by ``WeightPublisher`` with
``WeightsConfig()``'s defaults (anchor every 10, bfloat16, hub retention 20), one every
``--interval-s``.

Per mechanism, all fresh: a hub SeaweedFS server that the publisher writes to directly (as the
hub's trainer does), a region SeaweedFS server (the replica), and an emulated link
(``rlbus.link``, in a process of its own; ``--delay-ms`` one way, ``--rate-mbit`` each way) whose
routes are the only addresses of the hub the region side is given:

* ``relay``: ``weightstore.replica.Replicator`` (the ``rlbus replica`` role, ``ReplicaConfig()``, in
  a child process) reads the hub's S3 API through the link and writes the region's. No model
  files are published here, so each of its passes also asks for them (one more round trip, as
  the run descriptor's conditional GET costs in a real run);
* ``filer_sync``: ``weed filer.sync -isActivePassive -a.filerProxy`` in the region, filer A (the
  hub's) named by the link's routes to its HTTP and gRPC ports, filer B the region's, both on
  ``/buckets/weights``. Without ``-a.filerProxy`` filer.sync reads chunks from the volume server
  that filer A names, straight from the hub and around the link (``--no-filer-proxy`` shows it).

The mechanism process's TCP connections are sampled from ``/proc`` through the run and sorted by
remote port: the link's routes, the region's server, the hub's server (a bypass of the link).

Figures per mechanism:

* ``bytes_down``: hub -> region over the link from the first publication until the replica holds
  every version (polling and metadata included); ``copies_per_version``: that / what the versions
  added to the hub (each version's new chunks + its manifest);
* ``propagation_s`` (p50, p99, max): from a version's manifest ``created_at`` to the first look at
  the replica (every ``--poll-s``; an upper bound) that finds all a follower needs for it: the
  manifests and chunks of its anchor path, and its patch from v-1;
* ``out_of_order_versions``: versions a look found named (their manifest, or LATEST) before all of
  those objects were there; ``out_of_order_polls``: such looks. A look reads LATEST, then lists
  manifests, then chunks (the reverse of publication order), so a copy made in publication order
  is never counted, and an object landing during a look is never counted missing;
* ``intact``: a ``WeightFollower(replica, replica_wait_s=60)`` polls the replica through the run
  (each version it loads hashed and compared with the published hash), and at the end every
  version whose manifest the replica holds is rebuilt from its anchor (``verify_version``): the
  relay's retention keeps 8 (``ReplicaConfig``), filer.sync mirrors the hub's deletions (20);
* ``cpu_s``: CPU seconds of the mechanism's process and of the hub's and region's servers from the
  first publication to the end of the drain; ``idle_bytes_per_s``: link bytes while nothing is
  published (``--idle-s``, after the drain).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Optional

import typer

from benchmarks.options import JsonOption

REPO = Path(__file__).resolve().parent.parent
POLICY = "main"
ACCESS_KEY_ID, SECRET_ACCESS_KEY = "bench", "bench-secret"
MECHANISMS = ("relay", "filer_sync")


# ---------------------------------------------------------------------- what the replica holds


def needed_keys(chain: list) -> frozenset[str]:
    """The objects a follower needs for ``chain[-1]`` (``chain``: its manifests from its anchor on):
    the manifests and chunks of the anchor path, and the version's own patch from v-1."""
    from weightstore.manifest import manifest_key

    anchor, top = chain[0], chain[-1]
    keys = {manifest_key(m.policy, m.version) for m in chain} | {c.key for c in anchor.chunks}
    for m in [*chain[1:], top]:
        keys |= {c.key for c in m.patch_chunks or []}
    return frozenset(keys)


@dataclass
class Tracker:
    """When each published version became complete in the replica, from successive looks at it."""

    need: dict[int, frozenset[str]] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)  # version -> its manifest's key
    created: dict[int, float] = field(default_factory=dict)
    arrived: dict[int, float] = field(default_factory=dict)
    named_early: set[int] = field(default_factory=set)
    first_early: dict[int, dict] = field(default_factory=dict)  # version -> what the first early look saw
    early_polls: int = 0
    polls: int = 0

    def published(self, version: int, manifest_key: str, created_at: float, need: frozenset[str]) -> None:
        self.need[version], self.names[version], self.created[version] = need, manifest_key, created_at

    def look(self, now: float, manifests: set[str], latest: int | None, chunks: set[str]) -> None:
        """One look: LATEST's version, then the manifest keys, then the chunk keys (each read after the one
        before it)."""
        self.polls += 1
        present, early = manifests | chunks, False
        for version, need in self.need.items():
            if version in self.arrived:
                continue
            if need <= present:
                self.arrived[version] = now
            elif self.names[version] in manifests or latest == version:
                missing = need - present
                self.first_early.setdefault(version, {
                    "by": "manifest" if self.names[version] in manifests else "LATEST",
                    "missing_chunks": sum(not k.endswith(".json") for k in missing),
                    "missing_manifests": sum(k.endswith(".json") for k in missing)})
                self.named_early.add(version)
                early = True
        self.early_polls += early

    def propagation_s(self) -> list[float]:
        return sorted(self.arrived[v] - self.created[v] for v in self.arrived)


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in [0, 1]) of ascending values; None when there are none."""
    if not sorted_values:
        return None
    rank = max(1, -(-len(sorted_values) * q // 1))  # ceil(n q), at least 1
    return sorted_values[int(rank) - 1]


# ---------------------------------------------------------------------- processes


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _remote_ports(pid: int) -> set[int]:
    """Remote ports of the established TCP connections of process ``pid``."""
    try:
        inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")}
        ports = set()
        for table in ("tcp", "tcp6"):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "01" and cols[9] in inodes:
                    ports.add(int(cols[2].rsplit(":", 1)[1], 16))
        return ports
    except OSError:  # the process ended, or a descriptor closed while we read
        return set()


def _link_child(conn, shape: dict, targets: list[tuple[str, int]]) -> None:
    """An emulated link in a process of its own (away from this one's GIL): sends its route
    addresses, then answers "stats" until "stop" or until the parent goes."""
    from broker.embedded import die_with_parent
    from rlbus.link import Link, LinkConfig

    die_with_parent()
    link = Link(LinkConfig(**shape), name="region")
    for target in targets:
        link.add_route(target)
    link.start()
    conn.send([r.listen[1] for r in link.routes])
    try:
        while conn.recv() == "stats":
            conn.send(link.stats())
    except EOFError:
        pass
    link.stop()


def _relay_child(hub_config, replica_config, stop, out) -> None:
    """``rlbus replica``'s loop: ``Replicator`` from the hub (through the link) into the replica."""
    from broker.embedded import die_with_parent
    from weightstore.config import ReplicaConfig, build_store
    from weightstore.replica import Replicator

    die_with_parent()
    relay = Replicator(build_store(hub_config), build_store(replica_config), [POLICY], region="bench",
                       config=ReplicaConfig())
    out.put("ready")
    relay.run(stop.is_set)
    out.put({k: v for k, v in relay.status().items() if k in ("bytes_copied", "objects_copied", "errors")})


def _store_config(endpoint: str):
    from weightstore.config import S3StoreConfig

    return S3StoreConfig(type="s3", bucket="weights", endpoint_url=endpoint, region="us-east-1",
                         access_key_id=ACCESS_KEY_ID, secret_access_key=SECRET_ACCESS_KEY, addressing_style="path")


def _store(endpoint: str):
    from weightstore.config import build_store

    return build_store(_store_config(endpoint))


class Relay:
    """The region's relay: ``Replicator`` in a child process, the hub's S3 API through the link."""

    def routes(self, hub) -> list[int]:
        return [hub.ports["s3.port"]]

    def start(self, link_ports: list[int], hub, region, tmp: Path) -> int:
        ctx = multiprocessing.get_context("spawn")
        self.stop_event, self.out = ctx.Event(), ctx.Queue()
        self.proc = ctx.Process(target=_relay_child, daemon=True, args=(
            _store_config(f"http://127.0.0.1:{link_ports[0]}"), _store_config(region.endpoint), self.stop_event,
            self.out))
        self.proc.start()
        if self.out.get(timeout=60) != "ready":
            raise RuntimeError("the relay did not start")
        return self.proc.pid

    def stop(self) -> dict:
        self.stop_event.set()
        try:
            counters = self.out.get(timeout=30)
        finally:
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
        return counters


class FilerSync:
    """``weed filer.sync`` run in the region: filer A (the hub's) through the link's routes."""

    def __init__(self, filer_proxy: bool, concurrency: int) -> None:
        self.filer_proxy, self.concurrency = filer_proxy, concurrency

    def routes(self, hub) -> list[int]:
        return [hub.ports["filer.port"], hub.ports["filer.port.grpc"]]

    def start(self, link_ports: list[int], hub, region, tmp: Path) -> int:
        from broker.embedded import die_with_parent
        from weightstore.embedded import weed_binary

        self.log = tmp / "filer-sync.log"
        args = [weed_binary(), "filer.sync", f"-a=127.0.0.1:{link_ports[0]}.{link_ports[1]}",
                f"-b={region.filer_address}", "-isActivePassive", "-a.path=/buckets/weights",
                "-b.path=/buckets/weights", f"-concurrency={self.concurrency}",
                *(["-a.filerProxy"] if self.filer_proxy else [])]
        with open(self.log, "wb") as fh:
            self.proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        deadline = time.monotonic() + 60
        while b"start sync" not in self.log.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"weed filer.sync did not start; {self.log}:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.1)
        return self.proc.pid

    def stop(self) -> dict:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        errors = [line for line in self.log.read_text(errors="replace").splitlines() if line.startswith("E")]
        return {"log_errors": len(errors), "first_error": errors[0][:300] if errors else None}


# ---------------------------------------------------------------------- one mechanism


def _look(store) -> tuple[set[str], int | None, set[str]]:
    from weightstore.manifest import read_latest

    latest = read_latest(store, POLICY)  # read in the reverse of publication order: an ordered copy is never
    manifests = set(store.list(f"{POLICY}/manifests/"))  # seen naming what it has not copied yet
    return manifests, None if latest is None else latest[0].version, set(store.list(f"{POLICY}/chunks/"))


class Watch:
    """Threads on the region side: looks at the replica every ``poll_s`` (and at the mechanism's
    connections), and a follower of the replica that hashes every version it loads."""

    def __init__(self, replica, pid: int, poll_s: float) -> None:
        self.replica, self.pid, self.poll_s = replica, pid, poll_s
        self.tracker, self.lock, self.stopping = Tracker(), threading.Lock(), threading.Event()
        self.ports: set[int] = set()
        self.sha: dict[int, str] = {}  # version -> published weights hash
        self.look_errors = 0
        self.follow = {"loaded": 0, "hash_mismatches": 0, "errors": [], "replica_waits": None}
        self.threads = [threading.Thread(target=self._observe, daemon=True),
                        threading.Thread(target=self._follow, daemon=True)]

    def __enter__(self) -> Watch:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(30)
        self.ports.update(_remote_ports(self.pid))

    def _observe(self) -> None:
        from weightstore.errors import StoreError

        while not self.stopping.is_set():
            began = time.monotonic()
            try:
                look = _look(self.replica)
            except StoreError:  # the region's server is local; a failed look is counted and repeated
                self.look_errors += 1
            else:
                with self.lock:
                    self.tracker.look(time.time(), *look)
                if self.tracker.polls % 5 == 0:
                    self.ports.update(_remote_ports(self.pid))
            self.stopping.wait(max(0.0, self.poll_s - (time.monotonic() - began)))

    def _follow(self) -> None:
        from weightstore.errors import StoreError
        from weightstore.follow import WeightFollower
        from weightstore.manifest import weights_sha256

        follower, out = WeightFollower(self.replica, POLICY, replica_wait_s=60), self.follow
        while not self.stopping.is_set():
            try:
                update = follower.poll()
            except StoreError as exc:  # counted; the follower keeps its weights and tries again
                out["errors"].append(str(exc)[:300])
                update = None
            if update is not None:
                out["loaded"] += 1
                out["hash_mismatches"] += weights_sha256(update.state_dict) != self.sha.get(update.version)
            self.stopping.wait(0.2)
        out["replica_waits"] = follower.replica_waits


def _publish(hub_store, states: list, interval_s: float, watch: Watch) -> tuple[dict[int, int], dict[int, str]]:
    """Publish ``states`` one every ``interval_s``; returns each version's stored bytes (new chunks +
    manifest) and kind."""
    from weightstore.config import WeightsConfig
    from weightstore.manifest import encode_model, manifest_key, read_manifest
    from weightstore.publish import WeightPublisher

    publisher = WeightPublisher(hub_store, POLICY, WeightsConfig())
    manifests, seen, stored, kinds, t0 = {}, set(), {}, {}, time.monotonic()
    for version, state in enumerate(states):
        time.sleep(max(0.0, t0 + version * interval_s - time.monotonic()))
        publisher.publish(version, state)
        m = manifests[version] = read_manifest(hub_store, POLICY, version)
        new = [c for c in m.chunks + m.delta_chunks if c.key not in seen]
        seen.update(c.key for c in new)
        stored[version], kinds[version] = sum(c.size for c in new) + len(encode_model(m)), m.kind
        need = needed_keys([manifests[v] for v in range(m.anchor_version, version + 1)])
        with watch.lock:
            watch.sha[version] = m.weights_sha256
            watch.tracker.published(version, manifest_key(POLICY, version), m.created_at, need)
    return stored, kinds


def _drain(watch: Watch, versions: int, timeout_s: float, grace_s: float = 2.0) -> None:
    """Until every version is complete in the replica; or ``grace_s`` after the last one is (a relay
    that took an anchor path skips older versions for good); or ``timeout_s``."""
    deadline, last_since = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        with watch.lock:
            arrived = watch.tracker.arrived
            if len(arrived) == versions:
                return
            if versions - 1 in arrived and last_since is None:
                last_since = time.monotonic()
        if last_since is not None and time.monotonic() - last_since > grace_s:
            return
        time.sleep(0.05)


def run_mechanism(name: str, mechanism, states: list, shape: dict, args: dict, tmp: Path) -> dict:
    """One mechanism on fresh servers and a fresh link: publish ``states``, measure, verify."""
    from weightstore.embedded import EmbeddedS3
    from weightstore.inspect import verify_version
    from weightstore.manifest import manifest_versions, read_latest

    hub, region = servers = [EmbeddedS3(tmp / name / side, access_key_id=ACCESS_KEY_ID,
                                        secret_access_key=SECRET_ACCESS_KEY, buckets=("weights",))
                             for side in ("hub", "region")]
    ctx = multiprocessing.get_context("spawn")
    link_conn, child_conn = ctx.Pipe()
    link_proc, started, phases, began = None, False, {}, time.monotonic()
    load_before = round(os.getloadavg()[0], 2)  # other work on the machine skews every figure

    def link_stats() -> dict:
        link_conn.send("stats")
        return link_conn.recv()

    try:
        for server in servers:
            server.start()
        link_proc = ctx.Process(target=_link_child, daemon=True,
                                args=(child_conn, shape, [("127.0.0.1", p) for p in mechanism.routes(hub)]))
        link_proc.start()
        link_ports = link_conn.recv()
        pid, started = mechanism.start(link_ports, hub, region, tmp / name), True
        hub_store, replica = _store(hub.endpoint), _store(region.endpoint)
        with Watch(replica, pid, args["poll_s"]) as watch:
            time.sleep(1.0)
            phases["setup"] = round(time.monotonic() - began, 1)
            pids = {"mechanism": pid, "hub_server": hub.proc.pid, "region_server": region.proc.pid}
            cpu0, link0, t0 = {k: _cpu_s(p) for k, p in pids.items()}, link_stats(), time.monotonic()
            stored, kinds = _publish(hub_store, states, args["interval_s"], watch)
            phases["publish"] = round(time.monotonic() - t0, 2)
            _drain(watch, len(states), args["drain_s"])
            link1, cpu1 = link_stats(), {k: _cpu_s(p) for k, p in pids.items()}
            phases["drain"] = round(time.monotonic() - t0 - phases["publish"], 2)
            time.sleep(args["idle_s"])
            link2 = link_stats()
        started = False
        counters = mechanism.stop()
        began = time.monotonic()
        checked = [verify_version(replica, POLICY, v) for v in manifest_versions(replica, POLICY)]
        latest = read_latest(replica, POLICY)
        phases["verify"] = round(time.monotonic() - began, 1)
    finally:
        if started:
            mechanism.stop()
        if link_proc is not None and link_proc.is_alive():
            link_conn.send("stop")
            link_proc.join(10)
        for server in servers:
            server.stop()

    tracker, follow, lags = watch.tracker, watch.follow, watch.tracker.propagation_s()
    down = link1["bytes_down"] - link0["bytes_down"]
    ports, on_link, on_region, on_hub = watch.ports, set(link_ports), set(region.ports.values()), set(hub.ports.values())
    return {
        "bytes_down": down, "bytes_up": link1["bytes_up"] - link0["bytes_up"],
        "bytes_down_per_version": round(down / len(states)),
        "copies_per_version": round(down / sum(stored.values()), 3),
        "propagation_s": {"p50": _round(percentile(lags, 0.5)), "p99": _round(percentile(lags, 0.99)),
                          "max": _round(lags[-1] if lags else None)},
        "slowest": [[v, _round(tracker.arrived[v] - tracker.created[v])] for v in sorted(
            tracker.arrived, key=lambda v: tracker.created[v] - tracker.arrived[v])[:3]],
        "versions_complete": len(tracker.arrived),
        "never_complete": sorted(set(range(len(states))) - set(tracker.arrived)),
        "out_of_order_versions": len(tracker.named_early), "out_of_order_polls": tracker.early_polls,
        "out_of_order_first": tracker.first_early, "polls": tracker.polls, "look_errors": watch.look_errors,
        "intact": {
            "follower_loaded": follow["loaded"], "follower_hash_mismatches": follow["hash_mismatches"],
            "follower_errors": len(follow["errors"]), "follower_first_error": (follow["errors"] or [None])[0],
            "follower_replica_waits": follow["replica_waits"],
            "replica_latest": None if latest is None else latest[0].version,
            "versions_verified": len(checked),
            "versions_ok": sum(r["ok"] and r["weights_sha256"] == watch.sha.get(r["version"]) for r in checked),
        },
        "cpu_s": {k: round(cpu1[k] - cpu0[k], 2) for k in pids},
        "idle_bytes_per_s": {"down": round((link2["bytes_down"] - link1["bytes_down"]) / args["idle_s"]),
                             "up": round((link2["bytes_up"] - link1["bytes_up"]) / args["idle_s"])},
        "connections_to": {"link": sorted(ports & on_link),
                           "region_server": len(ports & on_region), "hub_server_directly": sorted(ports & on_hub),
                           "other": sorted(ports - on_link - on_region - on_hub)},
        "phases_s": phases, "load_avg_1m_before": load_before, **counters, "_stored": stored, "_kinds": kinds,
    }


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


# ---------------------------------------------------------------------- the weights


def train_versions(versions: int, sets: list[str], tmp: Path, seed: int = 0) -> tuple[list, dict]:
    """``versions`` successive weights of the default config's model, one AdamW step apart, cast to
    the publish dtype; and a description of the model."""
    import random

    import torch

    from rlbus.config import load_config
    from rlbus.examples.addition import build_model
    from trainer.model import load_policy
    from weightstore.config import WeightsConfig

    torch.manual_seed(seed)
    cfg = load_config(REPO / "configs" / "default.toml", sets, environ={})
    model, tok = load_policy(build_model(tmp / "model", **cfg.example.model.model_dump()), device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.lr)
    dtype, rng, n = getattr(torch, WeightsConfig().publish_dtype), random.Random(seed), cfg.example.max_operand
    states, losses = [], []
    for _ in range(versions):
        pairs = [(rng.randrange(n), rng.randrange(n)) for _ in range(32)]
        batch = tok([f"{a}+{b}={a + b}{tok.eos_token}" for a, b in pairs], padding=True, return_tensors="pt")
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        states.append({k: v.detach().to(dtype if v.is_floating_point() else v.dtype, copy=True)
                       for k, v in model.state_dict().items()})
    full = sum(t.numel() * t.element_size() for t in states[0].values())
    return states, {"parameters": sum(p.numel() for p in model.parameters()), "full_bytes": full,
                    "arch": cfg.example.model.arch, "hidden_size": cfg.example.model.hidden_size,
                    "layers": cfg.example.model.layers, "loss_first": round(losses[0], 3),
                    "loss_last": round(losses[-1], 3)}


def main(
    versions: Annotated[int, typer.Option(help="Versions published (optimizer steps).")] = 60,
    interval_s: Annotated[float, typer.Option(help="Seconds between two publications.")] = 0.5,
    delay_ms: Annotated[float, typer.Option(help="One-way delay of the link, ms.")] = 50.0,
    rate_mbit: Annotated[float, typer.Option(help="Capacity of each direction of the link, Mbit/s.")] = 200.0,
    mechanisms: Annotated[str, typer.Option(help="Comma-separated: relay, filer_sync.")] = ",".join(MECHANISMS),
    filer_proxy: Annotated[bool, typer.Option(help="filer.sync's -a.filerProxy (without it, chunks bypass "
                                                   "the link).")] = True,
    sync_concurrency: Annotated[int, typer.Option(help="filer.sync's -concurrency (files at once).")] = 32,
    poll_s: Annotated[float, typer.Option(help="Seconds between two looks at the replica.")] = 0.05,
    drain_s: Annotated[float, typer.Option(
        help="Most seconds to wait for the replica after the last publication.")] = 60.0,
    idle_s: Annotated[float, typer.Option(help="Seconds of idle link traffic measured after the drain.")] = 3.0,
    sets: Annotated[Optional[list[str]], typer.Option("--set", help="Override of the default config for the "
                                                       "model, e.g. example.model.hidden_size=512.")] = None,
    json_out: JsonOption = False,
) -> None:
    """Bytes over the link, propagation and ordering of rlbus's relay against weed filer.sync."""
    from weightstore.config import WeightsConfig

    chosen = [m.strip() for m in mechanisms.split(",") if m.strip()]
    if not chosen or set(chosen) - set(MECHANISMS):
        raise typer.BadParameter(f"choose among {', '.join(MECHANISMS)}", param_hint="--mechanisms")
    tmp = Path(tempfile.mkdtemp(prefix="rlbus-replication-"))
    began = time.monotonic()
    states, model = train_versions(versions, sets or [], tmp)
    print(f"trained {versions} steps in {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
    shape = {"delay_ms": delay_ms, "rate_mbit": rate_mbit}
    args = {"interval_s": interval_s, "poll_s": poll_s, "drain_s": drain_s, "idle_s": idle_s}
    makers = {"relay": Relay, "filer_sync": lambda: FilerSync(filer_proxy, sync_concurrency)}
    results = {}
    for name in chosen:
        began = time.monotonic()
        results[name] = run_mechanism(name, makers[name](), states, shape, args, tmp)
        results[name]["wall_s"] = round(time.monotonic() - began, 1)
        print(f"[{name}] {json.dumps({k: v for k, v in results[name].items() if not k.startswith('_')})}",
              file=sys.stderr, flush=True)
    first = next(iter(results.values()))
    stored, kinds = first["_stored"], first["_kinds"]
    of_kind = lambda kind: [s for v, s in stored.items() if kinds[v] == kind]  # noqa: E731
    out = {
        "command": "python -m benchmarks.replication " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": _commit(),
        "machine": f"{os.uname().nodename}, {os.cpu_count()} cpus",
        "link": shape, "versions": versions, "interval_s": interval_s, "poll_s": poll_s,
        "anchor_every": WeightsConfig().anchor_every, "filer_proxy": filer_proxy,
        "model": model,
        "stored_bytes": {"per_version_mean": round(sum(stored.values()) / len(stored)),
                         **{f"{k}_mean": round(sum(of_kind(k)) / max(1, len(of_kind(k)))) for k in ("anchor", "delta")}},
        **{name: {k: v for k, v in r.items() if not k.startswith("_")} for name, r in results.items()},
    }
    print(json.dumps(out, indent=None if json_out else 1))
    shutil.rmtree(tmp, ignore_errors=True)  # kept when a run fails: the servers' and filer.sync's logs are there


if __name__ == "__main__":
    typer.run(main)
