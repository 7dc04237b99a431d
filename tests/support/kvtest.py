"""Helpers shared by the test modules: chained keys, daemon processes (tests/support/daemon.py), stand-in
engines, waiting.

(A module of its own, not conftest.py: tests/gpu and tests/vllm have conftest files of their own, and
``from conftest import`` would pick whichever directory came first on sys.path.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from daemon import DaemonProc
from support.engine import chain_keys  # noqa: F401 - one definition, shared with bench/

from kvoffd_client.client import KvoffdClient

ROOT = Path(__file__).resolve().parents[2]


def _pool_usable(c: KvoffdClient) -> bool:
    pool = c.stats()["pool"]
    return pool["capacity_bytes"] == pool["total_bytes"]


def start_daemon(address: str, pool_size: str = "256MiB", *extra: str, env: dict | None = None,
                 preexec_fn=None, connect_s: float = 20.0) -> DaemonProc:
    """A test's daemon (tests/support/daemon.py), with metrics on a free port and debug logs, ready and
    with its whole pool usable. ``preexec_fn`` runs in the daemon's process before it starts (e.g. to
    lower its RLIMIT_NOFILE); ``connect_s``: how long it may take to be ready (a disk tier of 100M
    blocks reads its index first)."""
    env = dict(os.environ if env is None else env)
    # A test's pool lives in private memory unless it passes --pool-path (tests/test_warm_restart.py):
    # a persistent pool per test would be left in /dev/shm.
    env.setdefault("KVOFFD_POOL_PATH", "none")
    d = DaemonProc(address, ["--pool-size", pool_size, "--metrics-address", "127.0.0.1:0", "--log-level", "debug",
                             *extra], env=env, preexec_fn=preexec_fn).start(connect_s)
    try:
        c = KvoffdClient(address, heartbeat=False)
        try:
            assert c.connect(10), f"daemon at {address} not reachable; log:\n{d.log()}"
            d.metrics_address = c.stats()["daemon"]["metrics_address"]
            # On a GPU host the pool becomes usable as it is pinned (about a second); until then stores
            # are dropped by design. Tests of everything else start from a whole pool, as on a CPU host.
            assert wait_until(lambda: _pool_usable(c), 30), f"pool never became usable:\n{d.log()}"
        finally:
            c.close()
    except BaseException:
        d.stop(signal.SIGKILL)
        raise
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
