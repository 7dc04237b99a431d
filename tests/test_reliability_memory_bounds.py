"""Drill: what one client can make the daemon hold, in bytes and in loop time (issue 18, defects 6, 10).

Defect 6: the reply queue was bounded in messages (SNDHWM 10,000), not bytes, so a peer that asks for
big replies and never reads them grew the daemon by megabytes a request; a lease held 8 bytes per key
and rank with only the lease count bounded (4 GiB per connection). Defect 10: copy descriptors (one
run per block and segment) were built on the event loop without bound: a block of 65,536 one-byte
segments made a 512-block STORE 33.6M runs, seconds of stall and gigabytes.

What must hold: the attacker gets ``too_many`` errors, the daemon's RSS (/proc/PID/status VmRSS)
stays bounded, and a well-behaved client keeps being served, promptly.
"""

from __future__ import annotations

import threading
import time

from kvtest import chain_keys, wait_until
from reliability_util import RawPeer, ShmEngine, record, rss_kb

from kvoffd.server.limits import MAX_LEASED_KEYS_PER_CONN, MAX_SEGMENTS
from kvoffd_client import protocol as P
from kvoffd_client.client import KvoffdError

SEGS = 1024  # segments of the runs drill: 16 bytes each, a 16 KiB block


def _keys(n: int, salt: bytes) -> bytes:
    return b"".join(chain_keys(n, salt))


def test_unread_explain_replies_are_bounded_in_bytes(make_daemon):
    d = make_daemon("16MiB", name="explain")
    pid = d.proc.pid
    attacker = RawPeer(d.address, rcvhwm=1)  # its libzmq stops reading the socket at once
    try:
        attacker.hello()
        other = d.client()
        other.ping()
        rss0 = rss_kb(pid)
        # small requests, big replies: 88 bytes of reply per 32-byte key
        big, small = _keys(8192, b"x"), _keys(4096, b"y")
        for _ in range(50):  # over the EXPLAIN bound: 720 KB of reply each before the fix
            attacker.send_msg(P.Explain(namespace="nobody", keys=big))
        for _ in range(600):  # 360 KB each: 216 MB if nothing bounds the bytes
            attacker.send_msg(P.Explain(namespace="nobody", keys=small))
        seq = attacker.send_msg(P.Ping())
        # the daemon has handled everything once the well-behaved client's STATS shows the attacker's
        # 350 EXPLAINs answered (their errors counted); meanwhile it answers that client promptly
        t0 = time.monotonic()
        handled = wait_until(lambda: other.stats()["counters"]["errors"] >= 50 + 600 - 60, 30, 0.05)
        took = time.monotonic() - t0
        rss1 = rss_kb(pid)
        assert handled, f"the EXPLAINs were not refused; daemon RSS grew {(rss1 - rss0) // 1024} MB"
        assert d.proc.poll() is None
        assert other.ping() < 1.0
        grown_mb = (rss1 - rss0) / 1024
        replies = attacker.recv_until(lambda r: r.get("seq") == seq, 60)  # now read everything
        codes = [r.get("code") for r in replies if r.get("op") == "error"]
        explained = sum(1 for r in replies if r.get("op") == "explained")
        record("memory_unread_explain", requests=650, explained=explained, too_many=codes.count("too_many"),
               rss_growth_mb=round(grown_mb, 1), handled_s=round(took, 2))
        assert codes.count("too_many") >= 50 + 600 - 60, (explained, codes[:5])
        assert grown_mb < 100, f"daemon grew {grown_mb:.0f} MB for one peer's unread replies"
    finally:
        attacker.close()


def test_leases_are_bounded_by_the_keys_they_pin(make_daemon):
    d = make_daemon("16MiB", name="lease")
    pid = d.proc.pid
    n = 16384
    eng = ShmEngine(n, 1024, tag="lease")
    c = d.client(timeout_s=10.0)
    try:
        c.register("lease-0", "lease", 0, 1, eng.memory, eng.layout)
        keys = chain_keys(n, b"lease")
        c.submit_store("lease-0", 1, keys, range(n))
        assert c.wait_notices({1}, 30)[0].ok
        rss0 = rss_kb(pid)
        taken, refused = 0, None
        for _ in range(400):  # 400 x 16,384 pinned keys: 52 MB of entry lists before the fix
            try:
                assert c.lookup("lease", keys, lease_ms=600_000).hits == n
                taken += 1
            except KvoffdError as e:
                refused = e.code
                break
        grown_mb = (rss_kb(pid) - rss0) / 1024
        record("memory_lease_bound", keys_per_lease=n, leases_taken=taken, refused=refused,
               rss_growth_mb=round(grown_mb, 1))
        assert refused == "too_many", (taken, refused)
        assert grown_mb < 40, f"daemon grew {grown_mb:.0f} MB for one connection's leases"
        assert taken == MAX_LEASED_KEYS_PER_CONN // n
        # another client is still served, leases included
        other = d.client()
        assert other.lookup("lease", keys[:64], lease_ms=1000).hits == 64
    finally:
        eng.close()


def test_a_layout_of_many_segments_is_refused(make_daemon):
    """The attack of the issue: a 64 KiB block described as 65,536 one-byte segments."""
    d = make_daemon("64MiB", name="segs")
    eng = ShmEngine(16, 65536, tag="segs")
    c = d.client()
    try:
        layout = {"num_blocks": 16, "segments": [[i, 65536, 1] for i in range(65536)]}
        t0 = time.monotonic()
        try:
            c.register("segs-0", "segs", 0, 1, eng.memory, layout, timeout_s=10)
            code = None
        except KvoffdError as e:
            code = e.code
        assert code == "too_many", code
        assert time.monotonic() - t0 < 5
        # at the bound it registers
        layout["segments"] = [[i * 16, 65536, 16] for i in range(MAX_SEGMENTS)]
        c.register("segs-1", "segs", 0, 1, eng.memory, layout)
    finally:
        eng.close()


def test_runs_per_job_are_bounded_and_built_off_the_loop(make_daemon):
    """1,024 segments of 16 bytes: a STORE of 65,536 blocks (67M runs) is refused at once; one of
    512 blocks (half a million runs, described a chunk at a time on a copy thread) is copied while
    PINGs keep their round trip small. (The kernel moves a 16-byte run in ~1-3 us: a job at the
    bound, 16.8M runs, would take its client most of a minute, so the drill stays smaller.)"""
    d = make_daemon("64MiB", name="runs")
    nb, seg = 4096, 16
    assert SEGS * seg == 16384 and SEGS <= MAX_SEGMENTS
    eng = ShmEngine(nb, 16384, tag="runs")
    c = d.client(timeout_s=10.0, job_deadline_s=120.0)
    pinger = d.client(timeout_s=10.0)
    try:
        layout = {"num_blocks": nb, "segments": [[i * nb * seg, seg, seg] for i in range(SEGS)]}
        c.register("runs-0", "runs", 0, 1, eng.memory, layout)
        t0 = time.monotonic()
        c.submit_store("runs-0", 1, chain_keys(65536, b"too-many"), [i % nb for i in range(65536)])
        n = c.wait_notices({1}, 10)
        refused_s = time.monotonic() - t0
        assert n and not n[0].ok and n[0].code == "too_many", n
        rtts: list[float] = []
        stop = threading.Event()

        def ping() -> None:
            while not stop.is_set():
                rtts.append(pinger.ping())

        t = threading.Thread(target=ping)
        t.start()
        t0 = time.monotonic()
        try:
            c.submit_store("runs-0", 2, chain_keys(512, b"bound"), range(512))
            n = c.wait_notices({2}, 60)
        finally:
            stop.set()
            t.join()
        store_s = time.monotonic() - t0
        assert n and n[0].ok, n
        record("descriptors_off_the_loop", runs=512 * SEGS, store_s=round(store_s, 2),
               refused_ms=round(1000 * refused_s, 1), pings=len(rtts),
               ping_max_ms=round(1000 * max(rtts), 1) if rtts else None)
        assert max(rtts) < 1.0, f"a PING waited {max(rtts):.2f} s behind the job's descriptors"
    finally:
        eng.close()
