"""The sandbox's supervisor: the script ``producers.tasks.sandbox.run_python`` runs in the child.

It is run as a file (``python -I -S -B``), never imported by rlbus, and imports only the standard
library: it reads the run's description from stdin, enters the namespaces, confines itself
(Landlock, a fresh uid, resource limits), runs the program as pid 1 of its pid namespace and then
the checks, and reports passed checks on its own pipe, each line tagged with the run's nonce.
``producers/tasks/sandbox.py`` documents the layers and what each one holds.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import resource
import signal
import struct
import sys
from typing import NoReturn

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = (
    0x20000, 0x8000000, 0x10000000, 0x20000000, 0x40000000)
MS_BIND, MS_REC, MS_PRIVATE, MNT_DETACH = 0x1000, 0x4000, 0x40000, 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_WRITE_FILE, LANDLOCK_REFER, LANDLOCK_TRUNCATE = 1 << 1, 1 << 13, 1 << 14
LANDLOCK_MUTATIONS = LANDLOCK_WRITE_FILE | sum(1 << bit for bit in range(4, 13))  # remove, make (dir, reg, sym...)
MAX_OPEN_FILES = 64


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _child_main() -> NoReturn:
    cfg = _read_header()
    _set_limit(resource.RLIMIT_CORE, 0)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    _die_with_parent(libc, cfg["ppid"])
    root = os.geteuid() == 0
    iso = _enter_namespaces(libc, cfg) if cfg["isolate"] else {"isolate-off"}
    if "pidns" in iso:
        child = os.fork()
        if child:
            _relay(child, cfg)
        os.setsid()  # out of the supervisor's group: the program cannot signal it by group
        _die_with_parent(libc, None)
    iso |= _confine(libc, cfg, iso, exempt=root and "uid" not in iso)
    os.write(cfg["chan"], f"{cfg['nonce']} iso {','.join(sorted(iso))}\n".encode())
    _run_program(cfg)


def _read_header() -> dict:
    """The run's description, ahead of the program's stdin: ``<length>\\n<json>``."""
    size = b""
    while not size.endswith(b"\n"):
        byte = os.read(0, 1)
        if not byte:
            raise SystemExit("sandbox: no header on stdin; this file is run by run_python, not by hand")
        size += byte
    data = bytearray()
    while len(data) < int(size):
        chunk = os.read(0, int(size) - len(data))
        if not chunk:
            raise SystemExit("sandbox: the header on stdin ended early")
        data += chunk
    return json.loads(data)


def _die_with_parent(libc: ctypes.CDLL, ppid: int | None) -> None:
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if ppid is not None and os.getppid() != ppid:
        os._exit(1)  # the parent died before the line above


def _enter_namespaces(libc: ctypes.CDLL, cfg: dict) -> set[str]:
    spaces, uid = CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC, cfg["uid"]
    if os.geteuid() == 0 and libc.unshare(spaces | CLONE_NEWNS) == 0:
        iso = {"pidns", "netns", "mountns"}
        private = libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0  # no mount reaches the host
        if uid is not None and private and _open_import_dirs(libc):
            _become(libc, uid, cfg["ppid"])
            iso.add("uid")
        return iso
    iso = set()
    if uid is not None and not _closed_import_dirs():
        _become(libc, uid, cfg["ppid"])
        iso.add("uid")
    if libc.unshare(spaces | CLONE_NEWUSER) == 0:
        iso |= {"pidns", "netns", "userns"}
    return iso


def _closed_import_dirs() -> dict[str, list[str]]:
    """Import directories another user cannot reach, by the topmost directory that stops them."""
    closed: dict[str, list[str]] = {}
    for path in filter(os.path.isdir, sys.path):
        parts = os.path.realpath(path).split(os.sep)
        for end in range(2, len(parts) + 1):
            prefix, need = os.sep.join(parts[:end]), 0o005 if end == len(parts) else 0o001
            if os.stat(prefix).st_mode & need != need:
                closed.setdefault(prefix, []).append(os.sep.join(parts))
                break
    return closed


def _open_import_dirs(libc: ctypes.CDLL) -> bool:
    """Cover each closed directory with a tmpfs holding views of the import directories under it."""
    for top, dirs in _closed_import_dirs().items():
        if top in dirs:
            return False  # the import directory itself is closed
        handles = [(path, os.open(path, os.O_PATH | os.O_CLOEXEC)) for path in dirs]
        try:
            if libc.mount(b"tmpfs", top.encode(), b"tmpfs", 0, b"mode=755,size=64k") != 0:
                return False
            for path, fd in handles:
                os.makedirs(path, exist_ok=True)
                if libc.mount(f"/proc/self/fd/{fd}".encode(), path.encode(), None, MS_BIND | MS_REC, None) != 0:
                    libc.umount2(top.encode(), MNT_DETACH)  # the library back in place, for root's imports
                    return False
        finally:
            for _, fd in handles:
                os.close(fd)
    return True


def _become(libc: ctypes.CDLL, uid: int, ppid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    _die_with_parent(libc, ppid)  # a change of user clears the parent-death signal


def _relay(child: int, cfg: dict) -> NoReturn:
    """Wait for the program (pid 1 of the namespace) and end the way it ended."""
    code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    if code < 0:  # said on the channel rather than re-raised: the supervisor must not dump core
        os.write(cfg["chan"], f"{cfg['nonce']} signal {-code}\n".encode())
        os._exit(128 - code)
    os._exit(code)


def _confine(libc: ctypes.CDLL, cfg: dict, iso: set[str], *, exempt: bool) -> set[str]:
    limits, mb, added = cfg["limits"], 1 << 20, set()
    nproc = None if exempt else _nproc_limit(limits["max_processes"], iso)
    if nproc is not None:
        _set_limit(resource.RLIMIT_NPROC, nproc)
        added.add("nproc")
    _set_limit(resource.RLIMIT_NOFILE, MAX_OPEN_FILES)
    _set_limit(resource.RLIMIT_FSIZE, limits["max_file_mb"] * mb)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # no core dump, even to a core_pattern pipe; no ptrace
    if cfg["isolate"]:
        added |= _landlock(libc, os.getcwd())
    files, network = "landlock-fs" not in added, not (iso | added) & {"netns", "landlock-net"}
    if files or network:
        _install_guard(os.getcwd(), files=files, network=network)
        added |= {"guard-fs"} if files else set()
        added |= {"guard-net"} if network else set()
    return added


def _nproc_limit(max_processes: int, iso: set[str]) -> int:
    if iso & {"uid", "userns"}:  # a count of its own; the supervisor is in it when it stayed outside
        return max_processes + ("pidns" in iso)
    mine = 0  # the user's count: RLIMIT_NPROC counts every thread of the real uid
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
            if int(status["Uid"].split()[0]) == os.getuid():
                mine += int(status["Threads"])
        except (OSError, KeyError, ValueError):
            continue
    return mine + max_processes - 1


def _set_limit(kind: int, value: int) -> None:
    """Soft and hard limit ``value``, or the hard limit already in place when that is lower."""
    hard = resource.getrlimit(kind)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(kind, (value, value))


def _syscall(libc: ctypes.CDLL, number: int, *args: object) -> int:
    return libc.syscall(ctypes.c_long(number), *(ctypes.c_long(a) if isinstance(a, int) else a for a in args))


def _landlock(libc: ctypes.CDLL, workdir: str) -> set[str]:
    """Writes only under ``workdir`` (and to /dev/null), no TCP, no signals out; the layers that held."""
    abi = _syscall(libc, SYS_LANDLOCK_CREATE_RULESET, None, 0, 1)
    if abi < 1:
        return set()
    fs = LANDLOCK_MUTATIONS | (LANDLOCK_REFER if abi >= 2 else 0) | (LANDLOCK_TRUNCATE if abi >= 3 else 0)
    net, scoped = (0b11 if abi >= 4 else 0), (0b11 if abi >= 6 else 0)
    attr = struct.pack("=QQQ", fs, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    ruleset = _syscall(libc, SYS_LANDLOCK_CREATE_RULESET, attr, len(attr), 0)
    if ruleset < 0:
        return set()
    try:
        for path, access in ((workdir, fs), ("/dev/null", LANDLOCK_WRITE_FILE | (fs & LANDLOCK_TRUNCATE))):
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                if _syscall(libc, SYS_LANDLOCK_ADD_RULE, ruleset, 1, struct.pack("=Qi", access, fd), 0) != 0:
                    return set()
            finally:
                os.close(fd)
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        if _syscall(libc, SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0) != 0:
            return set()
    finally:
        os.close(ruleset)
    return {"landlock-fs"} | ({"landlock-net"} if net else set()) | ({"landlock-scope"} if scoped else set())


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_PATH_ARGS = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.chmod": (0,), "os.chown": (0,),
              "os.truncate": (0,), "os.utime": (0,), "os.rename": (0, 1), "os.link": (0, 1), "os.symlink": (1,)}
_ESCAPES = ("ctypes.", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen")


def _install_guard(workdir: str, *, files: bool, network: bool) -> None:
    """The audit-hook fallback: refuse file mutations outside ``workdir``, non-Unix sockets, and the
    ways around a Python-level hook (ctypes, running another program)."""
    home = os.path.realpath(workdir)

    def outside(path: object) -> bool:
        if not isinstance(path, str | bytes | os.PathLike):
            return False  # a file descriptor, opened under this guard
        real = os.path.realpath(os.fsdecode(path))
        return real != home and not real.startswith(home + os.sep)

    def hook(event: str, args: tuple) -> None:
        if event.startswith(_ESCAPES):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if files and event == "open" and isinstance(args[2], int) and args[2] & _WRITE_FLAGS and outside(args[0]):
            raise PermissionError(f"sandbox: writing {args[0]!r} outside the working directory is not allowed")
        if files and event in _PATH_ARGS and any(outside(args[i]) for i in _PATH_ARGS[event]):
            raise PermissionError(f"sandbox: {event} outside the working directory is not allowed")
        if network and event == "socket.__new__" and args[1] != 1:  # AF_UNIX
            raise PermissionError("sandbox: network sockets are not allowed")

    sys.addaudithook(hook)


def _run_program(cfg: dict) -> NoReturn:
    """Run the program as ``__main__``, then each check; report passes on the channel; exit."""
    import builtins
    import traceback
    import types

    # Bound now: the program may replace builtins and os functions for everything that runs after it.
    run, build, write, leave, print_exc = exec, compile, os.write, os._exit, traceback.print_exc
    chan, tag, checks = cfg["chan"], f"{cfg['nonce']} pass ".encode(), list(enumerate(cfg["checks"]))
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"], sys.argv = main, ["solution.py"]
    cpu, memory = math.ceil(cfg["limits"]["cpu_s"]), cfg["limits"]["memory_mb"] << 20
    _set_limit(resource.RLIMIT_CPU, cpu)  # soft = hard: SIGKILL, as pid 1 of a namespace ignores SIGXCPU
    _set_limit(resource.RLIMIT_AS, memory)
    status = 0
    try:
        run(build(cfg["source"], "solution.py", "exec"), main.__dict__)
    except SystemExit as exc:  # as the interpreter would end: an int is the status, anything else is printed
        status = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:
        print_exc()
        status = 1
    for index, check in checks if status == 0 else ():
        try:
            run(build(check, f"<check {index}>", "exec"), main.__dict__)
        except BaseException:  # SystemExit too: a program that exits inside a check fails it
            print_exc()
            continue
        write(chan, tag + b"%d\n" % index)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass  # a closed or broken stream: its output is lost, the status stands
    leave(status)


if __name__ == "__main__":
    _child_main()
