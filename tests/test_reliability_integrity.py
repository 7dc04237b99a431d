"""Drill: integrity. Corrupt a pool slot behind the daemon's back; ``--verify`` must catch it on load.

The pool is an anonymous shared mapping inside the daemon; the test writes into it through
/proc/<daemon pid>/mem (ptrace rights: root, or the same user with Yama ptrace_scope 0) at
``pool base + slot offset``. The daemon reports both: ``stats["pool"]["base_address"]`` and
``slots`` (rank -> offset) in each ``explain`` entry. Without ``--verify`` the corrupted bytes are served (the control case: it
proves the corruption really lands in the slot, so the ``--verify`` case can fail); with it the LOAD
notice lists the block as failed with code ``checksum_mismatch`` (vLLM recomputes it), the block is
never served, and ``kvoffd_checksum_failures_total`` counts it.
"""

from __future__ import annotations

import os

import pytest
from kvtest import chain_keys
from reliability_util import ShmEngine, metric_value, peek, poke, record

SLOT = 16384
N = 8
BAD = 3


def _slot_address(c, key: bytes) -> int:
    pool = c.stats()["pool"]
    base = pool.get("base_address", pool.get("pool_base"))
    entry = c.explain("integrity", [key])[0]
    slot = entry["slots"]["0"] if "slots" in entry else entry.get("slot")
    if base is None or slot is None:
        pytest.fail(f"the daemon reports no pool base (stats.pool) or slot (explain): {pool}, {entry}")
    return base + slot


def _store_corrupt_load(d) -> tuple[object, ShmEngine, list[bytes], object]:
    pid = d.proc.pid
    eng = ShmEngine(2 * N, SLOT, tag="integrity")
    c = d.client()
    c.register("integrity-0", "integrity", 0, 1, eng.memory, eng.layout)
    keys = chain_keys(N, b"integrity")
    eng.fill(range(N), keys)
    c.submit_store("integrity-0", 1, keys, range(N))
    assert c.wait_notices({1}, 10)[0].ok
    addr = _slot_address(c, keys[BAD]) + SLOT // 2
    before = peek(pid, addr, 16)
    assert before == eng.read([BAD])[0][SLOT // 2:SLOT // 2 + 16].tobytes(), "address is not the block's slot"
    flipped = bytes(b ^ 0xFF for b in before)
    poke(pid, addr, flipped)
    assert peek(pid, addr, 16) == flipped
    eng.poison(range(N, 2 * N))
    c.submit_load("integrity-0", 2, keys, range(N, 2 * N))
    notice = c.wait_notices({2}, 10)
    assert notice, "no notice for the load"
    return notice[0], eng, keys, c


@pytest.mark.skipif(os.geteuid() != 0, reason="writing /proc/<pid>/mem needs ptrace rights")
def test_corrupted_slot_is_served_without_verify(make_daemon):
    """Control: proves the corruption lands in the block's slot (otherwise the next test proves nothing)."""
    d = make_daemon("16MiB", name="noverify")
    n, eng, keys, _ = _store_corrupt_load(d)
    try:
        assert n.ok
        good = eng.matches(range(N, 2 * N), keys)
        assert not good[BAD] and good.sum() == N - 1
    finally:
        eng.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="writing /proc/<pid>/mem needs ptrace rights")
def test_verify_reports_a_corrupted_slot(make_daemon):
    d = make_daemon("16MiB", "--verify", name="verify")
    n, eng, keys, c = _store_corrupt_load(d)
    try:
        assert not n.ok and n.failed == [BAD] and n.code == "checksum_mismatch", n
        ok = [i for i in range(N) if i != BAD]
        assert eng.matches([N + i for i in ok], [keys[i] for i in ok]).all(), "an intact block loaded wrong"
        assert metric_value(d.metrics(), "kvoffd_checksum_failures_total") == 1
        # never served afterwards: the block is dropped (a miss) or fails its check again
        eng.poison([N + BAD])
        c.submit_load("integrity-0", 3, [keys[BAD]], [N + BAD])
        again = c.wait_notices({3}, 10)[0]
        assert not again.ok and again.code in ("checksum_mismatch", "not_resident"), again
        assert not eng.matches([N + BAD], [keys[BAD]])[0] or again.code == "not_resident"
        record("integrity_verify", corrupted_blocks=1, failed=n.failed, code=n.code,
               checksum_failures_total=metric_value(d.metrics(), "kvoffd_checksum_failures_total"),
               second_load=again.code)
    finally:
        eng.close()
