"""Drill: engine death. SIGKILL an engine process with big jobs in flight, mid-store and mid-load.

What must hold (issue 6, drill 2; anchors §6.14 — LMCache #3206, a dead engine's buffers never freed):
the daemon notices within 1 s, lets the running copies finish into memory it still maps, then drops
the mapping (the engine's memfd: once unmapped, no process holds it and its memory is freed), the lease
and every pin; it serves other engines
throughout, and the pool's books return exactly to their prior value (nothing leaks).
"""

from __future__ import annotations

import os
import time

import pytest
from kvtest import chain_keys, wait_until
from reliability_util import RawPeer, ShmEngine, anyone_maps, maps_mention, record

from kvoffd_client import protocol as P

# 512 KiB blocks, 128 of them: one job of all blocks moves 64 MiB
BIG = dict(blocks=128, layers=4, heads=8, block_size=16, head_dim=128)
NB = BIG["blocks"]


def _engine(stats: dict, engine_id: str) -> dict | None:
    return next((e for e in stats["engines"] if e["engine_id"] == engine_id), None)


def _round_trip(eng, keys: list[bytes], job: int) -> None:
    """A bystander's store + load into other blocks, checked byte for byte."""
    n = len(keys)
    assert eng.store(job, keys, list(range(n)))["ok"]
    assert eng.load(job + 1, keys, list(range(n, 2 * n)))["ok"]
    assert eng("digest", ids=list(range(n, 2 * n))) == eng("digest", ids=list(range(n)))


@pytest.mark.parametrize("phase", ["store", "load"])
def test_engine_sigkilled_mid_job(make_daemon, engines, phase):
    d = make_daemon("512MiB", name=f"death-{phase}")
    dpid = d.proc.pid
    watcher = d.client()
    assert watcher.stats()["pool"]["used_bytes"] == 0
    bystander = engines(d.address, "bystander", namespace="bystander", blocks=32)
    bystander("fill", ids=list(range(16)), seed=4)
    victim = engines(d.address, "victim", namespace="death", **BIG)
    slot = victim.info["slot_bytes"]
    victim("fill", ids=list(range(NB)), seed=7)
    want = victim("digest", ids=list(range(NB)))
    memfd = "/memfd:kvoffd-victim (deleted)"  # the stand-in names its memfd after the engine id
    assert maps_mention(dpid, memfd) and maps_mention(victim.proc.pid, memfd)

    keys = chain_keys(8 * NB, b"death")
    assert victim.store(1, keys[:NB], list(range(NB)))["ok"]
    lease = victim.lookup(keys[:NB], lease_ms=60_000)  # held by the victim's connection
    assert lease["hits"] == NB and lease["lease_id"]
    jobs = range(10, 16) if phase == "store" else range(10, 42)
    for j in jobs:  # stores: 6 x 64 MiB of new keys; loads: 32 x 64 MiB
        if phase == "store":
            ks = keys[(j - 9) * NB:(j - 8) * NB]
            victim("submit_store", job=j, keys=[k.hex() for k in ks], ids=list(range(NB)))
        else:
            victim("submit_load", job=j, keys=[k.hex() for k in keys[:NB]], ids=list(range(NB)))
    assert wait_until(lambda: (_engine(watcher.stats(), "victim") or {}).get("in_flight", 0) > 0, 5, 0.001)
    in_flight = _engine(watcher.stats(), "victim")["in_flight"]
    t0 = time.monotonic()
    victim.kill(reap=False)  # a zombie until the end: its parent need not reap it for the cleanup to run
    assert wait_until(lambda: _engine(watcher.stats(), "victim") is None, 5, 0.005)
    noticed_s = time.monotonic() - t0
    assert noticed_s < 1.0, f"the daemon took {noticed_s:.3f} s to notice the engine's death"
    s = watcher.stats()
    in_flight_after = s["in_flight_jobs"]
    assert s["leases"] == 0, "the dead engine's lease was kept"

    _round_trip(bystander, chain_keys(16, b"bystander-1"), 1)  # served while the dead engine's copies drain
    assert wait_until(lambda: watcher.stats()["in_flight_jobs"] == 0, 30)
    drained_s = time.monotonic() - t0
    assert wait_until(lambda: not maps_mention(dpid, memfd), 5), "the dead engine's memory is still mapped"
    unmapped_s = time.monotonic() - t0
    assert not anyone_maps(memfd), "the dead engine's memory is still held: it is never freed"
    victim.proc.wait(10)  # reaped only now
    _round_trip(bystander, chain_keys(16, b"bystander-2"), 3)

    # no pin survives; what the dead engine stored is exact for its successor
    s = watcher.stats()
    stored = keys[: s["resident_blocks"] - 32] if phase == "store" else keys[:NB]
    assert not any(e.get("held") for e in watcher.explain("death", keys))
    heir = engines(d.address, "heir", namespace="death", **BIG)
    hits = heir.lookup(keys[: 7 * NB])["hits"]
    assert hits >= NB
    for j in range(hits // NB):
        assert heir.load(100 + j, keys[j * NB:(j + 1) * NB], list(range(NB)))["ok"]
        assert heir("digest", ids=list(range(NB))) == want, "a block stored by the dead engine is wrong"

    # the books: exact, and back to the prior value once cleared
    s = watcher.stats()
    assert s["pool"]["used_bytes"] == sum(ns["bytes"] for ns in s["namespaces"])
    assert s["leases"] == 0 and s["in_flight_jobs"] == 0
    assert watcher.clear("").removed_blocks == s["resident_blocks"]
    s = watcher.stats()
    assert s["pool"]["used_bytes"] == 0 and s["resident_blocks"] == 0, "slots leaked"
    assert d.proc.poll() is None
    record(f"engine_death_{phase}", jobs_submitted=len(jobs), job_mib=NB * slot >> 20,
           in_flight_at_kill=in_flight, in_flight_right_after=in_flight_after, noticed_s=round(noticed_s, 4),
           drained_s=round(drained_s, 3), unmapped_s=round(unmapped_s, 3), heir_hits=hits, stored_keys=len(stored))


def test_vanished_client_without_pidfd_is_dropped_by_heartbeat_timeout(make_daemon):
    """A client in another pid namespace (no pidfd: HELLO pid 0) is dropped by --engine-timeout.

    Deployments share the pid namespace (deploy/k8s: shareProcessNamespace / hostPID), so this is the
    fallback path; it must still release the lease and the mapping.
    """
    d = make_daemon("16MiB", "--engine-timeout", "0.5", name="nopidfd")
    dpid = d.proc.pid
    eng = ShmEngine(16, 4096, tag="nopidfd")
    peer = RawPeer(d.address)
    try:
        peer.hello(pid=0)
        assert peer.ask(P.Register(engine_id="ghost", namespace="ghost", memory=eng.memory,
                                   layout=eng.layout))["op"] == "registered"
        keys = chain_keys(4, b"ghost")
        eng.fill(range(4), keys)
        peer.send_msg(P.Store(engine_id="ghost", job_id=1, keys=keys, block_ids=[0, 1, 2, 3]))
        assert peer.recv_until(lambda r: r["op"] == "notice")[-1]["ok"]
        assert peer.ask(P.Lookup(namespace="ghost", keys=keys, lease_ms=60_000))["lease_id"]
        watcher = d.client()
        assert watcher.stats()["leases"] == 1 and maps_mention(dpid, eng.tag)
        t0 = time.monotonic()
        peer.close()  # the process "dies": no more messages, and no pidfd to tell
        assert wait_until(lambda: not watcher.stats()["engines"], 5)
        gone_s = time.monotonic() - t0
        assert gone_s < 0.5 + 1.0
        assert watcher.stats()["leases"] == 0
        assert wait_until(lambda: not maps_mention(dpid, eng.tag), 5)
        record("engine_death_no_pidfd", engine_timeout_s=0.5, noticed_s=round(gone_s, 3))
    finally:
        eng.close()


def test_a_stopped_daemon_does_not_count_its_clients_silence_against_them(make_daemon):
    """The daemon is stopped (SIGSTOP) for longer than --engine-timeout while its client keeps sending
    heartbeats, and a STORE, into the socket. Thawed, it must not take its own stall for the client's
    silence: the engine stays registered and the STORE sent meanwhile completes (before the fix, the
    first housekeeping after the thaw unregistered the engine and its jobs ended without a notice: a
    vLLM holding blocks for a late load waited for ever)."""
    import signal

    d = make_daemon("16MiB", "--engine-timeout", "2", name="stalled")  # the client pings every second
    eng = ShmEngine(16, 4096, tag="stalled")
    c = d.client(name="stalled")
    try:
        c.register("e0", "stall", 0, 1, eng.memory, eng.layout)
        keys = chain_keys(4, b"stall")
        eng.fill(range(4), keys)
        os.kill(d.proc.pid, signal.SIGSTOP)  # at once, before any housekeeping ran since the start (it did)
        try:
            c.submit_store("e0", 1, keys, range(4))  # queued in the socket; the heartbeats too
            time.sleep(4.5)  # the stall itself: more than twice --engine-timeout
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        notices = c.wait_notices({1}, 10)
        assert notices and notices[0].ok, notices
        assert c.lookup("stall", b"".join(keys)).hits == 4
        assert [e["engine_id"] for e in c.stats()["engines"]] == ["e0"]  # registered once, never dropped
        log = d.log()
        assert "did not run for" in log and "unregistering its engines" not in log, log[-2000:]
    finally:
        c.close()
        eng.close()
