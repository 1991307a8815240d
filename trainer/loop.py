"""The trainer of one policy (``PolicyTrainer``): batches in, optimizer step, weights out, then offsets committed.

Order per step (the at-least-once contract): take B groups from the intake → train → publish
version N to the weightstore → announce N on the control topic → commit the offsets of the
groups that fed N. A crash anywhere before the commit redelivers those groups; the checkpoint
holds the offsets it was taken at (per topic: the policy's own and the regions' mirrors of it), so
a resumed trainer seeks there.

Publishing runs on one background thread, so step N + 1 trains while version N is encoded and
written (the weights are copied first). That thread also carries every control announcement, so
announcements and publications stay in order; a step waits for the previous publication before
queueing its own, so at most one is in flight, and a checkpoint waits for all of them.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from broker.control import ControlAnnouncer
from broker.metrics import counter, gauge, histogram
from broker.reader import Partition
from broker.tracing import finished_span, links_to
from consumers.fleet import Propagation
from consumers.intake import Batch, TrainerIntake
from consumers.stages import GroupStage, apply_group_stages, stage_metrics
from trainer.checkpoint import offsets_by_topic
from trainer.config import TrainerConfig
from trainer.learner import Learner
from weightstore.telemetry import StoreTelemetry
from weightstore.publish import WeightPublisher

logger = logging.getLogger(__name__)

LIVE_WORKER_WINDOW_S = 30.0


class NoTrajectories(RuntimeError):
    """No trajectory arrived for longer than the idle timeout."""

    retriable = False


@dataclass(frozen=True)
class Fork:
    """Where a resumed trainer took up: the checkpoint it restored (``version``, ``step``) and the
    first version it published after it (``resumed_at``). Versions in between were published
    before the crash from weights the trainer no longer has (a lost branch)."""

    version: int
    step: int
    resumed_at: int


@dataclass
class TrainerState:
    """``step`` counts optimizer steps (max_steps, the lr schedule and checkpoints go by it);
    ``version`` labels published weights. They are equal until a resume finds the store ahead
    of the checkpoint: versions only move forward, so the resumed weights get the next one."""

    version: int
    groups_trained: int = 0
    groups_consumed: int = 0
    offsets: dict[Partition, int] = field(default_factory=dict)
    """Next offset to read per (topic, partition), of the groups the published versions were trained on."""
    log_losses: int = 0
    worker_last_seen: dict[str, float] = field(default_factory=dict)
    worker_region: dict[str, str] = field(default_factory=dict)
    step: int | None = None
    fork: Fork | None = None

    def __post_init__(self) -> None:
        if self.step is None:
            self.step = self.version

    def lag(self, version: int) -> int:
        """How many optimizer steps separate the current weights from those of ``version``.

        Across a resume: weights published before the checkpoint are ``fork.version - version``
        steps behind it, those of the lost branch ``version - fork.version`` steps off it, and
        the steps since the resume come on top (deeper histories count as the newest fork does:
        an overestimate, so never fresher than they are)."""
        fork = self.fork
        if fork is None or version >= fork.resumed_at:
            return self.version - version
        return (self.step - fork.step) + abs(version - fork.version)


class PolicyTrainer:
    def __init__(
        self,
        *,
        policy: str,
        config: TrainerConfig,
        learner: Learner,
        intake: TrainerIntake,
        publisher: WeightPublisher,
        announcer: ControlAnnouncer,
        run_dir: Path,
        metrics_path: Path | None = None,
        stages: list[GroupStage] | None = None,
        wait_turn: Callable[[int], None] | None = None,
        telemetry: StoreTelemetry | None = None,
    ) -> None:
        """``metrics_path``: the JSONL file of one row per step (default ``run_dir/metrics.jsonl``);
        ``wait_turn(version)`` returns when this policy may take its next step (alternating trainers);
        ``telemetry`` mirrors the rows into the store; ``learner``: the model side (on rank 0 of
        several, each of its calls is one the other ranks join)."""
        self.policy, self.config = policy, config
        self.learner = learner
        self.intake, self.publisher, self.announcer = intake, publisher, announcer
        self.run_dir = run_dir
        self.stages = list(stages or [])
        self.wait_turn = wait_turn
        self._no_signal_fills = 0
        self._fresh_at: float | None = None  # when the last fresh group arrived (None: none yet)
        self.repair_anchors = 0
        self.metrics_path = metrics_path or run_dir / "metrics.jsonl"
        self.checkpoint_dir = run_dir / "checkpoints" / policy
        self._checkpointed: int | None = None
        self._queue = ThreadPoolExecutor(1, thread_name_prefix=f"publish-{policy}")
        self._jobs: list[Future] = []
        self.telemetry = telemetry
        self.propagation = Propagation()
        self._published: collections.deque[tuple[int, float]] = collections.deque()  # (version, when), from the publishing thread

    # -- the ordered background queue ------------------------------------------------------
    def _submit(self, fn, *args) -> Future:
        self._reap()
        job = self._queue.submit(fn, *args)
        self._jobs.append(job)
        return job

    def _reap(self) -> None:
        """Forget finished jobs; a failed publication or announcement fails the trainer here."""
        done = [job for job in self._jobs if job.done()]
        self._jobs = [job for job in self._jobs if not job.done()]
        for job in done:
            job.result()

    def drain(self) -> None:
        """Wait until everything queued is published, announced and committed."""
        for job in self._jobs:
            job.result()
        self._jobs.clear()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self._queue.shutdown(wait=True)
            if self.telemetry is not None:
                self.telemetry.close()

    def _collect(self, state: TrainerState, should_stop=lambda: False) -> tuple[list, Batch, int] | None:
        """Block until B groups passed the data stages (stages may drop some: keep filling), or until
        ``should_stop``: then None, and nothing of the partial batch counts (its offsets were not
        taken, so the trainer that resumes from the checkpoint reads those groups again).

        Groups dropped on the way (stale, rejected, or by a stage) are announced as consumed at
        once, so the curator dispatches replacements; without that, admission (in flight ≤
        (η + 1) × B) could starve a trainer whose stages drop more than η × B groups.
        Returns (groups to train on, a batch carrying every offset consumed on the way, how many
        of the groups to train on came from the intake — replayed copies are not among them).
        """
        merged = Batch(groups=[], offsets={})
        kept_arrivals = stage_drops = 0
        idle_since = time.monotonic()
        consumed_before = state.groups_consumed
        while len(merged.groups) < self.config.groups_per_step:
            if should_stop():  # a stopped fleet sends nothing more: do not wait for a full batch
                state.groups_consumed = consumed_before
                self.intake.forget([g.header.group_id for g in merged.groups])
                return None
            need = self.config.groups_per_step - len(merged.groups)
            batch = self.intake.next_batch(need, state.version, timeout_s=1.0, lag=state.lag)
            self._maybe_repair(state, fresh=batch is not None and bool(batch.groups))
            if batch is None:
                if time.monotonic() - idle_since > self.config.idle_timeout_s:
                    raise NoTrajectories(
                        f"no trajectory groups for {self.config.idle_timeout_s:.0f}s on {self.intake.topic}: "
                        "are rollout workers attached (rlbus worker --broker … --store …)?"
                    )
                merged.wait_s += 1.0
                continue
            idle_since = time.monotonic()
            passed = apply_group_stages(self.stages, batch.groups, state.version)
            stage_drops += max(0, len(batch.groups) - len(passed))
            if stage_drops > self.config.max_stage_drops_per_step * self.config.groups_per_step:
                passed = self._without_signal(passed, batch.groups, need, stage_drops)
            by_stages = max(0, len(batch.groups) - len(passed))
            kept_arrivals += len(batch.groups) - by_stages
            dropped = by_stages + batch.dropped_stale + batch.rejected
            if dropped:
                state.groups_consumed += dropped
                # Queued behind the publication of state.version, so it never announces it early.
                self._submit(self.announcer.version, self.policy, state.version, state.groups_consumed)
            merged.groups.extend(passed)
            merged.offsets.update(batch.offsets)
            merged.dropped_stale += batch.dropped_stale
            merged.duplicates += batch.duplicates
            merged.rejected += batch.rejected
            merged.wait_s += batch.wait_s
            merged.consumed_ids.extend(batch.consumed_ids)
            merged.from_lost_log.extend(batch.from_lost_log)
            merged.traceparents.update(batch.traceparents)
        return merged.groups, merged, kept_arrivals

    def _maybe_repair(self, state: TrainerState, *, fresh: bool) -> None:
        """``repair_anchor_after_s`` without a fresh group, once groups had flowed: republish the
        weights as a full anchor under the next version (no step is taken; once until fresh groups
        flow again). Workers stuck before a version they cannot build (a damaged chunk on its
        chain) move to it; without it the trainer waited for fresh groups that no worker could
        generate, and no later anchor came."""
        now = time.monotonic()
        if fresh or self._fresh_at is None:
            self._fresh_at = now if fresh else self._fresh_at
            return
        after = self.config.repair_anchor_after_s
        if after is None or now - self._fresh_at < after:
            return
        self._fresh_at = None  # once per spell without fresh groups: a fleet that is simply gone costs one anchor
        state.version += 1
        written, _, _ = self.publish(state, anchor=True)
        self.repair_anchors += 1
        logger.warning("no fresh group for %.0fs: republished the weights as an anchor, v%d (%d bytes), for workers "
                       "that cannot build the newest version (a damaged chunk?)", after, state.version, written)

    def _without_signal(self, passed: list, arrived: list, need: int, drops: int) -> list:
        """Fill the step with groups the stages dropped: the run goes on when nothing carries signal."""
        kept = {g.header.group_id for g in passed}
        filler = [g for g in arrived if g.header.group_id not in kept][: max(0, need - len(passed))]
        self._no_signal_fills += bool(filler)
        if filler and self._no_signal_fills % 100 == 1:  # the first time, then every 100th
            logger.warning(
                "the data stages dropped %d groups while this step filled (all rewards equal: no signal); training on "
                "%d of them so the run goes on. Does the model ever get a reward? Warm it up, check the task, or "
                "remove dynamic_sampling", drops, len(filler))
        return passed + filler

    def publish(self, state: TrainerState, *, anchor: bool = False) -> tuple[int, int, str]:
        """Publish and announce the current weights as ``state.version`` (blocking; ``anchor``: in full)."""
        self.drain()
        info = self.publisher.publish(state.version, self.learner.weights(self.publisher.dtype), anchor=anchor,
                                      owned=True)
        self._published.append((state.version, time.time()))
        self.announcer.version(self.policy, state.version, state.groups_consumed)
        return info.bytes_written, info.full_bytes, info.kind

    def _publish_step(self, version: int, weights: dict, consumed: int, offsets: dict[Partition, int], row: dict,
                      consumed_ids: list[str]) -> None:
        """On the queue: publish → announce → commit the offsets that fed ``version`` → metrics row."""
        started = time.monotonic()
        info = self.publisher.publish(version, weights, owned=True)
        self._published.append((version, time.time()))
        self.announcer.version(self.policy, version, consumed, consumed_ids)
        self.intake.commit(offsets)
        row.update(publish_bytes=info.bytes_written, publish_full_bytes=info.full_bytes, publish_kind=info.kind,
                   publish_s=time.monotonic() - started)
        with open(self.metrics_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")
        if self.telemetry is not None:
            self.telemetry.add(row)
        self._record_metrics(row)
        logger.info(
            "v%d reward %.3f loss %.4f stale-dropped %d wait %.2fs train %.2fs publish %.2fs (%s %dB)",
            version, row["reward_mean"], row["loss"], row["groups_dropped_stale"], row["wait_s"], row["train_s"],
            row["publish_s"], info.kind, info.bytes_written,
        )

    def run(self, state: TrainerState, should_stop) -> TrainerState:
        started = time.time()
        while state.step < self.config.max_steps and not should_stop():
            if self.wait_turn is not None:
                self.wait_turn(state.version)
                if should_stop():
                    break
            t0 = time.monotonic()
            collected = self._collect(state, should_stop)
            if collected is None:
                break
            groups, batch, kept_arrivals = collected
            t_train = time.monotonic()
            result = self.learner.step(groups, state.step)
            weights = self.learner.weights(self.publisher.dtype)  # copies: the next step may train at once
            t_queue = time.monotonic()
            lags = [state.lag(g.header.min_version) for g in groups]
            state.version += 1
            state.step += 1
            state.groups_trained += len(groups)
            state.groups_consumed += kept_arrivals  # the dropped ones were counted while collecting
            if self.intake.log_losses != state.log_losses:  # the broker lost the log those offsets were of
                state.log_losses, state.offsets = self.intake.log_losses, {}
            state.offsets.update(batch.offsets)
            now = time.time()
            while self._published:
                self.propagation.publish(*self._published.popleft())
            for g in groups:
                state.worker_last_seen[g.header.worker_id] = now
                state.worker_region[g.header.worker_id] = g.header.region
                self.propagation.observe(g.header.worker_id, g.header.min_version, g.header.created_at)
            self.drain()  # at most one publication in flight: the previous one ends first
            t_end = time.monotonic()
            self._step_span(state, groups, batch, wall_end=time.time(), took_s=t_end - t0)
            row = self._metrics_row(state, groups, lags, result, started, wait_s=t_train - t0,
                                    train_s=t_queue - t_train, step_s=t_end - t0)
            row["consumed_prompt_ids"] = batch.consumed_ids  # trained, dropped stale or by a stage, or copies
            # Which log they came from: rows of log_losses n read the (n+1)-th log, but for the groups
            # listed as read before its loss.
            row["log_losses"], row["consumed_from_lost_log"] = self.intake.log_losses, batch.from_lost_log
            self._submit(self._publish_step, state.version, weights, state.groups_consumed, dict(batch.offsets), row,
                         batch.consumed_ids)
            if state.step % self.config.checkpoint_every == 0:
                self.checkpoint(state)
        self.drain()
        return state

    def _record_metrics(self, row: dict) -> None:
        """The step's figures as OpenTelemetry metrics (``broker.metrics``)."""
        policy = {"policy": self.policy}
        kind = {**policy, "kind": row["publish_kind"]}
        counter("rlbus.trainer.groups", "{group}", "Groups trained").add(row["groups"], policy)
        counter("rlbus.trainer.tokens", "{token}", "Completion tokens trained").add(row["tokens"], policy)
        gauge("rlbus.trainer.wait_fraction", "1", "Share of the last step spent waiting for groups").set(
            row["wait_s"] / max(row["step_wall_s"], 1e-9), policy)
        gauge("rlbus.trainer.version", "{version}", "Newest published weight version").set(row["version"], policy)
        staleness = histogram("rlbus.trainer.staleness", "{version}", "Versions behind the trainer, per trained group")
        for lag, n in row["staleness_counts"].items():
            for _ in range(n):
                staleness.record(int(lag), policy)
        histogram("rlbus.weights.publish.duration", "s", "Time to publish a version").record(row["publish_s"], kind)
        histogram("rlbus.weights.publish.size", "By", "Bytes written per version").record(row["publish_bytes"], kind)
        if row["propagation_s"] is not None:
            gauge("rlbus.weights.propagation", "s", "From publishing a version to the last live worker using it").set(
                row["propagation_s"], policy)

    def _step_span(self, state: TrainerState, groups: list, batch: Batch, *, wall_end: float, took_s: float) -> None:
        """The step's span, linked to the publish span of every group it trained on (each one's trace
        is its prompt's: the curator's dispatch, the worker's generation and publication)."""
        links = links_to(batch.traceparents.get(g.header.group_id) for g in groups)
        finished_span("trainer.step", parent=None, start_s=wall_end - took_s, end_s=wall_end, links=links,
                      attributes={"rlbus.policy": self.policy, "rlbus.step": state.step, "rlbus.version": state.version,
                                  "rlbus.groups": len(groups), "rlbus.group_ids": [g.header.group_id for g in groups]})

    def checkpoint(self, state: TrainerState) -> None:
        if state.version == self._checkpointed:
            return
        self.drain()  # the checkpoint's offsets are committed ones, of a published version
        self._checkpointed = state.version
        self.learner.save(
            self.checkpoint_dir,
            version=state.version,
            offsets={self.intake.topic: {}} | offsets_by_topic(state.offsets),  # the own topic always, as before
            extra={"groups_trained": state.groups_trained, "groups_consumed": state.groups_consumed,
                   "step": state.step, "fork": None if state.fork is None else dataclasses.asdict(state.fork),
                   "cluster_id": self.intake.cluster_id, "seen_group_ids": self.intake.seen_ids(),
                   "intake_counts": self.intake.stats.counts()},
            keep=self.config.checkpoints_kept,
        )

    def _metrics_row(self, state, groups, lags, result, started, *, wait_s, train_s, step_s) -> dict:
        now = time.time()
        live = sorted(w for w, t in state.worker_last_seen.items() if now - t < LIVE_WORKER_WINDOW_S)
        stats = self.intake.stats
        propagated = self.propagation.latest(live)
        by_worker = collections.Counter(g.header.worker_id for g in groups)
        by_region, tokens_by_region, lag_by_region = collections.Counter(), collections.Counter(), {}
        for g, lag in zip(groups, lags, strict=True):
            by_region[g.header.region] += 1
            tokens_by_region[g.header.region] += len(g.completion_tokens)
            lag_by_region.setdefault(g.header.region, []).append(lag)
        regions = sorted({state.worker_region[w] for w in live})
        reached = {r: self.propagation.latest([w for w in live if state.worker_region[w] == r]) for r in regions}
        stale = collections.Counter(str(lag) for lag in lags)  # JSON keys: strings
        return {
            "policy": self.policy,
            "version": state.version,
            "step": state.step,
            "reward_mean": result.reward_mean,
            "loss": result.loss,
            "lr": self.learner.optimizer.param_groups[0]["lr"],
            "grad_norm": result.grad_norm,
            "groups": len(groups),
            "trained_group_ids": [g.header.group_id for g in groups],  # what this step stepped on, for audits
            "groups_trained": state.groups_trained,
            "groups_dropped_stale": stats.dropped_stale,
            "groups_rejected": stats.rejected,
            "duplicates": stats.duplicates,
            "repair_anchors": self.repair_anchors,
            "staleness_mean": sum(lags) / len(lags),
            "staleness_max": max(lags),
            "staleness_counts": dict(stale),  # groups trained per staleness (versions behind)
            "groups_by_worker": dict(by_worker),
            "groups_by_region": dict(by_region),
            "tokens_by_region": dict(tokens_by_region),  # completion tokens of the groups trained
            "staleness_by_region": {r: sum(v) / len(v) for r, v in lag_by_region.items()},
            "propagation_by_region": {r: None if v is None else [v[0], round(v[1], 3)] for r, v in reached.items()},
            "dropped_stale_by_region": dict(stats.dropped_stale_by_region),
            "propagated_version": None if propagated is None else propagated[0],
            "propagation_s": None if propagated is None else propagated[1],
            "tokens": result.tokens,
            "tokens_per_s": result.tokens / max(step_s, 1e-9),
            "turns_mean": _turns_mean(groups),
            "live_workers": len(live),
            "workers_seen": sorted(state.worker_last_seen),
            "wait_s": wait_s,
            "train_s": train_s,
            "step_wall_s": step_s,
            "queued": self.intake.queued,
            "wall_s": now - started,
            "time": now,
            **{f"loss_{k}": v for k, v in result.stats.items()},
            **{f"stage/{k}": v for k, v in stage_metrics(self.stages).items()},
            **self._rescore_metrics(stats),
        }

    def _rescore_metrics(self, stats) -> dict:
        """The intake's re-scoring counters so far, per worker (none when it does not re-score)."""
        if self.intake.rescorer is None:
            return {}
        return {"groups_rescored": sum(stats.rescored.values()), "rescored_by_worker": dict(stats.rescored),
                "reward_disagreements": dict(stats.disagreements), "groups_unscored": dict(stats.unscored)}


def _turns_mean(groups: list) -> float | None:
    """Turns per episode over the step's multi-turn samples; None when it has none."""
    turns = [len(t) for g in groups if g.header.turns is not None for t in g.header.turns]
    return sum(turns) / len(turns) if turns else None
