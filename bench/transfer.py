"""GPU <-> pool transfer benchmark (issue 4). One run prints one table; see docs/benchmarks.md.

    python bench/transfer.py                  # backend in this process, engine in a child process
    python bench/transfer.py --daemon         # also through a real daemon (python -m kvoffd)
    python bench/transfer.py --gpus 8         # also all 8 GPUs at once through one daemon (transfer_gpus.py)

The stand-in engine (bench/support/standin.py) allocates a Llama-8B-shaped cache (32 layers, 8 KV heads,
head dim 128, bf16, 16-token blocks: 2 MiB per block) the way vLLM does, in a per-layer (LBHNC) or a
block-contiguous (BLHNC) layout, and exports it through CUDA IPC. Every figure moves 1024 scattered
blocks to or from scattered pool slots; correctness is checked byte-exactly before timing.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from support.standin import Engine, Spec  # noqa: E402

from kvoffd.pool.allocator import Pool  # noqa: E402
from kvoffd.transfer.base import Direction, MappedMemory  # noqa: E402
from kvoffd.transfer.cuda import CudaBackend, copy_runs_one_by_one  # noqa: E402
from kvoffd.transfer.pinning import Pinner  # noqa: E402
from kvoffd_client.protocol import parse_layout  # noqa: E402

GiB = 1 << 30
results: dict[str, Any] = {}
rows: list[tuple[str, str, str]] = []


def row(name: str, value: str, note: str = "") -> None:
    rows.append((name, value, note))
    print(f"  {name:<48} {value:>14}  {note}", flush=True)


def gbps(nbytes: int, s: float) -> float:
    return nbytes / s / 1e9


def new_pool(size: int, mapping: str) -> Pool:
    """A Pool; ``private`` swaps its (untouched) shared mapping for a private one at the same address
    (MAP_FIXED), where transparent huge pages apply even when shmem THP is off. Measurement only."""
    pool = Pool(size)
    if mapping == "private":
        import ctypes
        import mmap as _mm

        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        MAP_FIXED = 0x10
        r = libc.mmap(pool.base_address, pool.nbytes, _mm.PROT_READ | _mm.PROT_WRITE,
                      _mm.MAP_PRIVATE | _mm.MAP_ANONYMOUS | MAP_FIXED, -1, 0)
        assert r == pool.base_address, "remap failed"
    return pool


# --- pinning ---------------------------------------------------------------------------------------
def bench_pinning(size: int, configs: list[dict[str, Any]]) -> None:
    for cfg in configs:
        cfg = dict(cfg)
        mapping = cfg.pop("mapping", "shared")
        pool = new_pool(size, mapping)
        p = Pinner(pool, None, **cfg)
        t = time.perf_counter()
        p.start()
        p.wait()
        dt = time.perf_counter() - t
        ok = p.stats.pinned_bytes == pool.nbytes and not p.stats.error
        tag = ",".join([mapping] + [f"{k}={v}" for k, v in cfg.items()])
        results.setdefault("pinning", []).append({**cfg, "mapping": mapping, "GiBps": pool.nbytes / GiB / dt,
                                                  "touch_s": p.stats.touch_s, "register_s": p.stats.register_s,
                                                  "error": p.stats.error})
        row(f"pin {size // GiB} GiB [{tag}]", f"{pool.nbytes / GiB / dt:.1f} GiB/s",
            f"touch {p.stats.touch_s:.1f} s, register {p.stats.register_s:.1f} s (thread-summed) "
            + ("" if ok else p.stats.error[:60]))
        p.unpin()
        pool.close()


# --- helpers ---------------------------------------------------------------------------------------
async def attach(backend: CudaBackend, eng: Engine, name: str) -> MappedMemory:
    info = eng("export")
    num_blocks, segs = parse_layout(info["layout"])
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, backend.attach, name, info["memory"], None, num_blocks, segs)


async def timed(coro_fn: Any, iters: int) -> float:
    await coro_fn()  # warm-up
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        await coro_fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def pool_bytes(pool: Pool, slots: np.ndarray, slot_bytes: int) -> bytes:
    return b"".join(pool.view(int(s), slot_bytes).tobytes() for s in slots)


async def bench_layout(backend: CudaBackend, pool: Pool, layout: str, args: argparse.Namespace) -> None:
    spec = Spec(layout=layout, num_blocks=args.cache_blocks)
    eng = Engine(spec)
    try:
        eng("randomize", seed=1)
        m = await attach(backend, eng, f"bench-{layout}")
        rng = np.random.default_rng(7)
        n = args.blocks
        ids = rng.permutation(spec.num_blocks)
        a_ids, b_ids = np.sort(ids[:n]), np.sort(ids[n:2 * n])
        slots_all = np.array(pool.alloc(m.slot_bytes, 2 * n), dtype=np.int64)
        assert len(slots_all) == 2 * n, "pool too small"
        slots_all = rng.permutation(slots_all)
        sa, sb = slots_all[:n], slots_all[n:]
        nbytes = n * m.slot_bytes
        S, L = Direction.STORE, Direction.LOAD
        # correctness: store A, check pool bytes, scramble A, load back, compare; then load A into B
        eng("snapshot", tag="a", ids=a_ids.tolist())
        await backend.submit(S, m, a_ids, sa)
        k = [0, n // 2, n - 1]
        want = eng("bytes", ids=a_ids[k].tolist())
        pool_ok = pool_bytes(pool, sa[k], m.slot_bytes) == want
        eng("scramble", ids=a_ids.tolist())
        await backend.submit(L, m, a_ids, sa)
        back_ok = eng("compare", tag="a", ids=a_ids.tolist())
        await backend.submit(L, m, b_ids, sa)
        cross_ok = eng("compare", tag="a", ids=b_ids.tolist())
        exact = pool_ok and back_ok and cross_ok
        row(f"[{layout}] byte-exact store/load", "yes" if exact else "NO",
            f"pool={pool_ok} back={back_ok} other-blocks={cross_ok}")
        eng("randomize", seed=2)
        runs = len(m.segments)

        t_store = await timed(lambda: backend.submit(S, m, a_ids, sa), args.iters)
        t_load = await timed(lambda: backend.submit(L, m, b_ids, sb), args.iters)

        async def both() -> None:
            await asyncio.gather(backend.submit(S, m, a_ids, sa), backend.submit(L, m, b_ids, sb))

        t_both = await timed(both, args.iters)
        r = results.setdefault(layout, {})
        r.update(store=gbps(nbytes, t_store), load=gbps(nbytes, t_load), both=gbps(2 * nbytes, t_both),
                 runs_per_block=runs, exact=exact)
        note = f"{n} blocks x {m.slot_bytes >> 10} KiB, {runs} run(s)/block"
        row(f"[{layout}] store GB/s (backend, 2 procs)", f"{r['store']:.1f}", note)
        row(f"[{layout}] load GB/s", f"{r['load']:.1f}")
        row(f"[{layout}] store+load together GB/s", f"{r['both']:.1f}")
        for spec_s in args.batch:
            br, bb = (int(x) for x in spec_s.split(":"))
            old = backend.tuning
            backend.tuning = dataclasses.replace(old, batch_runs=br, batch_bytes=bb << 20)
            ts = await timed(lambda: backend.submit(S, m, a_ids, sa), args.iters)
            tl = await timed(lambda: backend.submit(L, m, b_ids, sb), args.iters)
            tb = await timed(both, args.iters)
            backend.tuning = old
            r[f"batch{br}:{bb}"] = (gbps(nbytes, ts), gbps(nbytes, tl), gbps(2 * nbytes, tb))
            row(f"[{layout}] batch {br} runs/{bb} MiB: store/load/both", f"{gbps(nbytes, ts):.1f}/"
                f"{gbps(nbytes, tl):.1f}/{gbps(2 * nbytes, tb):.1f}")
        # latency
        for nb in (1, 8, 64):
            lat_s = await timed(lambda nb=nb: backend.submit(S, m, a_ids[:nb], sa[:nb]), 30)
            lat_l = await timed(lambda nb=nb: backend.submit(L, m, b_ids[:nb], sb[:nb]), 30)
            r[f"lat{nb}"] = (lat_s * 1e6, lat_l * 1e6)
            row(f"[{layout}] latency {nb} block(s) store/load", f"{lat_s * 1e6:.0f}/{lat_l * 1e6:.0f} us")
        # per-run cuMemcpyAsync loop (reference): the backend's path for a driver without
        # cuMemcpyBatchAsync, forced on this instance for the measurement only
        backend._copy_runs = lambda drv, stream, _attrs, src, dst, lens: copy_runs_one_by_one(drv, stream, src,
                                                                                             dst, lens)
        t_ls = await timed(lambda: backend.submit(S, m, a_ids, sa), 2)
        t_ll = await timed(lambda: backend.submit(L, m, b_ids, sb), 2)
        del backend._copy_runs
        r["loop"] = (gbps(nbytes, t_ls), gbps(nbytes, t_ll))
        row(f"[{layout}] per-run cuMemcpyAsync loop store/load", f"{r['loop'][0]:.1f}/{r['loop'][1]:.1f}")
        if layout == "blocks" and not args.skip_matmul:
            await bench_matmul(backend, m, eng, a_ids, sa, b_ids, sb)
        if layout == "blocks":
            ceil = eng("ceiling")
            results["ceiling"] = ceil
            row("ceiling: contiguous pinned copy d2h/h2d GB/s", f"{ceil['d2h_GBps']:.1f}/{ceil['h2d_GBps']:.1f}",
                f"both {ceil['both_GBps']:.1f}")
        pool.free(m.slot_bytes, slots_all.tolist())
        await asyncio.get_running_loop().run_in_executor(None, backend.detach, m)
    finally:
        eng.close()


async def bench_matmul(backend: CudaBackend, m: MappedMemory, eng: Engine, a_ids: np.ndarray, sa: np.ndarray,
                       b_ids: np.ndarray, sb: np.ndarray, secs: float = 3.0) -> None:
    """A bf16 matmul's time alone vs while stores and loads run back to back."""
    loop = asyncio.get_running_loop()

    async def phase(busy: bool) -> float:
        await loop.run_in_executor(None, lambda: eng("matmul_start"))
        await asyncio.sleep(0.5)
        end = time.perf_counter() + secs
        moved = 0
        while time.perf_counter() < end:
            if busy:
                await asyncio.gather(backend.submit(Direction.STORE, m, a_ids, sa),
                                     backend.submit(Direction.LOAD, m, b_ids, sb))
                moved += 2 * len(a_ids) * m.slot_bytes
            else:
                await asyncio.sleep(0.05)
        t = (await loop.run_in_executor(None, lambda: eng("matmul_stop")))["times_ms"]
        if busy:
            results["matmul_transfer_GBps"] = moved / secs / 1e9
        return statistics.median(t[2:]) if len(t) > 4 else float("nan")

    alone = await phase(False)
    busy = await phase(True)
    alone2 = await phase(False)
    base = min(alone, alone2)
    slow = (busy / base - 1) * 100
    results["matmul"] = {"alone_ms": base, "busy_ms": busy, "slowdown_pct": slow}
    row("bf16 8192^3 matmul alone / during transfers", f"{base:.3f}/{busy:.3f} ms",
        f"slowdown {slow:+.1f}% (transfers {results.get('matmul_transfer_GBps', 0):.0f} GB/s)")


async def bench_two_gpus(backend: CudaBackend, pool: Pool, args: argparse.Namespace) -> None:
    """Engines on GPU 0 and GPU 1, both storing and loading at once into the one pool."""
    from kvoffd.transfer import cuda_driver as cudart

    if cudart.driver().device_count() < 2:
        row("two GPUs", "skipped", "one GPU visible")
        return
    engs = [Engine(Spec(layout="blocks", num_blocks=args.cache_blocks, device=d)) for d in (0, 1)]
    try:
        ms = []
        for d, e in enumerate(engs):
            e("randomize", seed=20 + d)
            ms.append(await attach(backend, e, f"gpu{d}"))
        n = args.blocks // 2
        rng = np.random.default_rng(5)
        ids = [np.sort(rng.permutation(args.cache_blocks)[:2 * n]) for _ in engs]
        slots = [np.array(pool.alloc(m.slot_bytes, 2 * n), dtype=np.int64) for m in ms]
        S, L = Direction.STORE, Direction.LOAD

        async def all4() -> None:
            await asyncio.gather(*(backend.submit(S, m, i[:n], s[:n]) for m, i, s in zip(ms, ids, slots, strict=True)),
                                 *(backend.submit(L, m, i[n:], s[n:]) for m, i, s in zip(ms, ids, slots, strict=True)))

        async def stores() -> None:
            await asyncio.gather(*(backend.submit(S, m, i[:n], s[:n]) for m, i, s in zip(ms, ids, slots, strict=True)))

        nb = n * ms[0].slot_bytes
        t4 = await timed(all4, args.iters)
        ts = await timed(stores, args.iters)
        results["two_gpus"] = {"store_load_GBps": gbps(4 * nb, t4), "store_GBps": gbps(2 * nb, ts)}
        row("2 GPUs: both store+load at once, aggregate GB/s", f"{gbps(4 * nb, t4):.1f}",
            f"stores only {gbps(2 * nb, ts):.1f}")
        for m, s in zip(ms, slots, strict=True):
            pool.free(m.slot_bytes, s.tolist())
            backend.detach(m)
    finally:
        for e in engs:
            e.close()


async def main_backend(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    pool = new_pool(args.pool_size, args.pool_map)
    t1 = time.perf_counter()
    backend = CudaBackend(pool)
    backend.start()
    ready = time.perf_counter() - t0
    row("backend ready (pool mapped, pinning started)", f"{ready * 1e3:.0f} ms",
        f"pool {args.pool_size // GiB} GiB (Pool() {(t1 - t0) * 1e3:.0f} ms)")
    while backend.pinner and not backend.pinner.stats.finished:
        await asyncio.sleep(0.01)
    s = backend.pinner.stats
    first_usable = time.perf_counter()
    row("pool pinned in background", f"{s.gib_per_s:.1f} GiB/s",
        f"{s.pinned_bytes / GiB:.0f} GiB in {s.seconds:.2f} s {s.error[:50]}")
    results["ready_ms"], results["pin_GiBps"] = ready * 1e3, s.gib_per_s
    del first_usable
    for layout in args.layouts:
        await bench_layout(backend, pool, layout, args)
    if args.two_gpus:
        await bench_two_gpus(backend, pool, args)
    backend.close()
    pool.close()


# --- through the daemon ----------------------------------------------------------------------------
def _keys(n: int, rng: np.random.Generator) -> list[bytes]:
    return [bytes(k) for k in rng.integers(0, 256, (n, 32), dtype=np.uint8)]


class _Jobs:
    """Job ids for one engine."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> int:
        self.n += 1
        return self.n


def bench_daemon(args: argparse.Namespace) -> None:
    import shutil
    import tempfile

    from support.daemon import BenchDaemon

    sock = os.path.join(tempfile.mkdtemp(prefix="kvoffd-bench-"), "kvoffd.sock")  # a private (0700) directory
    address = f"ipc://{sock}"
    log_path = os.path.join(args.out or tempfile.gettempdir(), "daemon.log")
    open(log_path, "w").close()  # this run's log alone
    daemon = BenchDaemon(address, ["--pool-size", str(args.pool_size), "--metrics-address", "127.0.0.1:0",
                                   "--log-level", "info"], log_path=log_path)
    t0 = time.perf_counter()
    daemon.spawn()  # the start is timed here, to the first answer
    try:
        _measure_daemon(args, daemon.proc, address, log_path, t0)
    finally:
        daemon.stop(timeout=20)
        daemon.give_back()  # its pool (the default place, in /dev/shm) is RAM until removed: the bench leaves none
        shutil.rmtree(os.path.dirname(sock), ignore_errors=True)


def _measure_daemon(args: argparse.Namespace, proc, address: str, log_path: str, t0: float) -> None:
    from kvoffd_client.client import KvoffdClient

    c = KvoffdClient(address, heartbeat=False, timeout_s=0.05)
    ready = None
    while time.perf_counter() - t0 < 30 and proc.poll() is None:
        if c.connect(0.02):
            ready = time.perf_counter() - t0
            break
    if ready is None:
        print(Path(log_path).read_text()[-3000:])
        raise SystemExit("daemon did not come up")
    row("daemon ready (spawn -> HELLO answered)", f"{ready * 1e3:.0f} ms", f"pool {args.pool_size // GiB} GiB")
    results["daemon_ready_ms"] = ready * 1e3
    while True:
        st = c.stats(timeout_s=5)
        if st["pool"]["pinned_bytes"] >= st["pool"]["total_bytes"]:
            break
        if time.perf_counter() - t0 > 120:
            break
        time.sleep(0.02)
    pin = [b.get("pinning", {}) for b in st["daemon"]["backends"] if b.get("name") == "cuda"]
    if pin:
        row("daemon pool pinned", f"{pin[0].get('gib_per_s', 0):.1f} GiB/s",
            f"{st['pool']['pinned_bytes'] / GiB:.0f} GiB; ready-to-pinned {time.perf_counter() - t0:.2f} s")
        results["daemon_pin_GiBps"] = pin[0].get("gib_per_s")
    c.close()
    for layout in args.layouts:
        _daemon_layout(address, layout, args)


def _daemon_layout(address: str, layout: str, args: argparse.Namespace) -> None:
    spec = Spec(layout=layout, num_blocks=args.cache_blocks)
    eng = Engine(spec)
    jid = _Jobs()
    rng = np.random.default_rng(11)
    n = args.blocks
    try:
        eng("randomize", seed=3)
        eng("connect", address=address)
        ns, eid = f"bench-{layout}", f"eng-{layout}"
        slot = eng("register", engine_id=eid, namespace=ns)
        ids = rng.permutation(spec.num_blocks)
        a_ids, b_ids = np.sort(ids[:n]).tolist(), np.sort(ids[n:2 * n]).tolist()
        ka = _keys(n, rng)

        def jobs(*js: tuple) -> dict[str, Any]:
            out = eng("jobs", engine_id=eid, jobs=[(k, jid(), keys, bids, -1) for k, keys, bids in js])
            bad = {j: v for j, v in out["notices"].items() if not v[0]}
            if bad or len(out["notices"]) != len(js):
                raise RuntimeError(f"jobs failed: {bad or out}")
            return out

        eng("snapshot", tag="a", ids=a_ids)
        jobs(("store", ka, a_ids))
        eng("scramble", ids=a_ids)
        hits = eng("client", method="lookup", args=[ns, ka])["hits"]
        jobs(("load", ka, a_ids))
        back = eng("compare", tag="a", ids=a_ids)
        jobs(("load", ka, b_ids))
        other = eng("compare", tag="a", ids=b_ids)
        exact = hits == n and back and other
        row(f"[{layout}] daemon: byte-exact store/lookup/load", "yes" if exact else "NO",
            f"slot {slot >> 10} KiB, hits {hits}/{n}, back={back} other-blocks={other}")
        nbytes = n * spec.block_bytes

        def med(fn: Any, iters: int) -> float:
            fn()
            return statistics.median(fn() for _ in range(iters))

        def clear_then(*js: tuple) -> float:
            eng("client", method="clear", args=[ns])
            if js[-1][0] == "load":
                jobs(("store", ka, a_ids))
            return jobs(*js)["wall_s"]

        t_store = med(lambda: clear_then(("store", ka, a_ids)), args.iters)
        t_load = med(lambda: jobs(("load", ka, b_ids))["wall_s"], args.iters)
        t_both = med(lambda: clear_then(("store", _keys(n, rng), a_ids), ("load", ka, b_ids)), args.iters)
        q = n // 4  # the same blocks as 4 jobs in flight at once (a step's batch split across requests)
        t_store4 = med(lambda: clear_then(*[("store", ka[i * q:(i + 1) * q], a_ids[i * q:(i + 1) * q])
                                             for i in range(4)]), args.iters)
        t_load4 = med(lambda: jobs(*[("load", ka[i * q:(i + 1) * q], b_ids[i * q:(i + 1) * q])
                                     for i in range(4)])["wall_s"], args.iters)
        # Steady state: k jobs of n blocks submitted back to back, as an engine's steps keep the daemon
        # busy; one job's round trip (send, plan, notice) then overlaps another's DMA.
        k = args.stream
        kss = [_keys(n, rng) for _ in range(k)]
        t_sstore = med(lambda: clear_then(*[("store", kss[i], a_ids) for i in range(k)]), args.iters)
        t_sload = med(lambda: clear_then(*[("load", ka, b_ids)] * k), args.iters)
        t_sboth = med(lambda: clear_then(*[j for i in range(k) for j in (("store", kss[i], a_ids), ("load", ka, b_ids))]),
                      args.iters)
        r = results.setdefault(f"daemon_{layout}", {})
        r.update(store=gbps(nbytes, t_store), load=gbps(nbytes, t_load), both=gbps(2 * nbytes, t_both), exact=exact,
                 store4=gbps(nbytes, t_store4), load4=gbps(nbytes, t_load4), stream_store=gbps(k * nbytes, t_sstore),
                 stream_load=gbps(k * nbytes, t_sload), stream_both=gbps(2 * k * nbytes, t_sboth))
        row(f"[{layout}] daemon 4 jobs x {q} blocks in flight store/load", f"{r['store4']:.1f}/{r['load4']:.1f}")
        row(f"[{layout}] daemon store GB/s (one job, submit -> notice)", f"{r['store']:.1f}", f"{n} scattered blocks")
        row(f"[{layout}] daemon load GB/s (one job)", f"{r['load']:.1f}")
        row(f"[{layout}] daemon store+load together GB/s (one job each)", f"{r['both']:.1f}")
        row(f"[{layout}] daemon steady state store/load/both GB/s",
            f"{r['stream_store']:.1f}/{r['stream_load']:.1f}/{r['stream_both']:.1f}",
            f"{k} jobs x {n} blocks back to back (each)")
        eng("client", method="clear", args=[ns])
        jobs(("store", ka, a_ids))
        for nb in (1, 8, 64):
            ls = med(lambda nb=nb: jobs(("store", _keys(nb, rng), a_ids[:nb]))["wall_s"], 20)
            ll = med(lambda nb=nb: jobs(("load", ka[:nb], b_ids[:nb]))["wall_s"], 20)
            r[f"lat{nb}"] = (ls * 1e6, ll * 1e6)
            row(f"[{layout}] daemon latency {nb} block(s) store/load", f"{ls * 1e6:.0f}/{ll * 1e6:.0f} us",
                "submit -> notice")
    finally:
        eng.close()


def parse_size(s: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    s = s.strip().lower().removesuffix("ib").removesuffix("b")
    return int(float(s[:-1]) * units[s[-1]]) if s[-1] in units else int(s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool-size", type=parse_size, default=12 * GiB)
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--cache-blocks", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--stream", type=int, default=3, help="jobs back to back for the daemon's steady-state figures")
    ap.add_argument("--layouts", nargs="+", default=["blocks", "layers"])
    ap.add_argument("--batch", nargs="*", default=["4096:4096", "512:256"],
                    help="runs:MiB per cuMemcpyBatchAsync call, each timed")
    ap.add_argument("--pin-size", type=parse_size, default=16 * GiB)
    ap.add_argument("--pin-configs", default="default",
                    help="'default', 'none', or a JSON list of Pinner keyword dicts")
    ap.add_argument("--skip-matmul", action="store_true")
    ap.add_argument("--pool-map", default="shared", choices=["shared", "private"])
    ap.add_argument("--two-gpus", action="store_true", help="also GPU 0 and GPU 1 at once (needs 2 GPUs)")
    ap.add_argument("--gpus", type=int, default=None,
                    help="also store/load on this many GPUs at once through one daemon, against N x the per-GPU "
                         "ceiling and the host memory bandwidth, all measured in this run (bench/transfer_gpus.py; "
                         "1: today's figures only). Refused when fewer GPUs are visible")
    ap.add_argument("--gpus-only", action="store_true", help="with --gpus N: only the N-GPU figures")
    ap.add_argument("--host-bytes", type=parse_size, default=GiB,
                    help="bytes per NUMA node copied by the host memory bandwidth figure (default 1GiB)")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--daemon", action="store_true", help="also measure through a real daemon (python -m kvoffd)")
    ap.add_argument("--daemon-only", action="store_true")
    ap.add_argument("--out", help="folder for the daemon log")
    args = ap.parse_args()
    if args.gpus is not None:
        from transfer_gpus import check_gpus

        if args.gpus < 1:
            ap.error("--gpus takes a number of GPUs, at least 1")
        why = check_gpus(args.gpus)
        if why:
            print(why, file=sys.stderr)
            raise SystemExit(2)
    multi = (args.gpus or 1) > 1
    print("kvoffd transfer benchmark", flush=True)
    if multi and args.gpus_only:
        args.pin_configs, args.daemon, args.daemon_only = "none", False, True
        args.layouts = []
    if args.pin_configs != "none" and not args.daemon_only:
        cfgs = ([{"threads": 4}, {"threads": 8}, {"threads": 4}]
                if args.pin_configs == "default" else json.loads(args.pin_configs))
        bench_pinning(args.pin_size, cfgs)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass  # uvloop is optional for the bench: asyncio's own loop measures the same copies
    if not args.daemon_only:
        asyncio.run(main_backend(args))
    if (args.daemon or args.daemon_only) and args.layouts:
        bench_daemon(args)
    if multi:
        from transfer_gpus import bench_gpus

        bench_gpus(args, row, results)
    print("\n| figure | value | note |\n|---|---|---|")
    for name, value, note in rows:
        print(f"| {name} | {value} | {note} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
