"""A real Prometheus for the tests: found (or explained away), started on 127.0.0.1 on a free port with
its own data directory, queried over its HTTP API, and always stopped.

Also the PromQL rewrite the tests need to ask "does this expression return series at all": an alert's
expression is a comparison that returns series only while it fires, so every comparison is turned into
its ``bool`` form (0 or 1 for every series it compares), which keeps the expression's vector matching
(``and``, ``on``, the labels on both sides) exactly as it is.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
INSTALL = "apt-get update && apt-get install -y --no-install-recommends prometheus"


@dataclass(frozen=True)
class Binaries:
    prometheus: str
    promtool: str


def binaries() -> Binaries:
    """prometheus and promtool, or a skip where they truly cannot be had (no root or no apt-get: what
    `make test` would install them with). Root with apt-get and no NO_APT fails instead: there, `make
    test` installs the package, so a missing binary is a broken set-up, not a reason to skip."""
    prom, tool = shutil.which("prometheus"), shutil.which("promtool")
    if prom and tool:
        return Binaries(prom, tool)
    can_install = os.geteuid() == 0 and shutil.which("apt-get") and not os.environ.get("NO_APT")
    why = f"prometheus and promtool (Debian package prometheus) are not on PATH; install them with: {INSTALL}"
    if can_install:
        pytest.fail(why + " (make test does so as root)")
    pytest.skip(why + " (this host cannot: not root, no apt-get, or NO_APT set)")


# --------------------------------------------------------------------------------------------------
# PromQL


_COMPARISON = re.compile(r"(==|!=|>=|<=|>|<)(\s+bool\b)?")


def comparisons_as_bool(expr: str) -> str:
    """``expr`` with every comparison operator given the ``bool`` modifier (outside selectors' braces and
    string literals, where ``!=`` and ``=~`` are label matchers)."""
    out, i, n = [], 0, len(expr)
    while i < n:
        c = expr[i]
        if c == "{":
            j = expr.index("}", i)
            out.append(expr[i:j + 1])
            i = j + 1
        elif c in "\"'":
            j = expr.index(c, i + 1)
            out.append(expr[i:j + 1])
            i = j + 1
        else:
            m = _COMPARISON.match(expr, i)
            if m:
                out.append(m.group(1) + " bool")
                i = m.end()
            else:
                out.append(c)
                i += 1
    return "".join(out)


def without_offsets(expr: str) -> str:
    """A fresh Prometheus has no yesterday: ``offset 1d`` would select nothing."""
    return re.sub(r"\s+offset\s+\d+[smhdwy]", "", expr)


# --------------------------------------------------------------------------------------------------
# the server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """One Prometheus process; a context manager that always stops it (SIGTERM, then SIGKILL)."""

    def __init__(self, binary: str, config: dict, workdir: Path, startup_s: float = 90.0):
        self.workdir = workdir
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log_path = workdir / "prometheus.log"
        self.proc: subprocess.Popen | None = None
        for _ in range(3):  # the free port may be taken between probing it and Prometheus binding it
            self.port = _free_port()
            self._start(binary)
            if self._wait_ready(startup_s):
                return
            self.stop()
            if "address already in use" not in self.log():
                break
        raise RuntimeError(f"Prometheus did not become ready:\n{self.log()}")

    def _start(self, binary: str) -> None:
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={self.config_path}", f"--storage.tsdb.path={self.workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h",
                 "--log.level=warn"],
                stdout=log, stderr=log, cwd=self.workdir, start_new_session=True)

    def _wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as r:
                    if r.status == 200:
                        return True
            except OSError:
                pass
            time.sleep(0.1)
        return False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-4000:]
        except OSError:
            return ""

    def api(self, path: str, **params: str) -> object:
        """GET /api/v1/<path>?<params>; the ``data`` of a successful answer (anything else raises)."""
        url = f"{self.url}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                answer = json.loads(r.read())
        except urllib.error.HTTPError as e:
            body = e.read()
            answer = json.loads(body) if body.startswith(b"{") else {"status": "error", "error": f"{e}: {body!r}"}
        if answer.get("status") != "success":
            raise AssertionError(f"/api/v1/{path} {params}: {answer.get('errorType')}: {answer.get('error')}")
        return answer["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query's series (a vector result; a scalar counts as one series)."""
        data = self.api("query", query=expr)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(20)

    def __enter__(self) -> Prometheus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
