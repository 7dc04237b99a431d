"""Drill: a client cannot take the daemon down through its file descriptors (issue 18, defect 2).

libzmq's ipc listener aborts the whole process when ``accept`` fails with EMFILE. Before the fix, a
flood of bare connects, idle connections to the metrics port, or enough registered engines ran the
daemon out of descriptors and it died (SIGABRT) for every engine on the node. What must hold: the
daemon survives, refuses what is over its budget (new connections while the flood lasts, REGISTER
with ``too_many``), keeps serving the clients it has, and accepts again once the flood is gone.

The CI variants run the daemon with RLIMIT_NOFILE soft = hard = 1024 (its start cannot raise it) and
a flood of a few thousand attempts from a separate process (tests/support/fd_flood.py). The 50,000-attempt
drill at the default limit is marked ``slow``.

Issue 28, item 0: another user (uid 65534) floods each endpoint the daemon listens on, one at a time,
at full speed, with the daemon at 1,024 descriptors. Before the fix a flood of the KV-event port
filled the daemon's descriptor table and libzmq aborted it (``Too many open files
(src/ipc_listener.cpp:297)``); the KV-event endpoints now live in the outlet process, whose
descriptors are not the daemon's (kvoffd/server/outlet.py), and the private endpoints refuse another
user at connect.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import time

import pytest
from kvevents_sub import EventSubscriber, resident
from kvtest import ROOT, chain_keys, start_daemon, wait_until
from reliability_util import ShmEngine, fd_count, record

from kvoffd_client.client import KvoffdClient, KvoffdError

SLOT = 4096


def _nofile(n: int):
    def set_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
    return set_limit


def _start(tmp_path, limit: int | None, name: str = "fd"):
    return start_daemon(f"ipc://{tmp_path}/{name}.sock", "16MiB",
                        preexec_fn=_nofile(limit) if limit else None)


NOBODY = ("setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups")


def _flood(target: str, attempts: int, hold: int, linger: bool = False, as_nobody: bool = False) -> subprocess.Popen:
    return subprocess.Popen([*(NOBODY if as_nobody else ()), sys.executable, str(ROOT / "tests" / "support" / "fd_flood.py"),
                             target, str(attempts), str(hold), *(["linger"] if linger else [])],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)


def _serve_while(d, proc: subprocess.Popen, keys: list[bytes]) -> list[float]:
    """LOOKUPs on an established connection for as long as the flood runs; their latencies."""
    c = d.client(timeout_s=10.0)
    lat = []
    while proc.poll() is None:
        t0 = time.perf_counter()
        assert c.lookup("fd", keys, timeout_s=10).hits == len(keys)
        lat.append(time.perf_counter() - t0)
        assert d.proc.poll() is None, f"daemon died (exit {d.proc.returncode}):\n{d.log()}"
    return lat


def _seed(d, tag: str) -> tuple[list[bytes], ShmEngine]:
    eng = ShmEngine(16, SLOT, tag=tag)
    c = d.client()
    c.register(f"fd-{tag}", "fd", 0, 1, eng.memory, eng.layout)
    keys = chain_keys(16, tag.encode())
    eng.fill(range(16), keys)
    c.submit_store(f"fd-{tag}", 1, keys, range(16))
    assert c.wait_notices({1}, 10)[0].ok
    return keys, eng


def _healthz(d) -> bool:
    try:
        return d.http("/healthz")[0] == 200
    except OSError:  # refused while the metrics server is at its connection cap
        return False


def _p(lat: list[float], q: float) -> float:
    s = sorted(lat)
    return round(1000 * s[min(len(s) - 1, int(q * len(s)))], 3) if s else 0.0


def _flood_drill(d, target: str, attempts: int, hold: int, keys: list[bytes]) -> tuple[dict, list[float]]:
    proc = _flood(target, attempts, hold)
    try:
        lat = _serve_while(d, proc, keys)
        out = json.loads(proc.stdout.read())
    finally:
        proc.kill()
        proc.wait()
    assert d.proc.poll() is None, f"daemon died (exit {d.proc.returncode}):\n{d.log()}"
    return out, lat


def _accepts_again(d, keys: list[bytes], within_s: float = 15.0) -> float:
    """Seconds until a brand-new client connects and is served (the guard listens again)."""
    t0 = time.monotonic()
    c = KvoffdClient(d.address, heartbeat=False)
    try:
        assert c.connect(within_s), f"no new connection within {within_s} s:\n{d.log()}"
        assert c.lookup("fd", keys, timeout_s=10).hits == len(keys)
    finally:
        c.close()
    return time.monotonic() - t0


def test_ipc_connection_flood_leaves_the_daemon_serving(tmp_path):
    d = _start(tmp_path, 1024)
    keys, eng = _seed(d, "ipc")
    try:
        out, lat = _flood_drill(d, d.address, 6000, 1500, keys)
        assert out["refused"] > 0, out  # 1,500 held connections do not fit 1,024 descriptors: some refused
        again = _accepts_again(d, keys)
        assert "refusing new connections" in d.log() or out["connected"] < 1024, d.log()
        record("fd_flood_ipc_ci", daemon_nofile=1024, **out, lookups=len(lat), lookup_p50_ms=_p(lat, 0.5),
               lookup_p99_ms=_p(lat, 0.99), lookup_max_ms=_p(lat, 1.0), accepts_again_s=round(again, 2))
    finally:
        eng.close()
        d.stop()


def test_metrics_port_flood_leaves_the_daemon_serving(tmp_path):
    """Idle connections to the metrics port, 1,500 held open at a time, while a client looks up and
    new clients keep arriving (engines restarting, ``kvoffd ctl``). Before the fix the metrics server
    held each for 5 s, the daemon sat at its descriptor limit, and libzmq aborted at an accept."""
    d = _start(tmp_path, 1024, "http")
    keys, eng = _seed(d, "http")
    c = d.client(timeout_s=10.0)
    proc = _flood(f"tcp://{d.metrics_address}", 4000, 1500)
    try:
        lat, newcomers = [], 0
        while proc.poll() is None or len(lat) < 200:
            t0 = time.perf_counter()
            assert c.lookup("fd", keys, timeout_s=10).hits == len(keys)
            lat.append(time.perf_counter() - t0)
            if len(lat) % 50 == 0 and proc.poll() is None:
                _accepts_again(d, keys)
                newcomers += 1
            assert d.proc.poll() is None, f"daemon died (exit {d.proc.returncode}):\n{d.log()}"
        out = json.loads(proc.stdout.read())
        assert wait_until(lambda: _healthz(d), 10)  # scrapes served again once the idle ones time out
        again = _accepts_again(d, keys)
        record("fd_flood_metrics_ci", daemon_nofile=1024, **out, lookups=len(lat), lookup_p99_ms=_p(lat, 0.99),
               new_clients_during_flood=newcomers, accepts_again_s=round(again, 2))
    finally:
        proc.kill()
        proc.wait()
        eng.close()
        d.stop()


def test_daemon_stops_cleanly_while_refusing_connections(tmp_path):
    """SIGTERM while libzmq's listener descriptor points at the idle socket: the guard points it back
    before the ZeroMQ socket closes (libzmq would otherwise abort removing it from its poller)."""
    d = _start(tmp_path, 1024, "stop")
    held: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "refusing new connections" not in d.log():
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(0.05)
            try:
                s.connect(d.address[6:])
                held.append(s)
            except OSError:
                s.close()
        assert "refusing new connections" in d.log(), d.log()
        assert d.stop() == 0, d.log()
        assert "Assertion" not in d.log() and "(src/" not in d.log(), d.log()
    finally:
        for s in held:
            s.close()


def test_register_is_refused_near_the_descriptor_budget(tmp_path):
    """Engines until REGISTER says ``too_many`` (each mapping may keep a descriptor): then the daemon
    still accepts a new client and serves it."""
    d = _start(tmp_path, 1024, "reg")
    engines: list[ShmEngine] = []
    clients: list[KvoffdClient] = []
    refused = None
    try:
        for i in range(1100):
            if i % 64 == 0:
                clients.append(d.client(timeout_s=10.0))
            eng = ShmEngine(1, SLOT, tag=f"reg{i}")
            engines.append(eng)
            try:
                clients[-1].register(f"reg-{i}", "reg", 0, 1, eng.memory, eng.layout)
            except KvoffdError as e:
                refused = (i, e.code, e.message)
                break
            assert d.proc.poll() is None, d.log()
        if refused is not None:
            assert refused[1] == "too_many", refused
        assert d.proc.poll() is None, d.log()
        c = KvoffdClient(d.address, heartbeat=False)
        try:
            assert c.connect(15), d.log()
            c.ping(timeout_s=10)
        finally:
            c.close()
        record("fd_register_budget", daemon_nofile=1024, engines_registered=refused[0] if refused else len(engines),
               refused=refused is not None, daemon_fds=fd_count(d.proc.pid))
    finally:
        for c in clients:
            c.close()
        for e in engines:
            e.close()
        d.stop()


@pytest.mark.slow
def test_fifty_thousand_connection_attempts_at_the_default_limit(tmp_path):
    """The acceptance drill: default descriptor limit, 50,000 attempts on the ipc socket and 50,000
    on the metrics port, each holding as many as the flood process can; a client's LOOKUP p99."""
    d = _start(tmp_path, None, "big")
    keys, eng = _seed(d, "big")
    try:
        limit = d.client().stats()["daemon"].get("fds", {}).get("limit")
        hold = resource.getrlimit(resource.RLIMIT_NOFILE)[1] - 100
        for name, target in (("ipc", d.address), ("metrics", f"tcp://{d.metrics_address}")):
            out, lat = _flood_drill(d, target, 50_000, hold, keys)
            again = _accepts_again(d, keys, 30)
            record(f"fd_flood_{name}_50k", daemon_nofile=limit, **out, lookups=len(lat),
                   lookup_p50_ms=_p(lat, 0.5), lookup_p99_ms=_p(lat, 0.99), lookup_max_ms=_p(lat, 1.0),
                   accepts_again_s=round(again, 2), daemon_rss_kb=_rss(d.proc.pid))
    finally:
        eng.close()
        d.stop()


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))



# --- issue 28, item 0: every endpoint, flooded by another user ---------------------------------------

ENDPOINTS = ("control", "fd_socket", "metrics", "kv_events", "kv_replay", "kv_events_ipc", "control_tcp")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root (setpriv) to be another user")
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_another_user_floods_an_endpoint_at_full_speed_and_the_daemon_serves_on(tmp_path, monkeypatch, endpoint):
    """uid 65534 opens bare connections to one endpoint as fast as it can (8,000 attempts, up to 3,000
    held: three times the daemon's 1,024 descriptors) while the daemon's own clients work: an engine
    looking up on its control connection, and a router subscribed to the KV events (tcp://, no CURVE:
    the worst case, a port anyone reaches). The daemon must live, serve them throughout, keep its own
    descriptors out of the flood's reach (for the KV-event endpoints: not one of them), and accept again
    afterwards. Before the fix the KV-event floods killed it (SIGABRT from libzmq)."""
    monkeypatch.setenv("KVOFFD_AUTH_TOKEN_FILE", str(tmp_path / "run" / "auth-token"))  # control_tcp's token
    address = f"tcp://127.0.0.1:{_free_port()}" if endpoint == "control_tcp" else f"ipc://{tmp_path}/flood.sock"
    events = ("ipc",) if endpoint == "kv_events_ipc" else ("tcp://127.0.0.1:0", "--kv-events-auth", "none")
    d = start_daemon(address, "16MiB", "--kv-events-address", *events, preexec_fn=_nofile(1024))
    eng = ShmEngine(16, SLOT, tag=endpoint)
    sub = None
    try:
        c = d.client(timeout_s=10.0, job_deadline_s=30.0)
        c.register(f"fl-{endpoint}", "fd", 0, 1, eng.memory, {**eng.layout, "kv_events": {"hash": "bytes", "block_size": 16}})
        keys = chain_keys(16, endpoint.encode())
        eng.fill(range(16), keys)
        c.submit_store(f"fl-{endpoint}", 1, keys[:8], range(8))
        assert c.wait_notices({1}, 30)[0].ok
        ev = c.stats()["daemon"]["kv_events"]
        sub = EventSubscriber(ev["endpoint"], ev["replay_endpoint"])
        assert sub.wait_for(lambda s: set(keys[:8]) <= resident(s.events()), 30)
        target = {"control": address, "control_tcp": address, "fd_socket": "seqpacket://" + c.hello.fd_socket,
                  "metrics": f"tcp://{d.metrics_address}", "kv_events": ev["endpoint"],
                  "kv_replay": ev["replay_endpoint"], "kv_events_ipc": ev["endpoint"]}[endpoint]
        base_fds = fd_count(d.proc.pid)
        proc = _flood(target, 8000, 3000, as_nobody=True)
        lat, peak = [], base_fds
        try:
            while proc.poll() is None:
                t0 = time.perf_counter()
                assert c.lookup("fd", keys[:8], timeout_s=10).hits == 8
                lat.append(time.perf_counter() - t0)
                assert d.proc.poll() is None, f"daemon died (exit {d.proc.returncode}):\n{d.log()}"
                peak = max(peak, fd_count(d.proc.pid))
            out = json.loads(proc.stdout.read())
        finally:
            proc.kill()
            proc.wait()
        assert d.proc.poll() is None and "Too many open files" not in d.log(), d.log()
        if endpoint.startswith("kv_"):  # the flood's descriptors are the outlet's, never the daemon's
            assert peak <= base_fds + 16, (base_fds, peak)
        if endpoint in ("control", "fd_socket", "kv_events_ipc"):  # the private directory: refused at connect
            assert out["connected"] == 0 and out["errors"].get("EACCES") == out["attempts"], out
        else:
            assert out["connected"] > 1024, out  # the flood did reach the endpoint, and past the limit
        # served throughout; the subscriber that was there all along gets what is stored now; new
        # clients and subscribers are accepted again
        c.submit_store(f"fl-{endpoint}", 2, keys[8:], range(8, 16))
        assert c.wait_notices({2}, 30)[0].ok
        assert sub.wait_for(lambda s: set(keys) <= resident(s.events()), 30), d.log()
        again = _accepts_again(d, keys[:8])
        late = EventSubscriber(ev["endpoint"], ev["replay_endpoint"])
        try:
            assert wait_until(lambda: late.catch_up() >= 2, 30)
        finally:
            late.close()
        record("fd_flood_other_uid", endpoint=endpoint, daemon_nofile=1024, **{k: v for k, v in out.items() if k != "errors"},
               lookups=len(lat), lookup_p99_ms=_p(lat, 0.99), lookup_max_ms=_p(lat, 1.0), daemon_fds_before=base_fds,
               daemon_fds_peak=peak, accepts_again_s=round(again, 2))
    finally:
        if sub is not None:
            sub.close()
        eng.close()
        d.stop()
