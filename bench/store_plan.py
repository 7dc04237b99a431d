"""Loop cost per block of a 1,024-block STORE in the index, by eviction policy (issue 15 point 2).

Times what the event loop does for one STORE besides the copy: the LOOKUP that precedes it (the
policy's ``on_lookup_miss``), ``Index.prepare_store`` (admission, allocation, the victims), ``add_pending``
and ``complete_store``, on a full pool of 65,536 slots, with a real Index and Pool. Each outcome is reported
apart: ``stored`` (1,024 new blocks admitted, 1,024 victims evicted) and ``refused`` (the default
refuses a first request once the pool is full: no slot, no copy).

    PYTHONPATH=.shim python bench/store_plan.py [--policy guarded-doorkeeper]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvoffd.cache.index import Index  # noqa: E402
from kvoffd.cache.policy import DEFAULT_POLICY, POLICIES  # noqa: E402
from kvoffd.pool.allocator import Pool  # noqa: E402

SLOT, CAP, BATCH = 4096, 65536, 1024


def measure(policy: str, rounds: int = 30) -> dict[str, float]:
    """Median ns per block of each outcome."""
    index = Index(Pool(CAP * SLOT), policy)
    t = index.table("ns", 0, 1, SLOT, (SLOT,))
    keys = [hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(CAP + 2 * rounds * BATCH)]

    def store(ks: list[bytes]) -> tuple[float, int, int]:
        t0 = time.perf_counter_ns()
        index.lookup("ns", b"".join(ks))
        p = index.prepare_store(t, ks)
        index.add_pending(p)
        index.complete_store(p, True)
        return (time.perf_counter_ns() - t0) / len(ks), len(p.copy_idx), len(p.refused)

    for i in range(0, CAP, BATCH):  # full, every block asked for twice
        store(keys[i:i + BATCH])
        store(keys[i:i + BATCH])
    out: dict[str, list[float]] = {"stored": [], "refused": []}
    base = CAP
    for r in range(rounds):  # first requests only
        dt, n, ref = store(keys[base + r * BATCH:base + (r + 1) * BATCH])
        (out["refused"] if ref == BATCH else out["stored"] if n == BATCH else []).append(dt)
    base += rounds * BATCH
    for r in range(rounds):  # a first and a second request each
        for _ in range(2):
            dt, n, ref = store(keys[base + r * BATCH:base + (r + 1) * BATCH])
            (out["refused"] if ref == BATCH else out["stored"] if n == BATCH else []).append(dt)
    return {k: statistics.median(v) for k, v in out.items() if v}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policy", action="append", choices=sorted(POLICIES),
                    help=f"repeatable (default: lru and {DEFAULT_POLICY})")
    a = ap.parse_args()
    for policy in a.policy or ["lru", DEFAULT_POLICY]:
        res = measure(policy)
        print(f"{policy}: " + ", ".join(f"{k} {v:,.0f} ns/block" for k, v in res.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
