"""An emulated WAN link between the hub and a region: a user-space relay with a one-way delay, a
bandwidth cap per direction, connection drops, and a switch that cuts it.

A link carries one or more *routes*, each a listening address on this machine forwarded to a
target (the hub's broker, the hub's S3 endpoint); every route of a link shares its delay, its
capacity and its cut, as the traffic of one region shares its WAN link. Bytes are counted in each
direction: *down* is hub → region (target → client), *up* region → hub.

* Delay: each chunk of bytes is delivered ``delay_ms`` after it left, in order; a request and its
  answer pay two delays, a round trip.
* Rate: one FIFO per direction serializes every connection's chunks at ``rate_mbit``; a sender runs
  at most ``MAX_AHEAD_S`` of link time ahead (then its reads stop, and the kernel pushes back on it,
  as a TCP window would).
* Drops: on average ``drops_per_min`` times a minute an open connection is reset (both ends see it
  close at once), standing for loss bad enough to break a connection; clients reconnect.
* Cut: nothing moves either way and new connections are accepted but not served, until the link
  is restored; bytes that were in flight are delivered then, as TCP would after a partition heals
  (an end that gave up meanwhile closed its connection).

A Kafka route (``kafka=True``) also replaces the broker's advertised address by the route's own in
the responses that carry it (``broker.advertised``), so that clients behind the link never go
around it. Several links can stand in front of one broker, one per region.

``rlbus link`` runs one link as a process (a compose service of a region), with a stats file and an
HTTP control port (``GET /stats``, ``POST /cut``, ``POST /restore``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from broker.advertised import AddressRewriter, NotKafka

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 16
"""Bytes read from a socket at a time."""
MAX_AHEAD_S = 0.25
"""How far (seconds of link time) a direction's queue may run ahead of the link before reads stop."""


class LinkCut(BaseModel):
    """One scheduled cut of a link: at a time after the link started, or (in `rlbus run`, whose
    supervisor drives it through the link's control port) once the trainer reached a step."""

    model_config = ConfigDict(extra="forbid")

    at_s: float | None = Field(default=None, ge=0, description="When the cut starts, seconds after the link started.")
    at_step: int | None = Field(default=None, ge=0, description="`rlbus run` only: when the first policy's trainer "
                                "has logged this step.")
    for_s: float = Field(gt=0, description="How long it lasts, seconds.")

    @model_validator(mode="after")
    def _one_start(self) -> LinkCut:
        if (self.at_s is None) == (self.at_step is None):
            raise ValueError("a cut starts at_s seconds after the link starts or at_step: give exactly one")
        return self


class LinkConfig(BaseModel):
    """The shape of an emulated WAN link (``rlbus.link``)."""

    model_config = ConfigDict(extra="forbid")

    delay_ms: float = Field(default=0.0, ge=0, description="One-way delay, ms (a round trip costs twice this).")
    rate_mbit: float | None = Field(
        default=None, gt=0, description="Capacity of each direction, Mbit/s; None: as fast as loopback.")
    drops_per_min: float = Field(
        default=0.0, ge=0, description="Open connections reset at random, on average this many a minute (loss bad "
        "enough to break a connection; clients reconnect).")
    cuts: list[LinkCut] = Field(default_factory=list, description="Scheduled cuts: nothing crosses while one lasts.")


def parse_address(text: str) -> tuple[str, int]:
    """``host:port`` (or a bare port, on 127.0.0.1)."""
    host, _, port = text.rpartition(":")
    try:
        return host or "127.0.0.1", int(port)
    except ValueError:
        raise ValueError(f"{text!r} is not an address: write host:port, e.g. 127.0.0.1:9092") from None


@dataclass
class _Direction:
    """One direction of the link: its FIFO's clock and its byte count."""

    rate_bps: float | None
    delay_s: float
    free_at: float = 0.0
    bytes: int = 0

    def schedule(self, nbytes: int, now: float) -> float:
        """When ``nbytes`` sent now arrive at the far end."""
        self.bytes += nbytes
        depart = now
        if self.rate_bps:
            depart = self.free_at = max(now, self.free_at) + nbytes * 8 / self.rate_bps
        return depart + self.delay_s

    def ahead_s(self, now: float) -> float:
        return max(0.0, self.free_at - now)


@dataclass
class _Route:
    target: tuple[str, int]
    listen: tuple[str, int]
    kafka: bool
    up: int = 0
    down: int = 0
    server: asyncio.base_events.Server | None = None


@dataclass(eq=False)
class _Conn:
    writers: list[asyncio.StreamWriter] = field(default_factory=list)

    def reset(self) -> None:
        """Both ends see the connection reset (RST), as when a network drops it: never a clean close
        (FIN), which a server may take for the end of a request's body."""
        for w in self.writers:
            sock = w.get_extra_info("socket")
            if sock is not None:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except OSError:
                    pass  # already closed
            w.transport.abort()


class Link:
    """One emulated link; ``start()`` runs it on a thread of its own. Thread-safe controls."""

    def __init__(self, config: LinkConfig, name: str = "link") -> None:
        self.config, self.name = config, name
        self.routes: list[_Route] = []
        delay = config.delay_ms / 1000
        rate = None if config.rate_mbit is None else config.rate_mbit * 1e6
        self.down, self.up = _Direction(rate, delay), _Direction(rate, delay)
        self.connections = 0
        self.drops = 0
        self.rewritten = 0
        self.cut_seconds = 0.0
        self.cut_log: list[list[float | None]] = []  # [start, end or None], Unix seconds
        self._cut_since: float | None = None
        self._conns: set[_Conn] = set()
        self._serving: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._open: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopping: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.started_at: float | None = None
        self.control_port: int | None = None

    def add_route(self, target: tuple[str, int], *, listen: tuple[str, int] | None = None,
                  kafka: bool = False) -> None:
        """Forward ``listen`` (default: a free port on 127.0.0.1) to ``target``; before ``start``."""
        if self._thread is not None:
            raise RuntimeError("add routes before the link starts")
        self.routes.append(_Route(target=target, listen=listen or ("127.0.0.1", 0), kafka=kafka))

    def address(self, i: int = 0) -> str:
        """``host:port`` where route ``i`` listens (after ``start``)."""
        host, port = self.routes[i].listen
        return f"{host}:{port}"

    # ------------------------------------------------------------------ control (any thread)

    def start(self, timeout_s: float = 10.0) -> Link:
        self._thread = threading.Thread(target=self._run, name=f"link-{self.name}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._error is not None:
            raise RuntimeError(f"link {self.name} did not start: {self._error}")
        return self

    def cut(self) -> None:
        """Nothing crosses until ``restore``."""
        self._call(self._set_open, False)

    def restore(self) -> None:
        self._call(self._set_open, True)

    @property
    def is_cut(self) -> bool:
        return self._cut_since is not None

    def stop(self) -> None:
        if self._loop is not None and self._stopping is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(10)

    def stats(self) -> dict:
        """Counters so far: bytes each way (in all and per route), connections, drops, cut time."""
        cut_now = 0.0 if self._cut_since is None else time.monotonic() - self._cut_since
        return {
            "name": self.name, "time": time.time(), "delay_ms": self.config.delay_ms, "rate_mbit": self.config.rate_mbit,
            "bytes_down": self.down.bytes, "bytes_up": self.up.bytes, "connections": self.connections,
            "open_connections": len(self._conns), "drops": self.drops, "cut": self.is_cut,
            "cut_seconds": round(self.cut_seconds + cut_now, 3), "cuts": [list(c) for c in self.cut_log],
            "started_at": self.started_at, "control_port": self.control_port,
            "kafka_addresses_rewritten": self.rewritten,
            "routes": {f"{r.listen[0]}:{r.listen[1]}": {"target": f"{r.target[0]}:{r.target[1]}", "kafka": r.kafka,
                                                        "bytes_down": r.down, "bytes_up": r.up} for r in self.routes},
        }

    def _call(self, fn, *args) -> None:
        if self._loop is None:
            raise RuntimeError(f"link {self.name} is not running")
        self._loop.call_soon_threadsafe(fn, *args)

    def _set_open(self, value: bool) -> None:
        assert self._open is not None
        if value and not self._open.is_set():
            self.cut_seconds += time.monotonic() - (self._cut_since or time.monotonic())
            self._cut_since = None
            self.cut_log[-1][1] = time.time()
            self._open.set()
            logger.info("link %s restored", self.name)
        elif not value and self._open.is_set():
            self._cut_since = time.monotonic()
            self.cut_log.append([time.time(), None])
            self._open.clear()
            logger.info("link %s cut", self.name)

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by start(); a running link's errors are logged
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._open, self._stopping = asyncio.Event(), asyncio.Event()
        self._open.set()
        for route in self.routes:
            route.server = await asyncio.start_server(
                lambda r, w, route=route: self._serve(route, r, w), route.listen[0], route.listen[1])
            route.listen = route.server.sockets[0].getsockname()[:2]
        self.started_at = time.time()
        tasks = [asyncio.create_task(self._schedule_cuts())]
        if self.config.drops_per_min > 0:
            tasks.append(asyncio.create_task(self._drop_at_random()))
        self._ready.set()
        await self._stopping.wait()
        for task in tasks:
            task.cancel()
        for route in self.routes:
            route.server.close()
        for conn in list(self._conns):
            conn.reset()
        await asyncio.wait(self._serving, timeout=5) if self._serving else None

    async def _schedule_cuts(self) -> None:
        start = self._loop.time()
        for cut in sorted((c for c in self.config.cuts if c.at_s is not None), key=lambda c: c.at_s):
            await asyncio.sleep(max(0.0, start + cut.at_s - self._loop.time()))
            self._set_open(False)
            await asyncio.sleep(cut.for_s)
            self._set_open(True)

    async def _drop_at_random(self) -> None:
        rng = random.Random()
        while True:
            await asyncio.sleep(rng.expovariate(self.config.drops_per_min / 60))
            if self._conns and self._open.is_set():
                rng.choice(sorted(self._conns, key=id)).reset()
                self.drops += 1

    async def _serve(self, route: _Route, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        conn = _Conn([client_w])
        self._conns.add(conn)
        self.connections += 1
        task = asyncio.current_task()
        self._serving.add(task)
        try:
            await self._open.wait()  # a cut link accepts, but serves no one
            try:
                server_r, server_w = await asyncio.open_connection(*route.target)
            except OSError as exc:
                logger.warning("link %s: %s:%s does not answer (%s)", self.name, *route.target, exc)
                return
            conn.writers.append(server_w)
            rewriter = AddressRewriter(route.target, route.listen) if route.kafka else None
            up = self._pipe(client_r, server_w, self.up, route, "up",
                            None if rewriter is None else rewriter.requests)
            down = self._pipe(server_r, client_w, self.down, route, "down",
                              None if rewriter is None else rewriter.responses)
            await asyncio.gather(up, down, return_exceptions=True)
            if rewriter is not None:
                self.rewritten += rewriter.rewritten
        finally:
            self._serving.discard(task)
            self._conns.discard(conn)
            for w in conn.writers:  # what was written is flushed before the close
                w.close()
            await asyncio.gather(*(w.wait_closed() for w in conn.writers), return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: _Direction,
                    route: _Route, side: str, transform) -> None:
        queue: asyncio.Queue = asyncio.Queue()
        loop = self._loop

        async def deliver() -> None:
            while (item := await queue.get())[1]:
                await self._open.wait()
                wait = item[0] - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                await self._open.wait()
                writer.write(item[1])
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()

        sender = asyncio.create_task(deliver())
        try:
            while True:
                await self._open.wait()
                while direction.ahead_s(loop.time()) > MAX_AHEAD_S:
                    await asyncio.sleep(min(0.05, direction.ahead_s(loop.time()) - MAX_AHEAD_S / 2))
                data = await reader.read(CHUNK_BYTES)
                if not data:
                    break
                if transform is not None:
                    data = transform(data)
                    if not data:
                        continue
                await self._open.wait()  # what was read as the link went down leaves after it comes back
                if side == "up":
                    route.up += len(data)
                else:
                    route.down += len(data)
                queue.put_nowait((direction.schedule(len(data), loop.time()), data))
        except (ConnectionError, NotKafka) as exc:
            if isinstance(exc, NotKafka):
                logger.warning("link %s: %s", self.name, exc)
        finally:
            queue.put_nowait((0.0, b""))
            await asyncio.gather(sender, return_exceptions=True)


# ---------------------------------------------------------------------- the `rlbus link` process


def serve(link: Link, *, stats_file: Path | None, control_port: int | None, should_stop,
          every_s: float = 1.0) -> None:
    """Run ``link`` until ``should_stop()``: its stats written to ``stats_file`` every ``every_s``
    (atomically), and an HTTP control port on 127.0.0.1 when ``control_port`` is given (0: a free
    one, named in the stats)."""
    server = None
    if control_port is not None:
        server = ThreadingHTTPServer(("127.0.0.1", control_port), _control_handler(link))
        link.control_port = server.server_address[1]
        threading.Thread(target=server.serve_forever, name="link-control", daemon=True).start()
        logger.info("link %s: control on http://127.0.0.1:%d", link.name, server.server_address[1])
    try:
        while not should_stop():
            if stats_file is not None:
                _write_stats(link, stats_file)
            time.sleep(every_s)
    finally:
        if server is not None:
            server.shutdown()
        if stats_file is not None:
            _write_stats(link, stats_file)
        link.stop()


def _write_stats(link: Link, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(link.stats()))
    tmp.replace(path)


def control(port: int, action: str, timeout_s: float = 10.0) -> dict:
    """``POST /cut`` or ``/restore`` (``action``) to a link's control port; its stats after."""
    import urllib.request

    request = urllib.request.Request(f"http://127.0.0.1:{port}/{action}", data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        return json.loads(answer.read())


def _control_handler(link: Link):
    class Handler(BaseHTTPRequestHandler):
        def _answer(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.rstrip("/") == "/stats":
                self._answer(200, link.stats())
            else:
                self._answer(404, {"error": "GET /stats, POST /cut, POST /restore"})

        def do_POST(self) -> None:  # noqa: N802
            actions = {"/cut": link.cut, "/restore": link.restore}
            action = actions.get(self.path.rstrip("/"))
            if action is None:
                self._answer(404, {"error": "GET /stats, POST /cut, POST /restore"})
                return
            action()
            time.sleep(0.05)  # the loop applies it
            self._answer(200, link.stats())

        def log_message(self, *args) -> None:  # quiet: the role's log has what matters
            pass

    return Handler
