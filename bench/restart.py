"""Warm restart (issue 14): time from daemon start to the first hit and to full adoption.

Fills a persistent pool to ~95% from a stand-in engine (the same engine memory stored under new keys
round after round), waits until every block is sealed, stops the daemon (SIGTERM, or --signal KILL),
starts a new one on the same pool file and measures, from the new process's start:
  * first_hit_s: until a LOOKUP of a stored key hits (the index is rebuilt before the daemon serves);
  * adopted_s: the index rebuild alone (the daemon's own figure);
  * verified_s: until the background pass has checked every adopted block's crc32 ("full adoption");
  * usable_s: until the pool is usable whole (on a GPU host: pinned).
Ceilings measured in the same run: a cold daemon's start to its first LOOKUP answer (first_hit is
compared with it), and crc32 on one thread of this process (the pass's throughput per thread is
compared with it). A sample of blocks is loaded back and checked byte-exact.

    .venv/bin/python bench/restart.py --pool-size 8GiB                       # 2-core VM
    .venv/bin/python bench/restart.py --pool-size 64GiB --backend auto       # H200 host, with pinning
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))

from kvtest import chain_keys  # noqa: E402
from reliability_util import ShmEngine  # noqa: E402

from kvoffd.config import parse_size  # noqa: E402
from kvoffd_client.client import KvoffdClient  # noqa: E402

NS = "restart-bench"


def _spawn(address: str, args: argparse.Namespace, pool_path: str, log: str, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "client"),
                                                       os.environ.get("PYTHONPATH", "")]))
    with open(log, "a") as f:
        return subprocess.Popen([sys.executable, "-m", "kvoffd", "--address", address, "--pool-size", args.pool_size,
                                 "--pool-path", pool_path, "--metrics-address", "off", "--backend", args.backend,
                                 *extra], stdout=subprocess.DEVNULL, stderr=f, env=env, cwd=ROOT)


def _first_answer(address: str, key: bytes, want_hit: bool, t0: float, timeout: float = 120) -> float:
    """Seconds from ``t0`` until a LOOKUP is answered (and, if ``want_hit``, hits)."""
    c = KvoffdClient(address, heartbeat=False, timeout_s=2.0)
    try:
        while time.monotonic() - t0 < timeout:
            if c.connect(0.05):
                r = c.lookup(NS, [key])
                if r.hits or not want_hit:
                    return time.monotonic() - t0
        raise RuntimeError("no answer")
    finally:
        c.close()


def _wait_stats(address: str, pred, timeout: float = 600) -> dict:
    c = KvoffdClient(address, heartbeat=False, timeout_s=10.0)
    try:
        assert c.connect(30)
        deadline = time.monotonic() + timeout
        while True:
            st = c.stats()
            if pred(st) or time.monotonic() > deadline:
                return st
            time.sleep(0.02)
    finally:
        c.close()


def _crc_ceiling() -> float:
    buf = np.random.default_rng(0).integers(0, 255, 256 << 20, dtype=np.uint8)
    t0 = time.perf_counter()
    zlib.crc32(buf)
    return buf.nbytes / (time.perf_counter() - t0) / 1e9


def _fill(address: str, args: argparse.Namespace, eng: ShmEngine) -> tuple[list[bytes], float]:
    """Store ~95% of the pool; returns the first round's keys and the seconds until all were sealed."""
    c = KvoffdClient(address, timeout_s=30.0, job_deadline_s=600.0)
    assert c.connect(30)
    c.register("bench-0", NS, 0, 1, eng.memory, eng.layout)
    total = int(0.95 * parse_size(args.pool_size) // eng.slot_bytes)
    n, job, first = 0, 0, []
    t0 = time.monotonic()
    while n < total:
        k = min(eng.num_blocks, total - n)
        keys = chain_keys(k, f"round{job}".encode())
        if job == 0:
            eng.fill(range(k), keys)
            first = keys
        job += 1
        c.submit_store("bench-0", job, keys, range(k))
        (note,) = c.wait_notices({job}, 600)
        assert note.ok, note
        n += k
        if job == 1:  # the engine's blocks now hold round 0 (checked after the restart); later rounds reuse them
            eng.poison(range(eng.num_blocks), 0x5A)
    st = _wait_stats(address, lambda s: s["persistence"]["sealed_blocks"] >= n)
    assert st["persistence"]["sealed_blocks"] >= n
    c.close()
    return first, time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pool-size", default="8GiB")
    ap.add_argument("--block-bytes", type=int, default=2 << 20)
    ap.add_argument("--engine-blocks", type=int, default=256)
    ap.add_argument("--backend", default="cpu", help="cpu, or auto/cuda on a GPU host (pinning included)")
    ap.add_argument("--signal", default="TERM", choices=["TERM", "KILL"])
    ap.add_argument("--json", default="", help="write the figures here too")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="kvoffd-restart-")
    shm = tempfile.mkdtemp(prefix="kvoffd-restart-", dir="/dev/shm")
    address, pool_path, log = f"ipc://{tmp}/d.sock", f"{shm}/kvoffd.pool", f"{tmp}/kvoffd.log"
    eng = ShmEngine(args.engine_blocks, args.block_bytes, layers=2, tag="restart")
    procs: list[subprocess.Popen] = []
    try:
        ceiling = _crc_ceiling()
        t0 = time.monotonic()
        procs.append(_spawn(address, args, pool_path, log, "--cold"))
        cold_answer_s = _first_answer(address, b"\0" * 32, False, t0)
        _wait_stats(address, lambda s: s["pool"]["capacity_bytes"] == s["pool"]["total_bytes"])
        first, fill_s = _fill(address, args, eng)
        procs[-1].send_signal(signal.SIGTERM if args.signal == "TERM" else signal.SIGKILL)
        procs[-1].wait(120)
        t0 = time.monotonic()
        procs.append(_spawn(address, args, pool_path, log))
        first_hit_s = _first_answer(address, first[0], True, t0)
        st = _wait_stats(address, lambda s: s["persistence"]["verified_s"] > 0
                         and s["pool"]["capacity_bytes"] == s["pool"]["total_bytes"])
        usable_s = time.monotonic() - t0
        p = st["persistence"]
        c = KvoffdClient(address, timeout_s=30.0, job_deadline_s=600.0)
        assert c.connect(30)
        c.register("bench-0", NS, 0, 1, eng.memory, eng.layout)
        sample = min(64, len(first))
        eng.poison(range(sample))
        c.submit_load("bench-0", 1, first[:sample], range(sample))
        (note,) = c.wait_notices({1}, 120)
        exact = int(eng.matches(range(sample), first[:sample]).sum())
        c.close()
        threads = max(1, min(8, (os.cpu_count() or 2) // 2))
        verify_gbps = p["adopted_bytes"] / max(p["verified_s"], 1e-9) / 1e9
        out = {"pool_size": args.pool_size, "block_bytes": args.block_bytes, "backend": args.backend,
               "signal": args.signal, "adopted_blocks": p["adopted_blocks"],
               "adopted_gib": round(p["adopted_bytes"] / (1 << 30), 2), "fill_and_seal_s": round(fill_s, 2),
               "cold_first_answer_s": round(cold_answer_s, 3), "first_hit_s": round(first_hit_s, 3),
               "adopted_s": p["adopt_s"], "verified_s": p["verified_s"], "usable_s": round(usable_s, 3),
               "verify_gbps": round(verify_gbps, 2), "crc32_ceiling_gbps_per_thread": round(ceiling, 2),
               "verify_threads": threads, "sample_loaded_exact": f"{exact}/{sample}",
               "first_hit_over_cold_start": round(first_hit_s / cold_answer_s, 2),
               "verify_per_thread_over_ceiling": round(verify_gbps / threads / ceiling, 2)}
        print(json.dumps(out, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
            shutil.copy(log, Path(args.json).with_suffix(".daemon.log"))  # its start phases and pinning lines
        return 0 if exact == sample and note.ok else 1
    finally:
        for pr in procs:
            if pr.poll() is None:
                pr.send_signal(signal.SIGKILL)
                pr.wait(30)
        eng.close()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
