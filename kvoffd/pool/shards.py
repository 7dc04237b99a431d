"""The pool's NUMA shards: contiguous chunk ranges of the one mapping, each on one node.

Why contiguous ranges of one mapping and not one mapping per node: a slot stays a byte offset from
one base (what every backend, the pool file's records and a warm restart already speak), the pinning
and the pool file stay one region, and a shard is just where its chunks are.

Sizing rule (``plan_shards``): the memory nodes that have GPUs get chunks in proportion to their GPUs
(the engines storing there are the GPUs'); when no GPU's node is known (a CPU-only host, firmware
saying -1 everywhere), every memory node gets an even share. Largest remainder, every shard at least
one chunk, shards in node order. One shard of no node (one node, ``--numa-map off``, a pool of fewer
chunks than nodes) is a pool without placement: no policy is set, nothing is placed. Every GPU
on one node of several: one shard, on that node.

Placement (``bind_shards``): each shard's range gets MPOL_PREFERRED on its node before its first
page exists (kvoffd/pool/mempolicy.py); a refusal (a node not online, a seccomp profile) is logged once at
INFO and the pool works unplaced. A warm-restarted pool's pages are where they were: the policy only
applies to pages made from now on, and adopted blocks are served from wherever they are.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvoffd.pool.mempolicy import Policy, mbind
from kvoffd.pool.topology import UNKNOWN, Topology, bind_thread

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shard:
    """Chunks ``[first_chunk, first_chunk + num_chunks)`` of the pool, on ``node`` (-1: no node, the
    single shard of an unplaced pool); ``cpus``: the node's CPUs (for the threads that touch it);
    ``near``: the other shards, nearest first (where a full shard spills)."""

    index: int
    node: int
    first_chunk: int
    num_chunks: int
    cpus: frozenset[int] = frozenset()
    near: tuple[int, ...] = ()
    bound: bool = False  # its range has the node's policy (bind_shards succeeded)

    @property
    def end_chunk(self) -> int:
        return self.first_chunk + self.num_chunks


def single_shard(num_chunks: int) -> list[Shard]:
    """One range, no node: the pool without placement."""
    return [Shard(0, UNKNOWN, 0, num_chunks)]


def _split(num_chunks: int, weights: list[int]) -> list[int]:
    """``num_chunks`` split in proportion to ``weights`` (largest remainder), each at least one."""
    total = sum(weights)
    exact = [num_chunks * w / total for w in weights]
    counts = [max(1, int(x)) for x in exact]
    while sum(counts) > num_chunks:  # the minimum of one took too many: from the largest
        counts[counts.index(max(counts))] -= 1
    order = sorted(range(len(weights)), key=lambda i: (counts[i] - exact[i], i))
    i = 0
    while sum(counts) < num_chunks:
        counts[order[i % len(order)]] += 1
        i += 1
    return counts


def plan_shards(topology: Topology | None, num_chunks: int) -> list[Shard]:
    """The shards of a pool of ``num_chunks`` chunks on this host (the rule: module docstring)."""
    if topology is None or topology.numa_map.mode == "off":
        return single_shard(num_chunks)
    mem = topology.memory_nodes
    per_gpu = {n: c for n, c in topology.gpus_per_node().items() if n in mem}
    nodes = sorted(per_gpu) if per_gpu else mem
    weights = [per_gpu[n] for n in nodes] if per_gpu else [1] * len(nodes)
    if len(topology.nodes) <= 1 or num_chunks < len(nodes) or not nodes:
        return single_shard(num_chunks)
    if len(nodes) == 1:  # every GPU on one node of several: the whole pool there
        return [Shard(0, nodes[0], 0, num_chunks, topology.cpus_of(nodes[0]))]
    counts = _split(num_chunks, weights)
    out: list[Shard] = []
    first = 0
    for i, (node, n) in enumerate(zip(nodes, counts, strict=True)):
        near = tuple(sorted((j for j in range(len(nodes)) if j != i),
                            key=lambda j, node=node: (topology.distance(node, nodes[j]), j)))
        out.append(Shard(i, node, first, n, topology.cpus_of(node), near))
        first += n
    return out


def byte_ranges(shards: list[Shard], chunk_bytes: int, nbytes: int) -> list[tuple[int, int]]:
    """(start, end) byte offsets of each shard in the pool (what the pinner's regions follow, so no
    region straddles two nodes)."""
    return [(s.first_chunk * chunk_bytes, min(s.end_chunk * chunk_bytes, nbytes)) for s in shards]


def bind_thread_near(shards: list[Shard], chunk_bytes: int, offset: int) -> None:
    """Run the calling thread on the CPUs of the node of the shard holding ``offset`` (a thread about to
    first-touch or fallocate there: the kernel zeroes pages from a CPU near them). One shard: nothing."""
    if len(shards) > 1:
        chunk = offset // chunk_bytes
        shard = next((s for s in shards if s.first_chunk <= chunk < s.end_chunk), None)
        if shard is not None:
            bind_thread(shard.cpus)


def bind_shards(shards: list[Shard], base_address: int, chunk_bytes: int) -> list[Shard]:
    """Set each shard's range to prefer its node (a shard of no node: nothing set).
    Returns the shards with ``bound`` telling which took; a refusal is one INFO line per shard."""
    if all(s.node == UNKNOWN for s in shards):
        return shards
    out = []
    for s in shards:
        r = mbind(base_address + s.first_chunk * chunk_bytes, s.num_chunks * chunk_bytes, s.node, Policy.PREFERRED)
        if not r.ok:
            log.info("pool shard %d (node %d, %d chunks): mbind refused (%s); its pages go wherever the kernel "
                     "puts them", s.index, s.node, s.num_chunks, r.error)
        out.append(Shard(s.index, s.node, s.first_chunk, s.num_chunks, s.cpus, s.near, r.ok))
    log.info("pool in %d NUMA shards: %s", len(out), ", ".join(
        f"node {s.node} chunks {s.first_chunk}-{s.end_chunk - 1}{'' if s.bound else ' (unplaced)'}" for s in out))
    return out
