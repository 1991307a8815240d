"""Produce→consume latency and groups/s through the Kafka layer (``broker.producer``, ``broker.reader``).

    .venv/bin/python -m benchmarks.kafka_layer --json

An embedded Tansu broker (memory storage) on loopback; records are encoded trajectory groups of
the default run's shape (G = 8, 3-token completions), read by a member of a consumer group that
already holds the topic's partition.

* ``latency_ms_*``: one group at a time is sent and read back; the time from the send call to its
  arrival, median and p90.
* ``groups_per_s``: ``--groups`` groups sent as fast as the producer takes them while the member
  reads; groups over the time from the first send to the last arrival.
* ``groups_per_s_one_ack_at_a_time`` (the baseline): the same, each send waiting for its
  acknowledgement before the next, as a producer that does not pipeline would.

``--storage memory --storage seaweedfs`` measures the broker's storage engines in turn: memory (the
baseline) and Tansu's ``s3://`` engine on a local SeaweedFS server (``weightstore.embedded``; a log
that survives a broker crash), one JSON object per engine. ``group_start_s``: from a consumer-group
member's subscription to its partition assignment.

``--log-growth 1000,10000,25000`` measures, on the memory engine, how the broker's CPU per record
grows with the record batches already in the topic (8 partitions): for each size, the topic is
filled to it one record per batch (as a run's curator and workers produce at their rates), then
records go one at a time (produce, read back) and the broker process's CPU (``/proc``) per record
is printed beside the ping latency; the first size is the baseline. ``scan_s_per_batch`` is the
slope: broker CPU per record per batch already in its partition.

Two ways through the layer: ``threads`` (``Producer.produce`` and ``GroupReader.read`` from plain
threads, as the trainer intake and the curator use them) and ``asyncio`` (``Producer.send`` awaited
on an event loop and ``read`` in a worker thread, as the rollout worker uses them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from benchmarks.options import JsonOption
from broker.admin import ensure_topics
from broker.codec import encode_group
from broker.embedded import EmbeddedBroker, EmbeddedBrokerConfig
from broker.producer import Producer
from broker.reader import GroupReader
from broker.schema import SamplingParams, TrajectoryGroup, TrajectoryHeader
from broker.settings import KafkaConfig


def _group(i: int) -> bytes:
    rng = np.random.default_rng(i)
    g, n = 8, 3
    header = TrajectoryHeader(
        run="bench", policy="main", group_id=f"g{i}", prompt_id=f"p{i}", task="addition", worker_id="w",
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=n), rewards=[1.0, 0.0] * (g // 2),
        finish_reasons=["stop"] * g, min_version=0, max_version=0, vocab_size=21, created_at=time.time(),
    )
    tokens = rng.integers(4, 21, g * n, dtype=np.int32)
    return encode_group(TrajectoryGroup(
        header=header, prompt_tokens=np.array([1, 7, 8, 14, 9, 10, 17], np.int32), completion_tokens=tokens,
        completion_offsets=np.arange(0, g * n + 1, n, dtype=np.int32),
        behaviour_logprobs=-rng.random(g * n, dtype=np.float32), token_versions=np.zeros(g * n, np.int32),
    ))


def _member(kafka: KafkaConfig, topic: str) -> tuple[GroupReader, float]:
    """A member of a new group holding the topic's partition, and the seconds it took to get it."""
    started = time.perf_counter()
    reader = GroupReader(kafka, f"bench-{uuid.uuid4().hex[:6]}", [topic])
    while not reader.assignment():
        reader.read(1, 0.1)
    return reader, time.perf_counter() - started


def _read_all(reader: GroupReader, count: int) -> float:
    received = 0
    while received < count:
        received += len(reader.read(500, 1.0))
    return time.perf_counter()


def _stats(latencies_s: list[float], rate: float, rate_one_ack: float, size: int, group_start_s: float) -> dict:
    ms = sorted(x * 1000 for x in latencies_s)
    return {"group_start_s": round(group_start_s, 2), "latency_ms_median": round(statistics.median(ms), 2), "latency_ms_p90": round(ms[int(0.9 * len(ms))], 2),
            "groups_per_s": round(rate), "groups_per_s_one_ack_at_a_time": round(rate_one_ack), "record_bytes": size}


def _threads(kafka: KafkaConfig, topic: str, pings: int, groups: list[bytes], one_ack: int) -> dict:
    (reader, joined_s), producer = _member(kafka, topic), Producer(kafka)
    try:
        latencies = []
        for i in range(pings):
            started = time.perf_counter()
            producer.produce(topic, groups[i % len(groups)], key=b"k")
            while not reader.read(64, 1.0):
                pass
            latencies.append(time.perf_counter() - started)
        rates = []
        for count, wait in ((len(groups), False), (one_ack, True)):
            ended: list[float] = []
            thread = threading.Thread(target=lambda n=count: ended.append(_read_all(reader, n)))
            thread.start()
            started = time.perf_counter()
            for value in groups[:count]:
                if wait:
                    producer.send_and_wait(topic, value, key=b"k")
                else:
                    producer.produce(topic, value, key=b"k")
            thread.join()
            rates.append(count / (ended[0] - started))
        return _stats(latencies, rates[0], rates[1], len(groups[0]), joined_s)
    finally:
        producer.close()
        reader.close()


async def _asyncio(kafka: KafkaConfig, topic: str, pings: int, groups: list[bytes], one_ack: int) -> dict:
    (reader, joined_s), producer = await asyncio.to_thread(_member, kafka, topic), Producer(kafka)
    try:
        latencies = []
        for i in range(pings):
            started = time.perf_counter()
            producer.send(topic, groups[i % len(groups)], key=b"k")
            while not await asyncio.to_thread(reader.read, 64, 1.0):
                pass
            latencies.append(time.perf_counter() - started)
        rates = []
        for count, wait in ((len(groups), False), (one_ack, True)):
            reading = asyncio.create_task(asyncio.to_thread(_read_all, reader, count))
            started = time.perf_counter()
            sent = []
            for value in groups[:count]:
                sent.append(producer.send(topic, value, key=b"k"))
                if wait:
                    await sent[-1]
            await asyncio.gather(*sent)
            rates.append(count / (await reading - started))
        return _stats(latencies, rates[0], rates[1], len(groups[0]), joined_s)
    finally:
        await asyncio.to_thread(producer.close)
        await asyncio.to_thread(reader.close)


GROWTH_PARTITIONS = 8


def log_growth(sizes: list[int], per_size: int = 1000) -> list[dict]:
    """Broker CPU and latency per produce→read cycle at each log size (see the module doc)."""
    from rlbus.supervisor import CpuMeter

    meter = CpuMeter(Path(os.devnull))
    values = [_group(i) for i in range(1000)]
    out = []
    with tempfile.TemporaryDirectory() as tmp, \
            EmbeddedBroker(EmbeddedBrokerConfig(storage_url="memory://"), Path(tmp) / "broker.log") as broker:
        kafka = KafkaConfig(bootstrap_servers=broker.address)
        topic = f"bench-growth-{uuid.uuid4().hex[:6]}"
        ensure_topics(kafka, {topic: GROWTH_PARTITIONS})
        (reader, _), producer = _member(kafka, topic), Producer(kafka)
        try:
            in_log = 0
            for size in sizes:
                for i in range(in_log, size):
                    producer.produce(topic, values[i % len(values)], key=str(i).encode())
                    producer.flush(10)  # one batch per record
                producer.flush(120)
                _read_all(reader, size - in_log)
                cpu0, latencies = meter.cpu_seconds(broker.pid), []
                for i in range(per_size):
                    started = time.perf_counter()
                    producer.produce(topic, values[i % len(values)], key=str(size + i).encode())
                    while not reader.read(64, 1.0):
                        pass
                    latencies.append(time.perf_counter() - started)
                in_log = size + per_size
                row = {"records_in_log": size, "broker_cpu_ms_per_record": round((meter.cpu_seconds(broker.pid) - cpu0) / per_size * 1000, 3),
                       "latency_ms_median": round(statistics.median(latencies) * 1000, 2)}
                print(f"[growth] {row}", file=sys.stderr, flush=True)
                out.append(row)
        finally:
            producer.close()
            reader.close()
    return out


def scan_slope(rows: list[dict], partitions: int = GROWTH_PARTITIONS) -> float:
    """Least-squares slope of broker CPU per record (s) against the batches already in a partition."""
    xs = [r["records_in_log"] / partitions for r in rows]
    ys = [r["broker_cpu_ms_per_record"] / 1000 for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main(
    pings: Annotated[int, typer.Option(help="Records sent one at a time for the latency.")] = 200,
    groups: Annotated[int, typer.Option(help="Records sent for the throughput.")] = 20_000,
    one_ack_groups: Annotated[int, typer.Option(help="Records sent one acknowledgement at a time.")] = 500,
    storage: Annotated[list[str], typer.Option(
        help="Broker storage engines to measure, each in turn: memory (the baseline) and seaweedfs (Tansu's s3:// "
        "engine on a local SeaweedFS server, a durable log).")] = ["memory"],  # noqa: B006
    log_growth_sizes: Annotated[str | None, typer.Option("--log-growth", help="Comma-separated log sizes: measure "
        "the memory engine's broker CPU per record at each instead (see the module doc).")] = None,
    json_out: JsonOption = False,
) -> None:
    """Produce→consume latency and groups/s through the Kafka layer."""
    if log_growth_sizes:
        rows = log_growth([int(x) for x in log_growth_sizes.split(",")])
        base = rows[0]["broker_cpu_ms_per_record"]
        print(json.dumps({"log_growth": rows, "scan_s_per_batch": scan_slope(rows),
                          "cpu_per_record_vs_first": [round(r["broker_cpu_ms_per_record"] / base, 2) for r in rows]},
                         indent=None if json_out else 1))
        return
    values = [_group(i) for i in range(groups)]
    results = {}
    for engine in storage:
        with tempfile.TemporaryDirectory() as tmp, _storage(engine) as (url, env), \
                EmbeddedBroker(EmbeddedBrokerConfig(storage_url=url), Path(tmp) / "broker.log", env=env) as broker:
            kafka = KafkaConfig(bootstrap_servers=broker.address)
            out = {}
            for name in ("threads", "asyncio"):
                topic = f"bench-{name}-{uuid.uuid4().hex[:6]}"
                ensure_topics(kafka, {topic: 1})
                if name == "threads":
                    out[name] = _threads(kafka, topic, pings, values, one_ack_groups)
                else:
                    out[name] = asyncio.run(_asyncio(kafka, topic, pings, values, one_ack_groups))
                print(f"[{engine} {name}] {out[name]}", file=sys.stderr, flush=True)
        results[engine] = out
    print(json.dumps(results if len(storage) > 1 else results[storage[0]], indent=None if json_out else 1))


@contextlib.contextmanager
def _storage(engine: str):
    """(storage URL, extra environment of the broker) for ``engine``; seaweedfs runs a SeaweedFS
    server meanwhile."""
    if engine == "memory":
        yield "memory://", {}
        return
    if engine != "seaweedfs":
        raise typer.BadParameter(f"storage {engine!r}: memory or seaweedfs")
    from weightstore.embedded import EmbeddedS3

    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedS3(Path(tmp), access_key_id="bench", secret_access_key="bench-secret", buckets=("tansu",))
        try:
            server.start()
            yield "s3://tansu/", server.aws_environment()
        finally:
            server.stop()


if __name__ == "__main__":
    typer.run(main)
