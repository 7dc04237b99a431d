"""The host's NUMA topology as the pool needs it: the memory nodes, their CPUs and distances, and the
node each GPU hangs off (its PCIe root), read from sysfs.

Why sysfs and not libnuma or NVML: both are optional libraries the daemon would have to load, while
/sys/devices/system/node and /sys/bus/pci/devices/<bus id>/numa_node say the same with plain reads,
in a container too, and a test can fake them with a directory (``--sysfs-root``). A GPU's node is
read through its PCI bus id: the CUDA backend knows it for each engine's device
(``cuDeviceGetPCIBusId``); for sizing the pool's shards before any CUDA call, the NVIDIA PCI functions
sysfs lists are counted per node. ``numa_node`` -1 (firmware did not say) is "unknown": such a GPU
has no preference.

``--numa-map`` overrides what sysfs says: ``auto`` (sysfs), ``off`` (one shard, no placement: the
pool's pages go wherever the kernel puts them), or ``gpu0=0,gpu1=0,gpu2=1`` (each listed CUDA ordinal on that
node; ordinals not listed keep what sysfs says). The map is also how an operator corrects firmware
that reports -1.

This module imports nothing of the daemon, so ``kvoffd doctor`` reads the same map the daemon uses.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

NVIDIA_VENDOR = "0x10de"
GPU_CLASSES = ("0x0300", "0x0302")  # VGA and 3D controllers (the class file's first 6 hex digits)
UNKNOWN = -1


class NumaMapError(ValueError):
    """A ``--numa-map`` that does not parse (one line naming the bad part)."""


@dataclass(frozen=True)
class NumaMap:
    """``--numa-map`` parsed: ``mode`` auto (sysfs, ``gpus`` overriding it) or off (one shard)."""

    mode: str = "auto"
    gpus: dict[int, int] = field(default_factory=dict)  # CUDA ordinal -> node


def parse_numa_map(text: str) -> NumaMap:
    """``auto``, ``off``, or comma-separated ``gpuN=NODE`` pairs (auto for every GPU not named)."""
    t = text.strip().lower()
    if t in ("", "auto"):
        return NumaMap()
    if t in ("off", "none"):
        return NumaMap(mode="off")
    gpus: dict[int, int] = {}
    for part in t.split(","):
        m = re.fullmatch(r"\s*gpu(\d+)\s*=\s*(\d+)\s*", part)
        if m is None:
            raise NumaMapError(f"--numa-map: {part.strip()!r} is not gpuN=NODE (e.g. gpu0=0,gpu1=1; or auto, off)")
        ordinal, node = int(m.group(1)), int(m.group(2))
        if ordinal in gpus:
            raise NumaMapError(f"--numa-map names gpu{ordinal} twice")
        gpus[ordinal] = node
    return NumaMap(gpus=gpus)


@dataclass(frozen=True)
class NumaNode:
    """One NUMA node: its CPUs, whether it has memory (a shard can live there), its distances to the
    other nodes (by node id, as /sys/devices/system/node/nodeN/distance lists them)."""

    node: int
    cpus: frozenset[int]
    memory: bool
    distances: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class GpuPlace:
    """A GPU of the host and the node it hangs off; ``source``: ``sysfs``, ``map`` (--numa-map) or
    ``unknown`` (firmware said -1 and no map names it)."""

    ordinal: int
    bus_id: str
    node: int
    source: str


@dataclass(frozen=True)
class Topology:
    """What the pool's shards and an engine's placement are derived from."""

    nodes: tuple[NumaNode, ...]
    gpus: tuple[GpuPlace, ...]
    numa_map: NumaMap
    sysfs_root: str = "/sys"

    @property
    def memory_nodes(self) -> list[int]:
        return [n.node for n in self.nodes if n.memory]

    def distance(self, a: int, b: int) -> int:
        """The firmware's distance (10 = local); unknown pairs count as far."""
        if a == b:
            return 10
        for n in self.nodes:
            if n.node == a:
                return n.distances.get(b, 255)
        return 255

    def cpus_of(self, node: int) -> frozenset[int]:
        for n in self.nodes:
            if n.node == node:
                return n.cpus
        return frozenset()

    def node_of_cpus(self, cpus: frozenset[int] | set[int]) -> int:
        """The node whose CPUs hold every one of ``cpus`` (a process bound to one node), else UNKNOWN."""
        if not cpus:
            return UNKNOWN
        for n in self.nodes:
            if n.cpus and set(cpus) <= n.cpus:
                return n.node
        return UNKNOWN

    def gpu_node(self, ordinal: int, bus_id: str = "") -> int:
        """The node of the GPU with this CUDA ordinal: the map's, else its bus id's numa_node in sysfs
        (the engine's device, as CUDA names it), else the ordinal's entry in the PCI listing; UNKNOWN
        where none says."""
        if ordinal in self.numa_map.gpus:
            return self.numa_map.gpus[ordinal]
        if bus_id:
            return read_pci_node(self.sysfs_root, bus_id)
        return next((g.node for g in self.gpus if g.ordinal == ordinal), UNKNOWN)

    def gpus_per_node(self) -> dict[int, int]:
        """How many GPUs of known node each node has (what sizes the shards)."""
        out: dict[int, int] = {}
        for g in self.gpus:
            if g.node != UNKNOWN:
                out[g.node] = out.get(g.node, 0) + 1
        return out


def parse_cpulist(text: str) -> frozenset[int]:
    """``0-3,8,10-11`` -> {0, 1, 2, 3, 8, 10, 11} (the kernel's cpulist format); "" -> empty."""
    out: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return frozenset(out)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def read_pci_node(sysfs_root: str, bus_id: str) -> int:
    """``numa_node`` of a PCI function (-1 when firmware does not say or the device is not there).
    CUDA writes bus ids as ``00000000:19:00.0``; sysfs as ``0000:19:00.0``."""
    bid = bus_id.strip().lower()
    dom, _, rest = bid.partition(":")
    if rest and len(dom) > 4:
        bid = f"{dom[-4:]}:{rest}"
    text = _read(os.path.join(sysfs_root, "bus", "pci", "devices", bid, "numa_node")).strip()
    try:
        return int(text)
    except ValueError:
        return UNKNOWN


def read_nodes(sysfs_root: str) -> tuple[NumaNode, ...]:
    """Every node sysfs lists, with CPUs, memory and distances. A host without the node directory
    (a kernel without NUMA) is one node 0 holding every CPU."""
    base = os.path.join(sysfs_root, "devices", "system", "node")
    try:
        names = sorted(int(d[4:]) for d in os.listdir(base) if re.fullmatch(r"node\d+", d))
    except OSError:
        names = []
    if not names:
        return (NumaNode(0, frozenset(os.sched_getaffinity(0)), True, {0: 10}),)
    mem_text = _read(os.path.join(base, "has_memory"))
    with_memory = parse_cpulist(mem_text) if mem_text.strip() else frozenset(names)
    nodes = []
    for n in names:
        d = os.path.join(base, f"node{n}")
        dist = [int(x) for x in _read(os.path.join(d, "distance")).split()]
        distances = dict(zip(names, dist, strict=False)) if len(dist) == len(names) else {n: 10}
        nodes.append(NumaNode(n, parse_cpulist(_read(os.path.join(d, "cpulist"))), n in with_memory, distances))
    return tuple(nodes)


def read_pci_gpus(sysfs_root: str) -> list[tuple[str, int]]:
    """(bus id, numa_node) of every NVIDIA GPU function sysfs lists, in bus-id order (the order CUDA
    numbers identical GPUs by default, CUDA_DEVICE_ORDER=PCI_BUS_ID giving it for any)."""
    base = os.path.join(sysfs_root, "bus", "pci", "devices")
    try:
        ids = sorted(os.listdir(base))
    except OSError:
        return []
    out = []
    for bid in ids:
        d = os.path.join(base, bid)
        if _read(os.path.join(d, "vendor")).strip().lower() != NVIDIA_VENDOR:
            continue
        if not _read(os.path.join(d, "class")).strip().lower().startswith(GPU_CLASSES):
            continue
        out.append((bid, read_pci_node(sysfs_root, bid)))
    return out


def read_topology(sysfs_root: str = "/sys", numa_map: NumaMap | None = None) -> Topology:
    """The host's topology, ``numa_map`` applied (``off``: what sysfs says is still read, for the
    doctor's map; the pool then has one shard)."""
    nm = numa_map or NumaMap()
    nodes = read_nodes(sysfs_root)
    gpus: list[GpuPlace] = []
    for i, (bid, node) in enumerate(read_pci_gpus(sysfs_root)):
        if i in nm.gpus:
            gpus.append(GpuPlace(i, bid, nm.gpus[i], "map"))
        else:
            gpus.append(GpuPlace(i, bid, node, "sysfs" if node != UNKNOWN else "unknown"))
    for ordinal in sorted(set(nm.gpus) - {g.ordinal for g in gpus}):  # named by the map, not seen in sysfs
        gpus.append(GpuPlace(ordinal, "", nm.gpus[ordinal], "map"))
    return Topology(nodes=nodes, gpus=tuple(gpus), numa_map=nm, sysfs_root=sysfs_root)


def process_cpus(pid: int) -> frozenset[int]:
    """The CPUs a process may run on (its affinity): how a CPU engine tells its node without saying.
    Empty when the process is not visible."""
    try:
        return frozenset(os.sched_getaffinity(pid))
    except OSError:
        return frozenset()


def bind_thread(cpus: frozenset[int]) -> bool:
    """Run the calling thread on ``cpus`` only (a pinning or fallocate worker that first-touches a
    shard: the kernel zeroes the pages from a CPU near them). False when refused (a cpuset)."""
    if not cpus:
        return False
    try:
        os.sched_setaffinity(0, cpus)
        return True
    except OSError as e:
        log.debug("cannot bind a thread to CPUs %s: %s", sorted(cpus), e)
        return False
