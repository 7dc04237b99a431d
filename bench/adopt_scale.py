"""How long adoption takes for N sealed records (issue 14: the first hit of a warm restart must come
within a second whatever the pool size): seals N records of one namespace straight into a pool file
(no daemon, no bytes copied), then times what a restarting daemon does before it serves (opening the
pool, ``keeper``: the records' checks, the pool's slabs, the index), the first LOOKUP of the *oldest*
block (whose slice would come last: a LOOKUP takes what it misses into the index at once, and the
first such ask sorts the waiting records' keys), and, where adoption goes on in the background, until
the last block is in the index.

    python bench/adopt_scale.py --records 31000,250000,1000000 --slot 64KiB
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "client")]

from kvoffd.cache.index import Index  # noqa: E402
from kvoffd.cache.restart.keeper import keeper, open_pool  # noqa: E402
from kvoffd.cache.restart.records import NamespaceFacts, RankFacts  # noqa: E402
from kvoffd.config import parse_size  # noqa: E402


def fill(path: str, pool_bytes: int, slot: int, n: int) -> bytes:
    """Seal ``n`` records; returns the oldest one's key."""
    pool, pf = open_pool(pool_bytes, path, "ipc:///nonexistent/x.sock", cold=True)
    index = Index(pool, "lru")
    p = keeper(pf, pool, index)
    ns = p.namespaces.id_for(NamespaceFacts("bench", 1, {0: RankFacts(slot, (slot,))}, 1))
    pool.set_allocated_bytes(pool.nbytes)  # no data is written: the sparse files will do
    slots = np.asarray(pool.alloc(slot, n), dtype=np.int64)
    assert len(slots) == n, f"the pool holds {len(slots)} slots of {slot}, not {n}"
    idx = p.records.index_of(slots, slot)
    keys = np.random.default_rng(1).integers(0, 256, (n, 32), dtype=np.uint8).tobytes()
    stamps = time.time() - np.arange(n, 0, -1, dtype=np.float64) / 1000
    p.records.seal(idx, ns, 0, keys, stamps, np.zeros(n, dtype=np.int64), slot)
    pf.write_header()
    del p, index
    gc.collect()  # their views of the metadata go with them (the lock goes with its last mapping)
    pf.map.close()
    pf.close()
    pool.close()
    return keys[:32]


async def adopt(path: str, pool_bytes: int, oldest: bytes) -> tuple[float, float, float, int]:
    t0 = time.perf_counter()
    pool, pf = open_pool(pool_bytes, path, "ipc:///nonexistent/x.sock", cold=False)
    index = Index(pool, "lru")
    p = keeper(pf, pool, index)
    serving = time.perf_counter() - t0
    p.start(asyncio.get_running_loop())
    t1 = time.perf_counter()
    if index.lookup("bench", oldest).n == 0:  # as the server's LOOKUP does (kvoffd/server/jobs.py)
        p.adopt_asked("bench", oldest)
    assert index.lookup("bench", oldest).n == 1
    first_hit = time.perf_counter() - t1
    while index.resident < p.adopted:
        await asyncio.sleep(0)
    whole = time.perf_counter() - t0
    got = index.resident
    await p.close()
    del p, index
    gc.collect()
    pf.map.close()
    pool.close()
    return serving, first_hit, whole, got


def main() -> None:
    os.environ["KVOFFD_TEST_NO_VERIFY_PASS"] = "1"  # the bytes are not what the records say (none copied)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", default="31000,250000")
    ap.add_argument("--slot", default="64KiB")
    a = ap.parse_args()
    slot = parse_size(a.slot)
    d = tempfile.mkdtemp(prefix="kvoffd-adopt-", dir="/dev/shm")
    try:
        for n in (int(x) for x in a.records.split(",")):
            chunk = 64 << 20
            pool_bytes = -(-n * slot // chunk) * chunk
            path = f"{d}/kvoffd.pool"
            oldest = fill(path, pool_bytes, slot, n)
            serving, first_hit, whole, got = asyncio.run(adopt(path, pool_bytes, oldest))
            print(f"{n:>9} records of {slot >> 10} KiB: serving after {serving:.3f} s, the oldest block's "
                  f"LOOKUP {first_hit * 1e3:.1f} ms later, all in the index after {whole:.3f} s ({got} blocks; "
                  f"{whole / n * 1e6:.1f} us per block)", flush=True)
            for f in os.listdir(d):
                os.unlink(os.path.join(d, f))
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
