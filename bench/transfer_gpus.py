"""``bench/transfer.py --gpus N`` (issue 20): every GPU of the node through one daemon at once.

One stand-in engine process per GPU (bench/support/standin.py, the Llama-8B-shaped cache of the single-GPU
figures, block-contiguous layout), all registered with one daemon (python -m kvoffd, NUMA placement
``auto``). Measured in the same run, so the figures compare with each other and not with another day:

  * each GPU's ceiling alone (contiguous pinned copies, d2h / h2d / both: the stand-in's ``ceiling``),
    summed over the N GPUs: "N x the single-GPU ceiling";
  * the host's memory bandwidth: a multi-threaded memcpy on each NUMA node (threads bound to the
    node's CPUs, buffers bound to its memory), then on every node at once; given as memory traffic
    (bytes read + bytes written per second), which is what a both-ways offload asks of host memory
    (a store writes a block, a load reads one);
  * store, load and both at once, the N engines each keeping ``--stream`` jobs of ``--blocks`` blocks
    in flight back to back (the steady state of the single-GPU daemon figures), aggregate GB/s over
    the parent's wall clock from the first submit to the last notice;
  * byte-exact: each engine's blocks back into itself, and every engine loading its neighbour's.

With N = 1 nothing here runs: ``bench/transfer.py`` gives today's figures unchanged. N larger than
the GPUs visible is refused before anything starts (``check_gpus``).
"""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from support.daemon import BenchDaemon
from support.standin import Engine, Spec

from kvoffd.pool.mempolicy import Policy, mbind
from kvoffd.pool.topology import bind_thread, read_topology

GiB = 1 << 30
Row = Callable[..., None]


def check_gpus(n: int) -> str:
    """"" when ``n`` GPUs are visible, else the one line that refuses the run."""
    from kvoffd.transfer import cuda_driver as cudart

    try:
        have = cudart.driver().device_count()
    except (cudart.CudaUnavailable, cudart.CudaError) as e:
        return f"--gpus {n}: no CUDA driver here ({e})"
    if have < n:
        return f"--gpus {n}: only {have} GPU(s) visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})"
    return ""


# --- host memory bandwidth ------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeCopy:
    """One node's memcpy: its threads and buffers, and the traffic measured (read + write GB/s)."""

    node: int
    threads: int
    traffic_GBps: float


def _node_buffer(nbytes: int, node: int) -> tuple[mmap.mmap, np.ndarray]:
    """An anonymous mapping bound to ``node`` before its first touch, then touched (so the timing
    measures copies, not page faults)."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(m, dtype=np.uint8)
    mbind(a.ctypes.data, nbytes, node, Policy.BIND)
    a[:: mmap.PAGESIZE] = 1
    return m, a


def _copy_in_threads(jobs: list[tuple[frozenset[int], np.ndarray, np.ndarray]], iters: int) -> float:
    """Seconds (median) for every (cpus, src, dst) job copied at once, one thread each, each thread
    bound to its CPUs (numpy's copy releases the GIL)."""
    go, done = threading.Barrier(len(jobs) + 1), threading.Barrier(len(jobs) + 1)
    stop = threading.Event()

    def work(cpus: frozenset[int], src: np.ndarray, dst: np.ndarray) -> None:
        bind_thread(cpus)
        while True:
            go.wait()
            if stop.is_set():
                return
            np.copyto(dst, src)
            done.wait()

    ts = [threading.Thread(target=work, args=j, daemon=True) for j in jobs]
    for t in ts:
        t.start()
    times = []
    for _ in range(iters + 1):  # the first one warms up
        t0 = time.perf_counter()
        go.wait()
        done.wait()
        times.append(time.perf_counter() - t0)
    stop.set()
    go.wait()
    for t in ts:
        t.join()
    return statistics.median(times[1:])


def host_bandwidth(nbytes_per_node: int, iters: int, row: Row) -> dict[str, Any]:
    """Memory traffic of a multi-threaded memcpy on each NUMA node, then on all at once."""
    topo = read_topology()
    nodes = [n for n in topo.nodes if n.memory and n.cpus]
    maps: list[mmap.mmap] = []
    per_node: dict[int, list[tuple[frozenset[int], np.ndarray, np.ndarray]]] = {}
    out: dict[str, Any] = {"nodes": []}
    try:
        for n in nodes:
            k = max(1, min(len(n.cpus), 16))
            ms, src = _node_buffer(nbytes_per_node, n.node)
            md, dst = _node_buffer(nbytes_per_node, n.node)
            maps += [ms, md]
            step = nbytes_per_node // k
            per_node[n.node] = [(n.cpus, src[i * step:(i + 1) * step], dst[i * step:(i + 1) * step]) for i in range(k)]
        for n in nodes:
            jobs = per_node[n.node]
            s = _copy_in_threads(jobs, iters)
            moved = sum(len(src) for _, src, _ in jobs)
            nc = NodeCopy(n.node, len(jobs), 2 * moved / s / 1e9)
            out["nodes"].append(nc.__dict__)
            row(f"host memory, node {n.node}: memcpy traffic GB/s", f"{nc.traffic_GBps:.1f}",
                f"{nc.threads} threads on its CPUs, {nbytes_per_node / GiB:.2f} GiB bound to it (read + write)")
        if len(nodes) > 1:
            jobs = [j for n in nodes for j in per_node[n.node]]
            s = _copy_in_threads(jobs, iters)
            out["all_GBps"] = 2 * sum(len(src) for _, src, _ in jobs) / s / 1e9
            row("host memory, every node at once: memcpy traffic GB/s", f"{out['all_GBps']:.1f}")
        else:
            out["all_GBps"] = out["nodes"][0]["traffic_GBps"] if out["nodes"] else 0.0
    finally:
        per_node.clear()
        for m in maps:
            try:
                m.close()
            except BufferError:
                pass
    return out


# --- the daemon and N engines ---------------------------------------------------------------------
def _keys(n: int, rng: np.random.Generator) -> list[bytes]:
    return [bytes(k) for k in rng.integers(0, 256, (n, 32), dtype=np.uint8)]


class _Rig:
    """The daemon and one engine per GPU, and the job ids of each."""

    def __init__(self, args: Any, pool_size: int) -> None:
        sock = os.path.join(tempfile.mkdtemp(prefix="kvoffd-bench-gpus-"), "kvoffd.sock")
        self.address = f"ipc://{sock}"
        self.log_path = os.path.join(args.out or tempfile.gettempdir(), "daemon-gpus.log")
        open(self.log_path, "w").close()  # this run's log alone
        self.daemon = BenchDaemon(self.address, ["--pool-size", str(pool_size), "--metrics-address", "127.0.0.1:0",
                                                 "--log-level", "info", "--pool-path", "none"],
                                  log_path=self.log_path).spawn()
        self.proc = self.daemon.proc
        self.engines: list[Engine] = []
        self.job = 0
        self.ns = "bench-gpus"

    def next_job(self) -> int:
        self.job += 1
        return self.job

    def wait_pinned(self) -> dict[str, Any]:
        from kvoffd_client.client import KvoffdClient

        c = KvoffdClient(self.address, heartbeat=False, timeout_s=0.05)
        t0 = time.perf_counter()
        try:
            while not c.connect(0.05):
                if self.proc.poll() is not None or time.perf_counter() - t0 > 30:
                    print(Path(self.log_path).read_text()[-3000:])
                    raise SystemExit("daemon did not come up")
            while True:
                st = c.stats(timeout_s=5)
                if st["pool"]["pinned_bytes"] >= st["pool"]["total_bytes"] or time.perf_counter() - t0 > 300:
                    return st
                time.sleep(0.05)
        finally:
            c.close()

    def all(self, op: str, per: Callable[[int], dict[str, Any]] | None = None) -> tuple[list[Any], float]:
        """Send ``op`` to every engine at once (``per(d)``: its arguments), collect every answer; the
        parent's wall seconds from the first send to the last answer."""
        t0 = time.perf_counter()
        for d, e in enumerate(self.engines):
            e.send(op, **(per(d) if per else {}))
        out = [e.answer(600) for e in self.engines]
        return out, time.perf_counter() - t0

    def close(self) -> None:
        for e in self.engines:
            e.close()
        self.daemon.stop(timeout=20)
        shutil.rmtree(os.path.dirname(self.address[len("ipc://"):]), ignore_errors=True)


def bench_gpus(args: Any, row: Row, results: dict[str, Any]) -> None:
    """The aggregate figures of ``--gpus N`` (see the module docstring)."""
    n_gpu, n, k = args.gpus, args.blocks, args.stream
    spec0 = Spec(layout="blocks", num_blocks=args.cache_blocks)
    need = n_gpu * (k + 1) * n * spec0.block_bytes
    pool_size = max(args.pool_size, -(-int(need * 1.1) // GiB) * GiB)  # every engine's blocks fit: no eviction
    r: dict[str, Any] = results.setdefault("gpus", {"n": n_gpu})
    r["host"] = host_bandwidth(args.host_bytes, args.iters, row)
    rig = _Rig(args, pool_size)
    try:
        st = rig.wait_pinned()
        shards = st["pool"].get("shards", [])
        row(f"{n_gpu} GPUs: daemon pool", f"{pool_size / GiB:.0f} GiB",
            "; ".join(f"shard {s['shard']} node {s['node']} {s['chunks']} chunks" for s in shards))
        rig.engines = [Engine(Spec(layout="blocks", num_blocks=args.cache_blocks, device=d)) for d in range(n_gpu)]
        ceilings = [e("ceiling") for e in rig.engines]  # one GPU at a time: each one's own ceiling
        ceil = {w: sum(c[f"{w}_GBps"] for c in ceilings) for w in ("d2h", "h2d", "both")}
        r["ceiling_per_gpu"], r["ceiling_sum"] = ceilings, ceil
        row(f"{n_gpu} x single-GPU ceiling d2h/h2d/both GB/s", f"{ceil['d2h']:.1f}/{ceil['h2d']:.1f}/{ceil['both']:.1f}",
            "each GPU measured alone, summed")
        rig.all("randomize", lambda d: {"seed": 40 + d})
        rig.all("connect", lambda d: {"address": rig.address})
        rig.all("register", lambda d: {"engine_id": f"gpu{d}", "namespace": rig.ns})
        engines = {e["engine_id"]: e for e in _stats(rig)["engines"]}
        row("engines' NUMA placement", ", ".join(f"gpu{d}: node {engines[f'gpu{d}'].get('numa_node', '?')} shard "
                                                  f"{engines[f'gpu{d}'].get('shard', '?')}" for d in range(n_gpu)))
        rng = np.random.default_rng(13)
        ids = [rng.permutation(args.cache_blocks) for _ in range(n_gpu)]
        a_ids = [np.sort(i[:n]).tolist() for i in ids]
        b_ids = [np.sort(i[n:2 * n]).tolist() for i in ids]
        ka = [_keys(n, rng) for _ in range(n_gpu)]
        r["exact"] = _byte_exact(rig, a_ids, b_ids, ka)
        row(f"{n_gpu} GPUs: byte-exact (own blocks back, and each GPU loading its neighbour's)",
            "yes" if r["exact"] else "NO")
        nbytes = n * spec0.block_bytes
        cross0 = _stats(rig)["counters"].get("cross_numa_load_blocks", 0)  # the neighbour loads above

        def run(jobs_of: Callable[[int], list[tuple]]) -> float:
            outs, wall = rig.all("jobs", lambda d: {"engine_id": f"gpu{d}",
                                                    "jobs": [(kind, rig.next_job(), keys, bids, -1)
                                                             for kind, keys, bids in jobs_of(d)]})
            bad = [o for d, o in enumerate(outs) if len(o["notices"]) != len(jobs_of(d))
                   or not all(v[0] for v in o["notices"].values())]
            if bad:
                raise RuntimeError(f"jobs failed: {bad[0]}")
            return wall

        def clear_then(jobs_of: Callable[[int], list[tuple]], store_first: bool = False) -> float:
            rig.engines[0]("client", method="clear", args=[rig.ns])
            if store_first:
                run(lambda d: [("store", ka[d], a_ids[d])])
            return run(jobs_of)

        def med(fn: Callable[[], float]) -> float:
            fn()
            return statistics.median(fn() for _ in range(args.iters))

        kss = [[_keys(n, rng) for _ in range(k)] for _ in range(n_gpu)]
        t_store = med(lambda: clear_then(lambda d: [("store", kss[d][i], a_ids[d]) for i in range(k)]))
        t_load = med(lambda: clear_then(lambda d: [("load", ka[d], b_ids[d])] * k, store_first=True))
        t_both = med(lambda: clear_then(lambda d: [j for i in range(k) for j in (("store", kss[d][i], a_ids[d]),
                                                                                 ("load", ka[d], b_ids[d]))],
                                        store_first=True))
        total = n_gpu * k * nbytes
        agg = {"store": total / t_store / 1e9, "load": total / t_load / 1e9, "both": 2 * total / t_both / 1e9}
        r["aggregate"] = agg
        host = r["host"].get("all_GBps", 0.0)
        r["vs"] = {"store": agg["store"] / ceil["d2h"], "load": agg["load"] / ceil["h2d"],
                   "both": agg["both"] / min(ceil["both"], host or ceil["both"])}
        note = f"{k} jobs x {n} blocks x {spec0.block_bytes >> 20} MiB per GPU in flight"
        row(f"{n_gpu} GPUs: aggregate store GB/s", f"{agg['store']:.1f}",
            f"{100 * r['vs']['store']:.0f}% of {n_gpu} x d2h ceiling; {note}")
        row(f"{n_gpu} GPUs: aggregate load GB/s", f"{agg['load']:.1f}", f"{100 * r['vs']['load']:.0f}% of {n_gpu} x h2d")
        row(f"{n_gpu} GPUs: aggregate store+load GB/s", f"{agg['both']:.1f}",
            f"{100 * r['vs']['both']:.0f}% of min({n_gpu} x both {ceil['both']:.0f}, host memory {host:.0f})")
        r["cross_numa_load_blocks"] = _stats(rig)["counters"].get("cross_numa_load_blocks", 0) - cross0
        row(f"{n_gpu} GPUs: blocks loaded across NUMA nodes while timed", str(r["cross_numa_load_blocks"]),
            "0 expected: each GPU loads what it stored, on its node's shard")
    finally:
        rig.close()


def _stats(rig: _Rig) -> dict[str, Any]:
    return rig.engines[0]("client", method="stats")


def _byte_exact(rig: _Rig, a_ids: list[list[int]], b_ids: list[list[int]], ka: list[list[bytes]]) -> bool:
    """Each engine stores A, scrambles it, loads it back (== its snapshot); then each loads its
    neighbour's A into its B blocks (== the neighbour's A digests)."""
    n_gpu = len(rig.engines)

    def jobs(kind: str, keys_of: Callable[[int], list[bytes]], ids_of: Callable[[int], list[int]]) -> list[Any]:
        return rig.all("jobs", lambda d: {"engine_id": f"gpu{d}",
                                          "jobs": [(kind, rig.next_job(), keys_of(d), ids_of(d), -1)]})[0]

    rig.all("snapshot", lambda d: {"tag": "a", "ids": a_ids[d]})
    ok = all(all(v[0] for v in o["notices"].values()) for o in jobs("store", lambda d: ka[d], lambda d: a_ids[d]))
    rig.all("scramble", lambda d: {"ids": a_ids[d]})
    jobs("load", lambda d: ka[d], lambda d: a_ids[d])
    back, _ = rig.all("compare", lambda d: {"tag": "a", "ids": a_ids[d]})
    want, _ = rig.all("digest", lambda d: {"ids": a_ids[d]})
    jobs("load", lambda d: ka[(d + 1) % n_gpu], lambda d: b_ids[d])
    got, _ = rig.all("digest", lambda d: {"ids": b_ids[d]})
    other = all(got[d] == want[(d + 1) % n_gpu] for d in range(n_gpu))
    return ok and all(back) and other

