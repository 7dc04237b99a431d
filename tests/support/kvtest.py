"""Helpers shared by the test modules: chained keys, daemon processes, stand-in engines, waiting.

(A module of its own, not conftest.py: tests/gpu and tests/vllm have conftest files of their own, and
``from conftest import`` would pick whichever directory came first on sys.path.)
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvoffd_client.client import KvoffdClient

ROOT = Path(__file__).resolve().parents[2]


def chain_keys(n: int, salt: bytes = b"", parent: bytes = b"root") -> list[bytes]:
    """Keys chained like vLLM's block hashes: each hashes its parent and its block's tokens."""
    keys, h = [], hashlib.sha256(parent).digest()
    for i in range(n):
        h = hashlib.sha256(h + salt + i.to_bytes(4, "little")).digest()
        keys.append(h)
    return keys


@dataclass
class DaemonProc:
    address: str
    proc: subprocess.Popen
    log_path: str
    metrics_address: str = ""
    clients: list[KvoffdClient] = field(default_factory=list)

    def client(self, **kw) -> KvoffdClient:
        c = KvoffdClient(self.address, **kw)
        assert c.connect(10), f"daemon at {self.address} not reachable; log:\n{self.log()}"
        self.clients.append(c)
        return c

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text()[-4000:]
        except OSError:
            return ""

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://{self.metrics_address}/metrics", timeout=5) as r:
            return r.read().decode()

    def http(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://{self.metrics_address}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def stop(self, sig: int = signal.SIGTERM) -> int:
        for c in self.clients:
            c.close()
        self.clients.clear()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                return self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return self.proc.wait(10)
        return self.proc.returncode


def _pool_usable(c: KvoffdClient) -> bool:
    pool = c.stats()["pool"]
    return pool["capacity_bytes"] == pool["total_bytes"]


def start_daemon(address: str, pool_size: str = "256MiB", *extra: str, env: dict | None = None,
                 preexec_fn=None, connect_s: float = 20.0) -> DaemonProc:
    """``preexec_fn`` runs in the daemon's process before it starts (e.g. to lower its RLIMIT_NOFILE);
    ``connect_s``: how long it may take to answer (a disk tier of 100M blocks reads its index first)."""
    env = dict(os.environ if env is None else env)
    # A test's pool lives in private memory unless it passes --pool-path (tests/test_warm_restart.py):
    # a persistent pool per test would be left in /dev/shm.
    env.setdefault("KVOFFD_POOL_PATH", "none")
    # in the session's log directory (tests/conftest.py removes it at the end), else the temp directory
    fd, log_path = tempfile.mkstemp(prefix="kvoffd-test-", suffix=".log", dir=os.environ.get("KVOFFD_TEST_LOG_DIR"))
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvoffd", "--address", address, "--pool-size", pool_size,
                                 "--metrics-address", "127.0.0.1:0", "--log-level", "debug", *extra],
                                stdout=subprocess.DEVNULL, stderr=log, env=env, cwd=ROOT,
                                preexec_fn=preexec_fn)
    d = DaemonProc(address, proc, log_path)
    c = KvoffdClient(address, heartbeat=False)
    try:
        if not c.connect(connect_s):
            proc.kill()
            raise RuntimeError(f"daemon did not come up:\n{d.log()}")
        d.metrics_address = c.stats()["daemon"]["metrics_address"]
        # On a GPU host the pool becomes usable as it is pinned (about a second); until then stores are
        # dropped by design. Tests of everything else start from a whole pool, as on a CPU host.
        assert wait_until(lambda: _pool_usable(c), 30), f"pool never became usable:\n{d.log()}"
    finally:
        c.close()
    return d


class Engine:
    """A stand-in engine worker in its own process (tests/support/standin_engine.py)."""

    def __init__(self, address: str, engine_id: str, wrapper: Sequence[str] = (), **kw: object):
        """``wrapper``: a command the engine runs under (e.g. ``unshare --pid --fork``)."""
        args = [*wrapper, sys.executable, str(ROOT / "tests" / "support" / "standin_engine.py"), "--address", address,
                "--engine-id", engine_id]
        for k, v in kw.items():
            args += ["--" + k.replace("_", "-"), str(v)]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"stand-in engine {engine_id} failed to start (exit {self.proc.wait()})")
        self.info = json.loads(line)

    def __call__(self, op: str, **kw: object):
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"stand-in engine died (exit {self.proc.poll()})")
        return json.loads(line)["result"]

    def store(self, job: int, keys: list[bytes], ids: list[int]) -> dict:
        return self("store", job=job, keys=[k.hex() for k in keys], ids=ids)[0]

    def load(self, job: int, keys: list[bytes], ids: list[int], lease: int = 0) -> dict:
        return self("load", job=job, keys=[k.hex() for k in keys], ids=ids, lease=lease)[0]

    def lookup(self, keys: list[bytes], lease_ms: int = 0) -> dict:
        return self("lookup", keys=[k.hex() for k in keys], lease_ms=lease_ms)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self("exit")
            except (RuntimeError, BrokenPipeError, json.JSONDecodeError):
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def kill(self, reap: bool = True) -> None:
        """SIGKILL. ``reap=False`` leaves the process a zombie (as a busy or dead parent does)."""
        self.proc.kill()
        if reap:
            self.proc.wait(10)


def wait_until(pred, timeout: float = 5.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()
