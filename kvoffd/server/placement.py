"""Where an engine's blocks go in a sharded pool: the shard of the NUMA node its memory is nearest.

Decided once, at REGISTER, from what the daemon can see for itself rather than from anything the
engine claims: a GPU engine's node is its device's (the CUDA backend's ordinal and PCI bus id, or
``--numa-map``); a CPU engine's is the node holding every CPU its process may run on (its affinity;
a process free to run anywhere has no node). An engine without a node, or a pool of one shard, has no
preference (-1): its stores take the pool's chunks in order, as a pool of one shard does.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvoffd.pool.allocator import Pool
from kvoffd.pool.topology import UNKNOWN, Topology, process_cpus
from kvoffd.transfer.base import MappedMemory


@dataclass(frozen=True)
class Placement:
    """An engine's NUMA node (-1: unknown), the shard its stores go to (-1: none preferred), and how
    the node was found (``gpu``, ``cpu-affinity``, ``unknown``)."""

    node: int = UNKNOWN
    shard: int = -1
    source: str = "unknown"


def shard_for_node(pool: Pool, topology: Topology, node: int) -> int:
    """The shard on ``node``, else the nearest one (a node without a shard: its GPUs' share went to
    the nodes that have GPUs); -1 for an unknown node or a pool of one shard."""
    if node == UNKNOWN or len(pool.shards) <= 1:
        return -1
    return min(pool.shards, key=lambda s: (topology.distance(node, s.node), s.index)).index


def place_engine(pool: Pool, topology: Topology | None, mapped: MappedMemory, pid: int) -> Placement:
    """The placement of an engine whose memory is ``mapped`` and whose process is ``pid``."""
    if topology is None or len(pool.shards) <= 1:
        return Placement()
    if mapped.gpu_ordinal >= 0:
        node, source = topology.gpu_node(mapped.gpu_ordinal, mapped.pci_bus_id), "gpu"
    else:
        node, source = topology.node_of_cpus(process_cpus(pid)), "cpu-affinity"
    if node == UNKNOWN:
        return Placement()
    return Placement(node, shard_for_node(pool, topology, node), source)
