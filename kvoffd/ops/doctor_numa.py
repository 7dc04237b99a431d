"""The ``numa`` check: the GPU <-> NUMA node <-> pool shard map the daemon will use, and whether the
kernel accepts a policy on each shard's node (a seccomp profile or an offline node refuses it).

It reads the same sysfs and ``--numa-map`` the daemon does (kvoffd/pool/topology.py) and sizes the shards
with the daemon's own rule (kvoffd/pool/shards.py), so what it prints is what the daemon will do. The GPUs
are the probe's (CUDA's ordinals and bus ids) when it found any, else the NVIDIA functions sysfs lists.
"""

from __future__ import annotations

import ctypes
import mmap

from kvoffd.ops.doctor_gpu_checks import gpu_findings
from kvoffd.ops.doctor_result import PASS, WARN, Context, Result
from kvoffd.pool.format import pool_geometry
from kvoffd.pool.mempolicy import mbind
from kvoffd.pool.shards import plan_shards
from kvoffd.pool.topology import UNKNOWN, GpuPlace, NumaMapError, Topology, parse_numa_map, read_topology

PROBE_BYTES = 2 << 20  # the mapping a policy is tried on


def _cpus(cpus: frozenset[int]) -> str:
    """{0,1,2,3,8} -> 0-3,8 (the kernel's cpulist form)."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out) or "none"


def _gpus(ctx: Context, topo: Topology) -> list[tuple[int, str, int]]:
    """(ordinal, bus id, node) of each GPU: the probe's view where it saw GPUs, else sysfs's."""
    probed = [g for g in gpu_findings(ctx).get("gpus", []) if "index" in g]
    if probed:
        return [(g["index"], g.get("bus_id") or "", topo.gpu_node(g["index"], g.get("bus_id") or ""))
                for g in probed]
    return [(g.ordinal, g.bus_id, g.node) for g in topo.gpus]


def _accepts(node: int) -> str:
    """"" when the kernel takes a policy on ``node`` for a small mapping, else why not."""
    m = mmap.mmap(-1, PROBE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    first = ctypes.c_char.from_buffer(m)
    r = mbind(ctypes.addressof(first), PROBE_BYTES, node)
    del first  # the buffer's export, so that the mapping can close
    m.close()
    return "" if r.ok else r.error


def check_numa(ctx: Context) -> Result:
    try:
        nm = parse_numa_map(ctx.numa_map)
    except NumaMapError as e:
        return Result("numa", WARN, str(e), "--numa-map takes auto, off or gpuN=NODE pairs")
    topo = read_topology(ctx.sysfs_root, nm)
    try:
        _, chunks = pool_geometry(ctx.pool_size)
    except ValueError:  # a size the pool refuses (the memory check says so): the map in whole chunks
        chunks = max(1, ctx.pool_size >> 26)
    gpus = _gpus(ctx, topo)
    if gpus and nm.mode != "off":  # the daemon sizes shards by the GPUs it will place: the same ones
        topo = Topology(topo.nodes, tuple(GpuPlace(o, b, node, "probe") for o, b, node in gpus), nm, topo.sysfs_root)
    shards = plan_shards(topo, chunks)
    by_node = {s.node: s for s in shards}
    parts = []
    for n in topo.nodes:
        on = [f"GPU{o}" + (f" {b}" if b else "") for o, b, node in gpus if node == n.node]
        s = by_node.get(n.node)
        share = f"shard {s.index}: {s.num_chunks}/{chunks} chunks" if s is not None and len(shards) > 1 else \
            ("no shard" if len(shards) > 1 else "the one shard")
        parts.append(f"node {n.node} (CPUs {_cpus(n.cpus)}{'' if n.memory else ', no memory'}): "
                     f"{', '.join(on) or 'no GPU'}; {share}")
    unknown = [f"GPU{o}" for o, _, node in gpus if node == UNKNOWN]
    detail = "; ".join(parts) + (f" (--numa-map {ctx.numa_map})" if nm.mode != "auto" or nm.gpus else "")
    if len(shards) == 1 and shards[0].node == UNKNOWN:
        return Result("numa", PASS, f"{detail}: one pool shard, no placement")
    if unknown and not nm.gpus:
        return Result("numa", WARN, f"{detail}; {', '.join(unknown)}: firmware gives no NUMA node (numa_node -1), "
                      "so their engines' blocks go anywhere", "name them: --numa-map gpu0=0,gpu1=1,...")
    refused = {s.node: why for s in shards if (why := _accepts(s.node))}
    if refused:
        return Result("numa", WARN, f"{detail}; the kernel refuses a memory policy on "
                      + ", ".join(f"node {n} ({why})" for n, why in refused.items())
                      + ": those shards' pages go wherever the kernel puts them",
                      "allow mbind (a container's seccomp profile) or check the nodes are online")
    return Result("numa", PASS, detail)

