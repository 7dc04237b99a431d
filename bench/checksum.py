"""Block checksums: GB/s of each candidate on 1, 2, ... threads over 2 MiB blocks of a buffer larger than
the caches (what the pool's sealer and the adoption pass run; issue 29 chose kvoffd/cache/checksum.py's
function from these figures).

Candidates: zlib.crc32 and adler32 (standard library), the numpy sums over the block's 64-bit words
that kvoffd/cache/checksum.py and the disk tier (kvoffd/cache/tiers/diskio.py) use, and, when they are
importable (``--extra-path`` to a ``pip install --target`` folder), the PyPI packages crc32c, xxhash and
isal, measured for comparison only (not dependencies of the daemon).

    .venv/bin/python bench/checksum.py --threads 1,2
    python3 bench/checksum.py --threads 1,8,14 --extra-path /tmp/ck      # H200 host
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def candidates() -> dict[str, Callable[[memoryview], int]]:
    from kvoffd.cache import checksum
    from kvoffd.cache.tiers.diskio import block_crc

    out: dict[str, Callable[[memoryview], int]] = {
        "zlib.crc32": zlib.crc32,
        "zlib.adler32": zlib.adler32,
        "numpy sum u64": lambda b: int(np.frombuffer(b, dtype=np.uint64).sum()),
        "pool block_sum": checksum.block_sum,
        "disk block_crc (sum + weighted sum)": lambda b: block_crc(b"\0" * 32, b),
    }
    try:
        import crc32c

        out["crc32c (PyPI)"] = crc32c.crc32c
    except ImportError:
        pass
    try:
        import xxhash

        out["xxh3_64 (PyPI)"] = xxhash.xxh3_64_intdigest
    except ImportError:
        pass
    try:
        from isal import isal_zlib

        out["isal crc32 (PyPI)"] = isal_zlib.crc32
    except ImportError:
        pass
    return out


def rate(fn: Callable[[memoryview], int], blocks: list[memoryview], threads: int, rounds: int) -> float:
    """GB/s of ``fn`` over every block ``rounds`` times, ``threads`` at once (best of 3)."""
    best = 0.0
    with ThreadPoolExecutor(threads) as ex:
        per = [blocks[i::threads] for i in range(threads)]

        def work(part: list[memoryview]) -> None:
            for _ in range(rounds):
                for b in part:
                    fn(b)

        for _ in range(3):
            t0 = time.perf_counter()
            list(ex.map(work, per))
            dt = time.perf_counter() - t0
            best = max(best, rounds * sum(len(b) for b in blocks) / dt / 1e9)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--block-bytes", type=int, default=2 << 20)
    ap.add_argument("--total-bytes", type=int, default=512 << 20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--extra-path", default="", help="a folder to import the PyPI candidates from")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.extra_path:
        sys.path.append(args.extra_path)
    buf = np.random.default_rng(0).integers(0, 1 << 63, args.total_bytes // 8, dtype=np.uint64).view(np.uint8)
    mv = memoryview(buf)
    blocks = [mv[i:i + args.block_bytes] for i in range(0, len(mv) - args.block_bytes + 1, args.block_bytes)]
    threads = [int(t) for t in args.threads.split(",")]
    rows = {}
    print(f"{'checksum':40s}" + "".join(f"{t:>3d} thr GB/s " for t in threads)
          + f"   ({len(blocks)} blocks of {args.block_bytes} bytes, {os.cpu_count()} CPUs)")
    for name, fn in candidates().items():
        got = [round(rate(fn, blocks, t, args.rounds), 2) for t in threads]
        rows[name] = dict(zip(map(str, threads), got, strict=True))
        print(f"{name:40s}" + "".join(f"{g:12.2f} " for g in got), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"block_bytes": args.block_bytes, "cpus": os.cpu_count(),
                                               "gbps": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
