"""Construction of librdkafka clients and translation of their errors into ``broker.errors``.

The only module (with ``broker.fetch``) that touches confluent-kafka's types directly; the clients
of ``broker.producer``, ``broker.reader`` and ``broker.admin`` are built here.
"""

from __future__ import annotations

from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient

from broker.errors import BrokerError, BrokerUnavailable, KafkaPropertyError

_UNREACHABLE = {
    KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._RESOLVE, KafkaError._TIMED_OUT,
    KafkaError.REQUEST_TIMED_OUT, KafkaError.NETWORK_EXCEPTION,
}  # fmt: skip


def _build(cls: type, conf: dict[str, Any]) -> Any:
    try:
        return cls(conf)
    except KafkaException as exc:
        raise KafkaPropertyError(_describe(exc)) from None
    except (TypeError, ValueError) as exc:  # a property value of the wrong type
        raise KafkaPropertyError(str(exc)) from None


def new_producer(conf: dict[str, Any]) -> Producer:
    return _build(Producer, conf)


def new_consumer(conf: dict[str, Any]) -> Consumer:
    return _build(Consumer, conf)


def new_admin(conf: dict[str, Any]) -> AdminClient:
    return _build(AdminClient, conf)


def _describe(exc: KafkaException) -> str:
    err = exc.args[0] if exc.args else None
    return err.str() if isinstance(err, KafkaError) else str(exc)


def broker_error(exc: KafkaException | KafkaError, what: str, address: str | None) -> BrokerError:
    """One of our errors for a client library failure while doing ``what``."""
    err = exc.args[0] if isinstance(exc, KafkaException) and exc.args else exc
    if not isinstance(err, KafkaError):
        return BrokerError(f"{what}: {exc}")
    if err.code() in _UNREACHABLE:
        return BrokerUnavailable(address or "?", f"{what}: {err.str()}")
    return BrokerError(f"{what}: {err.str()}", retriable=bool(err.retriable()) and not err.fatal())
