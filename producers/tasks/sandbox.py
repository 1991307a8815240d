"""Running an untrusted Python program in a subprocess it cannot break out of cheaply.

``run_python(source, stdin=..., checks=..., limits=...)`` starts ``python -I -S -X utf8`` on
``producers/tasks/sandbox_child.py`` (standard library only, no site-packages, no ``PYTHON*``
variables) in a fresh directory
(deleted afterwards) with a minimal environment (``PATH``, ``HOME``/``TMPDIR`` = that directory,
UTF-8 locale; nothing of the caller's, so no ``AWS_*`` or ``RLBUS_*``). That child, the
*supervisor*, confines itself with what Linux offers, best first, and records which layers held in
``SandboxResult.isolation``:

* ``pidns``, ``netns``: namespaces of its own, unshared directly as root (then also ``mountns``),
  else inside a new user namespace (``userns``, unprivileged). The program is pid 1 of the new pid
  namespace: when it ends, or is killed, the kernel kills every process it started, whatever
  session or group they moved to. The network namespace has nothing but a down loopback: no
  address, not even the host's 127.0.0.1, is reachable.
* ``uid``: as root, the program runs as a fresh random uid, so ``RLIMIT_NPROC`` binds (the kernel
  exempts root) and file permissions apply. Where the interpreter's library sits under a directory
  other users cannot enter (``/root/.pyenv``), that directory is covered, in the private mount
  namespace, by a tmpfs holding only views of the library (root's other files stay hidden).
* ``landlock-fs``, ``landlock-net``, ``landlock-scope`` (Linux 5.13+, unprivileged): the program
  may create, write, rename or remove files only under its directory (and write ``/dev/null``;
  not ``/dev/shm``, so no ``multiprocessing`` locks); TCP bind/connect is refused (ABI 4+); it
  cannot signal processes outside its domain (ABI 6+). Reading is left to file permissions.
* ``nproc``: ``RLIMIT_NPROC`` bounds its processes (and threads), counted in a fresh uid or user
  namespace, else on top of what the user already runs.
* ``guard-fs``, ``guard-net``: only where Landlock is missing: a PEP 578 audit hook refuses writes
  and removals outside the directory, non-Unix sockets, ``ctypes`` and exec. A determined program
  can get around a Python-level guard (``dir_fd``, a hard-linked path...); the other layers and
  the resource limits still hold. A warning is logged once for each layer a machine lacks.
* ``isolate-off``: the caller asked for rlimits and the guard only (``isolate=False``).

Always: ``RLIMIT_CPU`` (``SIGKILL``: pid 1 of a namespace ignores ``SIGXCPU``), ``RLIMIT_AS``,
``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, no core dumps; a wall-clock limit; stdout and stderr read up to
``max_output_bytes`` each (then the run is killed). At the end the caller stops the supervisor,
kills the program's pid 1 and waits for the namespace to empty, then kills the supervisor's process
group; without a pid namespace it kills the group and every process of the session, so only a
program that escapes with ``setsid`` outlives the run (bounded by its CPU and process limits). A
supervisor whose caller dies is killed by the kernel (parent-death signal), and its program with it.

Checks (``checks``: statements run one by one after the program, in its namespace) report a pass
on a private pipe as a line tagged with a random nonce; the result keeps the indices that passed
before the run ended. One process serves all checks of a sample: one start-up and one time budget,
at the price that a check that hangs or kills the process fails the ones after it. A program that
exits early (``os._exit(0)``) passes nothing; one that digs the nonce out of its own interpreter
could forge passes, which no in-process test runner prevents (nor objects whose ``__eq__`` is
always true).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import select
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields

logger = logging.getLogger(__name__)

UID_RANGE = (1_000_000, 2_000_000_000)
"""Where the fresh uid of a run comes from (no passwd entry needed)."""
CHANNEL_CAP = 1 << 16
NAMESPACE_TEARDOWN_S = 10.0
"""How long the caller waits for a killed pid namespace to empty before it logs and goes on."""
WEAK = {"pidns": "a program's processes that call setsid may outlive the run",
        "netns|landlock-net": "network isolation is only a Python-level guard",
        "landlock-fs": "writes outside the sandbox directory are stopped only by a Python-level guard",
        "nproc": "the number of processes a program starts is not bounded (root without a fresh uid)"}
_warned: set[str] = set()  # the only module state: which weaknesses were logged already


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program): every sample would score 0, so it is not hidden."""

    retriable = False


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use. The wall clock bounds a run; CPU seconds bound each of its processes."""

    cpu_s: float = 5.0
    """CPU seconds of each process, rounded up to whole seconds."""
    wall_s: float = 10.0
    memory_mb: int = 1024
    """Address space of each process; the interpreter itself takes some 30 MB of it."""
    max_output_bytes: int = 1 << 20
    """Kept of stdout, and of stderr; a program that writes more is killed."""
    max_processes: int = 16
    """Processes and threads at once, the program's own included."""
    max_file_mb: int = 16

    def __post_init__(self) -> None:
        floors = {"cpu_s": 0.01, "wall_s": 0.01, "memory_mb": 64, "max_output_bytes": 1, "max_processes": 1,
                  "max_file_mb": 0}
        for name, floor in floors.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < floor:
                raise ValueError(f"sandbox limit {name}={value!r}: give a number >= {floor}")


@dataclass(frozen=True)
class SandboxResult:
    """How a run ended. ``returncode`` is negative when a signal killed the program."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    output_truncated: bool
    killed_by_signal: int | None
    passed_checks: frozenset[int]
    """Indices of ``checks`` that ran without raising."""
    isolation: frozenset[str]
    """The layers that held (module docstring); empty when the run timed out before they were set."""

    @property
    def ok(self) -> bool:
        """The program ran to its end, exit status 0, within its limits."""
        return self.returncode == 0 and not self.timed_out and not self.output_truncated


def run_python(source: str, *, stdin: str = "", checks: Sequence[str] = (),
               limits: SandboxLimits = SandboxLimits(), isolate: bool = True) -> SandboxResult:
    """Run ``source`` as ``__main__`` fed ``stdin``, then each of ``checks``. Never raises for what
    the program does; ``SandboxError`` when the sandbox itself fails. ``isolate=False`` leaves out
    namespaces, Landlock and the uid change (for machines where they misbehave): the resource
    limits and the audit-hook guard remain."""
    if not sys.platform.startswith("linux"):
        raise RuntimeError("the code sandbox needs Linux (rlimits, pidfd, namespaces); run the worker on Linux")
    nonce = secrets.token_hex(16)
    uid = secrets.randbelow(UID_RANGE[1] - UID_RANGE[0]) + UID_RANGE[0] if isolate and os.geteuid() == 0 else None
    workdir = tempfile.mkdtemp(prefix="rlbus-sandbox-")
    chan_r, chan_w = os.pipe()
    try:
        if uid is not None:
            os.chown(workdir, uid, uid)
        header = json.dumps({"source": source, "checks": list(checks), "nonce": nonce, "uid": uid,
                             "isolate": isolate, "ppid": os.getpid(), "chan": chan_w,
                             "limits": {f.name: getattr(limits, f.name) for f in fields(limits)}}).encode()
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LC_ALL": "C.UTF-8"}
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", "-X", "utf8", os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")], cwd=workdir, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(chan_w,),
            start_new_session=True)
        os.close(chan_w)
        chan_w = -1
        payload = b"%d\n" % len(header) + header + stdin.encode()
        return _supervise(proc, payload, chan_r, nonce, limits)
    finally:
        for fd in (chan_r, chan_w):
            if fd >= 0:
                os.close(fd)
        _remove_tree(workdir)


class _Capped:
    """What one pipe delivered, kept up to ``cap`` bytes."""

    def __init__(self, cap: int) -> None:
        self.cap, self.data, self.truncated = cap, bytearray(), False

    def read(self, fd: int) -> bool:
        """Read once (the pipe is non-blocking); False at end of file or past the cap."""
        chunk = os.read(fd, 1 << 16)
        self.data += chunk[: self.cap + 1 - len(self.data)]
        self.truncated = len(self.data) > self.cap
        return bool(chunk) and not self.truncated

    def drain(self, fd: int) -> None:
        """Read what is left, up to end of file, an empty pipe or the cap."""
        try:
            while self.read(fd):
                pass
        except BlockingIOError:
            pass  # a writer outlived the run (no pid namespace); what it writes later is not ours

    def text(self) -> str:
        return bytes(self.data[: self.cap]).decode("utf-8", "replace")


def _supervise(proc: subprocess.Popen, payload: bytes, chan_r: int, nonce: str, limits: SandboxLimits) -> SandboxResult:
    out, err, chan = _Capped(limits.max_output_bytes), _Capped(limits.max_output_bytes), _Capped(CHANNEL_CAP)
    streams = {proc.stdout.fileno(): out, proc.stderr.fileno(): err, chan_r: chan}
    stdin_fd, sent = proc.stdin.fileno(), 0
    pidfd = os.pidfd_open(proc.pid)
    deadline = time.monotonic() + limits.wall_s
    timed_out = exited = False
    try:
        with selectors.DefaultSelector() as sel:
            for fd in (*streams, stdin_fd):
                os.set_blocking(fd, False)
                sel.register(fd, selectors.EVENT_WRITE if fd == stdin_fd else selectors.EVENT_READ)
            sel.register(pidfd, selectors.EVENT_READ)
            while not (exited or out.truncated or err.truncated):
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                for key, _ in sel.select(left):
                    if key.fd == pidfd:
                        exited = True  # the supervisor ended; what is left in the pipes is read below
                    elif key.fd == stdin_fd:
                        try:
                            sent += os.write(stdin_fd, payload[sent: sent + (1 << 16)])
                        except BrokenPipeError:
                            sent = len(payload)  # the program closed its stdin: it wants no more
                        if sent >= len(payload):
                            sel.unregister(stdin_fd)
                            proc.stdin.close()
                    elif not streams[key.fd].read(key.fd):
                        sel.unregister(key.fd)
            _kill_all(proc, pidfd, pid_namespace="pidns" in _parse_channel(chan.data, nonce)[0])
            for fd, stream in streams.items():
                if fd in sel.get_map():
                    stream.drain(fd)
    finally:
        os.close(pidfd)
        if proc.returncode is None:  # an error of ours above: leave nothing running
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            pipe.close()
    isolation, passed, signalled = _parse_channel(chan.data, nonce)
    if not isolation and not timed_out:  # the supervisor reports before it runs any of the program
        raise SandboxError(f"the sandbox failed before running the program (exit {proc.returncode}): "
                           f"{err.text()[-2000:] or 'no message'}")
    returncode = -signalled if signalled else proc.returncode
    if isolation:
        _warn_once(isolation)
    return SandboxResult(returncode=returncode, stdout=out.text(), stderr=err.text(), timed_out=timed_out,
                         output_truncated=out.truncated or err.truncated,
                         killed_by_signal=-returncode if returncode < 0 else None,
                         passed_checks=frozenset(passed), isolation=frozenset(isolation))


def _parse_channel(data: bytes | bytearray, nonce: str) -> tuple[set[str], set[int], int]:
    """(isolation layers, checks passed, signal that killed the program) from the nonce-tagged lines."""
    isolation: set[str] = set()
    passed: set[int] = set()
    signalled = 0
    for line in bytes(data).decode("ascii", "replace").splitlines():
        tag, _, rest = line.partition(" ")
        kind, _, value = rest.partition(" ")
        if tag != nonce:
            continue
        if kind == "iso":
            isolation = set(filter(None, value.split(",")))
        elif kind == "pass" and value.isdigit():
            passed.add(int(value))
        elif kind == "signal" and value.isdigit():
            signalled = int(value)
    return isolation, passed, signalled


def _kill_all(proc: subprocess.Popen, pidfd: int, *, pid_namespace: bool) -> None:
    """Kill the supervisor, its program and everything the program started; return once they are gone."""
    with contextlib.suppress(ProcessLookupError):  # stopped, it cannot reap its child, whose pid stays put
        signal.pidfd_send_signal(pidfd, signal.SIGSTOP)
    for pid in _children(proc.pid):
        _kill_and_wait(pid, verify=None)  # a pid namespace's first process: its death empties the namespace
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    if not pid_namespace:
        for _ in range(100):
            members = [pid for pid in _pids() if _session_of(pid) == proc.pid]
            if not members:
                break
            for pid in members:
                _kill_and_wait(pid, verify=proc.pid)
    proc.wait()


def _kill_and_wait(pid: int, *, verify: int | None) -> None:
    """SIGKILL ``pid`` through a pidfd (when ``verify``, only if it is still in that session) and wait
    for it to exit; the exit of a pid namespace's first process waits for the whole namespace."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return  # gone already
    try:
        if verify is not None and _session_of(pid) != verify:
            return
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(NAMESPACE_TEARDOWN_S * 1000):
            logger.warning("sandbox: process %d still exits %.0f s after SIGKILL; going on", pid, NAMESPACE_TEARDOWN_S)
    except ProcessLookupError:
        pass
    finally:
        os.close(fd)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(child) for child in f.read().split()]
    except OSError:
        return []


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _session_of(pid: int) -> int | None:
    """The session of a live process (None when gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state, _ppid, _pgrp, session = f.read().rsplit(")", 1)[1].split()[:4]
    except (OSError, ValueError):
        return None
    return None if state == "Z" else int(session)


def _warn_once(isolation: set[str]) -> None:
    if "isolate-off" in isolation:
        return  # asked for
    for layers, why in WEAK.items():
        if not isolation & set(layers.split("|")) and layers not in _warned:
            _warned.add(layers)
            logger.warning("sandbox: %s here (layers in effect: %s)", why, ", ".join(sorted(isolation)))


def _remove_tree(path: str) -> None:
    if os.geteuid() != 0:  # a directory the program made unreadable would stop rmtree
        for root, dirs, _ in os.walk(path):
            for name in dirs:
                if not os.path.islink(os.path.join(root, name)):
                    os.chmod(os.path.join(root, name), 0o700)
    shutil.rmtree(path, ignore_errors=True)
    if os.path.exists(path):
        logger.warning("sandbox: could not remove %s", path)
