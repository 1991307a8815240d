"""Which prompt-topic partition each dispatched prompt goes to.

Kafka gives each partition of ``<run>.prompts.<workflow>`` to one member of the rollout group, so a
prompt sent to a partition waits behind the backlog of that partition's worker. With the Kafka
default (hash of the key) every worker gets the same share, and on a fleet of uneven machines the
slowest one holds prompts the others could have served long ago: in synchronous training every
step waits for it, in asynchronous training its groups come back stale.

``LeastDelayRouter`` learns from the curator's feedback (the groups that come back) which worker
serves each partition and how fast each worker is, measured on the worker's own clock: a batch of
k groups whose generation started at ``created_at`` and was done at ``published_at`` (both in the
group header, throttling included) is a sample of k / (published_at − created_at) groups per
second. Each prompt goes to the worker with the least expected delay, (outstanding + 1) / rate,
and there to its partition with the fewest outstanding prompts. Partitions whose worker is not
known yet count as a worker of their own at the mean known rate, so new workers are found.

A worker with outstanding prompts that returns nothing for ``suspect_after_s`` (and more than
``suspect_batches`` of its own batch times) is treated as gone: it gets no new prompts, and its
partitions are probed again as unknown once the group has had time to move them elsewhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field


class RoutingConfig(BaseModel):
    """How the curator picks a prompt's partition."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["least_delay", "key_hash"] = Field(
        default="least_delay",
        description="'least_delay': send each prompt where the feedback says it will be served soonest "
        "(for fleets of uneven speed); 'key_hash': Kafka's default partitioner on the prompt id.",
    )
    rate_alpha: float = Field(
        default=0.3, gt=0.0, le=1.0, description="Weight of the newest batch in a worker's speed estimate."
    )
    suspect_after_s: float = Field(
        default=15.0, gt=0, description="Seconds without feedback (with prompts outstanding) before a worker is suspect."
    )
    suspect_batches: float = Field(
        default=4.0, gt=0, description="…and at least this many of the worker's own batch times."
    )


class Router(Protocol):
    def choose(self, now: float) -> int | None:
        """The partition for the next prompt; None lets the producer's partitioner decide."""

    def dispatched(self, prompt_id: str, partition: int | None, now: float) -> None: ...

    def returned(self, prompt_id: str, worker_id: str, created_at: float, published_at: float, now: float) -> None: ...

    def report(self) -> dict[str, float]: ...


class KeyHashRouter:
    """Kafka's default: the producer hashes the prompt id. Feedback is ignored."""

    def choose(self, now: float) -> int | None:
        return None

    def dispatched(self, prompt_id: str, partition: int | None, now: float) -> None:
        pass

    def returned(self, prompt_id: str, worker_id: str, created_at: float, published_at: float, now: float) -> None:
        pass

    def report(self) -> dict[str, float]:
        return {}


@dataclass
class _Worker:
    rate: float | None = None  # groups per second of its own service time (EWMA over batches)
    batch_s: float = 0.0  # EWMA of its batch duration
    batch: tuple[float, float] | None = None  # (created_at, published_at) of the batch being counted
    batch_groups: int = 0
    last_return: float = 0.0
    partitions: set[int] = field(default_factory=set)
    served: int = 0
    batches: int = 0  # batches whose rate was sampled (groups of one batch may arrive split)


class LeastDelayRouter:
    """Least-expected-delay routing over the partitions of one prompt topic (see module doc)."""

    def __init__(self, partitions: int, config: RoutingConfig | None = None) -> None:
        if partitions < 1:
            raise ValueError("a prompt topic has at least one partition")
        self.config = config or RoutingConfig()
        self.partitions = partitions
        self.outstanding = [0] * partitions
        self.owner: list[str | None] = [None] * partitions
        self.workers: dict[str, _Worker] = {}
        self._where: dict[str, int] = {}  # prompt id -> partition, while outstanding
        self._busy_since = [0.0] * partitions  # when the partition last went from 0 to 1 outstanding
        self._next = 0  # rotates ties between equal partitions

    # -- estimates -------------------------------------------------------------------------
    def _mean_rate(self) -> float:
        rates = [r for w in self.workers.values() if (r := self.rate_of(w))]
        return sum(rates) / len(rates) if rates else 1.0

    def _patience_s(self, worker: _Worker) -> float:
        return max(self.config.suspect_after_s, self.config.suspect_batches * worker.batch_s)

    def _suspect(self, worker: _Worker, now: float) -> bool:
        """Prompts outstanding, and nothing back since it got them or last returned something."""
        since = [self._busy_since[p] for p in worker.partitions if self.outstanding[p]]
        return bool(since) and now - max(worker.last_return, min(since)) > self._patience_s(worker)

    def _forget_gone(self, now: float) -> None:
        """A worker silent for twice its patience is forgotten: its partitions are probed as unknown
        (the group has moved them to other members by then, or the worker was only idle)."""
        for worker_id, worker in list(self.workers.items()):
            if now - worker.last_return > 2 * self._patience_s(worker):
                for p in worker.partitions:
                    self.owner[p] = None
                del self.workers[worker_id]

    # -- routing ---------------------------------------------------------------------------
    def choose(self, now: float) -> int | None:
        self._forget_gone(now)
        default_rate = self._mean_rate()
        best: tuple[float, int, int] | None = None
        best_partition = 0
        for i in range(self.partitions):
            p = (self._next + i) % self.partitions
            owner = self.owner[p]
            worker = self.workers.get(owner) if owner is not None else None
            if worker is None:
                delay = (self.outstanding[p] + 1) / default_rate
            elif self._suspect(worker, now):
                delay = math.inf
            else:
                load = sum(self.outstanding[q] for q in worker.partitions)
                delay = (load + 1) / (self.rate_of(worker) or default_rate)
            key = (delay, self.outstanding[p], i)
            if best is None or key < best:
                best, best_partition = key, p
        if best is not None and math.isinf(best[0]):
            best_partition = min(range(self.partitions), key=lambda q: self.outstanding[q])  # all suspect: least loaded
        self._next = (best_partition + 1) % self.partitions
        return best_partition

    def dispatched(self, prompt_id: str, partition: int | None, now: float) -> None:
        if partition is None:
            return
        if self.outstanding[partition] == 0:
            self._busy_since[partition] = now
        self.outstanding[partition] += 1
        self._where[prompt_id] = partition

    def returned(self, prompt_id: str, worker_id: str, created_at: float, published_at: float, now: float) -> None:
        """A group of ``prompt_id`` came back from ``worker_id``. Unknown ids (dispatched before a
        restart, or a redelivered duplicate) still teach the worker's speed."""
        worker = self.workers.setdefault(worker_id, _Worker())
        worker.last_return = now
        worker.served += 1
        self._measure(worker, created_at, published_at)
        partition = self._where.pop(prompt_id, None)
        if partition is None:
            return
        self.outstanding[partition] -= 1
        previous = self.owner[partition]
        if previous != worker_id:
            if previous is not None and previous in self.workers:
                self.workers[previous].partitions.discard(partition)
            self.owner[partition] = worker_id
            worker.partitions.add(partition)

    def _measure(self, worker: _Worker, created_at: float, published_at: float) -> None:
        """Groups of one batch share ``created_at``; the batch took until its last ``published_at``."""
        if worker.batch is not None and worker.batch[0] == created_at:
            worker.batch = (created_at, max(worker.batch[1], published_at))
            worker.batch_groups += 1
        else:
            self._close_batch(worker)
            worker.batch, worker.batch_groups = (created_at, published_at), 1

    def _close_batch(self, worker: _Worker) -> None:
        if worker.batch is None:
            return
        duration = max(worker.batch[1] - worker.batch[0], 1e-3)
        worker.batches += 1
        sample = worker.batch_groups / duration
        a = self.config.rate_alpha
        worker.rate = sample if worker.rate is None else a * sample + (1 - a) * worker.rate
        worker.batch_s = duration if not worker.batch_s else a * duration + (1 - a) * worker.batch_s

    @staticmethod
    def rate_of(worker: _Worker) -> float | None:
        """Groups per second: the estimate over finished batches, else the batch being counted."""
        if worker.rate is not None:
            return worker.rate
        if worker.batch is None:
            return None
        return worker.batch_groups / max(worker.batch[1] - worker.batch[0], 1e-3)

    def report(self) -> dict[str, float]:
        out: dict[str, float] = {"outstanding": float(sum(self.outstanding))}
        for worker_id, worker in sorted(self.workers.items()):
            out[f"worker/{worker_id}/rate"] = round(self.rate_of(worker) or 0.0, 2)
            out[f"worker/{worker_id}/served"] = float(worker.served)
            out[f"worker/{worker_id}/batches"] = float(worker.batches)
            out[f"worker/{worker_id}/outstanding"] = float(sum(self.outstanding[p] for p in worker.partitions))
        return out


def build_router(config: RoutingConfig, partitions: int) -> Router:
    if config.type == "key_hash":
        return KeyHashRouter()
    return LeastDelayRouter(partitions, config)

