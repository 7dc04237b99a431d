"""Issue 28, items 1, 7 and 13: who may read the KV-event stream, what they read, and what it costs.

Against real daemons with real outlets (the process that holds the KV-event endpoints,
kvoffd/server/outlet.py), other users played with ``setpriv --reuid 65534``:

* item 1: the stream leaked prompt content. Before the fix uid 65534 connected to the loopback PUB and
  replay ports and read every stored block's token ids, the last 10,000 batches on request. Now the
  default stream (``--kv-events-address ipc``) is a socket in the daemon's private directory (another
  user's connect fails with EACCES), a tcp:// stream takes only CURVE clients whose key is allowed,
  and token ids are published only with ``--kv-events-token-ids``.
* item 7: replay requests nobody reads took about 1 MB each (2,500 took the daemon to 2.6 GB). Now a
  replay goes out a window at a time, bounded per peer and in all.
* item 13: KV-event connections were counted in the daemon's descriptor budget only by its
  once-a-second measurement. Now they are not the daemon's descriptors at all, and the outlet counts
  each one at its accept and at its disconnect.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import zmq
from kvevents_sub import EventSubscriber, resident, router_keys, stream_keys
from kvtest import ROOT, chain_keys, start_daemon, wait_until
from reliability_util import ShmEngine, fd_count, record

from kvoffd_client.vllm.events import NO_PARENT, block_tokens

NOBODY = ("setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups")
needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="needs root (setpriv) to be another user")
LAYOUT_EVENTS = {"hash": "int64", "block_size": 4}


def _spy(ev: dict, server_key: str = "") -> dict:
    """tests/support/kv_spy.py as uid 65534: what another user reads of the stream STATS describes."""
    r = subprocess.run([*NOBODY, sys.executable, str(ROOT / "tests" / "support" / "kv_spy.py"), ev["endpoint"],
                        ev["replay_endpoint"], *([server_key] if server_key else [])],
                       capture_output=True, text=True, timeout=120, cwd="/")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _store_described(c, eng: ShmEngine, engine_id: str, job: int, keys: list[bytes]) -> None:
    """A STORE as the connector sends it to a daemon that asks for descriptions: tokens and parents."""
    toks = [[100 + 4 * i + j for j in range(4)] for i in range(len(keys))]
    eng.fill(range(len(keys)), keys)
    c.submit_store(engine_id, job, keys, range(len(keys)), tokens=b"".join(block_tokens(t, 0, 4) for t in toks),
                   parents=NO_PARENT + b"".join(keys[:-1]))
    (n,) = c.wait_notices({job}, 30)
    assert n.ok, n


@needs_root
def test_the_default_stream_is_the_daemon_users_and_carries_no_token_ids(tmp_path):
    """``--kv-events-address ipc``: the sockets sit beside the daemon's own, in its 0700 directory. uid
    65534's connects fail (EACCES); the daemon's user reads the stream. A client that describes its
    blocks anyway (tokens, parents) gets them checked and dropped: no token id is published, and
    HELLO_OK does not ask for them."""
    d = start_daemon(f"ipc://{tmp_path}/ev.sock", "16MiB", "--kv-events-address", "ipc")
    eng = ShmEngine(4, 4096, tag="default")
    try:
        c = d.client(job_deadline_s=30.0)
        ev = c.stats()["daemon"]["kv_events"]
        assert (ev["endpoint"], ev["auth"], ev["token_ids"]) == (f"ipc://{tmp_path}/ev.sock.events", "ipc", False)
        assert "kv_events" not in c.hello.capabilities
        c.register("df-0", "dfns", 0, 1, eng.memory, {**eng.layout, "kv_events": LAYOUT_EVENTS})
        keys = chain_keys(4, b"default")
        _store_described(c, eng, "df-0", 1, keys)
        sub = EventSubscriber(ev["endpoint"], ev["replay_endpoint"])
        try:
            assert sub.wait_for(lambda s: len(resident(s.events())) == 4)
            assert all(e["token_ids"] == [] and e["parent_block_hash"] is None for e in sub.events())
        finally:
            sub.close()
        got = _spy(ev)
        assert (got["publish"], got["replay"], got["batches"]) == ("EACCES", "EACCES", 0), got
    finally:
        eng.close()
        d.stop()


@needs_root
def test_a_tcp_stream_takes_only_allowed_curve_keys(tmp_path):
    """tcp:// on loopback, with token ids asked for: any local user reaches the port, so the daemon
    takes CURVE clients only, and only those whose public key is in ``allowed/``. uid 65534 without a
    key, and with a key pair of its own (it knows the daemon's public key: STATS shows it), completes
    no handshake and reads nothing; it cannot read the router key (0700 directory, 0600 file). The
    operator's router, with ``router.key_secret``, reads the stream, tokens included."""
    curve = tmp_path / "curve"
    d = start_daemon(f"ipc://{tmp_path}/ev.sock", "16MiB", "--kv-events-address", "tcp://127.0.0.1:0",
                     "--kv-events-curve-dir", str(curve), "--kv-events-token-ids")
    eng = ShmEngine(4, 4096, tag="curve")
    try:
        c = d.client(job_deadline_s=30.0)
        ev = c.stats()["daemon"]["kv_events"]
        assert ev["auth"] == "curve" and ev["curve_public_key"] and "kv_events" in c.hello.capabilities
        c.register("cv-0", "cvns", 0, 1, eng.memory, {**eng.layout, "kv_events": LAYOUT_EVENTS})
        keys = chain_keys(4, b"curve")
        _store_described(c, eng, "cv-0", 1, keys)
        for mode in (curve, curve / "router.key_secret"):
            assert oct(mode.stat().st_mode & 0o777) in ("0o700", "0o600"), mode
        sub = EventSubscriber(ev["endpoint"], ev["replay_endpoint"], curve=stream_keys(ev))
        try:
            assert sub.wait_for(lambda s: len(resident(s.events())) == 4)
            assert [e["token_ids"] for e in sub.events()] == [[100 + 4 * i + j for j in range(4)] for i in range(4)]
        finally:
            sub.close()
        for key in ("", ev["curve_public_key"]):
            got = _spy(ev, key)
            assert got["publish"] == got["replay"] == "handshake_failed" and got["batches"] == 0, (key, got)
            assert "live" not in got, got
        r = subprocess.run([*NOBODY, "cat", str(curve / "router.key_secret")], capture_output=True, text=True)
        assert r.returncode != 0 and "Permission denied" in r.stderr, r
        assert wait_until(lambda: c.stats()["daemon"]["kv_events"]["outlet"].get("denied", 0) >= 2, 10)
        assert router_keys(str(curve))[0].decode() == ev["curve_public_key"]
    finally:
        eng.close()
        d.stop()


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


@needs_root
def test_unread_replays_are_bounded_per_peer_and_in_all(tmp_path):
    """20 replay connections of another user each ask 20 times for the whole buffer (~1.4 MB here) and
    read nothing. Before the fix each request queued a copy of every kept batch: the daemon grew by
    575 MB and stayed there. Now a peer has one replay at a time, a replay goes out a window at a time
    with its payloads zero-copy, and what libzmq holds for peers that do not read is bounded per peer
    (4 MiB) and in all (64 MiB): the daemon and its outlet together grow by a few MB, and once those
    peers are gone a router's replay is whole again."""
    d = start_daemon(f"ipc://{tmp_path}/ev.sock", "64MiB", "--kv-events-address", "tcp://127.0.0.1:0",
                     "--kv-events-auth", "none", "--eviction-policy", "lru")
    eng = ShmEngine(256, 4096, tag="replay")
    flood = None
    try:
        c = d.client(job_deadline_s=30.0)
        c.register("rp-0", "rpns", 0, 1, eng.memory, {**eng.layout, "kv_events": {"hash": "bytes", "block_size": 16}})
        eng.fill(range(256), chain_keys(256, b"fill"))
        for job in range(1, 121):  # one batch each: 256 keys of 32 bytes, ~9 KB of events
            c.submit_store("rp-0", job, chain_keys(256, b"r%d" % job), range(256))
            assert c.wait_notices({job}, 30)[0].ok
        def held() -> bool:  # every batch handed to the outlet is in its replay ring
            now = c.stats()["daemon"]["kv_events"]
            return now["outlet"].get("batches") == now["batches_sent"]

        assert wait_until(held, 30)
        ev = c.stats()["daemon"]["kv_events"]
        sub = EventSubscriber(ev["endpoint"], ev["replay_endpoint"])
        try:
            whole = sub.catch_up()
        finally:
            sub.close()
        assert whole == ev["batches_sent"] >= 120
        outlet = ev["outlet_pid"]
        before = _rss_kb(d.proc.pid) + _rss_kb(outlet)
        flood = subprocess.Popen([*NOBODY, sys.executable, str(ROOT / "tests" / "support" / "replay_flood.py"),
                                  ev["replay_endpoint"], "20", "20"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True, cwd="/")
        assert json.loads(flood.stdout.readline())["requests"] == 400

        def grown_mb() -> float:
            return (_rss_kb(d.proc.pid) + _rss_kb(outlet) - before) / 1024

        def seen() -> int:  # requests the outlet has read: being served, served, waiting or dropped
            return c.stats()["daemon"]["kv_events"].get("outlet", {}).get("replays", 0)

        assert wait_until(lambda: seen() >= 400 or grown_mb() > 64, 30)
        out = c.stats()["daemon"]["kv_events"]["outlet"]
        grown = grown_mb()
        assert grown < 64 and seen() >= 400, (grown, out)
        assert out["replay_bytes_in_flight"] <= 64 << 20, out
        assert d.proc.poll() is None
        flood.stdin.close()
        flood.wait(30)
        flood = None
        late = EventSubscriber(ev["endpoint"], ev["replay_endpoint"])  # the peers are gone: replay is whole
        try:
            assert wait_until(lambda: late.catch_up() >= 0 and len(late.batches) >= whole, 60)
            assert len(late.batches) == whole
        finally:
            late.close()
        record("kv_events_unread_replays", peers=20, requests=400, kept_batches=whole, grown_mb=round(grown, 1),
               replay_bytes_in_flight=out["replay_bytes_in_flight"], replays_dropped=out["replays_dropped"],
               replays_waiting=out["replays_waiting"])
    finally:
        if flood is not None:
            flood.kill()
            flood.wait()
        eng.close()
        d.stop()


def test_kv_event_connections_are_the_outlets_and_counted_at_each_accept(tmp_path):
    """300 subscribers connect and leave. The daemon's own descriptors do not move (they are the
    outlet's), and the outlet's count follows each connection, from its accept and disconnect events
    rather than a once-a-second measurement: exactly 300, then 0."""
    d = start_daemon(f"ipc://{tmp_path}/ev.sock", "16MiB", "--kv-events-address", "ipc")
    ctx = zmq.Context()
    socks = []
    try:
        c = d.client()
        before = fd_count(d.proc.pid)

        def outlet() -> dict:
            return c.stats()["daemon"]["kv_events"]["outlet"]

        ev = c.stats()["daemon"]["kv_events"]
        for i in range(300):
            s = ctx.socket(zmq.SUB if i % 2 else zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ev["endpoint"] if i % 2 else ev["replay_endpoint"])
            socks.append(s)
        assert wait_until(lambda: outlet().get("connections") == {"publish": 150, "replay": 150}, 30), outlet()
        assert fd_count(d.proc.pid) <= before + 2, (before, fd_count(d.proc.pid))
        assert outlet()["in_use"] >= 300  # the outlet's budget has them (a measurement would lag)
        for s in socks:
            s.close(0)
        socks.clear()
        assert wait_until(lambda: outlet().get("connections") == {"publish": 0, "replay": 0}, 30), outlet()
        # the daemon's metrics show the outlet's counts too
        assert 'kvoffd_kv_events_connections{socket="publish"} 0.0' in d.metrics()
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
        d.stop()


def test_a_dead_outlet_is_replaced_and_the_daemon_serves_on(tmp_path):
    """The outlet is killed (SIGKILL: what an abort would do). The daemon goes on serving, starts another
    outlet on the same endpoints, and the router that was subscribed gets the next batches through its
    own reconnect; the gap in seq it sees is what replay is for."""
    d = start_daemon(f"ipc://{tmp_path}/ev.sock", "16MiB", "--kv-events-address", "ipc")
    eng = ShmEngine(8, 4096, tag="outlet")
    sub = None
    try:
        c = d.client(job_deadline_s=30.0)
        c.register("ol-0", "olns", 0, 1, eng.memory, {**eng.layout, "kv_events": {"hash": "bytes", "block_size": 16}})
        keys = chain_keys(8, b"outlet")
        eng.fill(range(8), keys)
        c.submit_store("ol-0", 1, keys[:4], range(4))
        assert c.wait_notices({1}, 30)[0].ok
        ev = c.stats()["daemon"]["kv_events"]
        sub = EventSubscriber(ev["endpoint"], ev["replay_endpoint"])
        assert sub.wait_for(lambda s: set(keys[:4]) <= resident(s.events()))
        os.kill(ev["outlet_pid"], 9)

        def restarted() -> bool:
            now = c.stats()["daemon"]["kv_events"]
            return now["outlet_restarts"] == 1 and now["outlet_pid"] not in (0, ev["outlet_pid"])

        assert wait_until(restarted, 30), d.log()
        assert c.ping() >= 0 and d.proc.poll() is None
        # the router's sockets found the new outlet by themselves (ZeroMQ reconnects)
        assert wait_until(lambda: c.stats()["daemon"]["kv_events"]["connections"] == {"publish": 1, "replay": 1}, 30)
        c.submit_store("ol-0", 2, keys[4:], range(4, 8))
        assert c.wait_notices({2}, 30)[0].ok

        def got_new(s: EventSubscriber) -> bool:  # live, or from the new outlet's replay (a slow rejoin)
            s.poll_live(200)
            if not any(set(keys[4:]) <= set(e.get("block_hashes", [])) for b in s.batches.values() for e in b[1]):
                s.catch_up()
            return any(set(keys[4:]) <= set(e.get("block_hashes", [])) for b in s.batches.values() for e in b[1])

        assert wait_until(lambda: got_new(sub), 30), d.log()
        assert "kvoffd_kv_events_outlet_restarts_total 1.0" in d.metrics()
        assert "the outlet (pid" in d.log() and "is gone" in d.log()
    finally:
        if sub is not None:
            sub.close()
        eng.close()
        d.stop()
