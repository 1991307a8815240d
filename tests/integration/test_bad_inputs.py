"""A corpus of bad trajectory records on the real broker, signed fleet: each costs one record (DLQ
with its reason, or counted as a duplicate), none is trained on, the intake never stops."""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import zstandard

from broker.codec import encode_claim, encode_group, encode_prompt
from broker.producer import Producer
from broker.schema import PromptRecord
from consumers.intake import IntakeConfig, TrainerIntake
from tests.integration.test_rollout_path import _group, _read_dlq
from tests.unit.test_codec import _columns, _frame
from weightstore.claims import put_claim
from weightstore.objectstore import LocalDirStore

pytestmark = pytest.mark.integration

KEY = b"fleet-key"


def _mutated(run, gid: str, mutate) -> bytes:
    """A frame of a valid group with one rule broken (written by hand: encode_group refuses it)."""
    group = _group(run, gid, vocab=64)
    header, columns = group.header.model_dump(mode="json"), {k: v.copy() for k, v in _columns(group).items()}
    mutate(header, columns)
    return _frame(header, columns)


def _with_signature(group, signature: str) -> bytes:
    group.header = group.header.model_copy(update={"signature": signature})
    return encode_group(group)  # no key: the signature is written as given


def _raw(payload: bytes) -> bytes:
    return b"RLBG" + struct.pack("<H", 1) + zstandard.ZstdCompressor(level=1).compress(payload)


def _corpus(run, store: LocalDirStore, limit: int) -> list[tuple[str, bytes]]:
    rng = np.random.default_rng(7)
    good = encode_group(_group(run, "p-template", vocab=64), signing_key=KEY)
    bad: list[tuple[str, bytes]] = []
    bad += [(f"random {n} bytes", rng.integers(0, 256, n, dtype=np.uint8).tobytes()) for n in (1, 2, 3, 5, 6, 7, 16, 64, 255, 999, 5000, 70000)]
    bad += [("empty value", b"")]
    bad += [(f"truncated at {k}", good[:k]) for k in (1, 4, 5, 6, 8, 10, len(good) // 2, len(good) - 1)]
    prompt = PromptRecord(run=run.topics.run, policy="main", prompt_id="x", task="addition", prompt="1+1=",
                          answer="2", group_size=2, dispatch_version=0)
    bad += [("a prompt record", encode_prompt(prompt))]
    bad += [("header length 2^31", _raw(struct.pack("<I", 2**31) + b"{}")),
            ("column of 2^40 elements", _raw(struct.pack("<I", 2) + b"{}" + struct.pack("<H", 1) + struct.pack("<BQ", 1, 2**40))),
            ("zip bomb", _raw(b"\0" * (300 * 1024 * 1024))),
            ("header not JSON", _raw(struct.pack("<I", 5) + b"{oops"))]

    def col(name, i, value):
        return lambda h, c: c[name].__setitem__(i, value)

    def head(**kv):
        return lambda h, c: h.update(kv)

    mutations = {
        "token id over the vocabulary": col("completion_tokens", 0, 100),
        "negative token id": col("prompt_tokens", 0, -1),
        "NaN log-prob": col("behaviour_logprobs", 0, np.nan),
        "positive log-prob": col("behaviour_logprobs", 1, 0.5),
        "loss mask 2": col("loss_mask", 0, 2),
        "token version outside the range": col("token_versions", 0, 3),
        "offsets not monotonic": lambda h, c: c.__setitem__("completion_offsets", np.array([0, 2, 1], np.int32)),
        "offsets past the tokens": lambda h, c: c.__setitem__("completion_offsets", np.array([0, 1, 9], np.int32)),
        "infinite reward": head(rewards=[float("inf"), 0.0]),
        "three rewards for two samples": head(rewards=[1.0, 0.0, 1.0]),
        "schema version 99": head(schema_version=99),
        "unknown header field": head(surprise=1),
        "min_version above max_version": head(min_version=3, max_version=2),
        "empty group id": head(group_id=""),
        "vocab size 0": head(vocab_size=0),
    }
    bad += [(name, _mutated(run, f"p-mut{i}", m)) for i, (name, m) in enumerate(mutations.items())]

    def signed(gid: str, **header) -> bytes:
        group = _group(run, gid, vocab=64)
        group.header = group.header.model_copy(update=header)
        if "max_version" in header:
            group.token_versions = np.full(len(group.token_versions), header["max_version"], np.int32)
        return encode_group(group, signing_key=KEY)

    bad += [("another run, signed", signed("p-run", run="elsewhere")),
            ("another policy, signed", signed("p-policy", policy="other")),
            ("version 10^6, signed", signed("p-future", min_version=10**6, max_version=10**6)),
            ("unsigned", encode_group(_group(run, "p-unsigned", vocab=64))),
            ("signed with another key", encode_group(_group(run, "p-forged", vocab=64), signing_key=b"other")),
            ("signature of zeros", _with_signature(_group(run, "p-altered", vocab=64), "0" * 64)),
            ("oversize record", b"\0" * (limit + 1))]
    for name, mangle in (("missing", "delete"), ("tampered", "flip"), ("of another run", "run")):
        data = signed(f"p-claim-{mangle}")
        claim = put_claim(store, run=run.topics.run, policy="main", group_id=f"p-claim-{mangle}/main", data=data)
        if mangle == "delete":
            store.delete(claim.key)
        elif mangle == "flip":
            store.put(claim.key, data[:-1] + bytes([data[-1] ^ 1]))
        else:
            claim = claim.model_copy(update={"run": "elsewhere"})
        bad.append((f"claim-checked object {name}", encode_claim(claim)))
    return bad


def test_bad_records_cost_one_record_each_and_are_never_trained(policy_run) -> None:
    run = policy_run
    store = LocalDirStore(Path(run.store_url))
    limit = run.kafka.max_message_bytes
    bad = _corpus(run, store, limit)
    n_good = len(range(0, len(bad), 10))
    goods = [encode_group(_group(run, f"p-good{i}", vocab=64), signing_key=KEY) for i in range(n_good)]
    twice = encode_group(_group(run, "p-twice", vocab=64), signing_key=KEY)
    topic = run.topics.trajectories("main")
    producer = Producer(run.kafka.model_copy(update={"max_message_bytes": 3 * limit}))
    sent, where = [], {}
    for i, (name, value) in enumerate(bad):
        where[name] = producer.produce(topic, value, key=f"bad{i}".encode(), partition=i % 3)
        sent.append(where[name])
        if i % 10 == 0:
            sent.append(producer.produce(topic, goods[i // 10], key=b"good", partition=i % 3))
    sent += [producer.produce(topic, twice, key=b"t", partition=0), producer.produce(topic, twice, key=b"t", partition=1)]
    producer.flush(60)
    producer.close()
    assert all(s.result() for s in sent)
    assert len(bad) + 1 >= 50  # the duplicate copy is the last bad input

    intake = TrainerIntake(run.kafka, run.topics, "main", IntakeConfig(), max_staleness=4, vocab_size=64,
                           signing_key=KEY, store=store)
    intake.start()
    trained: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while intake.stats.received < len(sent) and time.monotonic() < deadline:
            batch = intake.next_batch(16, version=0, timeout_s=1.0)
            trained += [g.header.prompt_id for g in batch.groups] if batch else []
        batch = intake.next_batch(16, version=0, timeout_s=2.0)  # anything still queued
        trained += [g.header.prompt_id for g in batch.groups] if batch else []
    finally:
        intake.close()
    assert sorted(trained) == sorted([f"p-good{i}" for i in range(n_good)] + ["p-twice"])
    assert intake.stats.duplicates == 1 and intake.stats.rejected == len(bad), intake.stats.rejected_reasons
    parked = _read_dlq(run, len(bad), timeout_s=60)
    assert len(parked) == len(bad)
    reasons = {(int(r.headers["rlbus-dlq-source-partition"]), int(r.headers["rlbus-dlq-source-offset"])):
               r.headers["rlbus-dlq-reason"] for r in parked}
    report = {name: reasons.get((where[name].result().partition, where[name].result().offset)) for name, _ in bad}
    assert all(report.values()), report  # every bad record is in the DLQ, with a reason
    if os.environ.get("RLBUS_PRINT_BAD_INPUTS"):
        print(json.dumps(report, indent=1))
