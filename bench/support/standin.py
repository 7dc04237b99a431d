"""A stand-in vLLM worker for the GPU benches (bench/transfer.py) and tests (tests/gpu), run in its own process.

It allocates the KV cache the way vLLM does (vllm-api.md §4.1: one int8 buffer, per-layer strided
views [B, H, N, 2*D]) in either a layer-major (LBHNC, per-layer runs) or a block-outermost (BLHNC,
one run per block) layout, exports it with kvoffd_client.memory.cuda_ipc, and obeys commands sent
over a multiprocessing pipe. It either talks to the daemon itself (``client`` commands, through
KvoffdClient) or lets its parent drive a backend directly.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any


@dataclass
class Spec:
    layout: str = "blocks"  # "blocks" (BLHNC) or "layers" (LBHNC)
    num_blocks: int = 2048
    layers: int = 32
    heads: int = 8
    tokens: int = 16
    head_dim: int = 128
    device: int = 0
    events: int = 64

    @property
    def page(self) -> int:  # bytes of one (layer, block): H*N*(K|V)*bf16
        return self.heads * self.tokens * 2 * self.head_dim * 2

    @property
    def block_bytes(self) -> int:
        return self.layers * self.page


def make_kv(spec: Spec, buf: Any = None) -> tuple[Any, dict[str, Any]]:
    """(int8 backing buffer, {layer name: bf16 view [B, H, N, 2D]}) as vLLM lays them out (over ``buf``,
    an int8 tensor of L*B*page bytes, when given)."""
    import torch

    L, B, H, N, C = spec.layers, spec.num_blocks, spec.heads, spec.tokens, 2 * spec.head_dim
    if buf is None:
        buf = torch.zeros(L * B * spec.page, dtype=torch.int8, device=f"cuda:{spec.device}")
    el = buf.view(torch.bfloat16)
    page_el = spec.page // 2
    views = {}
    for layer in range(L):
        if spec.layout == "layers":  # L,B,H,N,C
            off, bstride = layer * B * page_el, page_el
        else:  # B,L,H,N,C: all layers of a block are one run
            off, bstride = layer * page_el, L * page_el
        views[f"model.layers.{layer}.self_attn.attn"] = torch.as_strided(
            el, (B, H, N, C), (bstride, N * C, C, 1), off)
    return buf, views


def block_view(spec: Spec, views: dict[str, Any], b: int) -> list[Any]:
    return [v[b] for v in views.values()]


def engine_main(conn: Any, spec: Spec, address: str | None = None) -> None:
    """Serve commands until 'exit' (or the pipe closes). Every reply is ('ok', value) or ('err', text)."""
    import torch

    torch.cuda.set_device(spec.device)
    from kvoffd_client.memory.cuda_ipc import export_kv_caches

    buf, views = make_kv(spec)
    names = list(views)
    exp = export_kv_caches(views, spec.num_blocks, num_events=spec.events)
    saved: dict[int, Any] = {}
    client = None
    mm: dict[str, Any] = {}

    def blocks(ids: list[int]) -> Any:
        """[n, L, page] int8 copy of blocks (gathered with torch; tests only)."""
        out = torch.empty((len(ids), spec.layers, spec.page), dtype=torch.int8, device=buf.device)
        for j, name in enumerate(names):
            v = views[name].view(torch.int8).reshape(spec.num_blocks, -1)
            out[:, j] = v[torch.tensor(ids, device=buf.device)]
        return out

    def write_blocks(ids: list[int], data: Any) -> None:
        idx = torch.tensor(ids, device=buf.device)
        for j, name in enumerate(names):
            v = views[name].view(torch.int8).reshape(spec.num_blocks, -1)
            v[idx] = data[:, j]

    def cmd(op: str, a: dict[str, Any]) -> Any:
        nonlocal client
        if op == "export":
            return {"memory": exp.memory.spec, "layout": exp.layout, "block_bytes": spec.block_bytes,
                    "pid": os.getpid()}
        if op == "randomize":
            g = torch.Generator(device=buf.device).manual_seed(a.get("seed", 0))
            buf.view(torch.int32).random_(generator=g)
            torch.cuda.synchronize()
            return True
        if op == "snapshot":  # remember blocks' bytes under a tag
            saved[a["tag"]] = blocks(a["ids"])
            return True
        if op == "scramble":
            ids = a["ids"]
            write_blocks(ids, torch.randint(-128, 127, (len(ids), spec.layers, spec.page), dtype=torch.int8,
                                            device=buf.device))
            torch.cuda.synchronize()
            return True
        if op == "compare":  # blocks now == snapshot tag (optionally of other block ids)
            got = blocks(a["ids"])
            want = saved[a["tag"]]
            return bool(torch.equal(got, want))
        if op == "digest":
            data = blocks(a["ids"]).cpu().numpy()
            return [hashlib.sha1(data[i].tobytes()).hexdigest() for i in range(len(a["ids"]))]
        if op == "bytes":
            return blocks(a["ids"]).cpu().numpy().tobytes()
        if op == "write_late":  # a slow kernel, then new bytes, then the ring event: the ordering test
            torch.cuda._sleep(a.get("cycles", 2_000_000))
            ids = torch.tensor(a["ids"], device=buf.device)
            for name in names:
                views[name].view(torch.int8).reshape(spec.num_blocks, -1)[ids] = a["value"]
            return exp.ring.record()
        if op == "record":
            if a.get("sleep_cycles"):
                torch.cuda._sleep(a["sleep_cycles"])
            return exp.ring.record()
        if op == "release":
            exp.ring.release(a["event"])
            return True
        if op == "sync":
            torch.cuda.synchronize()
            return True
        if op == "ceiling":
            return ceiling(buf, a.get("nbytes", 2 << 30), a.get("iters", 5))
        if op == "matmul_start":
            mm.clear()
            mm["stop"] = threading.Event()
            mm["thread"] = threading.Thread(target=matmul_loop, args=(spec.device, mm), daemon=True)
            mm["thread"].start()
            return True
        if op == "matmul_stop":
            mm["stop"].set()
            mm["thread"].join()
            return {"times_ms": mm["times"]}
        if op == "connect":
            from kvoffd_client.client import KvoffdClient

            client = KvoffdClient(a["address"], name="standin")
            if not client.connect(a.get("timeout", 10.0)):
                raise RuntimeError("daemon not reachable")
            return True
        if op == "register":
            reply = client.register(a["engine_id"], a["namespace"], a.get("rank", 0), a.get("world_size", 1),
                                    exp.memory, exp.layout, replicas=a.get("replicas", 1))
            return getattr(reply, "slot_bytes", reply)
        if op == "jobs":  # submit jobs, wait for notices: [(kind, job_id, keys, ids, event)] -> {job_id: ok}
            return run_jobs(client, exp, a)
        if op == "client":  # a plain client call by name (lookup, clear, stats, ...)
            return _plain(getattr(client, a["method"])(*a.get("args", []), **a.get("kwargs", {})))
        raise ValueError(f"unknown op {op}")

    serve(conn, cmd)


def serve(conn: Any, cmd: Any) -> None:
    """Answer the parent's commands with ``cmd(op, args)`` until 'exit' (or the pipe closes)."""
    while True:
        try:
            op, a = conn.recv()
        except (EOFError, OSError):
            return
        if op == "exit":
            conn.send(("ok", True))
            return
        try:
            conn.send(("ok", cmd(op, a)))
        except Exception:  # noqa: BLE001 - report to the parent
            conn.send(("err", traceback.format_exc()))


def _plain(v: Any) -> Any:
    if hasattr(v, "to_wire"):
        return v.to_wire()
    return v


def run_jobs(client: Any, exp: Any, a: dict[str, Any]) -> dict[str, Any]:
    """Submit jobs back to back and wait for all notices; returns per-job outcome and wall time."""
    t0 = time.perf_counter()
    ids = set()
    for kind, job_id, keys, block_ids, event in a["jobs"]:
        if kind == "store":
            client.submit_store(a["engine_id"], job_id, keys, block_ids, event=event)
        else:
            client.submit_load(a["engine_id"], job_id, keys, block_ids, lease_id=a.get("lease_id", 0),
                               event=event)
        ids.add(job_id)
    got = client.wait_notices(ids, a.get("timeout", 30.0))
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "notices": {n.job_id: (n.ok, n.code, n.message, list(n.failed)) for n in got}}


def ceiling(buf: Any, nbytes: int, iters: int) -> dict[str, float]:
    """Contiguous pinned<->GPU copy GB/s, each way and both at once (the PCIe ceiling)."""
    import torch

    dev = buf.device
    n = min(nbytes, buf.numel() // 2)
    host_a = torch.empty(n, dtype=torch.int8, pin_memory=True)
    host_b = torch.empty(n, dtype=torch.int8, pin_memory=True)
    g_a, g_b = buf[:n], buf[n:2 * n]
    s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

    def timed(fn: Any) -> float:
        fn()
        torch.cuda.synchronize()
        best = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            best.append(time.perf_counter() - t)
        best.sort()
        return best[len(best) // 2]

    def d2h() -> None:
        with torch.cuda.stream(s1):
            host_a.copy_(g_a, non_blocking=True)

    def h2d() -> None:
        with torch.cuda.stream(s2):
            g_b.copy_(host_b, non_blocking=True)

    def both() -> None:
        d2h()
        h2d()

    out = {"d2h_GBps": n / timed(d2h) / 1e9, "h2d_GBps": n / timed(h2d) / 1e9, "both_GBps": 2 * n / timed(both) / 1e9}
    return out


def matmul_loop(device: int, mm: dict[str, Any]) -> None:
    """bf16 8192^3 matmuls back to back on this process's stream; records each one's ms (events)."""
    import torch

    torch.cuda.set_device(device)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    times: list[float] = []
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    while not mm["stop"].is_set():
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(5):
            a @ b
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / 5)
    mm["times"] = times


class Engine:
    """Parent-side handle on a stand-in engine process."""

    def __init__(self, spec: Spec, env: dict[str, str] | None = None, target: Any = None):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.spec = spec
        self.conn, child = ctx.Pipe()
        old = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        try:
            self.proc = ctx.Process(target=target or engine_main, args=(child, spec), daemon=True)
            self.proc.start()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child.close()

    def __call__(self, op: str, timeout: float = 120.0, **a: Any) -> Any:
        self.conn.send((op, a))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"engine did not answer {op} within {timeout} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"engine {op} failed:\n{value}")
        return value

    def send(self, op: str, **a: Any) -> None:
        """Fire a command without waiting for its answer (collect it with ``answer``)."""
        self.conn.send((op, a))

    def answer(self, timeout: float = 120.0) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError("engine did not answer")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self("exit", timeout=10)
            except (TimeoutError, OSError, EOFError, RuntimeError):
                pass  # the stand-in died or hangs: the join and kill below end it
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
