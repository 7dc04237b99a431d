"""Disk tier throughput: spill and promote GB/s of kvoffd's disk tier next to ``dd`` on the same file system.

The tier (kvoffd/cache/tiers/disk.py) is driven through its interface the way the daemon drives it:
batches of blocks spilled from page-aligned staging buffers (``write``), then read back into
page-aligned pool-like buffers (``read``), every block's checksum verified; its I/O threads do the
``pwritev``/``preadv``. The ceiling is ``dd`` with O_DIRECT (``oflag=direct`` / ``iflag=direct``,
``conv=fsync``) moving the same bytes with the same block size in the same directory, in the same run;
where the file system refuses O_DIRECT (tmpfs) both sides use the page cache and the output says so.
Reads are of data just written: with O_DIRECT that is the device; without it, memory.

    .venv/bin/python bench/disk_tier.py [--dir /mnt/nvme/kvoffd-bench] [--block-bytes 2MiB] [--total 4GiB]
                                        [--batch 64] [--threads 4] [--out disk_tier.json]

Prints GB/s for both and the ratios (tier / dd); the issue's target is >= 0.8.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import mmap
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvoffd.cache.tiers.base import SpillResult, TableRef  # noqa: E402
from kvoffd.cache.tiers.disk import DISK_THREADS, DiskTier  # noqa: E402
from kvoffd.config import parse_size  # noqa: E402


def dd(args: list[str]) -> float:
    """GB/s that dd reports (its last line: '... bytes ... copied, S s, R GB/s')."""
    r = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", r.stderr)
    if not m:
        raise RuntimeError(f"unexpected dd output: {r.stderr}")
    return int(m.group(1)) / float(m.group(2)) / 1e9


def dd_ceiling(directory: str, block: int, count: int, direct: bool) -> tuple[float, float]:
    path = os.path.join(directory, "dd.bin")
    try:
        wflags = ["oflag=direct", "conv=fsync"] if direct else ["conv=fsync"]
        w = dd(["if=/dev/zero", f"of={path}", f"bs={block}", f"count={count}", *wflags])
        r = dd([f"if={path}", "of=/dev/null", f"bs={block}", f"count={count}", *(["iflag=direct"] if direct else [])])
        return w, r
    finally:
        if os.path.exists(path):
            os.unlink(path)


async def tier_run(directory: str, block: int, count: int, batch: int, threads: int) -> dict:
    tier = DiskTier(os.path.join(directory, "tier"), (count + batch) * -(-block // 4096) * 4096, threads)
    loop = asyncio.get_running_loop()
    tier.start(loop)
    ref = TableRef("bench", 0, 1, (block,))
    keys = [hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(count)]
    src = mmap.mmap(-1, batch * block)  # a batch of staging buffers, filled once
    np.frombuffer(src, dtype=np.uint8)[:] = np.random.default_rng(0).integers(0, 256, batch * block, np.uint8)
    sv = memoryview(src)
    bufs = [sv[i * block:(i + 1) * block] for i in range(batch)]
    try:
        t0 = time.perf_counter()
        futs = [tier.write(ref, b"".join(keys[i:i + batch]), bufs[:len(keys[i:i + batch])])
                for i in range(0, count, batch)]
        results = [r for f in await asyncio.gather(*futs) for r in f]
        os.fsync(tier._classes[block].files.fd)  # as dd's conv=fsync: the bytes are on the device
        t_write = time.perf_counter() - t0
        written = sum(r is SpillResult.WRITTEN for r in results)
        dst = mmap.mmap(-1, 4 * batch * block)  # four batches in flight, each into its own buffers
        np.frombuffer(dst, dtype=np.uint8)[:] = 1  # faulted in, as the daemon's pool is
        dv = memoryview(dst)
        dbufs = [dv[i * block:(i + 1) * block] for i in range(4 * batch)]
        ok = 0
        t0 = time.perf_counter()
        for i in range(0, count, batch * 4):
            group = range(i, min(count, i + batch * 4), batch)
            futs = [tier.read(ref, b"".join(keys[j:j + batch]), dbufs[j - i:j - i + len(keys[j:j + batch])])
                    for j in group]
            ok += sum(int(r.sum()) for r in await asyncio.gather(*futs))
        t_read = time.perf_counter() - t0
        st = tier.stats()
        return {"written_blocks": written, "read_ok_blocks": ok, "spill_gbps": written * block / t_write / 1e9,
                "promote_gbps": ok * block / t_read / 1e9, "direct_io": st.notes.get("direct_io"),
                "io_errors": st.io_errors, "checksum_failures": st.checksum_failures}
    finally:
        tier.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="", help="a directory on the file system to measure (default: a tmp dir)")
    ap.add_argument("--block-bytes", default="2MiB")
    ap.add_argument("--total", default="1GiB", help="bytes written and read by each side")
    ap.add_argument("--batch", type=int, default=64, help="blocks per tier call")
    ap.add_argument("--threads", type=int, default=DISK_THREADS, help="the tier's I/O threads (default: the daemon's)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    block, total = parse_size(a.block_bytes), parse_size(a.total)
    count = max(a.batch, total // block)
    directory = tempfile.mkdtemp(prefix="kvoffd-disk-bench-", dir=a.dir or None)
    try:
        t = asyncio.run(tier_run(directory, block, count, a.batch, a.threads))
        direct = t["direct_io"] == "on"
        dw, dr = dd_ceiling(directory, block, count, direct)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    res = {"dir": a.dir or tempfile.gettempdir(), "block_bytes": block, "blocks": count, "threads": a.threads,
           **t, "dd_write_gbps": dw, "dd_read_gbps": dr, "spill_ratio": t["spill_gbps"] / dw,
           "promote_ratio": t["promote_gbps"] / dr, "dd_direct": direct}
    print(f"{res['dir']}: {count} blocks of {block} B, {a.threads} threads, direct I/O {t['direct_io']}")
    print(f"  spill   {t['spill_gbps']:6.2f} GB/s   dd write {dw:6.2f} GB/s   ratio {res['spill_ratio']:.2f}")
    print(f"  promote {t['promote_gbps']:6.2f} GB/s   dd read  {dr:6.2f} GB/s   ratio {res['promote_ratio']:.2f}")
    if t["written_blocks"] != count or t["read_ok_blocks"] != count:
        print(f"  WARNING: {t['written_blocks']} written, {t['read_ok_blocks']} read back verified of {count}")
    if a.out:
        a.out.write_text(json.dumps(res, indent=2) + "\n")
    return 0 if t["read_ok_blocks"] == count else 1


if __name__ == "__main__":
    sys.exit(main())
