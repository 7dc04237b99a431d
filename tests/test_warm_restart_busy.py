"""Warm restart of a busy daemon (issue 29): every block whose STORE was acknowledged survives a SIGKILL
or a SIGTERM, however far the checksums lag behind the stores.

The lag is made deterministic with the daemon's gate ``KVOFFD_TEST_HOLD_SEALING`` (kvoffd/cache/restart/sealing.py):
``always`` holds every checksum back for good, ``until_stop`` until the daemon stops. Real daemons, a real
engine (this process, its memory a sealed memfd), a real pool file on tmpfs. What must hold: the
acknowledged blocks are adopted and load byte-exact although none had its checksum; a STORE in flight
at the SIGKILL never yields a torn block; SIGTERM keeps a held-back backlog (summed when it can be,
committed without a checksum when it cannot); the new daemon sums the blocks it adopted without one, so
the restart after it catches a flipped byte in them.
"""

from __future__ import annotations

import functools
import signal
import subprocess
import sys

import pytest
from kvtest import chain_keys, wait_until
from pools import flip_block
from reliability_util import metric_value

HOLD = "KVOFFD_TEST_HOLD_SEALING"
NS = "busy"


@pytest.fixture
def rig(warm_rig):
    """``rig(nb=128, slot=256 KiB, pool="64MiB")``: one engine (this process) and the daemon it uses,
    killed and started again at one address (tests/support/pools.py's WarmRig); every block it loads is
    checked byte-exact (``load_exact``)."""
    return functools.partial(warm_rig, name=NS, flags=("--eviction-policy", "lru"), stop_s=30)


def _status(address: str) -> str:
    out = subprocess.run([sys.executable, "-m", "kvoffd.ops.ctl", "--address", address, "status"],
                         capture_output=True, text=True, timeout=30)
    return next(ln for ln in out.stdout.splitlines() if "warm restart" in ln)


def test_sigkill_with_every_checksum_held_back_keeps_every_acknowledged_block(rig, monkeypatch):
    nb = 128
    monkeypatch.setenv(HOLD, "always")
    r = rig()
    keys = chain_keys(nb, b"held")
    r.store(keys[:64], range(64))
    r.store(keys[64:], range(64, nb))
    p = r.persistence()
    assert p["committed_blocks"] == nb and p["sealed_blocks"] == 0 and p["seal_backlog_blocks"] == nb, p
    assert f"{nb} blocks (32.0 MiB) without their checksum yet" in _status(r.d.address)
    assert metric_value(r.d.metrics(), "kvoffd_checksum_backlog_blocks") == nb
    monkeypatch.delenv(HOLD)
    watcher = r.restart(signal.SIGKILL)
    p = watcher.stats()["persistence"]
    assert p["adopted_blocks"] == nb and p["adopted_unchecked"] == nb, p
    assert "(128 without a checksum)" in _status(r.d.address)
    assert len(r.load_exact(keys, range(nb))) == nb
    # the new daemon sums what it adopted without a checksum: the next restart checks those blocks
    assert wait_until(lambda: watcher.stats()["persistence"]["sealed_blocks"] >= nb, 30), watcher.stats()
    victim = 40
    slot = int(watcher.explain(NS, [keys[victim]])[0]["slots"]["0"])
    r.d.proc.send_signal(signal.SIGTERM)
    assert r.d.proc.wait(30) is not None
    flip_block(r.pool_path, r.pool, slot)
    watcher = r.restart(None)
    p = watcher.stats()["persistence"]
    assert p["adopted_blocks"] == nb and p["adopted_unchecked"] == 0, p
    served = r.load_exact(keys, range(nb))
    assert victim not in served and len(served) == nb - 1


def test_a_store_in_flight_at_sigkill_never_yields_a_torn_block(rig, monkeypatch):
    """An acknowledged STORE (no checksum: held back), then a larger one that evicts part of it and
    copies into those slots while the daemon is SIGKILLed: the evicted blocks' records went before their
    slots were reused, the in-flight store has none, so whatever the new daemon serves is exact; the
    acknowledged blocks not evicted are all adopted."""
    monkeypatch.setenv(HOLD, "always")
    r = rig(nb=192, slot=1 << 20, pool="256MiB")  # 256 slots
    a, b = chain_keys(128, b"acked"), chain_keys(192, b"in-flight")
    r.store(a, range(128))
    assert r.persistence()["seal_backlog_blocks"] == 128
    watcher = r.d.client()
    job = r.submit(b, range(192))  # 128 free slots and 64 of a's: a copy of 192 MiB on one thread

    def started() -> bool:  # in flight now (or, on a fast machine, done already: the rule holds either way)
        st = watcher.stats()
        return st["in_flight_jobs"] >= 1 or st["counters"]["stored_blocks"] >= 128 + 192

    assert wait_until(started, 10)
    r.d.proc.send_signal(signal.SIGKILL)
    r.d.proc.wait(10)
    r.c.wait_notices({job}, 30)
    monkeypatch.delenv(HOLD)
    watcher = r.restart(None)
    adopted = watcher.stats()["persistence"]["adopted_blocks"]
    assert adopted >= 128 - 64, f"only {adopted} blocks adopted (the acknowledged store's survivors at least)"
    served_a = r.load_exact(a, range(128))  # asserts every served block exact
    served_b = r.load_exact(b, range(192))
    assert len(served_a) >= 64 and len(served_a) + len(served_b) == adopted


@pytest.mark.parametrize("hold", ["always", "until_stop"])
def test_sigterm_keeps_a_held_back_backlog(rig, monkeypatch, hold):
    """``always``: the checksums cannot be summed at the stop either, and the blocks are kept committed
    without one; ``until_stop``: SIGTERM sums the backlog before the daemon exits, so every block is
    adopted with its checksum and verified by the background pass."""
    nb = 128
    monkeypatch.setenv(HOLD, hold)
    r = rig()
    keys = chain_keys(nb, b"term")
    r.store(keys, range(nb))
    assert r.persistence()["seal_backlog_blocks"] == nb
    monkeypatch.delenv(HOLD)
    old = r.d
    watcher = r.restart(signal.SIGTERM)
    p = watcher.stats()["persistence"]
    assert p["adopted_blocks"] == nb, p
    if hold == "always":
        assert p["adopted_unchecked"] == nb, p
        assert f"kept: {nb} blocks for the next daemon to adopt, {nb} of them without their checksum yet" in old.log()
    else:
        assert p["adopted_unchecked"] == 0, p
        assert wait_until(lambda: watcher.stats()["persistence"]["verified_s"] > 0, 30)
        assert watcher.stats()["persistence"]["verify_failures"] == 0
    assert len(r.load_exact(keys, range(nb))) == nb


def test_the_backlog_never_holds_more_than_the_resident_blocks(rig, monkeypatch):
    """A block evicted while its checksum is held back leaves the backlog at its eviction (its record
    is gone: nothing to fill in), so the backlog is bounded by what the pool holds."""
    monkeypatch.setenv(HOLD, "always")
    r = rig(nb=192)  # 256 slots of 256 KiB
    r.store(chain_keys(128, b"first"), range(128))
    r.store(chain_keys(192, b"second"), range(192))  # evicts 64 of the first
    st = r.d.client().stats()
    p = st["persistence"]
    assert st["resident_blocks"] == 256 and p["seal_backlog_blocks"] == 256, p
    assert p["seal_backlog_bytes"] == 256 * (256 << 10) and p["committed_blocks"] == 320, p
