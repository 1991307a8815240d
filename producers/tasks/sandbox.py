"""Running an untrusted Python program: a subprocess with limits, killed with its whole process group.

Layers, each holding on its own:

* **Resource limits** (``setrlimit`` in the child before exec): CPU seconds, address space, file
  size, open files, processes, no core dumps; and a wall-clock limit after which the parent kills
  the process group (``SIGKILL``), whatever it left running.
* **A process group of its own** (``start_new_session``): when the program ends, times out or
  floods its output, every process it started is killed with it.
* **Its own empty directory** as working directory, deleted afterwards; a minimal environment (no
  credentials, no ``PYTHON*`` variables); ``python -I -S`` (no user site, no site-packages).
* **Another user** when rlbus runs as root: the child drops to ``nobody`` before exec, so the
  kernel refuses writes outside its directory and counts its processes (``RLIMIT_NPROC`` binds).
* **An audit hook** (PEP 578) installed before the program runs, which refuses: ``fork``, ``exec``,
  ``subprocess`` and ``posix_spawn``; sockets (connect, bind, sendto, getaddrinfo); ``ctypes``;
  opening files for writing, and removing or renaming them, outside the working directory; and
  frame introspection (``sys._getframe``). An audit hook cannot be removed from Python code, but a
  program may still find a way around a Python-level guard; the process-level layers above still
  hold then.
* **A network namespace** where the kernel allows unprivileged user namespaces: the child unshares
  user and network namespaces and has no interface but a down loopback. Where it does not, the
  audit hook is the network guard (logged once).

A test passes only when the runner prints, after the test code ran, a random token the program
never sees: a program that exits early (``os._exit(0)``) fails its tests.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pwd
import resource
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
_warned_network = False

RUNNER = r'''
import os, sys
def _run():
    fd = int(sys.argv[1])
    token = os.read(fd, 64).decode()
    os.close(fd)
    here = os.path.realpath(os.getcwd())
    with open("program.py", encoding="utf-8") as fh:
        program = fh.read()
    with open("test.py", encoding="utf-8") as fh:
        test = fh.read()
    def inside(path):
        try:
            real = os.path.realpath(os.fsdecode(path) if not isinstance(path, int) else here)
        except (TypeError, ValueError):
            return False
        return real == here or real.startswith(here + os.sep)
    refused = {"os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.kill",
               "os.killpg", "subprocess.Popen", "socket.connect", "socket.bind", "socket.sendto",
               "socket.sendmsg", "socket.getaddrinfo", "socket.__new__", "ctypes.dlopen", "ctypes.dlsym",
               "ctypes.cdata", "sys._getframe", "sys._current_frames", "os.chdir", "os.chmod", "os.chown",
               "os.symlink", "os.link", "os.truncate", "shutil.rmtree", "os.putenv", "os.unsetenv"}
    def hook(event, args):
        if event in refused:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open" and args[1] is not None and any(c in str(args[1]) for c in "wax+"):
            if not inside(args[0]):
                raise PermissionError(f"sandbox: writing outside the working directory: {args[0]}")
        if event in ("os.remove", "os.rename", "os.rmdir", "os.mkdir") and not all(
                inside(a) for a in args[:2] if isinstance(a, (str, bytes))):
            raise PermissionError(f"sandbox: {event} outside the working directory")
    sys.addaudithook(hook)
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    exec(compile(program, "program.py", "exec"), scope)
    exec(compile(test, "test.py", "exec"), scope)
    sys.stdout.flush()
    sys.stdout.write("\n" + token + "\n")
    sys.stdout.flush()
_run()
'''


@dataclass(frozen=True)
class SandboxLimits:
    """What one run of a program may use."""

    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 512
    max_output_bytes: int = 1 << 20
    max_processes: int = 1
    max_file_mb: int = 16
    max_open_files: int = 64

    def __post_init__(self) -> None:
        if min(self.cpu_s, self.wall_s, self.memory_mb, self.max_output_bytes, self.max_file_mb) <= 0:
            raise ValueError(f"sandbox limits must be positive: {self}")


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None
    stdout: str
    stderr: str
    passed: bool
    """The test code ran to its end (the runner's token came after it)."""
    timed_out: bool
    output_truncated: bool


_USER: tuple[int, int] | None | bool = False  # False: not probed yet


def _nobody() -> tuple[int, int] | None:
    """``nobody``'s ids when running as root and ``nobody`` can run this interpreter, else None."""
    global _USER
    if _USER is not False:
        return _USER
    _USER = None
    if os.geteuid() == 0:
        try:
            entry = pwd.getpwnam("nobody")
            ids = (entry.pw_uid, entry.pw_gid)

            def drop() -> None:
                os.setgroups([])
                os.setgid(ids[1])
                os.setuid(ids[0])

            probe = subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], preexec_fn=drop, capture_output=True,
                                   timeout=30, cwd="/")
            _USER = ids if probe.returncode == 0 else None
        except (KeyError, OSError, subprocess.SubprocessError):
            _USER = None
        if _USER is None:
            logger.warning("sandbox: running as root but 'nobody' cannot run %s; programs keep root's user (the "
                           "audit hook and resource limits still apply)", sys.executable)
    return _USER


def _preexec(limits: SandboxLimits, user: tuple[int, int] | None, isolate_network: bool):
    mb = 1024 * 1024

    def setup() -> None:  # in the child, before exec
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * mb, limits.memory_mb * mb))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.max_file_mb * mb, limits.max_file_mb * mb))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if user is not None:
            os.setgroups([])
            os.setgid(user[1])
            os.setuid(user[0])
            resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes + 1, limits.max_processes + 1))
        if isolate_network:  # after dropping the user: the new user namespace maps nobody's ids
            ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWUSER | CLONE_NEWNET)  # failure: the hook still guards

    return setup


def _network_namespaces() -> bool:
    """Whether this kernel lets an unprivileged process unshare user and network namespaces."""
    global _warned_network
    probe = subprocess.run([sys.executable, "-I", "-S", "-c",
                            "import ctypes,sys; sys.exit(ctypes.CDLL(None).unshare(%d))" % (CLONE_NEWUSER | CLONE_NEWNET)],
                           capture_output=True, timeout=30)
    if probe.returncode != 0 and not _warned_network:
        _warned_network = True
        logger.warning("sandbox: no unprivileged network namespaces here; the audit hook is the only network guard")
    return probe.returncode == 0


_NETNS: bool | None = None


def run_python(program: str, test: str = "", *, stdin: str = "", limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``program`` then ``test`` (Python source) in a sandboxed subprocess fed ``stdin``."""
    global _NETNS
    if _NETNS is None:
        _NETNS = _network_namespaces()
    user = _nobody()
    work = Path(tempfile.mkdtemp(prefix="rlbus-sandbox-"))
    token = secrets.token_hex(16)
    try:
        (work / "program.py").write_text(program, encoding="utf-8")
        (work / "test.py").write_text(test, encoding="utf-8")
        if user is not None:
            os.chown(work, *user)
        read_end, write_end = os.pipe()
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(work)}
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", RUNNER, str(read_end)], cwd=work, env=env, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(read_end,), start_new_session=True,
                preexec_fn=_preexec(limits, user, _NETNS),
            )
        finally:
            os.close(read_end)
        os.write(write_end, token.encode())
        os.close(write_end)
        return _collect(proc, stdin, token, limits)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _collect(proc: subprocess.Popen, stdin: str, token: str, limits: SandboxLimits) -> SandboxResult:
    out, err = bytearray(), bytearray()
    truncated = timed_out = False
    deadline = time.monotonic() + limits.wall_s
    try:
        proc.stdin.write(stdin.encode()[: 1 << 20])
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        pass  # the program ended or closed its stdin: it did not want the input
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(timeout=min(left, 0.5)):
                chunk = os.read(key.fileobj.fileno(), 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                key.data.extend(chunk)
                if len(out) + len(err) > limits.max_output_bytes:
                    truncated = True
            if truncated:
                break
    _kill_group(proc)
    code = proc.wait()
    stdout = bytes(out[: limits.max_output_bytes]).decode("utf-8", "replace")
    lines = stdout.rstrip("\n").split("\n")
    passed = not (timed_out or truncated) and code == 0 and lines[-1] == token
    if lines and lines[-1] == token:
        stdout = "\n".join(lines[:-1])
        stdout = stdout[:-1] if stdout.endswith("\n") else stdout
    return SandboxResult(returncode=code, stdout=stdout, stderr=bytes(err[:65536]).decode("utf-8", "replace"),
                         passed=passed, timed_out=timed_out, output_truncated=truncated)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the session leader's pid is the group id
    except ProcessLookupError:
        pass
    for stream in (proc.stdout, proc.stderr):
        stream.close()
