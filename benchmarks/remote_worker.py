"""Throughput of one rollout worker far from its broker, against the same worker on loopback.

    .venv/bin/python -m benchmarks.remote_worker --json

For each one-way delay (``--delays-ms``, 0 = loopback: the worker talks to the broker directly) a
Tansu broker (memory storage) listens on loopback; for a delay above 0 it sits behind a TCP relay
that holds every chunk of bytes that long in each direction (a round trip costs twice the delay),
standing for a worker in another region. Every client, the worker's included, knows the broker
only by the relay's address (it is the advertised listener). A real ``rlbus worker`` process
attaches to a fresh run (the default config's model built from scratch, weights v0 in a local
store) with ``--prompts`` prompts already queued. ``groups_per_s`` is the number of groups over the
time between the first group's and the last group's send times (their Kafka CreateTime), so the
worker's start-up is left out. Delays alternate and each runs ``--repeats`` times; the figure is
the median. The baseline is loopback, measured in the same invocation: ``ratio_<d>ms`` is the
groups/s at delay d over the loopback groups/s.
"""

from __future__ import annotations

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
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from benchmarks.options import JsonOption

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


@contextmanager
def _broker(delay_ms: float, log: Path):
    """A Tansu broker, behind a relay of ``delay_ms`` each way when that is above 0; yields the
    address every client uses."""
    from broker.admin import wait_for_broker
    from broker.embedded import resolve_tansu_binary
    from broker.settings import KafkaConfig

    broker_port = _free_port()
    client_port = _free_port() if delay_ms > 0 else broker_port
    with open(log, "wb") as fh:
        broker = subprocess.Popen(
            [resolve_tansu_binary(None), "broker", "--listener-url", f"tcp://127.0.0.1:{broker_port}",
             "--advertised-listener-url", f"tcp://127.0.0.1:{client_port}", "--storage-engine", "memory://"],
            stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, "NO_COLOR": "1"},
        )
    relay = None
    if delay_ms > 0:
        relay = multiprocessing.get_context("spawn").Process(
            target=_relay, args=(client_port, broker_port, delay_ms / 1000), daemon=True
        )
        relay.start()
    address = f"127.0.0.1:{client_port}"
    try:
        wait_for_broker(KafkaConfig(bootstrap_servers=address), timeout_s=60)
        yield address
    finally:
        if relay is not None:
            relay.terminate()
        broker.terminate()
        broker.wait(30)


def _prepare_run(run: str, address: str, store_dir: Path, model_dir: Path, prompts: int):
    from broker.admin import ensure_run_topics
    from broker.codec import encode_prompt
    from broker.producer import Producer
    from broker.schema import PromptRecord
    from broker.topics import Topics
    from rlbus.config import load_config, worker_descriptor
    from trainer.model import load_policy
    from weightstore.config import LocalStoreConfig, build_store
    from weightstore.modelfiles import publish_model_files, write_run_descriptor
    from weightstore.publish import WeightPublisher

    cfg = load_config(REPO / "configs" / "default.toml", [f"run.name={run}", f"kafka.bootstrap_servers={address}"],
                      environ={})
    topics = Topics(run)
    ensure_run_topics(cfg.kafka, topics, [cfg.run.policy], [cfg.run.policy])
    store = build_store(LocalStoreConfig(type="local", path=str(store_dir)))
    publish_model_files(store, cfg.run.policy, model_dir)
    write_run_descriptor(store, worker_descriptor(cfg))
    WeightPublisher(store, cfg.run.policy, cfg.weights).publish(0, load_policy(model_dir)[0].state_dict())
    producer = Producer(cfg.kafka)
    for i in range(prompts):
        a, b = i % 50, (7 * i) % 50
        record = PromptRecord(run=run, policy=cfg.run.policy, prompt_id=f"p{i}", task=cfg.run.task, prompt=f"{a}+{b}=",
                              answer=str(a + b), group_size=cfg.sampling.group_size, dispatch_version=0)
        producer.produce(topics.prompts(cfg.run.policy), encode_prompt(record), key=record.prompt_id.encode())
    producer.flush(120)
    producer.close()
    return cfg, topics


def _measure(cfg, topics, store_dir: Path, prompts: int, unacked_bytes: int | None, log: Path) -> float:
    """Groups per second between the first group's send time and the last's (Kafka CreateTime)."""
    from broker.reader import PartitionReader

    cmd = [sys.executable, "-m", "rlbus.cli", "worker", "--broker", cfg.kafka.bootstrap_servers, "--store",
           str(store_dir), "--id", "bench"]
    if unacked_bytes is not None:
        cmd += ["--set", f"worker.max_unacked_bytes={unacked_bytes}"]
    reader = PartitionReader(cfg.kafka, topics.trajectories(cfg.run.policy))
    with open(log, "wb") as fh:
        worker = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                                  cwd=REPO)
    stamps: list[int] = []
    try:
        deadline = time.monotonic() + 900
        while len(stamps) < prompts:
            if worker.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"worker stopped or stalled at {len(stamps)}/{prompts} groups; see {log}")
            stamps += [r.timestamp_ms for r in reader.read(1000, 1.0)]
    finally:
        worker.terminate()
        worker.wait(60)
        reader.close()
    stamps.sort()
    return (len(stamps) - 1) / max((stamps[-1] - stamps[0]) / 1000, 1e-9)


def main(
    delays_ms: Annotated[str, typer.Option(help="One-way delays, ms; 0 (loopback) is the baseline.")] = "0,25,100",
    prompts: Annotated[int, typer.Option(help="Prompts queued per measurement.")] = 2000,
    repeats: Annotated[int, typer.Option(help="Measurements per delay; the figure is the median.")] = 2,
    unacked_bytes: Annotated[
        int | None, typer.Option(help="worker.max_unacked_bytes of the worker (default: the config's).")
    ] = None,
    json_out: JsonOption = False,
) -> None:
    """Groups/s of a worker 25 and 100 ms from its broker against the same worker on loopback."""
    from rlbus.config import load_config
    from rlbus.examples.addition import build_model

    delays = [float(x) for x in delays_ms.split(",")]
    if 0 not in delays:
        raise typer.BadParameter("the delays must include 0, the loopback baseline", param_hint="--delays-ms")
    tmp = Path(tempfile.mkdtemp(prefix="rlbus-remote-worker-"))
    cfg = load_config(REPO / "configs" / "default.toml", [], environ={})
    model_dir = build_model(tmp / "model", **cfg.example.model.model_dump())
    results: dict[float, list[float]] = {d: [] for d in delays}
    for repeat in range(repeats):
        for delay in delays:
            name = f"remote{repeat}d{int(delay)}"
            with _broker(delay, tmp / f"{name}-broker.log") as address:
                run_cfg, topics = _prepare_run(name, address, tmp / name, model_dir, prompts)
                rate = _measure(run_cfg, topics, tmp / name, prompts, unacked_bytes, tmp / f"{name}.log")
            results[delay].append(rate)
            print(f"[{delay:g} ms] {rate:.1f} groups/s", file=sys.stderr, flush=True)
    median = {d: statistics.median(v) for d, v in results.items()}
    out = {
        "prompts": prompts,
        "group_size": cfg.sampling.group_size,
        "max_prompts_per_poll": cfg.worker.max_prompts_per_poll,
        "max_unacked_bytes": cfg.worker.max_unacked_bytes if unacked_bytes is None else unacked_bytes,
        "repeats": repeats,
        "loopback_groups_per_s": round(median[0], 1),
        **{f"groups_per_s_{d:g}ms": round(median[d], 1) for d in delays if d},
        **{f"ratio_{d:g}ms": round(median[d] / median[0], 3) for d in delays if d},
        "runs": {f"{d:g}ms": [round(x, 1) for x in v] for d, v in results.items()},
    }
    print(json.dumps(out, indent=None if json_out else 1))


if __name__ == "__main__":
    typer.run(main)
