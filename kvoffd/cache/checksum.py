"""The pool's block checksum: what a slot record holds (kvoffd/cache/restart/records.py), what ``--verify``
and the first LOAD of an adopted block compare with (kvoffd/server/verify.py), what the background pass
of a warm restart checks (kvoffd/cache/restart/verifier.py).

Why not zlib's crc32 (what an older daemon's SEALED records hold, still read): one thread sums 2.1-2.4 GB/s, and stores land
at 44-54 GB/s from one H200 engine, so checksums behind stores would fall further behind every busy
second. Measured (``bench/checksum.py``, GB/s, 2 MiB blocks; an H200 host on 1 / 8 / 14 threads, and
a 2-core VM on one thread, shared with other work; docs/benchmarks.md): zlib.crc32 2.4 / 14 / 22, VM
2.1; crc32c (PyPI, hardware) 9.3 / 50 / 72, VM 8.6-9.7; xxh3_64 (PyPI) 6.9 / 43 / 66, VM 7.8; a numpy
uint64 sum 8.4 / 53 / 70, VM 5.7-8.1; this function, VM 5.5-6.5, within the VM's noise of the plain
sum. All are bound by memory bandwidth past a few threads, so no package clearly wins over numpy,
which the daemon has already (numpy releases the GIL in the reductions: the threads run in parallel).
One block's pass is made by a small C kernel where it is built (kvoffd/cache/_rowsum.c: one call, the
GIL released throughout, the same value; numpy's dozen calls per block cost the cluster tier's
verified GETs a third of the store's speed); numpy stays the reference and the fallback.

What it is: the block's 64-bit words in rows of 4 KiB, each row summed (one pass, vectorised), then the
row sums added plainly and weighted by their row's position, mixed and folded to 32 bits; a length
that is not whole words adds its last bytes' crc32. Any single changed word changes the plain sum; two
changed words of different rows, a stale page, a page written in another's place change the weighted
one (but for the 2^-32 chance of the fold). A crafted collision is not the threat (the files are the
daemon's own, 0600): the checksum catches bytes that changed after their block was committed (a stray
write into the pool file, a memory error ECC did not correct).

Records written by an older daemon hold zlib's crc32 of the slot: ``LEGACY_CRC32`` marks such a value
in ``Entry.checksum`` so that an upgraded daemon still verifies the blocks it adopts from one.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

ROW_WORDS = 512  # 4 KiB: a page
NONE = -1  # Entry.checksum of a block with no checksum yet
LEGACY_CRC32 = 1 << 32  # Entry.checksum = LEGACY_CRC32 | crc32: a record of an older daemon (zlib's crc32)
_MASK = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15
_WEIGHTS: dict[int, np.ndarray] = {}  # rows per block -> 1..rows (one per block size, never written)


try:  # the compiled pass (kvoffd/cache/_rowsum.c, which says why); without it, the same sums in numpy
    from kvoffd.cache import _rowsum
except ImportError:  # pragma: no cover - a build without a C compiler
    _rowsum = None
KERNEL = "c" if _rowsum is not None else "numpy"


def block_sum(data: memoryview | np.ndarray) -> int:
    """The checksum (32 bits) of one block's bytes (any buffer): one C call that releases the GIL for
    the whole pass where the kernel is built, else ``block_sum_numpy`` (the same value)."""
    if _rowsum is None:
        return block_sum_numpy(data)
    raw = np.frombuffer(data, dtype=np.uint8)
    n = len(raw) // 8
    plain, weighted = _rowsum.row_sums(raw[:n * 8])
    return _fold(plain, weighted, zlib.crc32(raw[n * 8:]) if len(raw) % 8 else 0)


def _fold(plain: int, weighted: int, tail: int) -> int:
    x = (plain * _MIX ^ weighted) & _M64
    return (x ^ (x >> 32) ^ tail) & _MASK


def block_sum_numpy(data: memoryview | np.ndarray) -> int:
    """``block_sum`` in numpy: the reference the kernel is tested against, and the fallback (releases
    the GIL in the reductions only)."""
    raw = np.frombuffer(data, dtype=np.uint8)
    n = len(raw) // 8
    tail = zlib.crc32(raw[n * 8:]) if len(raw) % 8 else 0
    words = raw[:n * 8].view(np.uint64)
    rows = n // ROW_WORDS
    sums = words[:rows * ROW_WORDS].reshape(rows, ROW_WORDS).sum(axis=1, dtype=np.uint64)
    rest = int(words[rows * ROW_WORDS:].sum(dtype=np.uint64))
    w = _WEIGHTS.get(rows)
    if w is None:
        w = _WEIGHTS.setdefault(rows, np.arange(1, rows + 1, dtype=np.uint64))
    plain = (int(sums.sum(dtype=np.uint64)) + rest) & _M64
    weighted = (int((sums * w).sum(dtype=np.uint64)) + rest * (rows + 1)) & _M64
    return _fold(plain, weighted, tail)


def block_sums(buf: np.ndarray, offsets: Sequence[int], size: int) -> list[int]:
    """``block_sum`` of each block of ``size`` bytes at ``offsets`` in ``buf`` (the pool, uint8), the
    same values; a run of consecutive blocks is summed in a few numpy calls whatever its length, so
    that the checksum threads hold the GIL (each call's Python around the reductions) a few
    microseconds per run rather than per block: at 44 GB/s of 2 MiB blocks, ~20 us per block would be
    half of the loop's GIL."""
    row = ROW_WORDS * 8
    if size % row:
        return [block_sum(buf[o:o + size]) for o in offsets]
    rows = size // row
    w = _WEIGHTS.get(rows)
    if w is None:
        w = _WEIGHTS.setdefault(rows, np.arange(1, rows + 1, dtype=np.uint64))
    out: list[int] = []
    i, n = 0, len(offsets)
    while i < n:
        j = i + 1
        while j < n and offsets[j] == offsets[j - 1] + size:
            j += 1
        k = j - i
        sums = buf[offsets[i]:offsets[i] + k * size].view(np.uint64).reshape(k, rows, ROW_WORDS).sum(
            axis=2, dtype=np.uint64)
        x = sums.sum(axis=1, dtype=np.uint64) * np.uint64(_MIX) ^ (sums * w).sum(axis=1, dtype=np.uint64)
        out += ((x ^ (x >> np.uint64(32))) & np.uint64(_MASK)).tolist()
        i = j
    return out


def sums_at(buf: np.ndarray, slots: Sequence[int], sizes: Sequence[int]) -> list[int]:
    """``block_sum`` of the block at each ``slots[j]`` of ``sizes[j]`` bytes, any order and sizes: grouped
    by size and summed by runs of neighbouring slots (``block_sums``)."""
    out = [NONE] * len(slots)
    by_size: dict[int, list[int]] = {}
    for j, size in enumerate(sizes):
        by_size.setdefault(size, []).append(j)
    for size, js in by_size.items():
        js.sort(key=slots.__getitem__)
        for j, c in zip(js, block_sums(buf, [slots[j] for j in js], size), strict=True):
            out[j] = c
    return out


def matches(data: memoryview | np.ndarray, want: int) -> bool:
    """Whether ``data`` still has the checksum ``want`` (an ``Entry.checksum``: ours, or an older
    daemon's crc32 marked ``LEGACY_CRC32``). NONE never matches: there is nothing to compare with."""
    if want < 0:
        return False
    if want & LEGACY_CRC32:
        return zlib.crc32(data) == want & _MASK
    return block_sum(data) == want
