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

``--busy`` (issue 29) is the restart of a daemon that is busy, not idle: stores at full speed into a
fresh pool file (``--fill`` of it, ``--window`` jobs in flight at a time), the signal ``--lag-ms`` after
the last STORE's notice without waiting for anything (no sealing, no stats), then a new daemon:
acknowledged blocks adopted (each round's chain looked up), spawn to first hit, a sample of every
round loaded back and compared byte for byte, and the store GB/s of the same flood into a daemon with
``--pool-path none``, measured in the same run just before (the cost of the pool file). ``--signal``
takes a list (TERM,KILL: one flood and restart each). ``--engine gpu`` stores from a CUDA stand-in
engine (bench/support/standin.py, 2 MiB blocks of 32 layers) instead of a CPU one (a memfd).

    .venv/bin/python bench/restart.py --pool-size 8GiB                       # 2-core VM
    .venv/bin/python bench/restart.py --pool-size 64GiB --backend auto       # H200 host, with pinning
    .venv/bin/python bench/restart.py --busy --pool-size 2GiB --signal TERM,KILL
    python3 bench/restart.py --busy --pool-size 64GiB --backend auto --engine gpu --signal TERM,KILL
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from support.daemon import BenchDaemon  # noqa: E402
from support.engine import ShmEngine, chain_keys  # noqa: E402

from kvoffd.config import parse_size  # noqa: E402
from kvoffd_client.client import KvoffdClient  # noqa: E402

NS = "restart-bench"


def _spawn(address: str, args: argparse.Namespace, pool_path: str, log: str, *extra: str) -> BenchDaemon:
    """A daemon started, not waited for: the bench times its start itself."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "client"),
                                                       os.environ.get("PYTHONPATH", "")]))
    return BenchDaemon(address, ["--pool-size", args.pool_size, "--pool-path", pool_path, "--metrics-address", "off",
                                 "--backend", args.backend, *extra], log_path=log, env=env).spawn()


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


class _CpuEngine:
    """A CPU engine in this process: its KV in a sealed memfd, ``blocks`` stored from, ``sample`` loaded into."""

    def __init__(self, blocks: int, sample: int, block_bytes: int):
        self.blocks, self.sample = blocks, sample
        self.eng = ShmEngine(blocks + sample, block_bytes, layers=2, tag="busy")
        self.src = chain_keys(blocks, b"content")  # every round stores these bytes under new keys
        self.eng.fill(range(blocks), self.src)
        self.block_bytes = block_bytes
        self.c: KvoffdClient | None = None
        self.loads = 10**9  # the sample loads' job ids (above the floods')

    def attach(self, address: str) -> None:
        self.detach()
        self.c = KvoffdClient(address, timeout_s=30.0, job_deadline_s=600.0)
        assert self.c.connect(30)
        self.c.register("busy-0", NS, 0, 1, self.eng.memory, self.eng.layout)

    def store(self, jobs: list[tuple[int, list[bytes]]]) -> dict[int, int]:
        """Submit the STOREs back to back, wait for every notice: blocks acknowledged per job."""
        for job, keys in jobs:
            self.c.submit_store("busy-0", job, keys, range(len(keys)))
        got = self.c.wait_notices({j for j, _ in jobs}, 600)
        return {n.job_id: len(dict(jobs)[n.job_id]) - len(n.failed) for n in got}

    def lookup(self, keys: list[bytes]) -> int:
        return self.c.lookup(NS, keys).hits

    def exact(self, keys: list[bytes], src: list[int]) -> int:
        """Load ``keys`` (stored from blocks ``src``) into the sample blocks: how many are byte-exact."""
        ids = range(self.blocks, self.blocks + len(keys))
        self.eng.poison(ids)
        self.loads += 1
        self.c.submit_load("busy-0", self.loads, keys, ids)
        self.c.wait_notices({self.loads}, 120)
        return int(self.eng.matches(ids, [self.src[i] for i in src]).sum())

    def detach(self) -> None:
        if self.c is not None:
            self.c.close()
            self.c = None

    def close(self) -> None:
        self.detach()
        self.eng.close()


class _GpuEngine:
    """The CUDA stand-in engine (bench/support/standin.py) in its own process: 2 MiB blocks of 32 layers."""

    def __init__(self, blocks: int, sample: int):
        from support.standin import Engine, Spec

        self.blocks, self.sample = blocks, sample
        self.spec = Spec(layout="blocks", num_blocks=blocks + sample)
        self.block_bytes = self.spec.block_bytes
        self.eng = Engine(self.spec)
        self.eng("randomize", seed=7)
        self.src = self.eng("digest", ids=list(range(blocks)), timeout=600)
        self.attached = False
        self.loads = 10**9

    def attach(self, address: str) -> None:
        self.detach()
        self.eng("connect", address=address, timeout=30.0)
        self.eng("register", engine_id="busy-0", namespace=NS)
        self.attached = True

    def store(self, jobs: list[tuple[int, list[bytes]]]) -> dict[int, int]:
        out = self.eng("jobs", engine_id="busy-0", timeout=600,
                       jobs=[("store", job, keys, list(range(len(keys))), -1) for job, keys in jobs])
        return {int(j): len(dict(jobs)[int(j)]) - len(v[3]) for j, v in out["notices"].items()}

    def lookup(self, keys: list[bytes]) -> int:
        return self.eng("client", method="lookup", args=[NS, keys])["hits"]

    def exact(self, keys: list[bytes], src: list[int]) -> int:
        ids = list(range(self.blocks, self.blocks + len(keys)))
        self.eng("scramble", ids=ids)
        self.loads += 1
        self.eng("jobs", engine_id="busy-0", jobs=[("load", self.loads, keys, ids, -1)], timeout=120)
        got = self.eng("digest", ids=ids)
        return sum(g == self.src[i] for g, i in zip(got, src, strict=True))

    def detach(self) -> None:
        if self.attached:
            self.eng("client", method="close")
            self.attached = False

    def close(self) -> None:
        self.eng.close()


def _flood(eng, address: str, args: argparse.Namespace, salt: bytes) -> tuple[list[list[bytes]], int, float]:
    """Store ``--fill`` of the pool as fast as the daemon takes it, ``--window`` jobs at a time. Returns
    each job's keys (acknowledged whole: a job with a block refused is left out of the adopted ratio's
    denominator only for its refused blocks), the blocks acknowledged, and the store GB/s (first submit
    to last notice)."""
    eng.attach(address)
    total = int(args.fill * parse_size(args.pool_size) // eng.block_bytes)
    rounds, acked, job = [], 0, 0
    t0 = time.monotonic()
    while acked < total and job < 10 * total:
        batch = []
        for _ in range(args.window):
            k = min(eng.blocks, total - acked - sum(len(b) for _, b in batch))
            if k <= 0:
                break
            job += 1
            batch.append((job, chain_keys(k, salt + b"%d" % job)))
        got = eng.store(batch)
        for j, keys in batch:
            if got.get(j, 0) == len(keys):
                rounds.append(keys)
            acked += got.get(j, 0)
    dt = time.monotonic() - t0
    return rounds, acked, acked * eng.block_bytes / dt / 1e9


def _tear_down(procs: list[BenchDaemon], eng: object, shm: str, tmp: str) -> None:
    """Kill what is still running, close the engine, remove the pool files and the socket directory."""
    for pr in procs:
        pr.stop(signal.SIGKILL, 30)
    eng.close()  # type: ignore[attr-defined]
    shutil.rmtree(shm, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)


def busy(args: argparse.Namespace) -> int:
    """``--busy``: the restart of a daemon signalled while it is busy (module docstring)."""
    tmp = tempfile.mkdtemp(prefix="kvoffd-restart-")
    shm = tempfile.mkdtemp(prefix="kvoffd-restart-", dir="/dev/shm")
    log = args.log or f"{tmp}/kvoffd.log"
    eng = _GpuEngine(args.engine_blocks, 64) if args.engine == "gpu" else \
        _CpuEngine(args.engine_blocks, 64, args.block_bytes)
    procs: list[BenchDaemon] = []
    runs = []
    ok = True
    try:
        for n, sig in enumerate(args.signal.split(",")):
            address = f"ipc://{tmp}/d{n}.sock"
            procs.append(_spawn(address, args, "none", log))  # the same flood into private memory first
            _wait_stats(address, lambda s: s["pool"]["capacity_bytes"] == s["pool"]["total_bytes"])
            _, _, none_gbps = _flood(eng, address, args, b"none%d-" % n)
            eng.detach()
            procs[-1].send_signal(signal.SIGTERM)
            procs[-1].wait(120)
            pool_path = f"{shm}/run{n}/kvoffd.pool"
            os.makedirs(os.path.dirname(pool_path), mode=0o700)
            procs.append(_spawn(address, args, pool_path, log, "--cold"))
            _wait_stats(address, lambda s: s["pool"]["capacity_bytes"] == s["pool"]["total_bytes"])
            rounds, acked, file_gbps = _flood(eng, address, args, b"file%d-" % n)
            if not rounds:
                raise RuntimeError(f"no STORE was acknowledged whole; the daemon's log: {log}")
            time.sleep(args.lag_ms / 1000)  # then the signal, waiting for nothing
            procs[-1].send_signal(signal.SIGTERM if sig == "TERM" else signal.SIGKILL)
            t_sig = time.monotonic()
            procs[-1].wait(120)
            stop_s = time.monotonic() - t_sig
            eng.detach()
            t0 = time.monotonic()
            procs.append(_spawn(address, args, pool_path, log))
            first_hit_s = _first_answer(address, rounds[-1][-1], True, t0)
            t_reg = time.monotonic()
            eng.attach(address)  # while the adopted pool is still being pinned
            register_s = time.monotonic() - t_reg
            adopted = sum(eng.lookup(keys) for keys in rounds)
            p = _wait_stats(address, lambda s: s["persistence"]["indexing_blocks"] == 0)["persistence"]
            per = max(1, args.sample // max(1, len(rounds)))
            picks = [(r, i) for r in range(len(rounds)) for i in range(0, len(rounds[r]), max(1, len(rounds[r]) // per))]
            exact = sampled = 0
            for at in range(0, len(picks), eng.sample):
                part = picks[at:at + eng.sample]
                exact += eng.exact([rounds[r][i] for r, i in part], [i for _, i in part])
                sampled += len(part)
            eng.detach()
            procs[-1].send_signal(signal.SIGTERM)
            procs[-1].wait(120)
            shutil.rmtree(os.path.dirname(pool_path), ignore_errors=True)  # its RAM, before the next round's pools
            run = {"signal": sig, "lag_ms": args.lag_ms, "acknowledged_blocks": acked, "adopted_acknowledged": adopted,
                   "adopted_ratio": round(adopted / max(1, acked), 5), "adopted_blocks": p["adopted_blocks"],
                   "adopted_without_checksum": p.get("adopted_unchecked", 0), "stop_s": round(stop_s, 3),
                   "first_hit_s": round(first_hit_s, 3), "register_s": round(register_s, 3),
                   "sample_exact": f"{exact}/{sampled}",
                   "store_gbps_pool_file": round(file_gbps, 2), "store_gbps_private": round(none_gbps, 2),
                   "store_file_over_private": round(file_gbps / max(none_gbps, 1e-9), 3)}
            runs.append(run)
            print(json.dumps(run), flush=True)
            ok &= exact == sampled and adopted == acked
        out = {"pool_size": args.pool_size, "block_bytes": eng.block_bytes, "backend": args.backend,
               "engine": args.engine, "window": args.window, "fill": args.fill, "runs": runs}
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
            shutil.copy(log, Path(args.json).with_suffix(".daemon.log"))
        return 0 if ok else 1
    finally:
        _tear_down(procs, eng, shm, tmp)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pool-size", default="8GiB")
    ap.add_argument("--block-bytes", type=int, default=2 << 20)
    ap.add_argument("--engine-blocks", type=int, default=256)
    ap.add_argument("--backend", default="cpu", help="cpu, or auto/cuda on a GPU host (pinning included)")
    ap.add_argument("--signal", default="TERM", help="TERM or KILL (--busy: a list, TERM,KILL)")
    ap.add_argument("--json", default="", help="write the figures here too")
    ap.add_argument("--busy", action="store_true", help="signal a busy daemon (module docstring)")
    ap.add_argument("--lag-ms", type=float, default=50.0, help="--busy: the signal this long after the last notice")
    ap.add_argument("--fill", type=float, default=0.9, help="--busy: the share of the pool stored")
    ap.add_argument("--window", type=int, default=4, help="--busy: STORE jobs in flight at a time")
    ap.add_argument("--engine", default="cpu", choices=["cpu", "gpu"], help="--busy: the engine's memory")
    ap.add_argument("--sample", type=int, default=512, help="--busy: blocks loaded back and compared")
    ap.add_argument("--log", default="", help="--busy: the daemons' log file (default: in a temporary directory)")
    args = ap.parse_args()
    if args.busy:
        return busy(args)
    if args.signal not in ("TERM", "KILL"):
        ap.error("--signal is TERM or KILL")
    tmp = tempfile.mkdtemp(prefix="kvoffd-restart-")
    shm = tempfile.mkdtemp(prefix="kvoffd-restart-", dir="/dev/shm")
    address, pool_path, log = f"ipc://{tmp}/d.sock", f"{shm}/kvoffd.pool", f"{tmp}/kvoffd.log"
    eng = ShmEngine(args.engine_blocks, args.block_bytes, layers=2, tag="restart")
    procs: list[BenchDaemon] = []
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
        _tear_down(procs, eng, shm, tmp)


if __name__ == "__main__":
    sys.exit(main())
