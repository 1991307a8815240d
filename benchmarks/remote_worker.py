"""Throughput of one rollout worker far from its broker: acknowledgements awaited in line or while
the next batch generates.

    .venv/bin/python -m benchmarks.remote_worker --json

A Tansu broker (memory storage) listens on loopback behind a TCP relay that holds every chunk of
bytes for ``--delay-ms`` in each direction (so a round trip costs twice that), standing for a
worker in another region; every client, the worker's included, knows the broker only by the
relay's address (it is the advertised listener). For each setting of
``worker.max_unacked_batches`` a real ``rlbus worker`` process attaches to a fresh run (the
default config's model built from scratch, weights v0 in a local store), with ``--prompts``
prompts already queued. ``groups_per_s`` is the number of groups over the time between the first
group's and the last group's send times (their Kafka CreateTime), so the worker's start-up is
left out. Settings alternate and each runs ``--repeats`` times; the figure is the median.

The baseline is ``max_unacked_batches = 0``: each batch waits for its groups' acknowledgement
and its offset commit (two round trips) before the next batch starts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _relay(listen: int, target: int, delay_s: float) -> None:
    """Forward every connection on ``listen`` to ``target``, each chunk ``delay_s`` late, in order."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while (item := await queue.get())[1]:
                await asyncio.sleep(max(0.0, item[0] - time.monotonic()))
                writer.write(item[1])
                await writer.drain()
            writer.close()

        sender = asyncio.create_task(deliver())
        try:
            while data := await reader.read(1 << 16):
                queue.put_nowait((time.monotonic() + delay_s, data))
        except ConnectionError:
            pass  # a client that stops closes abruptly
        queue.put_nowait((0.0, b""))
        await asyncio.gather(sender, return_exceptions=True)

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", target)
        await asyncio.gather(pipe(client_r, server_w), pipe(server_r, client_w), return_exceptions=True)

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", listen)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def _prepare_run(run: str, address: str, store_dir: Path, model_dir: Path, prompts: int):
    from confluent_kafka import Producer

    from broker.codec import encode_prompt
    from broker.schema import PromptRecord
    from broker.topics import Topics
    from rlbus.config import load_config
    from rlbus.roles import ensure_run_topics, worker_descriptor
    from trainer.basemodel import load_policy
    from weightstore.config import LocalStoreConfig, build_store
    from weightstore.modelfiles import publish_model_files, write_run_descriptor
    from weightstore.publish import WeightPublisher

    cfg = load_config(REPO / "configs" / "default.toml",
                      [f"run.name={run}", f"kafka.bootstrap_servers={json.dumps(address)}"], environ={})
    store = build_store(LocalStoreConfig(type="local", path=str(store_dir)))
    ensure_run_topics(cfg)
    publish_model_files(store, cfg.run.policy, model_dir)
    write_run_descriptor(store, worker_descriptor(cfg))
    WeightPublisher(store, cfg.run.policy, cfg.weights).publish(0, load_policy(model_dir)[0].state_dict())
    producer = Producer(cfg.kafka_config().confluent_producer_conf())
    topics = Topics(run)
    for i in range(prompts):
        a, b = i % cfg.data.max_operand, (7 * i) % cfg.data.max_operand
        record = PromptRecord(run=run, policy=cfg.run.policy, prompt_id=f"p{i}", task=cfg.run.task, prompt=f"{a}+{b}=",
                              answer=str(a + b), group_size=cfg.sampling.group_size, dispatch_version=0)
        producer.produce(topics.prompts(cfg.run.policy), value=encode_prompt(record), key=record.prompt_id.encode())
    if producer.flush(60) != 0:
        raise SystemExit("prompts were not acknowledged by the broker within 60s")
    return cfg, topics


def _measure(cfg, topics, store_dir: Path, unacked: int, prompts: int, log: Path) -> float:
    """Groups per second between the first group's send time and the last's (Kafka CreateTime)."""
    from broker.admin import end_offsets

    kafka = cfg.kafka_config()
    topic = topics.trajectories(cfg.run.policy)
    cmd = [sys.executable, "-m", "rlbus.cli", "worker", "--broker", kafka.bootstrap_servers, "--store", str(store_dir),
           "--id", f"bench-{unacked}", "--set", f"worker.max_unacked_batches={unacked}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log, "wb") as fh:
        worker = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 600
        while (done := sum(end_offsets(kafka, topic).values())) < prompts:
            if worker.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"worker stopped or stalled at {done}/{prompts} groups; see {log}")
            time.sleep(0.2)
    finally:
        worker.terminate()
        worker.wait(60)
    stamps = sorted(_create_times(kafka, topic, prompts))
    return (len(stamps) - 1) / max((stamps[-1] - stamps[0]) / 1000, 1e-9)


def _create_times(kafka, topic: str, count: int) -> list[int]:
    """The CreateTime (ms) of the first ``count`` records of ``topic``."""
    from confluent_kafka import Consumer, TopicPartition

    reader = Consumer(kafka.confluent_consumer_conf(f"{topic}.bench"))
    stamps: list[int] = []
    try:
        parts = reader.list_topics(topic, timeout=30).topics[topic].partitions
        reader.assign([TopicPartition(topic, p, 0) for p in parts])
        deadline = time.monotonic() + 120
        while len(stamps) < count and time.monotonic() < deadline:
            stamps += [m.timestamp()[1] for m in reader.consume(num_messages=1000, timeout=1.0) if m.error() is None]
    finally:
        reader.close()
    if len(stamps) < count:
        raise SystemExit(f"read back {len(stamps)} of {count} groups from {topic}")
    return stamps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay-ms", type=float, default=25.0, help="One-way delay of the relay, ms.")
    parser.add_argument("--prompts", type=int, default=2000, help="Prompts queued per measurement.")
    parser.add_argument("--unacked", default="0,1,2",
                        help="Settings of worker.max_unacked_batches; the first is the baseline.")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="Print one JSON object.")
    args = parser.parse_args()
    settings = [int(x) for x in args.unacked.split(",")]

    from broker.admin import wait_for_broker
    from broker.embedded import resolve_tansu_binary
    from broker.settings import KafkaConfig
    from rlbus.config import load_config
    from trainer.basemodel import build_base_model

    tmp = Path(tempfile.mkdtemp(prefix="rlbus-remote-worker-"))
    m = load_config(REPO / "configs" / "default.toml", [], environ={}).model
    model_dir = build_base_model(tmp / "model", arch=m.arch, hidden_size=m.hidden_size, layers=m.layers, heads=m.heads,
                                 intermediate_size=m.intermediate_size)
    broker_port, relay_port = _free_port(), _free_port()
    with open(tmp / "broker.log", "wb") as log:
        broker = subprocess.Popen(
            [resolve_tansu_binary(None), "broker", "--listener-url", f"tcp://127.0.0.1:{broker_port}",
             "--advertised-listener-url", f"tcp://127.0.0.1:{relay_port}", "--storage-engine", "memory://"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "NO_COLOR": "1"},
        )
    relay = multiprocessing.get_context("spawn").Process(
        target=_relay, args=(relay_port, broker_port, args.delay_ms / 1000), daemon=True
    )
    relay.start()
    address = f"127.0.0.1:{relay_port}"
    results: dict[int, list[float]] = {k: [] for k in settings}
    try:
        wait_for_broker(KafkaConfig(bootstrap_servers=address), timeout_s=60)
        for repeat in range(args.repeats):
            for unacked in settings:
                run = f"remote{repeat}u{unacked}"
                cfg, topics = _prepare_run(run, address, tmp / run, model_dir, args.prompts)
                rate = _measure(cfg, topics, tmp / run, unacked, args.prompts, tmp / f"{run}.log")
                results[unacked].append(rate)
                print(f"[max_unacked_batches={unacked}] {rate:.1f} groups/s", file=sys.stderr, flush=True)
    finally:
        relay.terminate()
        broker.terminate()
        broker.wait(30)
    median = {k: round(statistics.median(v), 1) for k, v in results.items()}
    base = settings[0]
    out = {
        "one_way_delay_ms": args.delay_ms,
        "prompts": args.prompts,
        "group_size": cfg.sampling.group_size,
        "max_prompts_per_poll": cfg.worker.max_prompts_per_poll,
        "repeats": args.repeats,
        "baseline_max_unacked_batches": base,
        "baseline_groups_per_s": median[base],
        "groups_per_s": {str(k): median[k] for k in settings},
        "speedup": {str(k): round(median[k] / median[base], 2) for k in settings if k != base},
        "runs": {str(k): [round(x, 1) for x in v] for k, v in results.items()},
    }
    print(json.dumps(out, indent=None if args.json else 1))


if __name__ == "__main__":
    main()
