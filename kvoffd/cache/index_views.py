"""What STATS and EXPLAIN read of the index: per-namespace figures and each key's state (resident,
storing, partial, evicted, failed, never seen). Functions of a read-only index: they read its
``namespaces`` and ``misses`` and change nothing (``Index.namespace_stats`` and
``Index.explain`` are these)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvoffd.cache.index import Index


def namespace_stats(index: Index) -> list[dict]:
    out = []
    for ns in index.namespaces.values():
        blocks = sum(len(t.visible) for t in ns.tables.values())
        nbytes = sum(len(t.visible) * t.slot_bytes for t in ns.tables.values())
        out.append({"namespace": ns.name, "world_size": ns.world_size, "replicas": ns.replicas,
                    "ranks": sorted(ns.tables), "blocks": blocks, "bytes": nbytes})
    return out


def explain(index: Index, namespace: str, keys: list[bytes]) -> list[dict]:
    ns = index.namespaces.get(namespace)
    out = []
    for k in keys:
        item: dict = {"key": k.hex()}
        ranks = {}
        if ns is not None:
            for r, t in ns.tables.items():
                e = t.entries.get(k)
                if e is not None:
                    ranks[r] = ("resident" if e.ready else "storing", e.stored_at, e.refs, e.slot)
        if ns is None:
            item["state"] = "namespace_unknown"
        elif len(ranks) * ns.replicas == ns.world_size and all(v[0] == "resident" for v in ranks.values()):
            item.update(state="resident", stored_at=min(v[1] for v in ranks.values()),
                        held=any(v[2] for v in ranks.values()),
                        slots={str(r): v[3] for r, v in ranks.items()})
        elif ranks:
            item.update(state="partial", ranks={str(r): v[0] for r, v in ranks.items()})
        elif (namespace, k) in index.misses.evicted:
            item.update(state="evicted", at=index.misses.evicted[(namespace, k)])
        elif (namespace, k) in index.misses.failed:
            item.update(state="failed", at=index.misses.failed[(namespace, k)])
        else:
            item["state"] = "never_seen"
        out.append(item)
    return out
