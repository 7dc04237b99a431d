"""One launcher for every kvoffd daemon a test starts: ``DaemonProc``.

Ready means what systemd's ``Type=notify`` waits for: the daemon's own ``READY=1`` datagram over
``$NOTIFY_SOCKET`` (kvoffd/sdnotify.py), sent once its socket is bound and its HTTP listener is up. The
launcher binds that socket itself, so a test never polls a port or guesses a delay; a daemon that exits
first is reported with its log. A caller's own ``NOTIFY_SOCKET`` (tests/test_ops_deploy.py) gets every
datagram the launcher reads, as it reads them.

The daemon's stdout and stderr go to one log file, in the session's log directory
(``$KVOFFD_TEST_LOG_DIR``, made and removed by tests/conftest.py) unless the caller names one. ``stop``
sends a signal, waits, kills after a timeout and always reaps; the notify socket and its directory go
as soon as the daemon is ready (else with the process).
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from kvoffd_client.client import KvoffdClient

ROOT = Path(__file__).resolve().parents[2]


class DaemonProc:
    """One ``python -m kvoffd --address ADDRESS *args`` process.

    ``env``: the daemon's whole environment (default: this process's); ``wrapper``: a command it runs
    under (``setpriv --reuid 65534 ...``); ``preexec_fn`` runs in the child before exec (e.g. to lower
    an rlimit); ``log_path``: where its output goes (default: a new file in the session's log directory)."""

    def __init__(self, address: str, args: Sequence[str] = (), *, env: dict[str, str] | None = None,
                 wrapper: Sequence[str] = (), preexec_fn=None, log_path: str | os.PathLike | None = None,
                 start_new_session: bool = False, cwd: str | os.PathLike = ROOT, argv: Sequence[str] | None = None):
        """``argv``: the whole command instead of ``python -m kvoffd --address ADDRESS *args`` (a daemon
        started through a wrapper script, tests/test_ops_connections.py)."""
        self.address = address
        self.argv = [*wrapper, *(argv if argv is not None else
                                 [sys.executable, "-m", "kvoffd", "--address", address, *args])]
        self.env = dict(os.environ if env is None else env)
        self.preexec_fn = preexec_fn
        self.start_new_session = start_new_session
        self.cwd = cwd
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="kvoffd-test-", suffix=".log",
                                            dir=os.environ.get("KVOFFD_TEST_LOG_DIR"))
            os.close(fd)
        self.log_path = str(log_path)
        self.proc: subprocess.Popen | None = None
        self.clients: list[KvoffdClient] = []
        self.notices: list[str] = []  # the datagrams the daemon sent over $NOTIFY_SOCKET up to READY=1, in order
        self._metrics_address = ""
        self._notify_dir: str | None = None
        self._notify: socket.socket | None = None
        self._relay = self.env.get("NOTIFY_SOCKET")  # the caller's own socket, if any

    # --- start ------------------------------------------------------------------------------------------

    def spawn(self) -> DaemonProc:
        """Start the process; do not wait for it (a test of a start that fails, or is held)."""
        self._notify_dir = tempfile.mkdtemp(prefix="kvoffd-notify-")
        os.chmod(self._notify_dir, 0o711)  # a daemon run as another user reaches the socket too
        path = os.path.join(self._notify_dir, "notify.sock")
        self._notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._notify.bind(path)
        os.chmod(path, 0o666)
        env = {**self.env, "NOTIFY_SOCKET": path}
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, cwd=self.cwd, preexec_fn=self.preexec_fn,
                                         start_new_session=self.start_new_session)
        return self

    def start(self, ready_s: float = 20.0) -> DaemonProc:
        """Start the process and wait for its READY=1 (``ready_s``: a disk tier of 100M blocks reads its
        index first). A daemon that exits or stays silent is killed, reaped and reported with its log."""
        self.spawn()
        try:
            self.wait_ready(ready_s)
        except BaseException:
            self.stop(signal.SIGKILL)
            raise
        return self

    def wait_ready(self, timeout: float) -> None:
        """Until its READY=1; then the notify socket and its directory go (what the daemon says later,
        STOPPING, it drops by design), so a test that reaps the process itself leaves nothing behind."""
        deadline = time.monotonic() + timeout
        while not any("READY=1" in m.split("\n") for m in self.notices):
            if self.proc.poll() is not None:
                self.read_notices()
                if any("READY=1" in m.split("\n") for m in self.notices):
                    break
                raise RuntimeError(f"daemon at {self.address} exited ({self.proc.returncode}) before it was "
                                   f"ready; log:\n{self.log()}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"daemon at {self.address} not ready within {timeout:.0f} s; log:\n{self.log()}")
            # short slices: a daemon that dies without a word is noticed by its exit, not by the deadline
            self.read_notices(min(left, 0.2))
        self._close_notify()

    def read_notices(self, timeout: float = 0.0) -> list[str]:
        """Collect the datagrams waiting (up to ``timeout`` for the first); forward each to the caller's
        $NOTIFY_SOCKET, if it set one. Returns all of them so far."""
        wait = timeout
        while self._notify is not None and select.select([self._notify], [], [], wait)[0]:
            data = self._notify.recv(65536)
            self.notices.append(data.decode("utf-8", "replace"))
            self._forward(data)
            wait = 0
        return self.notices

    def _forward(self, data: bytes) -> None:
        if not self._relay or not self._relay.startswith(("/", "@")):
            return
        addr = "\0" + self._relay[1:] if self._relay.startswith("@") else self._relay
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.sendto(data, addr)
        except OSError:
            pass  # the caller's socket is gone: it asked for nothing more

    # --- use --------------------------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def metrics_address(self) -> str:
        """HOST:PORT of its HTTP listener, as the daemon reports it (STATS), asked once."""
        if not self._metrics_address:
            with KvoffdClient(self.address, heartbeat=False) as c:
                assert c.connect(10), f"daemon at {self.address} not reachable; log:\n{self.log()}"
                self._metrics_address = c.stats()["daemon"]["metrics_address"]
        return self._metrics_address

    @metrics_address.setter
    def metrics_address(self, value: str) -> None:
        self._metrics_address = value

    def client(self, **kw) -> KvoffdClient:
        """A connected client, closed at ``stop``."""
        c = KvoffdClient(self.address, **kw)
        assert c.connect(10), f"daemon at {self.address} not reachable; log:\n{self.log()}"
        self.clients.append(c)
        return c

    def log(self, tail: int = 4000) -> str:
        try:
            text = Path(self.log_path).read_text()
        except OSError:
            return ""
        return text[-tail:] if tail else text

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://{self.metrics_address}/metrics", timeout=5) as r:
            return r.read().decode()

    def http(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://{self.metrics_address}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    # --- stop -------------------------------------------------------------------------------------------

    def send_signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float | None = None) -> int:
        """Reap the process (``subprocess.TimeoutExpired`` after ``timeout``); its exit status."""
        rc = self.proc.wait(timeout)
        self._close_notify()
        return rc

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        """Close its clients, send ``sig``, wait ``timeout`` (then SIGKILL); always reaped. Exit status."""
        for c in self.clients:
            c.close()
        self.clients.clear()
        if self.proc is None:
            self._close_notify()
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.wait()

    def kill(self) -> int:
        return self.stop(signal.SIGKILL)

    def _close_notify(self) -> None:
        if self._notify is not None:
            self.read_notices()
            self._notify.close()
            self._notify = None
        if self._notify_dir is not None:
            shutil.rmtree(self._notify_dir, ignore_errors=True)
            self._notify_dir = None

    def __enter__(self) -> DaemonProc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_daemon(args: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 60.0,
               preexec_fn=None) -> subprocess.CompletedProcess:
    """``python -m kvoffd *args`` for a start that ends by itself (a refused configuration, a second
    daemon on an address already served): its exit status, stdout and stderr apart (the refusals are
    one line on stderr)."""
    return subprocess.run([sys.executable, "-m", "kvoffd", *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT, preexec_fn=preexec_fn)
