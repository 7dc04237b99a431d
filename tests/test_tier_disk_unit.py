"""The disk tier itself (kvoffd/cache/tiers/disk.py) on a real file, driven through its interface on a
real event loop: CLOCK reuse under pressure never hands one slot to two blocks, every block read back
is the one written, and a second tier on the same directory is refused."""

from __future__ import annotations

import asyncio
import hashlib
import mmap

import numpy as np
import pytest

from kvoffd.cache.tiers.base import SpillResult, TableRef
from kvoffd.cache.tiers.disk import DiskTier

SLOT = 4096
REF = TableRef("unit", 0, 1, (SLOT,))


def _blocks(lo: int, n: int) -> tuple[bytes, list[memoryview], list[bytes]]:
    keys = [hashlib.sha256(b"k%d" % i).digest() for i in range(lo, lo + n)]
    buf = mmap.mmap(-1, n * SLOT)
    arr = np.frombuffer(buf, dtype=np.uint8).reshape(n, SLOT)
    for j, k in enumerate(keys):
        arr[j] = np.frombuffer(hashlib.sha256(k).digest() * (SLOT // 32), dtype=np.uint8)
    view = memoryview(buf)
    return b"".join(keys), [view[j * SLOT:(j + 1) * SLOT] for j in range(n)], [bytes(arr[j]) for j in range(n)]


async def _pressure(path: str) -> None:
    tier = DiskTier(path, 64 * SLOT, threads=2)  # 64 slots
    tier.start(asyncio.get_running_loop())
    try:
        keys, src, want = _blocks(0, 64)
        assert all(r is SpillResult.WRITTEN for r in await tier.write(REF, keys, src))
        assert tier.contains(REF, keys).all()  # every reference bit set: the next sweep must wrap
        keys2, src2, want2 = _blocks(64, 48)
        res = await tier.write(REF, keys2, src2)
        assert all(r is SpillResult.WRITTEN for r in res)
        c = tier._classes[SLOT]
        owned = c.owner[c.owner != 0xFFFFFFFF]
        assert len(owned) == len(set(owned.tolist())) == c.table.used == 64
        for k_all, w_all in ((keys, want), (keys2, want2)):
            held = tier.contains(REF, k_all)
            n = len(w_all)
            dst = mmap.mmap(-1, n * SLOT)
            dv = memoryview(dst)
            ok = await tier.read(REF, k_all, [dv[j * SLOT:(j + 1) * SLOT] for j in range(n)])
            assert (ok == held).all()
            for j in np.flatnonzero(ok).tolist():
                assert bytes(dv[j * SLOT:(j + 1) * SLOT]) == w_all[j]
        st = tier.stats()
        assert st.checksum_failures == 0 and st.evictions == 48 and st.resident_blocks == 64
    finally:
        tier.close()


def test_clock_reuse_under_pressure_keeps_every_block_intact(tmp_path):
    asyncio.run(_pressure(str(tmp_path / "disk")))


def test_one_daemon_per_directory(tmp_path):
    a = DiskTier(str(tmp_path / "disk"), 1 << 20)
    try:
        with pytest.raises(OSError, match="in use by another kvoffd"):
            DiskTier(str(tmp_path / "disk"), 1 << 20)
    finally:
        a.close()
