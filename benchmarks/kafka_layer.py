"""Produce→consume latency and groups/s of the Kafka clients, as the roles use them.

    .venv/bin/python -m benchmarks.kafka_layer --json

An embedded Tansu broker (memory storage) on loopback; records are encoded trajectory groups of
the default run's shape (G = 8, 3-token completions). For each client:

* ``latency``: one group at a time is sent and read back by a consumer-group member that already
  holds the topic's partition; the time from the send call to its arrival, median and p90 (ms).
* ``groups_per_s``: ``--groups`` groups sent as fast as the producer takes them while the same
  member reads; groups over the time from the first send to the last arrival.

Clients: ``aiokafka`` (the rollout worker's producer and prompt consumer) and ``confluent``
(the trainer intake's consumer and the curator's producer), each with the settings
``broker.settings.KafkaConfig`` gives it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np

from broker.admin import ensure_topics
from broker.codec import encode_group
from broker.embedded import EmbeddedBroker, EmbeddedBrokerConfig
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


def _summary(latencies_s: list[float], rate: float, size: int) -> dict:
    ms = sorted(x * 1000 for x in latencies_s)
    return {"latency_ms_median": round(statistics.median(ms), 2), "latency_ms_p90": round(ms[int(0.9 * len(ms))], 2),
            "groups_per_s": round(rate, 1), "record_bytes": size}


# ----------------------------------------------------------------------------- aiokafka


async def _aiokafka(kafka: KafkaConfig, topic: str, pings: int, groups: list[bytes]) -> dict:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    consumer = AIOKafkaConsumer(topic, **kafka.aiokafka_consumer_kwargs(f"bench-{uuid.uuid4().hex[:6]}"))
    producer = AIOKafkaProducer(**kafka.aiokafka_producer_kwargs())
    await consumer.start()
    await producer.start()
    try:
        while not consumer.assignment():
            await consumer.getmany(timeout_ms=100)
        latencies = []
        for i in range(pings):
            started = time.perf_counter()
            await producer.send(topic, groups[i % len(groups)], key=b"k")
            got = 0
            while not got:
                got = sum(len(v) for v in (await consumer.getmany(timeout_ms=1000, max_records=64)).values())
            latencies.append(time.perf_counter() - started)
        received = 0

        async def read() -> float:
            nonlocal received
            while received < len(groups):
                received += sum(len(v) for v in (await consumer.getmany(timeout_ms=1000, max_records=500)).values())
            return time.perf_counter()

        reader = asyncio.create_task(read())
        started = time.perf_counter()
        for value in groups:
            await producer.send(topic, value, key=b"k")
        ended = await reader
        return _summary(latencies, len(groups) / (ended - started), len(groups[0]))
    finally:
        await producer.stop()
        await consumer.stop()


# ----------------------------------------------------------------------------- confluent-kafka


def _confluent(kafka: KafkaConfig, topic: str, pings: int, groups: list[bytes]) -> dict:
    from confluent_kafka import Consumer, Producer

    from broker.fetch import ContiguousReader

    consumer = Consumer(kafka.confluent_consumer_conf(f"bench-{uuid.uuid4().hex[:6]}"))
    consumer.subscribe([topic])
    reader = ContiguousReader(consumer)
    producer = Producer(kafka.confluent_producer_conf())
    try:
        while not consumer.assignment():
            reader.read(1, 0.1)
        latencies = []
        for i in range(pings):
            started = time.perf_counter()
            producer.produce(topic, groups[i % len(groups)], key=b"k")
            producer.poll(0)
            while not reader.read(64, 1.0):
                pass
            latencies.append(time.perf_counter() - started)
        received, ended = 0, 0.0

        def read() -> None:
            nonlocal received, ended
            while received < len(groups):
                received += len(reader.read(500, 1.0))
            ended = time.perf_counter()

        thread = threading.Thread(target=read)
        thread.start()
        started = time.perf_counter()
        for value in groups:
            while True:
                try:
                    producer.produce(topic, value, key=b"k")
                    break
                except BufferError:
                    producer.poll(0.01)
            producer.poll(0)
        producer.flush(60)
        thread.join()
        return _summary(latencies, len(groups) / (ended - started), len(groups[0]))
    finally:
        consumer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pings", type=int, default=200, help="Records sent one at a time for the latency.")
    parser.add_argument("--groups", type=int, default=20_000, help="Records sent for the throughput.")
    parser.add_argument("--json", action="store_true", help="Print one JSON object.")
    args = parser.parse_args()
    groups = [_group(i) for i in range(args.groups)]
    with tempfile.TemporaryDirectory() as tmp, EmbeddedBroker(EmbeddedBrokerConfig(), Path(tmp) / "broker.log") as broker:
        kafka = KafkaConfig(bootstrap_servers=broker.address)
        out = {}
        for name in ("aiokafka", "confluent"):
            topic = f"bench-{name}-{uuid.uuid4().hex[:6]}"
            ensure_topics(kafka, {topic: 1})
            if name == "aiokafka":
                out[name] = asyncio.run(_aiokafka(kafka, topic, args.pings, groups))
            else:
                out[name] = _confluent(kafka, topic, args.pings, groups)
            print(f"[{name}] {out[name]}", file=sys.stderr, flush=True)
    print(json.dumps(out, indent=None if args.json else 1))


if __name__ == "__main__":
    main()
