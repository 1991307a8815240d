"""The WAN link's pieces that need no network: the broker-address rewriting of Kafka responses and
the FIFO clock that shapes a direction."""

from __future__ import annotations

import random
import struct

import pytest

from broker.advertised import AddressRewriter, NotKafka, address_encodings
from rlbus.link import LinkConfig, _Direction, parse_address

BROKER, PROXY = ("127.0.0.1", 9092), ("127.0.0.1", 19193)


def request(api: int, correlation: int, body: bytes = b"") -> bytes:
    payload = struct.pack(">hhi", api, 0, correlation) + body
    return struct.pack(">i", len(payload)) + payload


def response(correlation: int, body: bytes) -> bytes:
    return struct.pack(">ii", len(body) + 4, correlation) + body


def metadata_body(host: str, port: int, compact: bool) -> bytes:
    old, new = address_encodings(host, port)
    return b"\x00\x00\x00\x01" + struct.pack(">i", 111) + (new if compact else old) + b"\x00rest-of-metadata"


def feed(rewriter: AddressRewriter, data: bytes, rng: random.Random, side: str) -> bytes:
    """``data`` through the rewriter in pieces of random sizes, as a socket would hand them over."""
    out, i = b"", 0
    fn = rewriter.requests if side == "requests" else rewriter.responses
    while i < len(data):
        n = rng.randint(1, 17)
        out += fn(data[i:i + n])
        i += n
    return out


@pytest.mark.parametrize("compact", [False, True])
def test_the_broker_address_in_a_metadata_response_becomes_the_links(compact: bool) -> None:
    rng = random.Random(compact)
    rewriter = AddressRewriter(BROKER, PROXY)
    fetch_body = b"records " + address_encodings(*BROKER)[int(compact)] + b" look alike"
    # a Metadata request (3), a Fetch (1), a FindCoordinator (10), pipelined
    sent = request(3, 7) + request(1, 8) + request(10, 9)
    assert feed(rewriter, sent, rng, "requests") == sent  # requests pass unchanged
    answers = (response(7, metadata_body(*BROKER, compact)) + response(8, fetch_body)
               + response(9, metadata_body(*BROKER, compact)))
    out = feed(rewriter, answers, rng, "responses")
    want = (response(7, metadata_body(*PROXY, compact)) + response(8, fetch_body)
            + response(9, metadata_body(*PROXY, compact)))
    assert out == want  # a Fetch that happens to hold the same bytes is left alone
    assert rewriter.rewritten == 2


def test_a_longer_host_changes_the_frame_length() -> None:
    rewriter = AddressRewriter(BROKER, ("rlbus-link.eu-west.internal", 9092))
    rewriter.requests(request(3, 1))
    out = rewriter.responses(response(1, metadata_body(*BROKER, compact=True)))
    size, correlation = struct.unpack(">ii", out[:8])
    assert size == len(out) - 4 and correlation == 1
    assert b"rlbus-link.eu-west.internal" in out and b"127.0.0.1" not in out


def test_bytes_that_are_not_kafka_frames_are_refused() -> None:
    with pytest.raises(NotKafka):
        AddressRewriter(BROKER, PROXY).requests(b"GET /bucket/key HTTP/1.1\r\n\r\n")


def test_a_direction_serializes_its_chunks_at_its_rate_then_delays_them() -> None:
    d = _Direction(rate_bps=8e6, delay_s=0.05)  # 1 MB/s
    first = d.schedule(100_000, now=10.0)  # 0.1 s on the wire
    second = d.schedule(100_000, now=10.0)  # queued behind the first
    assert first == pytest.approx(10.15) and second == pytest.approx(10.25)
    assert d.ahead_s(10.0) == pytest.approx(0.2)
    later = d.schedule(1000, now=20.0)  # an idle link starts afresh
    assert later == pytest.approx(20.0 + 0.001 + 0.05)
    assert d.bytes == 201_000
    assert _Direction(rate_bps=None, delay_s=0.1).schedule(10**9, now=1.0) == pytest.approx(1.1)


def test_link_settings_and_addresses_are_checked() -> None:
    assert parse_address("127.0.0.1:9092") == ("127.0.0.1", 9092)
    assert parse_address("9092") == ("127.0.0.1", 9092)
    with pytest.raises(ValueError, match="host:port"):
        parse_address("localhost:kafka")
    with pytest.raises(ValueError):
        LinkConfig(rate_mbit=0)
    with pytest.raises(ValueError):
        LinkConfig(cuts=[{"at_s": 5, "for_s": 0}])
    with pytest.raises(ValueError, match="exactly one"):
        LinkConfig(cuts=[{"at_s": 5, "at_step": 10, "for_s": 3}])
    assert LinkConfig(cuts=[{"at_step": 10, "for_s": 3}]).cuts[0].at_step == 10
