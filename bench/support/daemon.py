"""One kvoffd for a bench: ``BenchDaemon`` and ``start_daemon``.

Ready means the daemon's own ``READY=1`` over ``$NOTIFY_SOCKET`` (kvoffd/sdnotify.py: sent once its
socket is bound and its HTTP listener is up), read from a socket this module binds, so a bench never
polls a port; figures are taken once the pool is usable (``wait_pool``), pinned if the bench asks. The
log goes to a file that ``stop`` removes (its tail stays readable through ``log()``), the process is
always reaped, and ``give_back`` removes the pool a daemon left in /dev/shm (``kvoffd purge``).

The tests have their own launcher (tests/support/daemon.py) with what a test needs besides (clients
closed at the stop, the session's log directory, a caller's notify socket relayed).
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvoffd_client.client import KvoffdClient

ROOT = Path(__file__).resolve().parents[2]


class BenchDaemon:
    """``python -m kvoffd --address ADDRESS *args``; ``log_path``: keep its log there (default: a
    temporary file removed at ``stop``)."""

    def __init__(self, address: str, args: Sequence[str] = (), *, log_path: str | os.PathLike | None = None,
                 env: dict[str, str] | None = None):
        self.address = address
        self.argv = [sys.executable, "-m", "kvoffd", "--address", address, *args]
        self.env = dict(os.environ if env is None else env)
        self._dir = tempfile.mkdtemp(prefix="kvoffd-bench-daemon-")
        self._own_log = log_path is None
        self.log_path = str(log_path or os.path.join(self._dir, "kvoffd.log"))
        self._log_tail = ""
        self._metrics_address = ""
        self._notify: socket.socket | None = None
        self._clients: list[KvoffdClient] = []
        self.proc: subprocess.Popen | None = None

    def spawn(self) -> BenchDaemon:
        """Start the process, not waiting (a bench that times the start itself)."""
        path = os.path.join(self._dir, "notify.sock")
        self._notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._notify.bind(path)
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**self.env, "NOTIFY_SOCKET": path}, cwd=ROOT)
        return self

    def start(self, ready_s: float = 30.0) -> BenchDaemon:
        """Start it and wait for its READY=1."""
        return self.spawn().wait_ready(ready_s)

    def wait_ready(self, ready_s: float = 30.0) -> BenchDaemon:
        """Until its READY=1; a daemon that exits or stays silent is killed, reaped and reported with its
        log (RuntimeError)."""
        deadline = time.monotonic() + ready_s
        while True:
            if select.select([self._notify], [], [], 0.2)[0] and \
                    "READY=1" in self._notify.recv(65536).decode().split("\n"):
                self._close_notify()  # what it says later (stopping) the daemon drops, by design
                return self
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = f"exited ({self.proc.returncode})" if self.proc.poll() is not None else \
                    f"not ready within {ready_s:.0f} s"
                self.stop(signal.SIGKILL)
                raise RuntimeError(f"kvoffd at {self.address} {why}; log:\n{self.log()}")

    def _close_notify(self) -> None:
        if self._notify is not None:
            self._notify.close()
            self._notify = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self._dir, "notify.sock"))

    def client(self, **kw: Any) -> KvoffdClient:
        """A connected client, closed at ``stop``."""
        c = KvoffdClient(self.address, **kw)
        if not c.connect(10):
            c.close()
            raise RuntimeError(f"kvoffd at {self.address} not reachable; log:\n{self.log()}")
        self._clients.append(c)
        return c

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stats(self, timeout_s: float = 10.0) -> dict[str, Any]:
        with KvoffdClient(self.address, heartbeat=False) as c:
            if not c.connect(timeout_s):
                raise RuntimeError(f"kvoffd at {self.address} not reachable; log:\n{self.log()}")
            return c.stats(timeout_s=timeout_s)

    @property
    def metrics_address(self) -> str:
        """HOST:PORT of its HTTP listener, as the daemon reports it, asked once."""
        if not self._metrics_address:
            self._metrics_address = self.stats()["daemon"]["metrics_address"]
        return self._metrics_address

    def wait_pool(self, timeout: float = 120.0, pinned: bool = False) -> dict[str, Any]:
        """Until the whole pool is usable (``pinned``: page-locked too), or ``timeout``; the last STATS.
        On a GPU host the pool becomes usable as it is pinned; until then stores are dropped by design."""
        deadline = time.monotonic() + timeout
        with KvoffdClient(self.address, heartbeat=False) as c:
            if not c.connect(min(timeout, 30.0)):
                raise RuntimeError(f"kvoffd at {self.address} not reachable; log:\n{self.log()}")
            while True:
                st = c.stats(timeout_s=5)
                pool = st["pool"]
                done = pool["pinned_bytes"] >= pool["total_bytes"] if pinned else \
                    pool["capacity_bytes"] == pool["total_bytes"]
                if done or time.monotonic() > deadline:
                    return st
                time.sleep(0.05)

    def log(self, tail: int = 4000) -> str:
        try:
            text = Path(self.log_path).read_text()
        except OSError:
            text = self._log_tail
        return text[-tail:] if tail else text

    def send_signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float | None = None) -> int:
        """Its exit status (``subprocess.TimeoutExpired`` after ``timeout``); ``stop`` cleans up after it."""
        return self.proc.wait(timeout)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        """Close its clients, send ``sig``, wait ``timeout`` (then SIGKILL); always reaped. Its exit status."""
        for c in self._clients:
            c.close()
        self._clients.clear()
        rc = 0
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(sig)
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
            rc = self.proc.wait(10)
        self._log_tail = self.log(0)
        self._close_notify()
        shutil.rmtree(self._dir, ignore_errors=True)
        return rc

    def give_back(self) -> None:
        """Remove the pool this (stopped) daemon kept in /dev/shm for a next start: a bench leaves no RAM."""
        subprocess.run([sys.executable, "-m", "kvoffd", "purge", "--address", self.address, "--pool-path", "none"],
                       cwd=ROOT, env=self.env, stdout=subprocess.DEVNULL, check=False)


def start_daemon(address: str, pool_size: str = "256MiB", *extra: str, ready_s: float = 30.0,
                 env: dict[str, str] | None = None) -> BenchDaemon:
    """A bench's daemon with metrics on a free port, its pool in private memory unless ``extra`` says
    ``--pool-path``, ready and with its whole pool usable."""
    env = dict(os.environ if env is None else env)
    env.setdefault("KVOFFD_POOL_PATH", "none")
    d = BenchDaemon(address, ["--pool-size", pool_size, "--metrics-address", "127.0.0.1:0", *extra],
                    env=env).start(ready_s)
    try:
        st = d.wait_pool(30)
        if st["pool"]["capacity_bytes"] != st["pool"]["total_bytes"]:
            raise RuntimeError(f"pool never became usable:\n{d.log()}")
    except BaseException:
        d.stop(signal.SIGKILL)
        raise
    return d
