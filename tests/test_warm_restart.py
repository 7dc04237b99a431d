"""Warm restart (issue 14): the pool lives in a file on tmpfs, and a new daemon adopts its blocks.

Real daemons, a real engine process (this test process, with its memory in a sealed memfd) that keeps
running while the daemon is stopped (SIGTERM), killed (SIGKILL, also in the middle of a large STORE)
and started again at the same address; the client re-registers by itself. What must hold: the blocks
stored before come back (>= 99%) and load byte-exact; a block served is never wrong, whatever
instant the daemon died at; a pool file of another size, or ``--cold``, gives a cold pool with one
log line; bytes flipped in the file while no daemon ran cost that block only.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from kvtest import chain_keys, wait_until
from pools import flip_block

from kvoffd.pool.format import default_pool_path, fs_type

NB, SLOT = 128, 256 << 10  # 32 MiB of blocks in a 64 MiB pool
NS = "warm"


@pytest.fixture
def rig(warm_rig):
    """``rig(**kw)``: one engine (this process) and the daemon it uses, restarted at will
    (tests/support/pools.py's WarmRig)."""
    return functools.partial(warm_rig, name=NS, stop_s=15)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_restart_keeps_the_blocks_and_the_engine_notices_only_a_gap(rig, sig):
    r = rig()
    keys = chain_keys(NB, b"warm")
    r.store(keys[:64], range(64))
    r.store(keys[64:], range(64, NB))
    if sig == signal.SIGKILL:
        r.sealed(NB)  # durable once sealed (milliseconds after the store); SIGTERM seals what is left
    watcher = r.restart(sig)
    st = watcher.stats()
    assert st["persistence"]["adopted_blocks"] >= 0.99 * NB, st["persistence"]
    assert watcher.lookup(NS, keys).hits >= 0.99 * NB  # answered from the adopted index at once
    served, _ = r.load(keys, range(NB))
    assert len(served) >= 0.99 * NB, f"only {len(served)} of {NB} blocks hit after the restart"
    r.exact(keys, range(NB), served)
    assert watcher.stats()["counters"]["loaded_blocks"] == len(served)
    r_ctl = subprocess.run([sys.executable, "-m", "kvoffd.ops.ctl", "--address", r.d.address, "status"],
                           capture_output=True, text=True, timeout=30)
    assert f"adopted {st['persistence']['adopted_blocks']} blocks" in r_ctl.stdout, r_ctl.stdout
    # the adopted pool keeps working: new blocks stored and found next to the adopted ones
    more = chain_keys(16, b"after")
    r.store(more, range(16))
    served, _ = r.load(more, range(16, 32))
    assert len(served) == 16
    r.exact(more, range(16, 32), served)


def test_sigkill_during_a_large_store_never_serves_a_wrong_byte(rig):
    """The pool holds 256 slots: the second STORE evicts most of the first one's blocks and copies into
    their slots while the daemon is killed. Whatever was adopted must be exact."""
    r = rig()
    a, b = chain_keys(NB, b"first"), chain_keys(NB, b"second")
    r.store(a, range(NB))
    r.sealed(NB)
    r.eng.fill(range(NB), b)
    r.job += 1
    r.c.submit_store("warm-0", r.job, b, range(NB))  # in flight while the daemon dies
    r.d.proc.send_signal(signal.SIGKILL)
    r.d.proc.wait(10)
    r.c.wait_notices({r.job}, 30)
    watcher = r.restart(signal.SIGKILL)  # (already dead: starts the next one)
    adopted = watcher.stats()["persistence"]["adopted_blocks"]
    for keys in (a, b):
        served, _ = r.load(keys, range(NB))
        r.exact(keys, range(NB), served)
    assert adopted >= NB // 2, f"only {adopted} blocks adopted (the first store's survivors at least)"


def test_a_pool_of_another_size_starts_cold_with_one_line(rig):
    r = rig()
    keys = chain_keys(32, b"size")
    r.store(keys, range(32))
    watcher = r.restart(signal.SIGTERM, pool="128MiB")
    assert watcher.stats()["persistence"]["adopted_blocks"] == 0
    assert watcher.lookup(NS, keys).hits == 0
    lines = [ln for ln in r.d.log().splitlines() if "not adopted" in ln]
    assert len(lines) == 1 and "pool size is 64MiB, this daemon's 128MiB" in lines[0], lines
    r.store(keys, range(32))  # the new pool works
    served, _ = r.load(keys, range(32, 64))
    assert len(served) == 32


def test_cold_starts_empty_on_purpose(rig):
    r = rig()
    keys = chain_keys(32, b"cold")
    r.store(keys, range(32))
    watcher = r.restart(signal.SIGTERM, "--cold")
    assert watcher.stats()["persistence"]["adopted_blocks"] == 0
    assert watcher.lookup(NS, keys).hits == 0
    assert "starting cold (--cold)" in r.d.log()


@pytest.mark.parametrize("how", ["first_load", "background_pass"])
def test_flipped_bytes_cost_that_block_only(rig, how, monkeypatch):
    """``first_load``: no background pass (KVOFFD_TEST_NO_VERIFY_PASS), so the LOAD checks the block and
    refuses it; ``background_pass``: the pass drops it before any LOAD. Every other block is served."""
    if how == "first_load":
        monkeypatch.setenv("KVOFFD_TEST_NO_VERIFY_PASS", "1")
    r = rig()
    keys = chain_keys(NB, b"flip")
    r.store(keys, range(NB))
    victim = 40
    slot = int(r.d.client().explain(NS, [keys[victim]])[0]["slots"]["0"])
    r.d.proc.send_signal(signal.SIGTERM)
    r.d.proc.wait(15)
    flip_block(r.pool_path, r.pool, slot)
    r.d = r.start()
    watcher = r.d.client()
    assert wait_until(lambda: any(e["engine_id"] == "warm-0" for e in watcher.stats()["engines"]), 15)
    assert watcher.stats()["persistence"]["adopted_blocks"] == NB
    if how == "background_pass":
        assert wait_until(lambda: watcher.stats()["persistence"]["verified_s"] > 0, 30)
        assert watcher.stats()["persistence"]["verify_failures"] == 1
    served, n = r.load(keys, range(NB))
    assert n.failed == [victim], n
    if how == "first_load":
        assert n.code == "checksum_mismatch", n
    r.exact(keys, range(NB), served)
    assert watcher.lookup(NS, keys).hits == victim  # the leading blocks up to the dropped one


def test_the_default_pool_path_is_memory_backed(tmp_path):
    """In a directory of its own in /dev/shm (tests/test_reliability_pool_ownership.py makes it), one per
    address, whether the socket's directory is memory-backed or not; read only: nothing is made here."""
    assert fs_type("/dev/shm") == "tmpfs"
    for address in (f"ipc://{tmp_path}/kvoffd.sock", "ipc:///dev/shm/kvoffd.sock", "tcp://127.0.0.1:5555"):
        path = default_pool_path(address)
        assert path.startswith(f"/dev/shm/kvoffd-{os.getuid()}-") and path.endswith("-XXXXXXXX/kvoffd.pool"), path
        assert not os.path.exists(os.path.dirname(path))
    assert default_pool_path("ipc:///a/x.sock") != default_pool_path("ipc:///b/x.sock")


def test_a_pool_file_on_disk_or_in_use_is_refused_and_the_daemon_still_serves(make_daemon, tmp_path, pool_path):
    if fs_type(str(tmp_path)) != "other":
        pytest.skip("needs a disk-backed temporary directory")
    d = make_daemon("64MiB", "--pool-path", str(tmp_path / "kvoffd.pool"), name="disk")
    assert d.client().stats()["persistence"]["path"] == ""
    assert "is not memory-backed" in d.log() and not (tmp_path / "kvoffd.pool").exists()
    first = make_daemon("64MiB", "--pool-path", pool_path, name="one")
    second = make_daemon("64MiB", "--pool-path", pool_path, name="two")
    assert first.client().stats()["persistence"]["path"] == pool_path
    assert second.client().stats()["persistence"]["path"] == ""
    assert "in use by another kvoffd" in second.log()
    np.testing.assert_equal(os.stat(pool_path).st_mode & 0o777, 0o600)


def test_doctor_reports_the_pool_file(rig, tmp_path):
    """Space, memory backing, permissions and what the file holds, from the real entry point."""
    r = rig()
    r.store(chain_keys(8, b"doc"), range(8))
    r.d.proc.send_signal(signal.SIGTERM)
    r.d.proc.wait(15)

    def doctor(path: str, size: str = "64MiB") -> str:
        out = subprocess.run([sys.executable, "-m", "kvoffd", "doctor", "--bandwidth-size", "0", "--no-ipc",
                              "--pool-size", size, "--pool-path", path], capture_output=True, text=True, timeout=60)
        return next(ln for ln in out.stdout.splitlines() if "pool-file" in ln)

    assert doctor(r.pool_path).startswith("PASS") and "adopted at the next start" in doctor(r.pool_path)
    assert "will not adopt (its pool size is 64MiB, this daemon's 128MiB)" in doctor(r.pool_path, "128MiB")
    if fs_type(str(tmp_path)) == "other":
        assert doctor(str(tmp_path / "kvoffd.pool")).startswith("WARN") and "not memory-backed" in \
            doctor(str(tmp_path / "kvoffd.pool"))
    os.chmod(r.pool_path, 0o644)
    assert "not a 0600 file of this user" in doctor(r.pool_path)


def test_the_adopted_lru_order_is_the_last_use_order(rig):
    """Blocks read by a LOAD get new last-use stamps (written at SIGTERM at the latest): after the
    restart, the blocks stored later but never read are the ones evicted first."""
    r = rig()
    r.d.stop()
    r.d = r.start("--eviction-policy", "lru")
    assert wait_until(lambda: r.c.connected and r.d.client().stats()["engines"], 15)
    a, b = chain_keys(64, b"old-but-read"), chain_keys(64, b"new-unread")
    r.store(a, range(64))
    r.store(b, range(64, 128))
    served, _ = r.load(a, range(64))
    assert len(served) == 64
    watcher = r.restart(signal.SIGTERM, "--eviction-policy", "lru")
    assert watcher.stats()["persistence"]["adopted_blocks"] == 128
    r.store(chain_keys(128, b"fill"), range(128))  # the pool (256 slots) is now full
    r.store(chain_keys(64, b"evicts"), range(64))  # evicts the 64 least recently used
    assert watcher.lookup(NS, a).hits == 64
    assert watcher.lookup(NS, b).hits == 0


def test_a_block_cleared_while_leased_does_not_come_back_after_a_crash(rig):
    """CLEAR unlinks a leased block at once but frees its slot only when the lease ends; its record goes
    at the CLEAR (IndexObserver.unlinked), so a crash in between cannot resurrect it."""
    r = rig()
    keys = chain_keys(32, b"cleared")
    r.store(keys, range(32))
    r.sealed(32)
    holder = r.d.client()
    assert holder.lookup(NS, keys, lease_ms=30_000).hits == 32  # pinned for 30 s
    assert holder.clear(NS).removed_blocks == 32
    r.d.proc.send_signal(signal.SIGKILL)
    r.d.proc.wait(10)
    watcher = r.restart(signal.SIGKILL)
    assert watcher.stats()["persistence"]["adopted_blocks"] == 0
    assert watcher.lookup(NS, keys).hits == 0


def test_small_slots_beyond_a_chunks_records_are_a_miss_never_wrong(rig):
    """4 KiB slots: a 64 MiB chunk holds 16,384 of them but has 4,096 records (metadata stays at 0.4%
    of the pool); the blocks past those are not persisted, so after a restart they are misses."""
    n = 5000
    r = rig(nb=n, slot=4 << 10)
    keys = chain_keys(n, b"small")
    r.store(keys, range(n))
    watcher = r.restart(signal.SIGTERM)
    assert watcher.stats()["persistence"]["adopted_blocks"] == 4096
    served, _ = r.load(keys, range(n))
    assert len(served) == 4096
    r.exact(keys, range(n), served)


def test_a_lookup_finds_an_adopted_block_before_its_slice_is_indexed(rig, monkeypatch):
    """Adopted blocks enter the index a slice per loop turn, newest first; a LOOKUP that misses one
    still waiting takes it at once, so the oldest block hits as soon as the daemon serves. The gate:
    KVOFFD_TEST_NO_ADOPTION_SLICES holds the slices for good, so only what a LOOKUP asks for is
    indexed. A CLEAR then gives up the rest: they miss, and their slots are free again."""
    r = rig()
    keys = chain_keys(NB, b"on-demand")
    r.store(keys[:64], range(64))  # the oldest: their slice would come last
    r.store(keys[64:], range(64, NB))
    monkeypatch.setenv("KVOFFD_TEST_NO_ADOPTION_SLICES", "1")
    watcher = r.restart(signal.SIGTERM)
    p = watcher.stats()["persistence"]
    assert p["adopted_blocks"] == NB and p["indexing_blocks"] == NB, p  # nothing indexed yet
    assert watcher.lookup(NS, [keys[0]]).hits == 1  # the oldest block
    assert watcher.lookup(NS, keys[:48]).hits == 48  # a chain, past the block already taken
    assert watcher.lookup(NS, [chain_keys(1, b"never-stored")[0]]).hits == 0
    p = watcher.stats()["persistence"]
    assert p["adopted_on_demand"] == 48 and p["indexing_blocks"] == NB - 48, p
    served, _ = r.load(keys[:48], range(48))
    assert len(served) == 48
    r.exact(keys[:48], range(48), served)
    used = watcher.stats()["pool"]["used_bytes"]
    assert watcher.clear(NS).removed_blocks == 48
    assert watcher.lookup(NS, keys[48:]).hits == 0  # given up with their namespace, never resurrected
    st = watcher.stats()
    assert st["persistence"]["indexing_blocks"] == 0 and st["persistence"]["adopted_on_demand"] == 48
    assert st["pool"]["used_bytes"] == used - NB * SLOT, (used, st["pool"])


def test_the_stop_line_counts_what_the_file_holds(rig):
    """Issue 33 point 7: the stop line said "kept: N blocks sealed" counting this process's seals (0 for
    a file holding 10 that a restarted daemon stopped without storing). It counts the file's records."""
    r = rig()
    keys = chain_keys(10, b"stopline")
    r.store(keys, range(10))
    r.restart(signal.SIGTERM)
    r.d.proc.send_signal(signal.SIGTERM)  # the second daemon stores nothing and stops
    assert r.d.proc.wait(15) is not None
    line = [ln for ln in r.d.log().splitlines() if " kept: " in ln][-1]
    assert "kept: 10 blocks for the next daemon" in line and "this process committed 0" in line, line
