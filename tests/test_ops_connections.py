"""Connection handling an operator relies on: a burst of HELLOs never evicts a live client, a client
the daemon did drop is told why, and a protocol version mismatch is reported on both sides.

Real daemon processes and real sockets. The connection table is lowered to 64 through the test-only
KVOFFD_TEST_MAX_CONNS, so a burst past it takes hundreds of sockets, not thousands.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import zmq
from daemon import DaemonProc
from kvtest import start_daemon, wait_until
from reliability_util import RawPeer

from kvoffd_client import protocol as P
from kvoffd_client.client import DaemonUnavailable, KvoffdClient

MAX_CONNS = 64


@pytest.fixture(autouse=True)
def _client_records_reach_caplog():
    """An in-process vLLM engine earlier in the session routes kvoffd_client's records to vLLM's
    logger and stops their propagation (kvoffd_client.vllm.logs.route_client_logs); these tests
    read them from caplog, which listens on the root logger."""
    lg = logging.getLogger("kvoffd_client")
    saved = lg.propagate, lg.level, list(lg.handlers)
    for h in saved[2]:
        lg.removeHandler(h)
    lg.propagate = True
    yield
    lg.propagate, lg.level = saved[:2]
    for h in saved[2]:
        lg.addHandler(h)


@pytest.fixture
def small_table(tmp_path):
    env = {**os.environ, "KVOFFD_TEST_MAX_CONNS": str(MAX_CONNS)}
    d = start_daemon(f"ipc://{tmp_path}/d.sock", "32MiB", env=env)
    yield d
    d.stop()


def _ctx() -> zmq.Context:
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 4096)
    return ctx


def _burst(ctx: zmq.Context, address: str, n: int) -> list[zmq.Socket]:
    """``n`` connections that each say HELLO and nothing else (sent at once, replies not read)."""
    socks = []
    for i in range(n):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(address)
        s.send(P.encode(P.Hello(seq=i + 1, pid=os.getpid(), client="burst")))
        socks.append(s)
    return socks


def _replies(socks: list[zmq.Socket], timeout_s: float = 30.0) -> list[P.Message]:
    deadline = time.monotonic() + timeout_s
    out = []
    for s in socks:
        assert s.poll(max(int((deadline - time.monotonic()) * 1000), 1)), "a HELLO was never answered"
        out.append(P.decode(s.recv()))
    return out


def test_hello_burst_never_evicts_a_busy_client(small_table):
    """A client that keeps asking (lookups, no lease: it holds nothing) survives a burst of HELLOs
    six times the table; the newcomers that never did anything after HELLO make room instead. On
    the old code the busy client was the first victim (its last message predates every HELLO)."""
    busy = small_table.client(heartbeat=False)
    keys = [bytes([i]) * 32 for i in range(4)]
    assert busy.lookup("burst", keys).hits == 0
    ctx = _ctx()
    socks: list[zmq.Socket] = []
    try:
        for _ in range(6):
            socks += _burst(ctx, small_table.address, MAX_CONNS)
            assert _replies(socks[-MAX_CONNS:])  # all answered before the busy client asks again
            assert busy.lookup("burst", keys).hits == 0  # still known: no hello_required, no reconnect
        assert busy.daemon_id is not None and busy.connected
        # the newcomers of the burst before the last one were all dropped to make room (each HELLO of
        # the last burst evicted the oldest newcomer), and each is told so
        for s in socks[-2 * MAX_CONNS:-MAX_CONNS]:
            s.send(P.encode(P.Ping(seq=99)))
        for r in _replies(socks[-2 * MAX_CONNS:-MAX_CONNS]):
            assert isinstance(r, P.Error) and r.code == "hello_required", r
            assert "to make room" in r.message and "nothing after HELLO" in r.message, r.message
    finally:
        for s in socks:
            s.close(0)
        ctx.term()


def test_dropped_client_is_told_what_happened(small_table, caplog):
    """A client evicted while idle (it said HELLO and nothing more) learns at once, from its next
    request, that the daemon dropped it to make room; not "did not answer within 5.0 s". It logs
    the link going down once, and once that it is back (issue 19, item 6)."""
    caplog.set_level(logging.INFO, logger="kvoffd_client")
    idle = KvoffdClient(small_table.address, heartbeat=False, timeout_s=5.0)
    ctx = _ctx()
    socks: list[zmq.Socket] = []
    try:
        assert idle.connect(10)
        socks = _burst(ctx, small_table.address, 2 * MAX_CONNS)
        _replies(socks)
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable) as exc:
            idle.ping()
        assert time.monotonic() - t0 < 2.0, "the error took the whole timeout"
        msg = str(exc.value)
        assert "to make room" in msg and "within" not in msg, msg
        assert wait_until(lambda: idle.connect(1), 10)  # and it says HELLO again by itself
        msgs = [r.getMessage() for r in caplog.records]
        assert sum("link lost" in m and "to make room" in m for m in msgs) == 1, msgs
        assert sum("is back (same daemon" in m for m in msgs) == 1, msgs
    finally:
        idle.close()
        for s in socks:
            s.close(0)
        ctx.term()


def test_full_table_of_live_clients_refuses_newcomers(small_table):
    """When every connection is live (it spoke after HELLO, recently), a new HELLO gets too_many,
    and nobody is evicted."""
    peers = []
    try:
        for _ in range(MAX_CONNS - 1):  # start_daemon's probe client is gone; this fills the table
            p = RawPeer(small_table.address)
            p.hello()
            assert p.ask(P.Ping())["op"] == "pong"
            peers.append(p)
        for p in peers:  # all spoke within the last moment (a slow machine may have taken seconds above)
            assert p.ask(P.Ping())["op"] == "pong"
        late = RawPeer(small_table.address)
        peers.append(late)
        extra = RawPeer(small_table.address)
        peers.append(extra)
        replies = [late.ask(P.Hello(pid=os.getpid())), extra.ask(P.Hello(pid=os.getpid()))]
        refused = [r for r in replies if r["op"] == "error"]
        assert refused and refused[-1]["code"] == "too_many" and "try again later" in refused[-1]["message"]
        for p in peers[:MAX_CONNS - 1]:
            assert p.ask(P.Ping())["op"] == "pong"  # every live client is still known
    finally:
        for p in peers:
            p.close()


# --------------------------------------------------------------------------------------------------
# protocol version mismatch


def test_version_mismatch_is_a_rate_limited_warning_in_the_daemon_log(make_daemon):
    daemon = make_daemon("16MiB", name="version")  # its own: the warning is once a minute per daemon
    p = RawPeer(daemon.address)
    try:
        for seq in range(1, 6):
            r = p.ask(P.Hello(seq=seq, version=7, pid=os.getpid(), client="old-client"))
            assert r["code"] == "version_mismatch" and f"v{P.PROTOCOL_VERSION}" in r["message"] and "v7" in r["message"]
        assert wait_until(lambda: "speaks protocol v7" in daemon.log(), 10), daemon.log()
        lines = [ln for ln in daemon.log().splitlines() if "speaks protocol v7" in ln]
        assert len(lines) == 1 and "WARNING" in lines[0] and "old-client" in lines[0], lines
        assert f"this daemon v{P.PROTOCOL_VERSION}" in lines[0]
    finally:
        p.close()


def _daemon_speaking(version: int, address: str, log_path: str) -> DaemonProc:
    """The real daemon, as a build that speaks another protocol version would."""
    code = (f"import sys; import kvoffd_client.protocol as P; P.PROTOCOL_VERSION = {version}; "
            "from kvoffd.cli import main; sys.exit(main())")
    return DaemonProc(address, log_path=log_path, argv=[sys.executable, "-c", code, "--address", address,
                                                        "--pool-size", "32MiB", "--metrics-address", "127.0.0.1:0"]).start()


def test_client_and_kvoffctl_report_a_version_mismatch(tmp_path, caplog):
    ours, theirs = P.PROTOCOL_VERSION, P.PROTOCOL_VERSION + 1  # the client's, the daemon's
    sock = tmp_path / "v-other.sock"
    address = f"ipc://{sock}"
    proc = _daemon_speaking(theirs, address, str(tmp_path / "d.log"))
    c = None
    try:
        assert wait_until(lambda: sock.exists(), 20), (tmp_path / "d.log").read_text()
        c = KvoffdClient(address, heartbeat=False, timeout_s=10)
        with caplog.at_level(logging.ERROR, logger="kvoffd_client"):
            t0 = time.monotonic()
            assert not c.connect(10)
            assert time.monotonic() - t0 < 5, "connect() waited out its timeout after a refusal"
            assert f"v{theirs}" in c.refusal and f"v{ours}" in c.refusal and "version" in c.refusal, c.refusal
            with pytest.raises(DaemonUnavailable) as exc:
                c.ping(timeout_s=3)
            assert "version" in str(exc.value), exc.value
        errors = [r.getMessage() for r in caplog.records if f"speaks protocol v{theirs}" in r.getMessage()]
        assert len(errors) == 1, errors  # logged once, though HELLO was refused more than once
        r = subprocess.run([sys.executable, "-m", "kvoffd.ops.ctl", "--address", address, "--timeout", "10", "status"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 3, r
        assert f"speaks protocol v{theirs}" in r.stderr and f"the client v{ours}" in r.stderr, r.stderr
        assert "stale socket" not in r.stderr, r.stderr
        log = (tmp_path / "d.log").read_text()
        assert "WARNING" in log and f"speaks protocol v{ours}, this daemon v{theirs}" in log, log
    finally:
        if c is not None:
            c.close()
        proc.stop(timeout=20)


def test_client_logs_the_daemon_going_away_and_coming_back_once_each(tmp_path, caplog):
    """Issue 19, item 6: nothing was logged when the daemon went away, only "restarted" on return."""
    caplog.set_level(logging.INFO, logger="kvoffd_client")
    address = f"ipc://{tmp_path}/d.sock"
    d1 = start_daemon(address, "32MiB")
    d2 = None
    c = KvoffdClient(address, timeout_s=5)  # with its heartbeat thread, as in an engine
    try:
        assert c.connect(10)
        d1.stop(signal.SIGKILL)
        assert wait_until(lambda: any("went away" in r.getMessage() for r in caplog.records), 10)
        d2 = start_daemon(address, "32MiB")
        assert wait_until(lambda: any("kvoffd restarted" in r.getMessage() for r in caplog.records), 10)
        msgs = [(r.levelname, r.getMessage()) for r in caplog.records]
        assert sum("went away" in m for _, m in msgs) == 1, msgs
        assert sum("kvoffd restarted" in m for _, m in msgs) == 1, msgs
        assert all(lvl == "WARNING" for lvl, m in msgs if "went away" in m or "restarted" in m), msgs
    finally:
        c.close()
        if d2 is not None:
            d2.stop()
        d1.stop()
