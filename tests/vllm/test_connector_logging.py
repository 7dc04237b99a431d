"""The connector's link lines inside vLLM: through vLLM's logger (its pid, level and timestamp), one
when the daemon goes away and one when it is back (issue 19, item 6).

The client runs in a child process with vLLM's default logging, set up as the connector's
constructor does; the daemon is killed and restarted under it. test_connector_e2e checks that a
real engine's connector routes the lines.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading

import pytest
from kvtest import ROOT, start_daemon

pytestmark = pytest.mark.vllm

CHILD = """
import sys
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
from kvoffd_client.vllm.logs import route_client_logs
from kvoffd_client.client import KvoffdClient

configure_logging(LoggingConfig())  # what each vLLM process does at start
route_client_logs()  # what KvoffdConnector's constructor does

c = KvoffdClient(sys.argv[1], name="log-test")
assert c.connect(20)
print("connected", flush=True)
sys.stdin.read()  # until the test closes stdin; the heartbeat thread watches the link meanwhile
c.close()
"""


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line.rstrip("\n"))


def _wait_for(lines: queue.Queue, seen: list[str], needle: str, timeout_s: float = 30.0) -> str:
    for line in seen:
        if needle in line:
            return line
    while True:
        try:
            line = lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"no line with {needle!r} within {timeout_s} s; got:\n" + "\n".join(seen)) from None
        seen.append(line)
        if needle in line:
            return line


def test_link_lines_use_vllms_format_once_each(tmp_path):
    address = f"ipc://{tmp_path}/d.sock"
    d1 = start_daemon(address, "32MiB")
    d2 = None
    # vLLM logs to stdout by default; stderr here, so stdout carries only the child's own signal
    env = {**os.environ, "NO_COLOR": "1", "VLLM_LOGGING_LEVEL": "INFO", "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
    child = subprocess.Popen([sys.executable, "-c", CHILD, address], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(child.stderr, lines), daemon=True).start()
    seen: list[str] = []
    try:
        assert child.stdout.readline().strip() == "connected", "the child could not connect"
        vllm_format = re.compile(rf"pid={child.pid}\) (INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d \[")
        up = _wait_for(lines, seen, "connected to kvoffd at")
        assert vllm_format.search(up), up
        d1.stop(signal.SIGKILL)
        down = _wait_for(lines, seen, "went away")
        assert vllm_format.search(down) and "WARNING" in down, down
        # issue 33 point 7: it must not read as if inference requests failed (none does: recompute)
        assert "requests fail" not in down and "no inference request fails" in down, down
        d2 = start_daemon(address, "32MiB")
        back = _wait_for(lines, seen, "kvoffd restarted")
        assert vllm_format.search(back) and "WARNING" in back, back
        child.stdin.close()
        assert child.wait(30) == 0
        seen += [ln.rstrip("\n") for ln in iter(lambda: lines.get(timeout=5) if not lines.empty() else "", "")]
        assert sum("went away" in ln for ln in seen) == 1, seen
        assert sum("kvoffd restarted" in ln for ln in seen) == 1, seen
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if d2 is not None:
            d2.stop()
        d1.stop()
