"""Domain errors of the wire contract and of the Kafka layer.

Every error carries ``retriable`` so callers can decide between retrying and routing the input to
the dead-letter queue without inspecting messages. ``broker.clients`` turns every client library
error into one of these; nothing outside ``broker/`` sees a client library's exception.
"""

from __future__ import annotations


class RecordError(ValueError):
    """A record's bytes could not be decoded or failed validation.

    ``reason`` is a short, precise description of what was wrong; it is what the consumer writes
    to the DLQ headers. Retrying cannot fix the same bytes, so ``retriable`` is False.
    """

    retriable = False

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class BrokerError(RuntimeError):
    """A Kafka client operation failed. ``retriable`` says whether the same call may succeed later
    (the client library's own verdict where it gives one)."""

    def __init__(self, message: str, *, retriable: bool = False) -> None:
        super().__init__(message)
        self.retriable = retriable


class BrokerNotConfigured(BrokerError):
    """A role needs a broker and none was named."""

    def __init__(self) -> None:
        super().__init__(
            "no Kafka broker is configured: pass --broker HOST:PORT, set kafka.bootstrap_servers in the "
            "config, or RLBUS_KAFKA__BOOTSTRAP_SERVERS",
            retriable=False,
        )


class KafkaPropertyError(BrokerError):
    """librdkafka refused a client setting (usually one given in ``kafka.properties``)."""

    def __init__(self, detail: str) -> None:
        super().__init__(
            f"the Kafka client refused its configuration: {detail}. Check kafka.properties against "
            "librdkafka's CONFIGURATION.md (keys are dotted, e.g. 'ssl.key.location')",
            retriable=False,
        )


class BrokerUnavailable(BrokerError):
    """No Kafka-protocol broker answered at the configured address.

    The condition is usually transient (broker still starting, network blip), so ``retriable``
    is True.
    """

    def __init__(self, address: str, detail: str) -> None:
        super().__init__(
            f"no Kafka broker answered at {address!r}: {detail}. Check that the broker is "
            "running and reachable from this machine (host, port, firewall), and that "
            "bootstrap_servers / --broker names it correctly.",
            retriable=True,
        )
        self.address = address
        self.detail = detail


class DeliveryFailed(BrokerError):
    """The broker did not acknowledge a record; whatever it stood for must not be committed. Not
    acknowledged is not "not written": a send that timed out in flight may still land, so a record
    sent again can be in the log twice (the trainer's intake drops a group id it has seen)."""

    def __init__(self, topic: str, detail: str, *, retriable: bool = True) -> None:
        super().__init__(f"record to {topic} was not acknowledged: {detail}", retriable=retriable)
        self.topic = topic


class TopicMissing(BrokerError):
    """The broker does not know a topic rlbus expected to exist.

    Topics are created by whoever starts the run (``admin.ensure_topics``); a worker that attaches
    early may see this and retry, so ``retriable`` is True.
    """

    def __init__(self, topic: str, address: str) -> None:
        super().__init__(
            f"topic {topic!r} does not exist on the broker at {address!r}. Start the run (which "
            "creates its topics) before attaching, or check that the run and policy names match.",
            retriable=True,
        )
        self.topic = topic
        self.address = address
