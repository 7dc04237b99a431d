"""CPU path throughput: STORE and LOAD GB/s through a daemon process, next to a plain memcpy.

The engine (this process) holds a vLLM-shaped CPU cache, LBHNC, Llama-8B geometry scaled to the
machine (32 layers, 8 KV heads, 128 head dim, bf16, 16-token blocks: 2 MiB per block, 64 KiB runs).
It stores scattered blocks, then loads them into other blocks, checks the bytes, and times both. The
reference is numpy copying the same number of bytes between two warm buffers in this process.

    .venv/bin/python bench/cpu_transfer.py [--blocks 256] [--repeat 5]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from support.daemon import BenchDaemon  # noqa: E402

from kvoffd_client.client import KvoffdClient  # noqa: E402
from kvoffd_client.memory.cpu_fd import share_cpu_kv_caches  # noqa: E402
from kvoffd_client.memory.layout import describe_layout  # noqa: E402

LAYERS, HEADS, BLOCK, HEAD_DIM = 32, 8, 16, 128


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=256, help="blocks per job (2 MiB each)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    nb = 2 * args.blocks + 8
    per_layer = nb * HEADS * BLOCK * 2 * HEAD_DIM * 2
    raw = torch.zeros(per_layer * LAYERS, dtype=torch.int8)
    kv = {f"l{i}": raw[i * per_layer:(i + 1) * per_layer].view(torch.bfloat16).view(nb, HEADS, BLOCK, 2 * HEAD_DIM)
          for i in range(LAYERS)}
    memory = share_cpu_kv_caches(kv, "bench")
    layout = describe_layout(kv, nb)
    for t in kv.values():  # random bytes everywhere (first touch too)
        t.view(torch.int16).random_()
    block_bytes = LAYERS * HEADS * BLOCK * 2 * HEAD_DIM * 2
    job_bytes = args.blocks * block_bytes
    tmp = tempfile.mkdtemp(prefix="kvoffd-bench-")
    addr = f"ipc://{tmp}/kvoffd.sock"
    pool = f"{(job_bytes * 2) >> 20}MiB"
    daemon = BenchDaemon(addr, ["--pool-size", pool, "--metrics-address", "off", "--log-level", "warning"]).start()
    rng = np.random.default_rng(0)
    try:
        c = KvoffdClient(addr, heartbeat=False, timeout_s=30, job_deadline_s=120)
        assert c.connect(20)
        c.register("bench-0", "bench", 0, 1, memory, layout)
        stores, loads = [], []
        job = 0
        for r in range(args.repeat + 1):
            c.clear("bench")
            ids = rng.permutation(nb)
            src, dst = ids[: args.blocks].tolist(), ids[args.blocks: 2 * args.blocks].tolist()
            keys = [hashlib.sha256(f"{r}-{i}".encode()).digest() for i in range(args.blocks)]
            job += 1
            t0 = time.perf_counter()
            c.submit_store("bench-0", job, keys, src)
            n = c.wait_notices({job}, 120)
            t1 = time.perf_counter()
            assert n and n[0].ok, n
            job += 1
            t2 = time.perf_counter()
            c.submit_load("bench-0", job, keys, dst)
            n = c.wait_notices({job}, 120)
            t3 = time.perf_counter()
            assert n and n[0].ok, n
            for t in (kv["l0"], kv["l31"]):  # byte-exact (first and last layer: the ends of a slot)
                assert torch.equal(t[dst].view(torch.int16), t[src].view(torch.int16)), "bytes differ"
            if r:  # the first round warms the pool's pages
                stores.append(job_bytes / (t1 - t0) / 1e9)
                loads.append(job_bytes / (t3 - t2) / 1e9)
        c.close()
    finally:
        daemon.stop()
        daemon.give_back()  # its pool (at the default place, in /dev/shm) is RAM until removed
        shutil.rmtree(tmp, ignore_errors=True)
    a = np.frombuffer(np.random.bytes(job_bytes), dtype=np.uint8)
    b = np.empty_like(a)
    b[:] = a
    mem = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        np.copyto(b, a)
        mem.append(job_bytes / (time.perf_counter() - t0) / 1e9)
    m, s, ld = statistics.median(mem), statistics.median(stores), statistics.median(loads)
    print(f"\nCPU transfer ({os.cpu_count()} cores): {args.blocks} scattered blocks of {block_bytes >> 20} MiB "
          f"({LAYERS} layers x {block_bytes // LAYERS >> 10} KiB runs), {job_bytes >> 20} MiB per job, "
          f"median of {args.repeat}")
    print(f"{'memcpy (numpy, same bytes)':<30} {m:6.2f} GB/s")
    print(f"{'kvoffd store':<30} {s:6.2f} GB/s  ({s / m:.0%} of memcpy)")
    print(f"{'kvoffd load':<30} {ld:6.2f} GB/s  ({ld / m:.0%} of memcpy)")


if __name__ == "__main__":
    main()
