"""``kvoffctl status``'s lines: one row per fact of STATS (daemon, pool, warm restart, KV events, hit
rate, jobs in flight, each tier), rendered from the reply as plain text."""

from __future__ import annotations

import time
from typing import Any

from kvoffd.ops.ctl_format import fmt_backend, fmt_dur, fmt_pct, fmt_size


def status_rows(st: dict[str, Any], address: str, rtt: float) -> list[tuple[str, Any]]:
    """The rows of ``status`` from a STATS reply (``address``: the one asked, when the daemon does not
    say; ``rtt``: the ping's round trip in seconds)."""
    d, pool, c = st.get("daemon", {}), st.get("pool", {}), st.get("counters", {})
    engines = st.get("engines", [])
    n_eng = len(engines) if isinstance(engines, list) else engines
    rows = [
        ("daemon", f"{d.get('id', '?')} (pid {d.get('pid', '?')}, version {d.get('version', '?')})"),
        ("address", d.get("address") or address),
        ("metrics", d.get("metrics_address") or "-"),
        ("kv events", kv_events_line(d.get("kv_events"))),
        ("uptime", fmt_dur(d.get("uptime_s"))),
        ("backends", ", ".join(fmt_backend(b) for b in d.get("backends", [])) or "-"),
        ("ping", f"{rtt * 1000:.2f} ms"),
        ("pool", f"{fmt_size(pool.get('used_bytes'))} used of {fmt_size(pool.get('capacity_bytes'))} "
                 f"({fmt_pct(pool.get('used_bytes'), pool.get('capacity_bytes'))}); "
                 f"{fmt_size(pool.get('pinned_bytes'))} pinned of {fmt_size(pool.get('total_bytes'))}"),
        ("warm restart", persistence_line(st.get("persistence") or {})),
        ("engines", n_eng),
        ("namespaces", len(st.get("namespaces", []) or [])),
        ("hit rate", hit_rate(c)),
        ("in flight", f"{st.get('in_flight_jobs', 0)} jobs, oldest {fmt_dur(st.get('oldest_in_flight_s', 0))}"),
    ]
    shards = pool.get("shards") or []
    if len(shards) > 1:  # a NUMA-sharded pool: where the blocks are
        at = next(i for i, r in enumerate(rows) if r[0] == "pool") + 1
        rows[at:at] = [(f"pool shard {s.get('shard', '?')}", shard_line(s, c)) for s in shards if isinstance(s, dict)]
    rows += [(f"tier {t.get('name', '?')}", tier_line(t)) for t in st.get("tiers", []) or []
             if isinstance(t, dict)]
    return rows


def shard_line(s: dict[str, Any], counters: dict[str, Any]) -> str:
    """One NUMA shard of the pool: its node, what it holds, what spilled to the others."""
    line = (f"node {s.get('node', '?')}: {fmt_size(s.get('used_bytes'))} used of {fmt_size(s.get('capacity_bytes'))} "
            f"({fmt_pct(s.get('used_bytes'), s.get('capacity_bytes'))}); {s.get('spilled_slots', 0)} slots spilled "
            "to other shards")
    if s.get("shard") == 0:
        line += f"; {counters.get('cross_numa_load_blocks', 0)} blocks loaded across nodes (all shards)"
    return line + ("" if s.get("bound", True) else "; not placed (mbind refused)")


def hit_rate(counters: dict[str, Any]) -> str:
    """Served hit rate: blocks loaded into engines / blocks looked up (what saved a recompute), then
    the share a LOOKUP found resident, an upper bound: a found block is not always loaded (the engine
    already held it, or the request was looked up again before it was scheduled)."""
    hit = counters.get("lookup_hit_blocks", 0) or 0
    asked = hit + (counters.get("lookup_miss_blocks", 0) or 0)
    if not asked:
        return "- (no lookups yet)"
    loaded = counters.get("loaded_blocks", 0) or 0
    return f"{fmt_pct(loaded, asked)} served (loaded / looked up); {fmt_pct(hit, asked)} found by lookup"


def persistence_line(p: dict) -> str:
    """Where the pool lives, what this daemon adopted from the previous one (docs/operations.md, warm
    restart), and the blocks whose checksum is not in their record yet (kept across a crash all the
    same)."""
    if not p.get("path"):
        return "pool in private memory: lost when the daemon stops"
    line = f"pool file {p['path']}; " + _adopted(p)
    if p.get("seal_backlog_blocks"):
        line += (f"; {p['seal_backlog_blocks']} blocks ({fmt_size(p.get('seal_backlog_bytes'))}) without their "
                 f"checksum yet, oldest {fmt_dur(p.get('seal_backlog_oldest_s', 0))}")
    return line


def _adopted(p: dict) -> str:
    if not p.get("adopted_blocks"):
        return "started cold"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(p.get("adopted_from", 0)))
    line = f"adopted {p['adopted_blocks']} blocks ({fmt_size(p.get('adopted_bytes'))}) written until {when}"
    if p.get("adopted_unchecked"):
        line += f" ({p['adopted_unchecked']} without a checksum)"
    if p.get("unverified_blocks"):
        return line + f", {p['unverified_blocks']} not verified yet"
    return line + f", verified {fmt_dur(p.get('verified_s'))} after start ({p.get('verify_failures', 0)} corrupt)"


def kv_events_line(ev: Any) -> str:
    """The KV-event endpoints (--kv-events-address), or "off"; who may subscribe (ipc, curve, none) and
    whether token ids go out; after a warm restart, how many adopted blocks were announced and how many
    wait for their namespace's identity (an engine's REGISTER); the outlet's connections."""
    if not isinstance(ev, dict) or not ev.get("endpoint"):
        return "off"
    topic = f", topic {ev['topic']!r}" if ev.get("topic") else ""
    adopted = (f"; adopted blocks: {ev.get('adopted_announced', 0):,} announced, {ev.get('adopted_waiting', 0):,} "
               "waiting for a REGISTER" if ev.get("adopted_announced") or ev.get("adopted_waiting") else "")
    access = f"; {ev['auth']}{', token ids' if ev.get('token_ids') else ''}" if ev.get("auth") else ""
    conns = ev.get("connections") or {}
    held = (f"; {conns.get('publish', 0)} subscribers, {conns.get('replay', 0)} replay connections"
            + (f", outlet restarted {ev['outlet_restarts']} times" if ev.get("outlet_restarts") else "")
            if conns else "")
    return (f"{ev['endpoint']} (replay {ev.get('replay_endpoint', '?')}{topic}{access}; "
            f"{ev.get('published', 0):,} published, {ev.get('dropped', 0):,} dropped{adopted}{held})")


def tier_line(t: dict[str, Any]) -> str:
    """One tier of STATS ``tiers`` (the pool is "dram"): what it holds, what it served, what went wrong."""
    if t.get("disabled"):
        return f"DISABLED: {t['disabled']}"
    if t.get("name") == "remote":
        return remote_line(t)
    parts = [f"{fmt_size(t.get('resident_bytes'))} in {t.get('resident_blocks', 0)} blocks of "
             f"{fmt_size(t.get('capacity_bytes'))}", f"{t.get('hits', 0)} hits"]
    if t.get("name") != "dram":
        dropped = sum((t.get("spills_dropped") or {}).values())
        parts += [f"{t.get('promotions', 0)} promoted ({t.get('promotion_failures', 0)} failed)",
                  f"{t.get('spills', 0)} spilled ({dropped} dropped, {t.get('spill_copies', 0)} copied on the loop, "
                  f"{t.get('spills_in_flight', 0)} in flight)",
                  f"read {fmt_size(t.get('read_bytes'))}, written {fmt_size(t.get('write_bytes'))}",
                  f"{t.get('io_errors', 0)} I/O errors, {t.get('checksum_failures', 0)} bad checksums"]
        notes = t.get("notes") or {}
        if notes.get("direct_io"):
            parts.append(f"direct I/O {notes['direct_io']}")
        if notes.get("index_kernel") == "numpy":  # the compiled probe was not built: slower disk-hit LOOKUPs
            parts.append("index probe numpy (the compiled kernel is not built)")
    parts.append(f"{t.get('evictions', 0)} evicted")
    if t.get("admissions_refused"):
        parts.append(f"{t['admissions_refused']} refused")
    return "; ".join(parts)


_PUBLISH_ON = {"admitted": "behind", "evicted": "as evicted"}  # --remote-publish, as the line says it


def remote_line(t: dict[str, Any]) -> str:
    """The cluster tier (--remote): the store is shared and evicts on its own, so what this node holds
    is not a size but what it knows the cluster holds; then its shards (a breaker open: that shard's
    keys are misses until it answers again), what it fetched and published, what went wrong."""
    notes = t.get("notes") or {}
    shards = [s.rsplit("=", 1) for s in (notes.get("breakers") or "").split(",") if "=" in s]
    down = [addr for addr, state in shards if state != "closed"]
    dropped = sum((t.get("spills_dropped") or {}).values())
    parts = [f"{len(shards) - len(down)}/{len(shards)} shards up" + (f" ({', '.join(down)} not answering)"
                                                                     if down else ""),
             f"{t.get('resident_blocks', 0)} blocks known there", f"{t.get('hits', 0)} hits",
             f"{t.get('promotions', 0)} fetched ({t.get('promotion_failures', 0)} failed)",
             f"{t.get('spills', 0)} published {_PUBLISH_ON.get(notes.get('publish_on', ''), 'behind')} "
             f"({dropped} dropped, {notes.get('dropped_oldest', 0)} of them the oldest queued, "
             f"{notes.get('skipped_known', 0)} already there, {t.get('spills_in_flight', 0)} queued)",
             f"read {fmt_size(t.get('read_bytes'))}, written {fmt_size(t.get('write_bytes'))}",
             f"{t.get('io_errors', 0)} I/O errors, {t.get('checksum_failures', 0)} values refused (checksum/MAC)"]
    return "; ".join(parts)
