"""The vLLM tests' helpers: the engines and models of bench/support/vllm_engines.py (one definition, shared
with the vLLM benches) and ``Daemon``, a test's kvoffd (tests/support/daemon.py) with kill/restart for the
degradation drills."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import urllib.request
from pathlib import Path
from typing import Any

from support.vllm_engines import (  # noqa: F401 - the vLLM tests import these from here
    BLOCK,
    HAVE_VLLM,
    PROMPTS,
    WINDOW,
    build_tiny_gemma3,
    build_tiny_llama,
    build_tiny_mistral,
    build_tiny_mla,
    build_tiny_qwen3_next,
    check_served,
    close_llm,
    connector_of,
    core_of,
    drain,
    external_hits,
    generate,
    generate_cached,
    greedy,
    issue_prompts,
    make_llm,
    shared_prefix_prompts,
    vllm_metric,
)

# A child process (bench/support/engine_child.py) runs an engine of these in a process of its own.
ENGINE_CHILD = Path(__file__).resolve().parents[2] / "bench" / "support" / "engine_child.py"


class ThawWatchdog:
    """Thaws the SIGSTOPped daemon (the pid in ``frozen``, once the test has frozen it) after ``after_s``
    should the code under test wait for it after all: a hang then fails the test rather than holding
    CI for its whole limit. ``stop()`` says whether it had to."""

    def __init__(self, frozen: list[int], after_s: float = 60.0):
        self.frozen = frozen
        self.fired = threading.Event()
        self._timer = threading.Timer(after_s, self._thaw)

    def _thaw(self) -> None:
        if self.frozen:
            self.fired.set()
            os.kill(self.frozen[0], signal.SIGCONT)

    def __enter__(self) -> ThawWatchdog:
        self._timer.start()
        return self

    def stop(self) -> bool:
        self._timer.cancel()
        return self.fired.is_set()

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()


class Daemon:
    """A real kvoffd subprocess on a private socket, with kill/restart for the degradation drills."""

    def __init__(self, workdir: Path, pool: str = "256MiB", extra: tuple[str, ...] = (), pool_path: str = "none"):
        """``pool_path``: the persistent pool's file (warm restarts); "none" keeps it in private memory."""
        self.workdir = workdir
        self.extra = extra  # more daemon flags (e.g. a disk tier)
        self.pool_path = pool_path
        self.address = f"ipc://{workdir}/kvoffd.sock"
        self.pool = pool
        self.running = None  # the process (tests/support/daemon.py's DaemonProc), None when stopped
        self.metrics_url = ""
        self.log = workdir / "kvoffd.log"

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.running.proc if self.running is not None else None

    def start(self, timeout: float = 20.0) -> Daemon:
        from daemon import DaemonProc  # tests/support, on the path from tests/conftest.py

        self.running = DaemonProc(self.address, ["--pool-size", self.pool, "--metrics-address", "127.0.0.1:0",
                                                "--log-level", "info", "--pool-path", self.pool_path, *self.extra],
                                 log_path=self.log, start_new_session=True).start(timeout)
        self.metrics_url = f"http://{self.running.metrics_address}/metrics"
        return self

    def kill(self) -> None:
        if self.running is not None:
            self.running.stop(signal.SIGKILL)
        self.running = None

    def stop(self) -> None:
        if self.running is not None:
            self.running.stop(signal.SIGTERM)
        self.running = None

    def stats(self) -> dict[str, Any]:
        from kvoffd_client.client import KvoffdClient

        with KvoffdClient(self.address, name="test", heartbeat=False) as c:
            return c.stats()

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a metric's samples from /metrics matching ``labels``."""
        text = urllib.request.urlopen(self.metrics_url, timeout=5).read().decode()
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name):
                continue
            m = re.match(rf"{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)", line)
            if not m:
                continue
            lab = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
            if all(lab.get(k) == v for k, v in labels.items()):
                total += float(m.group(2))
        return total
