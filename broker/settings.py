"""Kafka client settings: one model for every role, translated for librdkafka (confluent-kafka).

Every client rlbus starts (producers, consumer-group readers, partition readers, admin) is a
librdkafka client built by ``broker.clients`` from one ``KafkaConfig``. Defaults work against both
Apache Kafka and Tansu 0.6 (the embedded broker); the fields whose best value differs between the
two say so. ``properties`` passes librdkafka keys rlbus does not model (mTLS, OAUTHBEARER, ...)
through to every client; a key rlbus sets itself is refused there with the field to use instead.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

MiB = 1024 * 1024

MANAGED_PROPERTIES: dict[str, str] = {
    "bootstrap.servers": "set kafka.bootstrap_servers (or --broker)",
    "metadata.broker.list": "set kafka.bootstrap_servers (or --broker)",
    "client.id": "set kafka.client_id",
    "acks": "set kafka.acks",
    "request.required.acks": "set kafka.acks",
    "compression.type": "set kafka.compression_type",
    "compression.codec": "set kafka.compression_type",
    "enable.idempotence": "set kafka.enable_idempotence",
    "partition.assignment.strategy": "set kafka.partition_assignment_strategy",
    "isolation.level": "set kafka.isolation_level",
    "message.max.bytes": "set kafka.max_message_bytes",
    "max.partition.fetch.bytes": "set kafka.max_message_bytes",
    "fetch.max.bytes": "set kafka.max_message_bytes",
    "receive.message.max.bytes": "set kafka.max_message_bytes",
    "session.timeout.ms": "set kafka.session_timeout_ms",
    "heartbeat.interval.ms": "set kafka.heartbeat_interval_ms",
    "max.poll.interval.ms": "set kafka.max_poll_interval_ms",
    "request.timeout.ms": "set kafka.request_timeout_ms",
    "socket.timeout.ms": "set kafka.request_timeout_ms",
    "fetch.wait.max.ms": "set kafka.fetch_max_wait_ms (or kafka.advisory_fetch_max_wait_ms)",
    "security.protocol": "set kafka.security_protocol",
    "sasl.mechanism": "set kafka.sasl_mechanism",
    "sasl.mechanisms": "set kafka.sasl_mechanism",
    "sasl.username": "set kafka.sasl_username",
    "sasl.password": "set kafka.sasl_password",
    "ssl.ca.location": "set kafka.ssl_cafile",
    "group.id": "rlbus names its consumer groups itself (<run>.rollout, <run>.train.<policy>)",
    "enable.auto.commit": "rlbus commits offsets itself, after the work they stand for is done",
    "enable.auto.offset.store": "rlbus commits offsets itself, after the work they stand for is done",
    "auto.offset.reset": "rlbus reads every topic from its beginning (or, for announcements, its end)",
    "enable.partition.eof": "rlbus sets it per reader",
}
"""librdkafka keys ``kafka.properties`` may not set, with what to do instead."""

PropertyValue = str | int | float | bool


STOP_WAIT_S = 8.0
"""How long a stopping role waits for the broker to answer what it sent (acknowledgements, commits)
before it lets go: a broker that is gone answers nothing however long it is waited for, and the
supervisor kills a role that has not stopped 20 s after its SIGTERM (which lets go of the same, later).
A worker's unacknowledged group leaves its prompt uncommitted: it is read again."""


class KafkaConfig(BaseModel):
    """How to reach the broker and how clients behave."""

    model_config = ConfigDict(extra="forbid")

    bootstrap_servers: str | None = Field(
        default=None,
        description="Comma-separated HOST:PORT list of brokers, e.g. '127.0.0.1:9092'. Unset, `rlbus run` "
        "starts the embedded broker; every other role needs it (or --broker).",
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
        description="Idempotent producer: no duplicates or reordering on producer retries. Set true on Apache "
        "Kafka; it works on Tansu 0.6 too, but there retries are rare and duplicates are removed by group id.",
    )
    partition_assignment_strategy: Literal["range", "roundrobin", "cooperative-sticky"] = Field(
        default="range",
        description="Consumer-group assignor. 'cooperative-sticky' moves only the partitions a joining or "
        "leaving member must (use it on Apache Kafka); it never completes an assignment on Tansu 0.6.",
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
        default=6_000,
        ge=1_000,
        description="Consumer-group session timeout in ms: a SIGKILLed worker's partitions are "
        "redelivered to the others after about this long. Tansu 0.6 holds every join of a group for half "
        "of it (the group's first member's), so a worker or trainer waits that long for its partitions and "
        "longer at each rebalance (23 s per join at librdkafka's 45,000); Apache Kafka answers a join as "
        "soon as the members are in, and 10,000 to 45,000 is usual there (it refuses less than its "
        "group.min.session.timeout.ms, 6,000 by default).",
    )
    heartbeat_interval_ms: int = Field(
        default=1_000,
        ge=100,
        description="Consumer heartbeat period in ms, at most a third of session_timeout_ms: how soon a "
        "member learns that its group rebalances. Each heartbeat is a write of the group's state in Tansu's "
        "storage engine.",
    )
    leave_group_on_close: bool = Field(
        default=False,
        description="Whether a closing group member tells the broker it leaves (its partitions move at "
        "once) or just goes, as a killed one does (they move when the broker expires it, after "
        "session_timeout_ms). Tansu 0.6 keeps a rebalancing group waiting for good when its leader leaves "
        "(no member is assigned again until the broker forgets the group), and a member cannot know it is "
        "the leader, so the default goes; set true on Apache Kafka.",
    )
    max_poll_interval_ms: int = Field(
        default=300_000,
        ge=1_000,
        description="Longest time in ms between two reads before the consumer leaves its group; "
        "must exceed the slowest generation or training step.",
    )
    request_timeout_ms: int = Field(default=30_000, ge=1_000, description="Per-request timeout in ms.")
    delivery_timeout_ms: int = Field(
        default=120_000,
        ge=1_000,
        description="How long a producer keeps retrying a record before its delivery fails, ms (librdkafka's "
        "message.timeout.ms). A worker commits no prompt whose group failed delivery.",
    )
    linger_ms: float = Field(
        default=5.0,
        ge=0,
        le=10_000,
        description="How long a producer waits to fill a batch before sending it, ms. Small: a group's "
        "acknowledgement waits for it; records already travel in parallel (bytes in flight, not round trips).",
    )
    fetch_max_wait_ms: int = Field(
        default=20,
        ge=0,
        le=10_000,
        description="Longest time the broker holds a fetch that found no new data, ms. Tansu 0.6 does not "
        "answer a waiting fetch when data arrives, so this is added to every hop (measured 120 ms median at "
        "500, 9 ms at 20); Apache Kafka answers at once, where 500 saves requests on idle topics. Tansu's s3 "
        "engine gives up a fetch whose listing of the partition outlasts this wait and returns nothing (at 20: "
        "every fetch past ~1,000 batch objects in a SeaweedFS bucket), so `rlbus run` with its log there uses "
        "100 unless this is set.",
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
    topic_retention_ms: int = Field(
        default=-1,
        ge=-1,
        description="retention.ms of the topics rlbus creates; -1: records leave only when rlbus trims them "
        "(log.trim: below every group's commits and every kept checkpoint, and the control topic's latest "
        "announcements kept), never by age, which would drop records no one has read yet while a run is paused. "
        "retention.bytes is -1 and segment.bytes topic_segment_bytes with it. Brokers that keep no retention "
        "(Tansu 0.6) store these and ignore them.",
    )
    topic_segment_bytes: int = Field(
        default=64 * MiB,
        ge=MiB,
        description="segment.bytes of the topics rlbus creates: a broker frees a log's disk a whole segment at a "
        "time, after a trim (DeleteRecords) or retention passed it; Kafka's own default is 1 GiB.",
    )
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] | None = Field(
        default=None, description="Transport security; None means PLAINTEXT."
    )
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"] | None = Field(
        default=None,
        description="SASL mechanism when security_protocol is SASL_*; OAUTHBEARER takes its settings "
        "from properties (sasl.oauthbearer.*).",
    )
    sasl_username: str | None = Field(default=None, description="SASL user name.")
    sasl_password: SecretStr | None = Field(default=None, description="SASL password (never logged).")
    ssl_cafile: str | None = Field(default=None, description="Path of a PEM CA bundle that signs the brokers.")
    properties: dict[str, PropertyValue] = Field(
        default_factory=dict,
        description="librdkafka properties passed to every client as they are, for what rlbus does not model: "
        "mTLS ('ssl.certificate.location', 'ssl.key.location'), OAUTHBEARER ('sasl.oauthbearer.method', ...), "
        "tuning. Keys rlbus sets itself are refused with the field to use instead; a key librdkafka does "
        "not know fails when the first client starts, naming it.",
    )

    @field_validator("properties")
    @classmethod
    def _unmanaged(cls, properties: dict[str, PropertyValue]) -> dict[str, PropertyValue]:
        for key in properties:
            if key in MANAGED_PROPERTIES:
                raise ValueError(f"kafka.properties may not set {key!r}: {MANAGED_PROPERTIES[key]}")
            if key.startswith(("on_", "error_cb", "stats_cb", "throttle_cb", "oauth_cb", "logger")):
                raise ValueError(f"kafka.properties may not set {key!r}: callbacks cannot be given in a config")
        return properties

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

    def with_broker(self, bootstrap_servers: str) -> KafkaConfig:
        """A copy pointing at ``bootstrap_servers``."""
        return self.model_copy(update={"bootstrap_servers": bootstrap_servers})

    def topic_settings(self) -> dict[str, str]:
        """The settings of a topic rlbus creates (``admin.ensure_topics``)."""
        return {"max.message.bytes": str(self.max_message_bytes), "cleanup.policy": "delete",
                "retention.ms": str(self.topic_retention_ms), "retention.bytes": "-1",
                "segment.bytes": str(max(self.topic_segment_bytes, self.max_message_bytes))}

    # ------------------------------------------------------------------ librdkafka configs

    def producer_conf(self) -> dict[str, Any]:
        """Config of a producer: every acknowledged record is durable per ``acks``. It never creates
        a topic (librdkafka's producers do by default): topics are made with their partition counts
        by ``broker.admin.ensure_topics``, and a record for a topic a restarted broker does not
        have yet waits for it instead of creating it with the broker's default partitions."""
        return {
            **self._common(),
            "allow.auto.create.topics": False,
            "acks": self.acks,
            "compression.type": self.compression_type,
            "enable.idempotence": self.enable_idempotence,
            "message.max.bytes": self.max_message_bytes + 64 * 1024,
            "request.timeout.ms": self.request_timeout_ms,
            "message.timeout.ms": self.delivery_timeout_ms,
            "linger.ms": self.linger_ms,
            **self.properties,
        }

    def consumer_conf(self, group_id: str, *, advisory: bool = False) -> dict[str, Any]:
        """Config of a consumer: manual commits, from the earliest offset. A group-less reader gets a
        unique ``group_id`` it never joins or commits to. ``advisory=True``: fetches wait
        ``advisory_fetch_max_wait_ms`` (readers no step waits on)."""
        fetch_max = max(self.max_message_bytes, 50 * MiB)
        return {
            **self._common(),
            "group.id": group_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "isolation.level": self.isolation_level,
            "partition.assignment.strategy": self.partition_assignment_strategy,
            "session.timeout.ms": self.session_timeout_ms,
            "heartbeat.interval.ms": self.heartbeat_interval_ms,
            "max.poll.interval.ms": self.max_poll_interval_ms,
            "max.partition.fetch.bytes": self.max_message_bytes,
            "fetch.max.bytes": fetch_max,
            "fetch.wait.max.ms": self.advisory_fetch_max_wait_ms if advisory else self.fetch_max_wait_ms,
            # librdkafka requires receive.message.max.bytes >= fetch.max.bytes + 512.
            "receive.message.max.bytes": fetch_max + MiB,
            **self.properties,
        }

    def admin_conf(self) -> dict[str, Any]:
        """Config of an admin client."""
        return {**self._common(), **self.properties}

    def _common(self) -> dict[str, Any]:
        if not self.bootstrap_servers:
            from broker.errors import BrokerNotConfigured

            raise BrokerNotConfigured()
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
