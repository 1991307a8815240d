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
