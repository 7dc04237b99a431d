"""Drill: another local user floods the metrics port (issue 28, item 3).

What must hold: /healthz, /readyz and /metrics keep answering while uid 65534 keeps hundreds of
connections to the port open at full speed (idle ones, unfinished request heads, requests hung up on
before the answer is read); the daemon keeps serving its engines meanwhile. Before the fix the
server refused every connection past 64, so whoever held 64 made every probe fail (40 of 40) and a
liveness probe on /healthz would have restarted a healthy daemon.

The flood is its own process (tests/support/http_flood.py) run with setpriv as uid 65534, so it is
another peer to the daemon, as another local user is. The probes come from this test process (root).
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time

import pytest
from kvtest import ROOT
from reliability_util import record

PROBES = 40
HOLD = 300  # the flood's connections: several times the server's 64 slots


def _probe(host: str, port: int, path: str) -> tuple[int, float]:
    """(status, seconds) of one GET on a fresh connection (0: no answer within 5 s)."""
    t0 = time.perf_counter()
    c = http.client.HTTPConnection(host, port, timeout=5)
    try:
        c.request("GET", path)
        r = c.getresponse()
        r.read()
        return r.status, time.perf_counter() - t0
    except OSError:
        return 0, time.perf_counter() - t0
    finally:
        c.close()


def _p(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return round(1000 * s[min(len(s) - 1, int(q * len(s)))], 2) if s else 0.0


@pytest.mark.skipif(os.getuid() != 0, reason="plays another local user with setpriv (needs root)")
@pytest.mark.parametrize("mode", ["idle", "slow", "unread"])
def test_probes_answer_while_another_user_floods_the_metrics_port(make_daemon, mode):
    d = make_daemon("16MiB", name=f"mf-{mode}")
    host, port = d.metrics_address.rsplit(":", 1)
    c = d.client(timeout_s=10.0)
    flood = subprocess.Popen(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", sys.executable,
                              str(ROOT / "tests" / "support" / "http_flood.py"), host, port, mode, str(HOLD)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        assert flood.stdout.readline().strip() == "ready"
        health, other, pings = [], [], []
        for i in range(PROBES):
            health.append(_probe(host, int(port), "/healthz"))
            if i % 8 == 0:
                other.append(_probe(host, int(port), "/readyz" if i % 16 else "/metrics"))
                pings.append(c.ping(10))
            assert flood.poll() is None, "the flood stopped early"
        live = subprocess.run([sys.executable, "-m", "kvoffd.ops.ctl", "--address", d.address, "ping"],
                              capture_output=True, text=True, timeout=60)  # the deployments' liveness probe
        failed = [s for s, _ in health if s != 200]
        flood.stdin.close()
        out = json.loads(flood.stdout.readline())
        assert d.proc.poll() is None, f"daemon died:\n{d.log()}"
        record(f"metrics_flood_{mode}", **out, probes=PROBES, probes_failed=len(failed),
               probe_p50_ms=_p([t for _, t in health], 0.5), probe_max_ms=_p([t for _, t in health], 1.0),
               ping_max_ms=_p(pings, 1.0))
        assert not failed, f"{len(failed)} of {PROBES} /healthz probes failed under the flood: {out}"
        assert [s for s, _ in other] == [200] * len(other), other
        assert live.returncode == 0, live.stderr
        assert out["opened"] > HOLD, out  # the server closed the flood's connections and it opened more
    finally:
        if flood.poll() is None:
            flood.kill()
        flood.wait()


def _raw(host: str, port: int, data: bytes, wait_s: float = 5.0) -> bytes:
    """Send ``data`` and read until the server closes (or ``wait_s``)."""
    import socket

    s = socket.create_connection((host, port), timeout=wait_s)
    try:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):  # closed before it took it all
            return b""
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                return out
            except ConnectionResetError:  # closed with bytes of ours unread
                return out
            if not chunk:
                return out
            out += chunk
    finally:
        s.close()


def test_the_routes_and_what_they_answer_to_bad_requests(make_daemon):
    """The hand-written server answers as the framework-free one before it: three GET routes, HEAD
    without a body, 404 and 405, garbage without a traceback; an unfinished or oversized head is closed."""
    d = make_daemon("16MiB", name="routes")
    host, port = d.metrics_address.rsplit(":", 1)
    port = int(port)
    assert _probe(host, port, "/healthz")[0] == 200
    assert _probe(host, port, "/readyz")[0] == 200
    assert b"kvoffd_build_info" in _raw(host, port, b"GET /metrics?x=1 HTTP/1.1\r\n\r\n")
    head = _raw(host, port, b"HEAD /healthz HTTP/1.1\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"Content-Length: 3\r\n" in head and head.endswith(b"\r\n\r\n")
    assert _raw(host, port, b"GET /nope HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 404 ")
    assert _raw(host, port, b"POST /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 405 ")
    assert _raw(host, port, b"GET /\xff\xfe\x80 HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 404 ")
    assert _raw(host, port, b"\xff\r\n\r\n").startswith(b"HTTP/1.1 405 ")
    assert _raw(host, port, b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 4000) == b""  # over 16 KiB: closed
    t0 = time.monotonic()
    assert _raw(host, port, b"GET /healthz HTTP/1.1\r\n", wait_s=10) == b""  # never finished: closed
    assert time.monotonic() - t0 < 5
    assert "Traceback" not in d.log() and "HTTP request failed" not in d.log()
