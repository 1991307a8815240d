"""Calls that may not end, bounded: each runs in a worker process that the caller kills at a deadline.

Verifiers evaluate what a model wrote. ``\\boxed{10^{10^{10}}}`` (math-verify, through sympy) or
``9**9**9`` (reasoning-gym's countdown, through ``parse_expr``) makes CPython compute a huge
integer in one C call that holds the GIL: no thread timeout stops it, nor ``SIGALRM`` (main thread
only, and handled between bytecodes), and the whole calling process stalls with it.

``BoundedPool.call(fn, *args)`` runs ``fn(*args)`` (a module-level function, picklable arguments)
in an idle worker process, started when none is idle, and waits at most ``timeout_s`` for the
result; past it the worker is killed and the call raises ``BoundedCallError``, as it does when
``fn`` raises or the worker dies. A call has its worker to itself, so one pool serves many threads;
up to ``max_idle`` idle workers are kept for later calls.

A worker is a fresh interpreter (``sys.executable -c``, the caller's ``sys.path``), not a fork (the
caller may hold CUDA or threads) nor a multiprocessing spawn (which re-imports the caller's
``__main__``). It runs ``warmup`` once before its first call (imports that must not count against
``timeout_s``), caps its address space at ``max_memory_bytes``, ignores ``SIGINT`` and, during a
call, lets the kernel kill it past ``2 * timeout_s + 1`` seconds of CPU, so a stuck worker ends
even when its caller was killed before it could kill the worker. It is no sandbox: ``fn`` runs
with the caller's user, files and network.
"""

from __future__ import annotations

import json
import math
import os
import queue
import resource
import signal
import socket
import subprocess
import sys
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

_BOOT = ("import sys, json; sys.path[:] = json.loads(sys.argv[2]); "
         "import producers.tasks.bounded as b; b._serve(int(sys.argv[1]))")


class BoundedCallError(RuntimeError):
    """A bounded call that gave no result: ``fn`` raised, its worker died, or (``timed_out``) it ran
    past its deadline."""

    retriable = False

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def _serve(fd: int) -> None:
    """A worker: read its settings, limit itself, warm up, say ready, then answer calls until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    warmup, max_memory_bytes, cpu_s = conn.recv()
    if max_memory_bytes is not None:
        resource.setrlimit(resource.RLIMIT_AS, (max_memory_bytes, max_memory_bytes))
    try:
        if warmup is not None:
            warmup()
    except Exception as exc:  # reported to the caller, which raises it as the worker's failure to start
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    while True:
        try:
            fn, args = conn.recv()
        except EOFError:  # the caller closed the pipe, or ended
            return
        used = resource.getrusage(resource.RUSAGE_SELF)
        soft = math.ceil(used.ru_utime + used.ru_stime + cpu_s)
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
        try:
            reply = ("ok", fn(*args))
        except Exception as exc:  # fn's failure is this call's result, not the worker's end
            reply = ("error", f"{type(exc).__name__}: {exc}")
        conn.send(reply)


class _Worker:
    def __init__(self, process: subprocess.Popen[bytes], conn: Connection) -> None:
        self.process, self.conn = process, conn

    def stop(self) -> None:
        self.conn.close()
        self.process.kill()
        self.process.wait()


def _stop_all(idle: queue.LifoQueue[_Worker]) -> None:
    while True:
        try:
            idle.get_nowait().stop()
        except queue.Empty:
            return


class BoundedPool:
    """Worker processes that run calls under a deadline; see the module docstring."""

    def __init__(self, *, timeout_s: float, warmup: Callable[[], object] | None = None, start_timeout_s: float = 120.0,
                 max_idle: int | None = None, max_memory_bytes: int | None = 4 << 30) -> None:
        """``max_idle`` defaults to the thread count of asyncio's default executor, ``min(32, cpus + 4)``."""
        if timeout_s <= 0 or start_timeout_s <= 0:
            raise ValueError(f"timeout_s ({timeout_s}) and start_timeout_s ({start_timeout_s}) must be positive")
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self.warmup, self.max_memory_bytes = warmup, max_memory_bytes
        self._idle: queue.LifoQueue[_Worker] = queue.LifoQueue(
            maxsize=max_idle if max_idle is not None else min(32, (os.cpu_count() or 1) + 4))
        self._finalizer = weakref.finalize(self, _stop_all, self._idle)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in a worker; ``BoundedCallError`` if it raises, its worker dies or it runs
        past ``timeout_s``."""
        name = getattr(fn, "__qualname__", repr(fn))
        worker = self._take()
        answered = False
        try:
            worker.conn.send((fn, args))
            if not worker.conn.poll(self.timeout_s):
                raise BoundedCallError(f"{name} gave no result in {self.timeout_s} s; its worker was killed",
                                       timed_out=True)
            status, value = worker.conn.recv()
            answered = True
        except (EOFError, OSError) as exc:
            raise BoundedCallError(f"the worker running {name} died ({type(exc).__name__}: {exc})") from None
        finally:
            if answered:
                self._give_back(worker)
            else:
                worker.stop()
        if status != "ok":
            raise BoundedCallError(f"{name} raised {value}")
        return value

    def close(self) -> None:
        """Stop the idle workers; a worker in a call stops when that call ends."""
        self._finalizer()

    def _take(self) -> _Worker:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            return self._start()

    def _give_back(self, worker: _Worker) -> None:
        try:
            if not self._finalizer.alive:
                raise queue.Full
            self._idle.put_nowait(worker)
        except queue.Full:
            worker.stop()

    def _start(self) -> _Worker:
        ours, theirs = socket.socketpair()
        with theirs:
            process = subprocess.Popen([sys.executable, "-c", _BOOT, str(theirs.fileno()), json.dumps(sys.path)],
                                       stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),))
        worker = _Worker(process, Connection(ours.detach()))
        try:
            worker.conn.send((self.warmup, self.max_memory_bytes, 2 * self.timeout_s + 1))
            ready = worker.conn.poll(self.start_timeout_s)
            status, value = worker.conn.recv() if ready else ("error", f"no answer in {self.start_timeout_s} s")
        except (EOFError, OSError) as exc:
            status, value = "error", f"it died ({type(exc).__name__}: {exc})"
        if status != "ready":
            worker.stop()
            raise RuntimeError(f"a worker process for bounded calls did not start: {value}; check that "
                               f"{getattr(self.warmup, '__qualname__', self.warmup)!r} runs in a fresh Python "
                               "process and that processes can be started here")
        return worker
