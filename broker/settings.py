"""Kafka client settings, mapped to aiokafka keyword arguments and confluent-kafka configs.

One ``KafkaConfig`` serves every role; the ``*_kwargs`` / ``*_conf`` methods translate it for the
client library a role uses. Defaults work against both Apache Kafka and Tansu 0.6 (the embedded
broker); the fields whose safe value differs between the two say so.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

MiB = 1024 * 1024


class KafkaConfig(BaseModel):
    """How to reach the broker and how clients behave."""

    model_config = ConfigDict(extra="forbid")

    bootstrap_servers: str = Field(
        min_length=1, description="Comma-separated HOST:PORT list of brokers, e.g. '127.0.0.1:9092'."
    )
    client_id: str = Field(default="rlbus", description="Client id reported to the broker (logs, quotas).")
    compression_type: Literal["zstd", "gzip", "lz4", "snappy", "none"] = Field(
        default="zstd",
        description="Producer batch compression. Records are already zstd-compressed by the codec; "
        "this compresses batches of small records (prompts) further.",
    )
    acks: Literal["all", "1", "0"] = Field(
        default="all", description="Producer acknowledgements; 'all' is needed for at-least-once."
    )
    enable_idempotence: bool = Field(
        default=False,
        description="Idempotent producer. Apache Kafka users should set true (no duplicates on "
        "producer retries). Keep false on Tansu 0.6: aiokafka's InitProducerId fails there.",
    )
    partition_assignment_strategy: Literal["range", "roundrobin", "cooperative-sticky"] = Field(
        default="range",
        description="Consumer-group assignor. 'cooperative-sticky' never completes an assignment on "
        "Tansu 0.6 and is not supported by aiokafka; use it only with confluent-kafka on Apache Kafka.",
    )
    isolation_level: Literal["read_uncommitted", "read_committed"] = Field(
        default="read_uncommitted",
        description="Consumer isolation. rlbus does not use transactions; 'read_committed' is "
        "unreliable on Tansu 0.6.",
    )
    max_message_bytes: int = Field(
        default=8 * MiB,
        ge=1024,
        description="Largest record value in bytes: producer request limit, consumer fetch size, "
        "and the topic's max.message.bytes. Larger groups go to the object store (claim check).",
    )
    session_timeout_ms: int = Field(
        default=10_000,
        ge=1_000,
        description="Consumer-group session timeout in ms: a SIGKILLed worker's partitions are "
        "redelivered to the others after about this long.",
    )
    heartbeat_interval_ms: int = Field(
        default=3_000, ge=100, description="Consumer heartbeat period in ms; below session_timeout_ms / 3."
    )
    max_poll_interval_ms: int = Field(
        default=300_000,
        ge=1_000,
        description="Longest time in ms between two polls before the consumer leaves its group; "
        "must exceed the slowest generation or training step.",
    )
    request_timeout_ms: int = Field(default=30_000, ge=1_000, description="Per-request timeout in ms.")
    fetch_max_wait_ms: int = Field(
        default=20,
        ge=0,
        le=10_000,
        description="Longest time the broker holds a fetch that found no new data, ms. Tansu 0.6 does not "
        "answer a waiting fetch when data arrives, so this is added to every hop (measured 120 ms median at "
        "500, 9 ms at 20); Apache Kafka answers at once, where 500 saves requests on idle topics.",
    )
    advisory_fetch_max_wait_ms: int = Field(
        default=250,
        ge=0,
        le=10_000,
        description="Fetch wait, ms, of the readers no step waits on: each worker's control listener (version "
        "announcements, a fast path beside the store, which a worker also asks before each generation). On "
        "Tansu 0.6 every idle fetch costs the broker about 0.7 ms of CPU, so these poll less often than the "
        "readers on the critical path (fetch_max_wait_ms); on Apache Kafka set both to 500. The curator's "
        "feedback reader is not among them: its router and prompt stages act on what it has read.",
    )
    prompt_partitions: int = Field(
        default=32, ge=1, description="Partitions of each prompt topic; caps how many workers share it."
    )
    trajectory_partitions: int = Field(default=8, ge=1, description="Partitions of each trajectory topic.")
    replication_factor: int = Field(
        default=1, ge=1, description="Replicas of each topic created by rlbus (3 on a production cluster)."
    )
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] | None = Field(
        default=None, description="Transport security; None means PLAINTEXT."
    )
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = Field(
        default=None, description="SASL mechanism when security_protocol is SASL_*."
    )
    sasl_username: str | None = Field(default=None, description="SASL user name.")
    sasl_password: SecretStr | None = Field(default=None, description="SASL password (never logged).")
    ssl_cafile: str | None = Field(default=None, description="Path of a PEM CA bundle that signs the brokers.")

    @model_validator(mode="after")
    def _check(self) -> KafkaConfig:
        if self.heartbeat_interval_ms >= self.session_timeout_ms:
            raise ValueError(
                f"heartbeat_interval_ms ({self.heartbeat_interval_ms}) must be below session_timeout_ms "
                f"({self.session_timeout_ms}); a third of it is usual"
            )
        if (self.sasl_username is None) != (self.sasl_password is None):
            raise ValueError("set both sasl_username and sasl_password, or neither")
        if self.sasl_mechanism and not (self.security_protocol or "").startswith("SASL"):
            raise ValueError("sasl_mechanism needs security_protocol SASL_PLAINTEXT or SASL_SSL")
        return self

    # ------------------------------------------------------------------ aiokafka

    def aiokafka_producer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``aiokafka.AIOKafkaProducer``."""
        return {
            "bootstrap_servers": self.bootstrap_servers,
            "client_id": self.client_id,
            "acks": "all" if self.acks == "all" else int(self.acks),
            "compression_type": None if self.compression_type == "none" else self.compression_type,
            "enable_idempotence": self.enable_idempotence,
            "max_request_size": self.max_message_bytes,
            "request_timeout_ms": self.request_timeout_ms,
            **self._aiokafka_security(),
        }

    def aiokafka_consumer_kwargs(self, group_id: str | None, *, advisory: bool = False) -> dict[str, Any]:
        """Keyword arguments for ``aiokafka.AIOKafkaConsumer``: manual commits, from the earliest.

        ``group_id=None`` gives a group-less consumer for manually assigned partitions;
        ``advisory=True`` one that fetches with ``advisory_fetch_max_wait_ms``.
        """
        return {
            "bootstrap_servers": self.bootstrap_servers,
            "client_id": self.client_id,
            "group_id": group_id,
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest",
            "isolation_level": self.isolation_level,
            "partition_assignment_strategy": self._aiokafka_assignors(),
            "session_timeout_ms": self.session_timeout_ms,
            "heartbeat_interval_ms": self.heartbeat_interval_ms,
            "max_poll_interval_ms": self.max_poll_interval_ms,
            "request_timeout_ms": self.request_timeout_ms,
            "max_partition_fetch_bytes": self.max_message_bytes,
            "fetch_max_bytes": max(self.max_message_bytes, 50 * MiB),
            "fetch_max_wait_ms": self.advisory_fetch_max_wait_ms if advisory else self.fetch_max_wait_ms,
            **self._aiokafka_security(),
        }

    def _aiokafka_assignors(self) -> tuple[type, ...]:
        from aiokafka.coordinator.assignors.range import RangePartitionAssignor
        from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor

        if self.partition_assignment_strategy == "range":
            return (RangePartitionAssignor,)
        if self.partition_assignment_strategy == "roundrobin":
            return (RoundRobinPartitionAssignor,)
        raise ValueError(
            "aiokafka does not support partition_assignment_strategy='cooperative-sticky'; "
            "set it to 'range' or 'roundrobin'"
        )

    def _aiokafka_security(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.security_protocol:
            out["security_protocol"] = self.security_protocol
        if self.sasl_mechanism:
            out["sasl_mechanism"] = self.sasl_mechanism
        if self.sasl_username is not None and self.sasl_password is not None:
            out["sasl_plain_username"] = self.sasl_username
            out["sasl_plain_password"] = self.sasl_password.get_secret_value()
        if (self.security_protocol or "").endswith("SSL"):
            from aiokafka.helpers import create_ssl_context

            out["ssl_context"] = create_ssl_context(cafile=self.ssl_cafile)
        return out

    # ------------------------------------------------------------------ confluent-kafka

    def confluent_producer_conf(self) -> dict[str, Any]:
        """Config dict for ``confluent_kafka.Producer``."""
        return {
            **self._confluent_common(),
            "acks": self.acks,
            "compression.type": self.compression_type,
            "enable.idempotence": self.enable_idempotence,
            "message.max.bytes": self.max_message_bytes + 64 * 1024,
            "request.timeout.ms": self.request_timeout_ms,
        }

    def confluent_consumer_conf(self, group_id: str) -> dict[str, Any]:
        """Config dict for ``confluent_kafka.Consumer``: manual commits, from the earliest."""
        return {
            **self._confluent_common(),
            "group.id": group_id,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "isolation.level": self.isolation_level,
            "partition.assignment.strategy": self.partition_assignment_strategy,
            "session.timeout.ms": self.session_timeout_ms,
            "heartbeat.interval.ms": self.heartbeat_interval_ms,
            "max.poll.interval.ms": self.max_poll_interval_ms,
            "max.partition.fetch.bytes": self.max_message_bytes,
            "fetch.max.bytes": max(self.max_message_bytes, 50 * MiB),
            "fetch.wait.max.ms": self.fetch_max_wait_ms,
            # librdkafka requires receive.message.max.bytes >= fetch.max.bytes + 512.
            "receive.message.max.bytes": max(self.max_message_bytes, 50 * MiB) + MiB,
        }

    def confluent_admin_conf(self) -> dict[str, Any]:
        """Config dict for ``confluent_kafka.admin.AdminClient``."""
        return self._confluent_common()

    def _confluent_common(self) -> dict[str, Any]:
        conf: dict[str, Any] = {
            "bootstrap.servers": self.bootstrap_servers,
            "client.id": self.client_id,
            "socket.timeout.ms": self.request_timeout_ms,
        }
        if self.security_protocol:
            conf["security.protocol"] = self.security_protocol
        if self.sasl_mechanism:
            conf["sasl.mechanisms"] = self.sasl_mechanism
        if self.sasl_username is not None and self.sasl_password is not None:
            conf["sasl.username"] = self.sasl_username
            conf["sasl.password"] = self.sasl_password.get_secret_value()
        if self.ssl_cafile:
            conf["ssl.ca.location"] = self.ssl_cafile
        return conf
