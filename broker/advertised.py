"""Rewriting the broker address a Kafka broker advertises, for a proxy between clients and broker.

A Kafka client connects to its bootstrap address once, then to the addresses the broker advertises
in its Metadata, FindCoordinator and DescribeCluster responses. A proxy that stands for a network
link (``rlbus.link``) must therefore replace the broker's own address in those responses by its
own, or the clients behind it would go around it after their first request. ``AddressRewriter``
does that on the two byte streams of one connection: it reads the requests' headers to learn which
API each response answers, and replaces the (host, port) pair in the answers of those three APIs,
in both of the protocol's string encodings (int16-prefixed and compact). Every other response
passes through unbuffered.

This is framing, not a client: nothing here speaks for itself to a broker.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

METADATA, FIND_COORDINATOR, DESCRIBE_CLUSTER = 3, 10, 60
ADDRESS_APIS = frozenset({METADATA, FIND_COORDINATOR, DESCRIBE_CLUSTER})
"""API keys whose responses carry broker addresses (host followed by port)."""
MAX_FRAME_BYTES = 1 << 30
"""A size prefix above this is not a Kafka frame: the stream is not the Kafka protocol."""


class NotKafka(ValueError):
    """The bytes on a connection are not Kafka frames (e.g. the link's route points at another service)."""


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def address_encodings(host: str, port: int) -> tuple[bytes, bytes]:
    """(host, port) as the protocol writes it: with an int16 length, and as a compact string."""
    raw = host.encode()
    return struct.pack(">h", len(raw)) + raw + struct.pack(">i", port), _uvarint(len(raw) + 1) + raw + struct.pack(">i", port)


@dataclass
class AddressRewriter:
    """One connection's rewriter: ``requests`` on the client → broker bytes (passed on unchanged),
    ``responses`` on the broker → client bytes (returns what may go to the client now)."""

    broker: tuple[str, int]
    """The address the broker advertises."""
    proxy: tuple[str, int]
    """The address the clients are to use instead (the proxy's)."""
    rewritten: int = 0
    """Responses in which an address was replaced."""
    _apis: dict[int, int] = field(default_factory=dict)  # correlation id -> api key
    _req: bytearray = field(default_factory=bytearray)
    _req_left: int = 0  # bytes of the current request frame still to pass
    _resp: bytearray = field(default_factory=bytearray)
    _resp_left: int = 0  # bytes of the current (passed-through) response frame still to pass

    def __post_init__(self) -> None:
        old, new = address_encodings(*self.broker), address_encodings(*self.proxy)
        self._pairs = list(zip(old, new, strict=True))

    def requests(self, data: bytes) -> bytes:
        """Note the API of every request frame in ``data``; the bytes are forwarded as they are."""
        view = memoryview(data)
        while view:
            if self._req_left:
                step = min(self._req_left, len(view))
                self._req_left -= step
                view = view[step:]
                continue
            need = 12 - len(self._req)  # size, api key, api version, correlation id
            self._req += view[:need]
            view = view[need:]
            if len(self._req) < 12:
                break
            size, api, _version, correlation = struct.unpack(">ihhi", self._req)
            if not 8 <= size <= MAX_FRAME_BYTES:
                raise NotKafka(f"a request frame of {size} bytes: not the Kafka protocol")
            self._apis[correlation] = api
            self._req_left = size - 8
            self._req.clear()
        return data

    def responses(self, data: bytes) -> bytes:
        """The bytes of ``data`` that can go to the client now: frames of other APIs as they come,
        an address-carrying frame once it is whole, with the broker's address replaced."""
        out = bytearray()
        view = memoryview(data)
        while view:
            if self._resp_left:  # passing a frame through
                step = min(self._resp_left, len(view))
                out += view[:step]
                self._resp_left -= step
                view = view[step:]
                continue
            if len(self._resp) < 8:
                need = 8 - len(self._resp)
                self._resp += view[:need]
                view = view[need:]
                if len(self._resp) < 8:
                    break
                size, correlation = struct.unpack(">ii", self._resp[:8])
                if not 4 <= size <= MAX_FRAME_BYTES:
                    raise NotKafka(f"a response frame of {size} bytes: not the Kafka protocol")
                if self._apis.pop(correlation, None) not in ADDRESS_APIS:
                    out += self._resp
                    self._resp_left = size - 4
                    self._resp.clear()
                continue
            size = struct.unpack(">i", self._resp[:4])[0]
            need = size + 4 - len(self._resp)
            self._resp += view[:need]
            view = view[need:]
            if len(self._resp) == size + 4:
                out += self._rewrite(bytes(self._resp[4:]))
                self._resp.clear()
        return bytes(out)

    def _rewrite(self, body: bytes) -> bytes:
        new = body
        for old, replacement in self._pairs:
            new = new.replace(old, replacement)
        if new != body:
            self.rewritten += 1
        return struct.pack(">i", len(new)) + new
