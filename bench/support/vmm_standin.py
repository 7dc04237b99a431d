"""A stand-in engine whose KV cache is VMM memory (``cuMemCreate``), for tests/gpu/test_vmm.py and
bench/vmm.py. Run in its own process through ``standin.Engine(spec, target=vmm_main)``.

``Spec.alloc`` picks how the KV buffer is made: ``vmm`` (``pieces`` physical allocations created with the
POSIX-descriptor handle type, mapped back to back in one reserved VA range), ``vmm_nofd`` (the same
without that handle type: not exportable), ``expandable`` (torch with ``expandable_segments:True``; the
parent sets PYTORCH_CUDA_ALLOC_CONF) or ``torch`` (plain cudaMalloc: the IPC-handle path). ``sleep`` and
``wake`` do what vLLM's sleep mode does to the KV memory: unregister, free; reallocate, re-register.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from support.standin import Spec, ceiling, make_kv, run_jobs, serve


@dataclass
class VmmSpec(Spec):
    alloc: str = "vmm"  # vmm | vmm_nofd | expandable | torch
    pieces: int = 4


class VmmBuffer:
    """``pieces`` cuMemCreate allocations mapped contiguously; freed (unmapped, released) by ``free``."""

    def __init__(self, nbytes: int, pieces: int, device: int, posix_fd: bool = True):
        from kvoffd.transfer import cuda_driver as cudart
        from kvoffd.transfer import cuda_vmm

        drv = cudart.driver()
        drv.use_device(device)
        self.vmm = cuda_vmm.Vmm(drv)
        gran = self.vmm.granularity(device)
        self.piece = -(-nbytes // pieces // gran) * gran
        self.size = self.piece * pieces
        self.va = self.vmm.reserve(self.size, gran)
        types = cuda_vmm.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR if posix_fd else 0
        self.handles = [self.vmm.create(self.piece, device, types) for _ in range(pieces)]
        for i, h in enumerate(self.handles):
            self.vmm.map(self.va + i * self.piece, self.piece, h)
        self.vmm.set_access(self.va, self.size, device)

    def tensor(self, device: int) -> Any:
        """An int8 torch tensor over the whole range (no copy: CUDA array interface)."""
        import torch

        class _Cai:
            __cuda_array_interface__ = {"shape": (self.size,), "typestr": "|i1", "data": (self.va, False),
                                        "version": 3, "strides": None}

        return torch.as_tensor(_Cai(), device=f"cuda:{device}")

    def free(self) -> None:
        for i, h in enumerate(self.handles):
            self.vmm.unmap(self.va + i * self.piece, self.piece)
            self.vmm.release(h)
        self.vmm.address_free(self.va, self.size)
        self.handles = []


def _alloc(spec: VmmSpec) -> tuple[Any, Any, dict[str, Any]]:
    """(VmmBuffer or None, int8 buffer, views) laid out as standin.make_kv lays them out."""
    if spec.alloc not in ("vmm", "vmm_nofd"):
        buf, views = make_kv(spec)
        return None, buf, views
    nbytes = spec.layers * spec.num_blocks * spec.page
    vb = VmmBuffer(nbytes, spec.pieces, spec.device, posix_fd=spec.alloc == "vmm")
    buf, views = make_kv(spec, vb.tensor(spec.device)[:nbytes])
    return vb, buf, views


def vmm_main(conn: Any, spec: VmmSpec) -> None:
    """Serve commands until 'exit'. Every reply is ('ok', value) or ('err', text)."""
    import torch

    from kvoffd_client.client import KvoffdClient
    from kvoffd_client.memory.cuda_ipc import export_kv_caches

    torch.cuda.set_device(spec.device)
    st: dict[str, Any] = {"client": None, "saved": {}}

    def build() -> None:
        st["vb"], st["buf"], st["views"] = _alloc(spec)
        st["exp"] = export_kv_caches(st["views"], spec.num_blocks, num_events=spec.events)

    def blocks(ids: list[int]) -> Any:
        views = st["views"]
        out = torch.empty((len(ids), spec.layers, spec.page), dtype=torch.int8, device=st["buf"].device)
        idx = torch.tensor(ids, device=st["buf"].device)
        for j, v in enumerate(views.values()):
            out[:, j] = v.view(torch.int8).reshape(spec.num_blocks, -1)[idx]
        return out

    def cmd(op: str, a: dict[str, Any]) -> Any:
        if op == "build":
            build()
            spec = st["exp"].memory.spec
            return {"kind": spec.KIND, "pieces": len(getattr(spec, "pieces", ()))}
        if op == "randomize":
            g = torch.Generator(device=st["buf"].device).manual_seed(a.get("seed", 0))
            st["buf"].view(torch.int32).random_(generator=g)
            torch.cuda.synchronize()
            return True
        if op == "snapshot":
            st["saved"][a["tag"]] = blocks(a["ids"]).cpu()
            return True
        if op == "scramble":
            st["buf"].fill_(0x5A)
            torch.cuda.synchronize()
            return True
        if op == "compare":
            return bool(torch.equal(blocks(a["ids"]).cpu(), st["saved"][a["tag"]]))
        if op == "connect":
            st["client"] = KvoffdClient(a["address"], name="vmm-standin")
            if not st["client"].connect(a.get("timeout", 10.0)):
                raise RuntimeError("daemon not reachable")
            return True
        if op == "register":
            exp = st["exp"]
            return st["client"].register(a["engine_id"], a["namespace"], 0, 1, exp.memory, exp.layout).backend
        if op == "jobs":
            return run_jobs(st["client"], st["exp"], a)
        if op == "lookup":
            return st["client"].lookup(a["namespace"], a["keys"]).hits
        if op == "sleep":  # what sleep mode does: drain (the caller's jobs are done), unregister, free
            st["client"].unregister(a["engine_id"], timeout_s=30)
            st["exp"].close()
            st["exp"] = st["views"] = st["buf"] = None
            if st["vb"] is not None:
                st["vb"].free()
            st["vb"] = None
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            return True
        if op == "wake":
            build()
            return True
        if op == "ceiling":
            return ceiling(st["buf"], a.get("nbytes", 1 << 30), a.get("iters", 5))
        if op == "free_mem":  # the GPU's free bytes (after sleep: the KV memory must be back)
            torch.cuda.synchronize()
            return torch.cuda.mem_get_info()[0]
        if op == "pid":
            return os.getpid()
        raise ValueError(f"unknown op {op}")

    serve(conn, cmd)
