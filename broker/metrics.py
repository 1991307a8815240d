"""Every role's OpenTelemetry instruments, named in one place so that names and units agree.

They record nothing until the process configures a meter provider (``rlbus.observability``: a
Prometheus endpoint and/or OTLP); Prometheus shows ``rlbus.trainer.groups`` as
``rlbus_trainer_groups_total`` and so on.

| instrument | kind | unit | attributes |
|---|---|---|---|
| ``rlbus.trainer.groups``, ``rlbus.trainer.tokens`` | counter | groups, tokens trained | policy |
| ``rlbus.trainer.wait_fraction`` | gauge | share of the last step spent waiting for groups | policy |
| ``rlbus.trainer.staleness`` | histogram | versions behind, per trained group | policy |
| ``rlbus.trainer.version`` | gauge | newest published version | policy |
| ``rlbus.weights.publish.duration``, ``rlbus.weights.publish.size`` | histogram | s, bytes | policy, kind |
| ``rlbus.weights.propagation`` | gauge | s from publishing a version to the last live worker using it | policy |
| ``rlbus.worker.groups``, ``rlbus.worker.tokens`` | counter | groups published, tokens generated | policy |
| ``rlbus.worker.generate.duration`` | histogram | s per batch | workflow |
| ``rlbus.worker.version`` | gauge | weight version loaded | policy |
| ``rlbus.weights.follow.duration`` | histogram | s from a version's manifest to its load | policy, path |
| ``rlbus.curator.dispatched``, ``rlbus.curator.redispatched`` | counter | prompts | workflow |
| ``rlbus.curator.in_flight`` | gauge | prompts dispatched and not consumed | workflow |
| ``rlbus.dlq.records`` | counter | records parked in the DLQ | role, reason |
| ``rlbus.consumer.lag`` | gauge | records of the topic the group has not read | group, topic |
"""

from __future__ import annotations

import re
from functools import cache

from opentelemetry import metrics


def _meter() -> metrics.Meter:
    return metrics.get_meter("rlbus")


@cache
def counter(name: str, unit: str, description: str) -> metrics.Counter:
    return _meter().create_counter(name, unit=unit, description=description)


@cache
def histogram(name: str, unit: str, description: str) -> metrics.Histogram:
    return _meter().create_histogram(name, unit=unit, description=description)


@cache
def gauge(name: str, unit: str, description: str) -> metrics.Gauge:
    return _meter().create_gauge(name, unit=unit, description=description)


def dlq(role: str, reason: str) -> None:
    """Count one record parked in the DLQ, by the kind of its reason (numbers and quoted names
    taken out, so that the label takes few values)."""
    kind = re.sub(r"\d+", "N", re.sub(r"'[^']*'", "'…'", reason.split(":")[0]))[:80]
    counter("rlbus.dlq.records", "{record}", "Records parked in the DLQ").add(1, {"role": role, "reason": kind})


def lag(group: str, topic: str, records: int) -> None:
    gauge("rlbus.consumer.lag", "{record}", "Records of the topic the consumer group has not read").set(
        records, {"group": group, "topic": topic})
