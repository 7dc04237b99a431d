"""VMM (``cuda_vmm``) against IPC-handle (``cuda_ipc``) KV memory through one real daemon, same run.

    python bench/vmm.py [--blocks 1024] [--iters 5] [--pieces 8] [--json out.json]

Two stand-in engines (bench/support/vmm_standin.py) with the same Llama-8B-shaped cache (32 layers, 2 MiB
blocks, block-contiguous): one in plain cudaMalloc memory (IPC handle), one in ``--pieces`` cuMemCreate
allocations mapped back to back (POSIX descriptors over the fd socket). Both register with the daemon;
stores and loads of ``--blocks`` scattered blocks alternate between them, byte-exactness is checked
first, and the table prints each path's GB/s, the ratio VMM/IPC, and the pinned-copy ceiling measured
by the engine in the same run. The daemon maps the pieces into one VA range, so the ratio should be 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from support.daemon import BenchDaemon  # noqa: E402
from support.standin import Engine  # noqa: E402
from support.vmm_standin import VmmSpec, vmm_main  # noqa: E402


def _keys(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [bytes(k) for k in rng.integers(0, 256, (n, 32), dtype=np.uint8)]


def _start_daemon(pool: str) -> tuple[BenchDaemon, str]:
    address = f"ipc://{tempfile.mkdtemp(prefix='kvoffd-vmm-')}/kvoffd.sock"
    d = BenchDaemon(address, ["--pool-size", pool, "--backend", "cuda", "--metrics-address", "127.0.0.1:0",
                              # every block admitted: the bench's keys are unchained, which the default
                              # policy refuses into a full pool; this measures the copies, not the policy
                              "--eviction-policy", "lru", "--pool-path", "none"])
    try:
        d.start(30)
    except RuntimeError as e:
        raise SystemExit(f"daemon did not come up:\n{e}") from None
    d.wait_pool(120, pinned=True)  # the pool page-locked: the figures are steady-state
    return d, address


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--cache-blocks", type=int, default=2048)
    ap.add_argument("--pieces", type=int, default=8)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--pool-size", default="8GiB")
    ap.add_argument("--json")
    args = ap.parse_args()
    daemon, address = _start_daemon(args.pool_size)
    engines = {}
    try:
        for kind, alloc in (("ipc", "torch"), ("vmm", "vmm")):
            e = Engine(VmmSpec(alloc=alloc, pieces=args.pieces, num_blocks=args.cache_blocks), target=vmm_main)
            got = e("build")
            assert got["kind"] == f"cuda_{kind}", got
            e("randomize", seed=3)
            e("connect", address=address)
            e("register", engine_id=f"bench-{kind}", namespace=f"bench-{kind}")
            engines[kind] = e
        rng = np.random.default_rng(0)
        ids = rng.permutation(args.cache_blocks)[:args.blocks]
        block_bytes = engines["ipc"].spec.block_bytes
        nbytes = args.blocks * block_bytes
        times: dict[str, dict[str, list[float]]] = {k: {"store": [], "load": []} for k in engines}
        n = 0
        for it in range(args.iters + 1):  # the first round checks bytes and warms up
            for kind, e in engines.items():
                keys = _keys(args.blocks, 100 * it + len(kind))
                for op in ("store", "load"):
                    n += 1
                    if op == "load" and it == 0:
                        e("snapshot", tag="s", ids=ids.tolist())
                        e("scramble")
                    r = e("jobs", engine_id=f"bench-{kind}", jobs=[(op, n, keys, ids.tolist(), -1)], timeout=120)
                    assert all(v[0] for v in r["notices"].values()), (kind, op, r)
                    if it == 0 and op == "load":
                        assert e("compare", tag="s", ids=ids.tolist()), f"{kind}: loaded bytes differ"
                    elif it > 0:
                        times[kind][op].append(r["wall_s"])
        ceiling = engines["ipc"]("ceiling", nbytes=1 << 30, iters=args.iters)
        out: dict[str, float] = {}
        print(f"{args.blocks} blocks of {block_bytes >> 20} MiB, {args.pieces} VMM pieces, median of {args.iters}")
        for op in ("store", "load"):
            for kind in engines:
                out[f"{kind}_{op}_GBps"] = nbytes / statistics.median(times[kind][op]) / 1e9
                print(f"  {kind} {op:<5} {out[f'{kind}_{op}_GBps']:8.1f} GB/s")
            out[f"{op}_ratio_vmm_ipc"] = out[f"vmm_{op}_GBps"] / out[f"ipc_{op}_GBps"]
            print(f"  {op} VMM/IPC ratio {out[f'{op}_ratio_vmm_ipc']:.3f}")
        out.update(ceiling)
        print(f"  ceiling (pinned copies, this run): d2h {ceiling['d2h_GBps']:.1f} GB/s, "
              f"h2d {ceiling['h2d_GBps']:.1f} GB/s")
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
    finally:
        for e in engines.values():
            e.close()
        daemon.stop(timeout=20)
        shutil.rmtree(os.path.dirname(address[len("ipc://"):]), ignore_errors=True)


if __name__ == "__main__":
    main()
