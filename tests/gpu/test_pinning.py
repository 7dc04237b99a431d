"""Background pinning: capacity grows as regions are pinned; failure degrades to unpinned memory."""

from __future__ import annotations

import time

from kvoffd.pool.allocator import Pool
from kvoffd.transfer.pinning import Pinner


def test_pinner_pins_everything_and_grows_capacity():
    pool = Pool(3 << 30)
    seen: list[int] = []

    def progress(n: int) -> None:
        seen.append(n)
        pool.set_usable_bytes(n)

    pool.set_usable_bytes(0)
    assert pool.capacity_bytes == 0
    p = Pinner(pool, progress, region_bytes=512 << 20, threads=4)
    t = time.perf_counter()
    p.start()
    assert p.wait(120)
    dt = time.perf_counter() - t
    try:
        assert not p.stats.error, p.stats.error
        assert p.stats.pinned_bytes == pool.nbytes == pool.pinned_bytes
        assert seen == sorted(seen) and seen[-1] == pool.nbytes
        assert pool.capacity_bytes == pool.nbytes
        print(f"pinned {pool.nbytes >> 30} GiB in {dt:.2f} s")
    finally:
        p.unpin()
        assert pool.pinned_bytes == 0
        pool.close()


def test_pinner_gives_up_cleanly_without_cuda(monkeypatch):
    from kvoffd.transfer import cuda_driver as cudart

    def boom():
        raise cudart.CudaUnavailable("no driver (test)")

    monkeypatch.setattr(cudart, "driver", boom)
    pool = Pool(256 << 20)
    got: list[int] = []
    p = Pinner(pool, got.append, region_bytes=64 << 20, threads=2)
    p.start()
    assert p.wait(10)
    assert p.stats.error and got == [pool.nbytes]
    pool.close()


def test_no_region_starts_while_a_registration_is_mapping():
    """``Pinner.yielding`` (held by the CUDA backend's attach): while it is held no further region is
    touched or registered, so an engine's mapping waits for the regions in progress only, never for the
    whole pool (the first REGISTER after a warm restart of a 64 GiB pool timed out behind it). The
    gate, not a clock: the count of pinned regions is read while the gate is held."""
    pool = Pool(4 << 30)
    pool.set_usable_bytes(0)
    p = Pinner(pool, pool.set_usable_bytes, region_bytes=256 << 20, threads=2)
    try:
        with p.yielding():
            p.start()
            time.sleep(0.5)  # time for regions to start, were they let
            assert len(p.stats.regions) == 0 and p.stats.touch_s == 0  # taken before any region began
        assert p.wait(120) and p.stats.pinned_bytes == pool.nbytes, p.stats.error
    finally:
        p.stop()
        p.unpin()
        pool.close()
