"""ContiguousReader on a scripted client that skips an offset the way Tansu 0.6 can.

The skip needs concurrent producers racing inside the broker and cannot be produced on demand,
so the client here replays it: a fetch returns the records readable at or after the position,
and moves the position past them even when an earlier offset is not readable yet.
"""

from __future__ import annotations

import time

from confluent_kafka import TopicPartition

from broker.fetch import ContiguousReader

TOPIC = "run.trajectories.main"


class _Message:
    def __init__(self, partition: int, offset: int) -> None:
        self._partition, self._offset = partition, offset

    def error(self):
        return None

    def topic(self) -> str:
        return TOPIC

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def value(self) -> bytes:
        return f"{self._partition}:{self._offset}".encode()


class _SkippingClient:
    """One partition's log, of which only the ``readable`` offsets can be fetched."""

    def __init__(self, end: int, readable: set[int]) -> None:
        self.end, self.readable = end, set(readable)
        self.position = 0
        self.seeks: list[int] = []
        self._fetched: list[_Message] = []

    def poll(self, timeout: float):
        if not self._fetched:
            batch = [o for o in range(self.position, self.end) if o in self.readable]
            self._fetched = [_Message(0, o) for o in batch]
            if batch:
                self.position = batch[-1] + 1
        return self._fetched.pop(0) if self._fetched else None

    def consume(self, num_messages: int, timeout: float) -> list:
        """What is already fetched, without fetching again (librdkafka's consume with timeout 0)."""
        taken, self._fetched = self._fetched[:num_messages], self._fetched[num_messages:]
        return taken

    def seek(self, tp: TopicPartition) -> None:
        self.seeks.append(tp.offset)
        self.position = tp.offset
        self._fetched.clear()  # a seek drops what the client had prefetched


def _read_all(reader: ContiguousReader, rounds: int) -> list[int]:
    return [m.offset() for _ in range(rounds) for m in reader.read(64, 0.0)]


def test_a_skipped_offset_is_read_again_in_order() -> None:
    client = _SkippingClient(end=4, readable={0, 2, 3})
    reader = ContiguousReader(client, give_up_s=3600)
    assert _read_all(reader, 3) == [0]  # 2 and 3 are held back: 1 is missing
    assert client.seeks and set(client.seeks) == {1}
    client.readable.add(1)
    assert _read_all(reader, 2) == [1, 2, 3]
    assert (reader.gaps_repaired, reader.gaps_skipped) == (1, 0)


def test_a_gap_that_never_fills_is_given_up_and_counted() -> None:
    client = _SkippingClient(end=3, readable={0, 2})
    reader = ContiguousReader(client, give_up_s=0.01)
    got = _read_all(reader, 2)
    deadline = time.monotonic() + 60
    while 2 not in got and time.monotonic() < deadline:
        time.sleep(0.01)
        got += _read_all(reader, 1)
    assert got == [0, 2]
    assert (reader.gaps_repaired, reader.gaps_skipped) == (0, 1)


def test_forget_accepts_a_new_start_after_reassignment() -> None:
    client = _SkippingClient(end=6, readable={0, 1, 2, 3, 4, 5})
    reader = ContiguousReader(client, give_up_s=3600)
    assert _read_all(reader, 1) == [0, 1, 2, 3, 4, 5]
    client.position = 2  # the partition came back at its committed offset
    reader.forget([TopicPartition(TOPIC, 0)])
    assert _read_all(reader, 1) == [2, 3, 4, 5]
    assert not client.seeks


def test_a_log_that_starts_over_is_read_from_its_new_beginning() -> None:
    """A broker that lost its log comes back with the partition empty; the client resets to its
    beginning without a reassignment. The new records are read, not taken for copies."""
    client = _SkippingClient(end=6, readable={0, 1, 2, 3, 4, 5})
    reader = ContiguousReader(client, give_up_s=3600)
    assert _read_all(reader, 1) == [0, 1, 2, 3, 4, 5]
    client.end, client.position, client.readable = 3, 0, {0, 1, 2}
    assert _read_all(reader, 2) == [0, 1, 2]
    assert reader.restarts == 1 and not client.seeks


def test_a_record_before_the_seek_position_is_not_taken_for_a_restart() -> None:
    client = _SkippingClient(end=4, readable={0, 2, 3})
    reader = ContiguousReader(client, give_up_s=3600)
    assert _read_all(reader, 2) == [0]
    client._fetched = [_Message(0, 0)]  # a copy of offset 0 fetched before the seek took effect
    client.readable.add(1)
    assert _read_all(reader, 3) == [1, 2, 3]
    assert reader.restarts == 0
