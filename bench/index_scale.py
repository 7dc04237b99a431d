"""Index scale: the disk tier's index at 1M, 10M, 100M blocks — memory per block and LOOKUP round trips.

For each size N the bench writes a disk tier directory holding N indexed blocks of 4 KiB (the index
file and its table map, built with the tier's own vectorised insert; the data file stays sparse but
for the blocks asked as disk hits, which are real, checksummed blocks: the bench times the index and
the promotion's work, not the disk), then starts a real daemon on it (``--disk-path``) and measures:

* memory: the index file's bytes and the per-slot arrays per block (what the tier reports as
  ``index_bytes``), and the daemon's RSS minus a daemon without a disk tier, per block (the index is
  a memory-mapped file the daemon reads at start, so its pages are in the RSS);
* LOOKUP round trips through the client library for 1, 64 and 1,024 keys that miss the pool and the
  disk (the whole probe sequence of the disk index runs: the common case of a new prompt) and that
  hit the disk (the answer is sent before the promotion's reads; each key set is asked once), next to
  a bare pyzmq ROUTER echo of the same message bytes, alternating (bench/control_plane.py's floor).
  The control-plane target is <= 1.5x the floor.

    .venv/bin/python bench/index_scale.py [--blocks 1000000,10000000] [--dir DIR] [--iters 300] [--out F]

100M blocks need about 7 GB of RAM and disk for the index (and a few minutes to build): run
``--blocks 100000000`` on a big host.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import msgpack
import numpy as np
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "client"), str(ROOT / "bench")]

from control_plane import echo_server  # noqa: E402  (the same echo floor as the control-plane bench)
from support.daemon import start_daemon  # noqa: E402
from support.engine import ShmEngine, rss_kb  # noqa: E402

from kvoffd.cache.tiers.diskindex import DiskIndex  # noqa: E402
from kvoffd.cache.tiers.diskio import block_crc  # noqa: E402
from kvoffd.server.procfs import cpu_seconds, major_faults, minor_faults  # noqa: E402
from kvoffd_client import protocol as P  # noqa: E402

SLOT = 4096
LAYOUT = [SLOT // 2, SLOT // 2]  # ShmEngine(layers=2): two runs per block
BUILD_BATCH = 1 << 20
HIT_BLOCKS = 250_000  # disk-hit keys with real blocks: (iters + 20) x (1 + 64 + 1,024) at the default iters



def build(directory: str, n: int, seed: int = 1) -> tuple[np.ndarray, int]:
    """A disk tier directory with ``n`` blocks of table 1 (nearly: at full load a few keys find both
    buckets full); returns the first keys (for hits) and the blocks indexed."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "tables.json"), "w") as f:
        json.dump({"tables": [{"tid": 1, "namespace": "scale", "rank": 0, "world_size": 1, "layout": LAYOUT}]}, f)
    t = DiskIndex(n)  # in memory, then saved in one pass (DiskIndex.save says why)
    rng = np.random.default_rng(seed)
    first = None
    for lo in range(0, n, BUILD_BATCH):
        m = min(BUILD_BATCH, n - lo)
        k = rng.integers(0, 2**63, size=(m, 4), dtype=np.int64).astype(np.uint64)
        pos = t.insert(1, k, np.arange(lo, lo + m, dtype=np.uint32), np.zeros(m, dtype=np.uint32))
        if first is None:
            ok = np.flatnonzero(pos >= 0)[:HIT_BLOCKS]  # (a key whose two buckets were full is not indexed)
            first = k[ok].copy()
            _write_hits(directory, t, first, pos[ok], lo + ok)
    t.save(os.path.join(directory, f"index-{SLOT}.kvx"))
    return first, t.used


def _write_hits(directory: str, t: DiskIndex, keys: np.ndarray, pos: np.ndarray, slots: np.ndarray) -> None:
    """Real blocks for the keys the bench asks as disk hits: their bytes in the data file and their
    checksums in the table, so that a promotion reads a good block (the rest of the file stays sparse;
    a block whose checksum failed would be forgotten, a write into the table the real path never does)."""
    crcs = np.zeros(len(keys), dtype=np.uint32)
    fd = os.open(os.path.join(directory, f"blocks-{SLOT}.dat"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        for i, (key, slot) in enumerate(zip(keys, slots.tolist(), strict=True)):
            kb = key.tobytes()
            data = kb * (SLOT // len(kb))
            crcs[i] = block_crc(kb, memoryview(data))
            os.pwrite(fd, data, slot * SLOT)
    finally:
        os.close(fd)
    t.recs["crc"][pos] = crcs


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has spent not idle (user, system, irq...), from /proc/stat."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


def _wait_idle(pid: int, busy: float = 0.1, window: float = 0.5, timeout: float = 120.0) -> float:
    """Seconds until the daemon and the whole machine used less than ``busy`` of a core over ``window``:
    the daemon's start-up work is done, and so is the kernel's after the build (at 100M it frees and
    writes gigabytes: kswapd, kcompactd and the flusher run for a while)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        a, m = cpu_seconds(pid), _machine_busy_s()
        time.sleep(window)
        if cpu_seconds(pid) - a < busy * window and _machine_busy_s() - m < busy * window:
            break
    return time.monotonic() - t0


def _wait_promoted(c, n: int, timeout: float = 60.0) -> None:
    """Until the disk tier has finished ``n`` promotions (read, or failed) in all. Not for the spills
    their evictions caused: waiting for those too (``spills_in_flight`` 0) made the next LOOKUPs slower
    on the 2-core VM, not faster (10M blocks: 1,024 keys 1.44x -> 3.03x the floor), the daemon and the
    machine having idled for longer; a LOOKUP costs most after the VM's cores sleep."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        disk = next(t for t in c.stats()["tiers"] if t["name"] == "disk")
        if disk["promotions"] + disk["promotion_failures"] >= n:
            c.stats()  # one more trip through the loop: the promotions' commit, queued before it, has run
            return
        time.sleep(0.002)
    raise RuntimeError(f"the disk tier did not finish {n} promotions in {timeout} s")


def _anon_huge_kb(pid: int) -> int:
    """The daemon's anonymous memory in transparent huge pages (/proc/PID/smaps_rollup), in KiB."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next((int(line.split()[1]) for line in f if line.startswith("AnonHugePages:")), 0)


def percentiles(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.median(xs), xs[min(len(xs) - 1, int(len(xs) * 0.99))]


def measure(n: int, base: str, iters: int, baseline_kb: int) -> dict:
    directory = os.path.join(base, f"tier-{n}")
    t0 = time.monotonic()
    # Built in a child process: the bench that measures never held the table's gigabytes (at 100M the
    # measuring process's heap and mappings would otherwise be 6 GB larger than a client's).
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
        hit_keys, indexed = ex.submit(build, directory, n).result()
    built_s = time.monotonic() - t0
    os.sync()  # the build's writes (the index, the hit blocks) are not left to write back while it measures
    t0 = time.monotonic()
    d = start_daemon(f"ipc://{base}/d{n}.sock", "512MiB", "--log-level", "warning", "--backend", "cpu",
                     "--disk-path", directory, "--disk-size", str(n * SLOT), ready_s=60 + n / 1e6 * 6)
    start_s = time.monotonic() - t0  # the daemon reads and adopts the whole index before it answers
    settle_s = _wait_idle(d.proc.pid)  # what it still does after answering is not what a LOOKUP costs
    eng = ShmEngine(1024, SLOT, layers=2, tag="index-scale")
    try:
        c = d.client(name="index-scale", timeout_s=60.0)
        c.register("scale-0", "scale", 0, 1, eng.memory, eng.layout)
        tier = next(t for t in c.stats()["tiers"] if t["name"] == "disk")
        assert tier["resident_blocks"] == indexed, tier
        rss = rss_kb(d.proc.pid)
        echo_addr = f"ipc://{base}/echo{n}.sock"
        echo = mp.get_context("spawn").Process(target=echo_server, args=(echo_addr,), daemon=True)
        echo.start()
        floor_sock = zmq.Context.instance().socket(zmq.DEALER)
        floor_sock.connect(echo_addr)
        rows = {}
        used = promoted = 0
        faults0 = major_faults(d.proc.pid)
        if (iters + 20) * (1 + 64 + 1024) > len(hit_keys):
            raise SystemExit(f"--iters {iters} asks more disk hits than the {len(hit_keys)} real blocks written")
        # the misses once more at the end: at 100M on the 2-core VM the first sets measured after the
        # start ran up to 2x slower than the same sets later, with the daemon and the machine idle
        plan = [(kind, k) for k in (1, 64, 1024) for kind in ("miss", "disk_hit")] + [("miss", 1), ("miss", 64)]
        for kind, k in plan:
            label = f"{kind}_{k}" + ("_again" if f"{kind}_{k}" in rows else "")
            floor, lat = [], []
            minor0, cpu0 = minor_faults(d.proc.pid), cpu_seconds(d.proc.pid)
            for i in range(iters + 20):
                if kind == "miss":
                    keys = [hashlib.sha256(b"absent%d-%d-%d-%s" % (k, i, j, label.encode())).digest()
                            for j in range(k)]
                else:
                    keys = [hit_keys[used + j].tobytes() for j in range(k)]
                    used += k
                msg = P.encode(P.Lookup(seq=1, namespace="scale", keys=keys))
                packed = b"".join(keys)
                t1 = time.perf_counter()
                floor_sock.send(msg)
                floor_sock.recv()
                t2 = time.perf_counter()
                r = c.lookup("scale", packed)
                t3 = time.perf_counter()
                assert r.hits == (0 if kind == "miss" else k), (kind, k, r.hits)
                if kind == "disk_hit":  # untimed: the promotions' reads land before the next floor is timed
                    promoted += k  # (back to back, 1,024-block hits outrun a small disk: the pool
                    _wait_promoted(c, promoted)  # fills with reads in flight and later hits are refused)
                if i >= 20:
                    floor.append(t2 - t1)
                    lat.append(t3 - t2)
            f50, _ = percentiles(floor)
            l50, l99 = percentiles(lat)
            rows[label] = {"floor_p50_us": f50 * 1e6, "p50_us": l50 * 1e6, "p99_us": l99 * 1e6,
                           "ratio": l50 / f50,  # the daemon's minor faults and CPU per LOOKUP of the set
                           "minor_faults": (minor_faults(d.proc.pid) - minor0) / (iters + 20),
                           "cpu_us": (cpu_seconds(d.proc.pid) - cpu0) / (iters + 20) * 1e6}
        faults = major_faults(d.proc.pid) - faults0  # pages of the index read back while asked
        huge_kb = _anon_huge_kb(d.proc.pid)  # the fingerprints' transparent huge pages (table.py)
        floor_sock.send(msgpack.packb({"op": "stop", "seq": 0}))
        floor_sock.recv()
        floor_sock.close(0)
        echo.join(5)
        return {"blocks": n, "indexed": indexed, "build_s": round(built_s, 1), "start_s": round(start_s, 1),
                "settle_s": round(settle_s, 1), "major_faults": faults, "anon_huge_kb": huge_kb,
                "index_kernel": tier["notes"].get("index_kernel", ""),
                "index_locked": tier["notes"].get(f"index_locked_{SLOT}", ""),
                "index_bytes": tier["index_bytes"],
                "index_bytes_per_block": tier["index_bytes"] / n,
                "rss_bytes_per_block": (rss - baseline_kb) * 1024 / n, "lookups": rows}
    finally:
        d.stop()
        eng.close()
        shutil.rmtree(directory, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", default="1000000,10000000")
    ap.add_argument("--dir", default="", help="where the index files go (default: a tmp dir)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    base = tempfile.mkdtemp(prefix="kvoffd-index-scale-", dir=a.dir or None)
    try:
        d0 = start_daemon(f"ipc://{base}/base.sock", "512MiB", "--log-level", "warning", "--backend", "cpu")
        eng = ShmEngine(1024, SLOT, layers=2, tag="index-scale")
        c = d0.client(name="index-scale")
        c.register("scale-0", "scale", 0, 1, eng.memory, eng.layout)
        baseline = rss_kb(d0.proc.pid)
        c.close()
        d0.stop()
        eng.close()
        results = []
        for n in [int(x) for x in a.blocks.split(",") if x.strip()]:
            r = measure(n, base, a.iters, baseline)
            results.append(r)
            print(f"{n:>11,} blocks: index {r['index_bytes_per_block']:.1f} B/block (file + slot arrays), "
                  f"daemon RSS +{r['rss_bytes_per_block']:.1f} B/block; built in {r['build_s']} s, daemon up in "
                  f"{r['start_s']} s, idle {r['settle_s']} s later; index locked: {r['index_locked'] or '?'}, "
                  f"kernel: {r['index_kernel'] or '?'}, {r['anon_huge_kb'] >> 10} MiB in huge pages, "
                  f"{r['major_faults']} major faults while asked", flush=True)
            for key, row in r["lookups"].items():
                print(f"    LOOKUP {key:>14}: p50 {row['p50_us']:7.1f} us  p99 {row['p99_us']:7.1f} us  "
                      f"floor {row['floor_p50_us']:6.1f} us  ratio {row['ratio']:.2f}  (daemon per LOOKUP: "
                      f"{row['minor_faults']:.1f} minor faults, {row['cpu_us']:.0f} us CPU)", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if a.out:
        a.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
