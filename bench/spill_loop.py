"""The event loop's work per evicted block when the disk tier spills it: 64 KiB vs 2 MiB blocks.

Drives a real ``Index`` over a real ``Pool`` with a real ``DiskTier`` (its I/O threads writing a
file under ``--dir``) through ``Tiers``, the daemon's own objects, and times on the loop thread the
index's eviction of a batch of blocks and the spill of its victims (``Spills.settle``, ``freeing``
included), two ways in the same run:

* **deferred** (the spill path): the slot stays out of the pool and the tier's threads write
  straight from it (victims handed over with their slots held, as ``Spills.keep_ahead`` takes them);
* **copied** (the fallback for a STORE's own victims, whose slots it reuses): each block copied out
  of its slot into a staging buffer on the loop.

The ceiling is a plain ``memcpy`` of one block (numpy slice assignment) measured in the same run: the
copied path costs about that much per block, the deferred path must not grow with the block size.

    .venv/bin/python bench/spill_loop.py [--dir /tmp] [--batch 16] [--rounds 5] [--out spill_loop.json]

Prints µs per evicted block for both paths at both sizes, and the ratio 2 MiB / 64 KiB of each.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvoffd.cache.index import Index  # noqa: E402
from kvoffd.cache.tiers.disk import DiskTier  # noqa: E402
from kvoffd.cache.tiers.manager import Tiers  # noqa: E402
from kvoffd.pool.allocator import Pool  # noqa: E402

SIZES = (64 << 10, 2 << 20)


def _store(index: Index, t, keys: list[bytes]) -> None:
    p = index.prepare_store(t, keys)  # into spare slots only: nothing evicted, nothing spilled
    index.add_pending(p)
    index.complete_store(p, True)


async def _one(directory: str, slot: int, batch: int, rounds: int) -> dict:
    nslots = 4 * batch
    pool = Pool(nslots * slot, chunk_bytes=nslots * slot)
    pool.buffer[:] = 7  # real pages, not the zero page
    index = Index(pool, "lru")
    with tempfile.TemporaryDirectory(dir=directory) as d:
        tier = DiskTier(d, 64 * nslots * slot, threads=2)
        tier.start(asyncio.get_running_loop())
        tiers = Tiers(index, [tier], spill_buffer_bytes=nslots * slot)
        spills = tiers.spills
        assert spills is not None
        t = index.table("bench", 0, 1, slot, (slot,))
        out = {"deferred": [], "copied": []}
        seq = 0
        try:
            for r in range(2 * rounds):
                mode = "deferred" if r % 2 else "copied"
                while pool.spare_slots(slot, 1):  # refill the pool: every eviction below spills
                    n = min(batch, pool.spare_slots(slot, batch))
                    _store(index, t, [hashlib.sha256(b"%d" % (seq + i)).digest() for i in range(n)])
                    seq += n
                victims: list = []
                t0 = time.perf_counter()
                got = index.eviction.evict(slot, batch, victims, held=mode == "deferred")
                spills.settle(victims)
                dt = time.perf_counter() - t0
                assert got == batch
                out[mode].append(dt / batch)
                while spills.in_flight:  # let the writes land (and the deferred slots come back)
                    await asyncio.wait(list(spills.in_flight))
                    await asyncio.sleep(0)
            src = np.full(slot, 3, np.uint8)
            dst = np.empty(slot, np.uint8)
            t0 = time.perf_counter()
            for _ in range(batch * rounds):
                dst[:] = src
            memcpy = (time.perf_counter() - t0) / (batch * rounds)
            written = tier.stats().spills
        finally:
            tier.close()
    return {"slot_bytes": slot, "deferred_us": 1e6 * float(np.median(out["deferred"])),
            "copied_us": 1e6 * float(np.median(out["copied"])), "memcpy_us": 1e6 * memcpy,
            "spills_written": written}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    rows = [asyncio.run(_one(a.dir, s, a.batch, a.rounds)) for s in SIZES]
    for r in rows:
        print(f"{r['slot_bytes'] >> 10:>5} KiB: deferred {r['deferred_us']:8.2f} us/block   copied "
              f"{r['copied_us']:8.2f} us/block   memcpy ceiling {r['memcpy_us']:8.2f} us   "
              f"({r['spills_written']} spills written)")
    lo, hi = rows
    res = {"rows": rows, "ratio_2m_64k_deferred": hi["deferred_us"] / lo["deferred_us"],
           "ratio_2m_64k_copied": hi["copied_us"] / lo["copied_us"],
           "copied_over_deferred_2m": hi["copied_us"] / hi["deferred_us"]}
    print(f"2 MiB / 64 KiB per block: deferred {res['ratio_2m_64k_deferred']:.2f}x, copied "
          f"{res['ratio_2m_64k_copied']:.2f}x; at 2 MiB copied / deferred {res['copied_over_deferred_2m']:.1f}x")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
