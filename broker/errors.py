"""Domain errors of the wire contract.

Every error carries ``retriable`` so callers can decide between retrying and routing the input
to the dead-letter queue without inspecting messages.
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


class BrokerUnavailable(RuntimeError):
    """No Kafka-protocol broker answered at the configured address.

    The condition is usually transient (broker still starting, network blip), so ``retriable``
    is True.
    """

    retriable = True

    def __init__(self, address: str, detail: str) -> None:
        super().__init__(
            f"no Kafka broker answered at {address!r}: {detail}. Check that the broker is "
            "running and reachable from this machine (host, port, firewall), and that "
            "bootstrap_servers / --broker names it correctly."
        )
        self.address = address
        self.detail = detail


class TopicMissing(LookupError):
    """The broker does not know a topic rlbus expected to exist.

    Topics are created by whoever starts the run (``admin.ensure_topics``); a worker that attaches
    early may see this and retry, so ``retriable`` is True.
    """

    retriable = True

    def __init__(self, topic: str, address: str) -> None:
        super().__init__(
            f"topic {topic!r} does not exist on the broker at {address!r}. Start the run (which "
            "creates its topics) before attaching, or check that the run and policy names match."
        )
        self.topic = topic
        self.address = address
