"""kvoffctl: ask a running kvoffd what it holds, who is attached, and why a prompt missed.

It speaks the daemon's own protocol over its socket (STATS, CLEAR, EXPLAIN, PING) through the same
client library the engines use, so what it shows is what an engine would see, not a second view
scraped from /metrics. Output is a readable table by default and JSON with ``--json`` (for scripts).

Exit codes: 0 done; 1 the daemon answered with an error; 2 the command line was wrong (argparse's
own code); 3 the daemon could not be reached. Scripts can tell "fix your call" from "the daemon is
down" without parsing text. The "cannot reach" case is one line naming the address and what to
try, never a traceback: it is the first thing an operator sees when the daemon is down.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from kvoffd.config import default_address, format_size
from kvoffd_client.client import DaemonUnavailable, KvoffdClient, KvoffdError
from kvoffd_client.protocol import KEY_SIZE

EXIT_OK = 0
EXIT_DAEMON_ERROR = 1
EXIT_USAGE = 2  # argparse's code for a bad command line
EXIT_UNREACHABLE = 3
MAX_TIMEOUT_S = 3600.0


class Unreachable(Exception):
    """The daemon did not answer; the message says where we looked and what to try."""


class DaemonError(Exception):
    """The daemon answered with ERROR (bad key, unknown namespace, ...)."""


class UsageError(Exception):
    """The command line is wrong in a way argparse cannot see (a malformed key)."""


# --------------------------------------------------------------------------------------------------
# Talking to the daemon. Everything goes through `connect()`, the one place that knows the client API.


def _address_hint(address: str) -> str:
    """Why an ipc:// address may be unreachable, judged from the file system (ZeroMQ cannot tell us)."""
    if not address.startswith("ipc://"):
        return ""
    path = address[len("ipc://"):]
    try:
        st = os.stat(path)
    except FileNotFoundError:
        parent = os.path.dirname(path) or "."
        if not os.path.isdir(parent):
            return f"; {parent} does not exist (is kvoffd running, and with this address?)"
        return f"; no socket at {path} (is kvoffd running?)"
    except PermissionError:
        return f"; permission denied on {os.path.dirname(path)} (run as the daemon's user or group)"
    if not stat.S_ISSOCK(st.st_mode):
        return f"; {path} is not a socket"
    if not os.access(path, os.W_OK):
        return f"; no write permission on {path} (run as the daemon's user or group)"
    return "; the socket exists but nobody answers (a stale socket from a daemon that died?)"


def connect(address: str, timeout_s: float) -> KvoffdClient:
    """A connected client, or Unreachable. The handshake (HELLO) proves the daemon is alive."""
    if address.startswith("ipc://") and not os.path.exists(address[len("ipc://"):]):
        # ZeroMQ would wait out the whole timeout for a socket file that is not there; say so now
        raise Unreachable(f"cannot reach kvoffd at {address}{_address_hint(address)}. "
                          "Set --address or KVOFFD_ADDRESS to the daemon's address.")
    try:
        client = KvoffdClient(address, name="kvoffctl", timeout_s=timeout_s, heartbeat=False)
    except zmq.ZMQError as e:  # a malformed endpoint
        raise Unreachable(f"cannot use address {address!r}: {e}") from None
    try:
        ok = client.connect(timeout_s)
    except KvoffdError as e:  # version mismatch and the like
        client.close()
        raise Unreachable(f"cannot talk to kvoffd at {address}: {e}") from None
    if not ok and client.refusal:  # it answered, and refused us: say why, not "nobody answers"
        client.close()
        raise Unreachable(f"kvoffd at {address} refused this client: {client.refusal}")
    if not ok:
        client.close()
        raise Unreachable(f"cannot reach kvoffd at {address}: no answer within {timeout_s:g}s"
                          f"{_address_hint(address)}. Set --address or KVOFFD_ADDRESS to the daemon's address.")
    return client


def _call(fn: Callable[[], Any]) -> Any:
    """Run one request, mapping the client's errors onto our exit codes."""
    try:
        return fn()
    except DaemonUnavailable as e:
        raise Unreachable(f"kvoffd stopped answering: {e.message}") from None
    except KvoffdError as e:
        raise DaemonError(str(e)) from None


# --------------------------------------------------------------------------------------------------
# Formatting


def _size(n: Any) -> str:
    return format_size(float(n)) if isinstance(n, (int, float)) else "-"


def _dur(s: Any) -> str:
    if not isinstance(s, (int, float)):
        return "-"
    s = float(s)
    if s < 1:
        return f"{s * 1000:.0f}ms"
    if s < 120:
        return f"{s:.1f}s"
    if s < 7200:
        return f"{s / 60:.1f}m"
    if s < 172800:
        return f"{s / 3600:.1f}h"
    return f"{s / 86400:.1f}d"


def _backend(b: Any) -> str:
    """``cpu (threads 2, process_vm_readv)`` from the daemon's description of one backend."""
    if not isinstance(b, dict):
        return str(b)
    rest = [f"{k} {v}" if k != "method" else str(v) for k, v in b.items() if k != "name"]
    return f"{b.get('name', '?')} ({', '.join(rest)})" if rest else str(b.get("name", "?"))


def _timeout(text: str) -> float:
    """--timeout: a finite number of seconds in (0, MAX_TIMEOUT_S]; nan and inf are usage errors."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < v <= MAX_TIMEOUT_S:  # (false for nan too)
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most {MAX_TIMEOUT_S:g} seconds, got {text}")
    return v


def _pct(part: Any, whole: Any) -> str:
    try:
        return f"{100.0 * float(part) / float(whole):.1f}%" if float(whole) > 0 else "-"
    except (TypeError, ValueError):
        return "-"


def table(rows: Sequence[Sequence[Any]], header: Sequence[str] | None = None) -> str:
    """Left-aligned text columns; numbers right-aligned."""
    cells = [[str(c) for c in r] for r in rows]
    if header:
        cells.insert(0, list(header))
    if not cells:
        return ""
    widths = [max(len(r[i]) for r in cells if i < len(r)) for i in range(max(map(len, cells)))]
    numeric = [all(_looks_numeric(r[i]) for r in cells[1 if header else 0:] if i < len(r)) for i in range(len(widths))]
    out = []
    for r in cells:
        parts = [c.rjust(widths[i]) if numeric[i] else c.ljust(widths[i]) for i, c in enumerate(r)]
        out.append("  ".join(parts).rstrip())
    return "\n".join(out)


def _looks_numeric(s: str) -> bool:
    return bool(s) and (s.replace(".", "", 1).replace("%", "").replace(",", "").lstrip("-").isdigit())


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, bytes):
        return obj.hex()
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "__dataclass_fields__"):
        return {k: _jsonable(getattr(obj, k)) for k in obj.__dataclass_fields__ if k != "seq"}
    return obj


def emit_json(obj: Any) -> None:
    print(json.dumps(_jsonable(obj), indent=2, sort_keys=True))


# --------------------------------------------------------------------------------------------------
# Commands. Each takes the parsed args and a connected client and returns an exit code.


def _hit_rate(counters: dict[str, Any]) -> str:
    """Served hit rate: blocks loaded into engines / blocks looked up (what saved a recompute), then
    the share a LOOKUP found resident, an upper bound: a found block is not always loaded (the engine
    already held it, or the request was looked up again before it was scheduled)."""
    hit = counters.get("lookup_hit_blocks", 0) or 0
    asked = hit + (counters.get("lookup_miss_blocks", 0) or 0)
    if not asked:
        return "- (no lookups yet)"
    loaded = counters.get("loaded_blocks", 0) or 0
    return f"{_pct(loaded, asked)} served (loaded / looked up); {_pct(hit, asked)} found by lookup"


def _persistence(p: dict) -> str:
    """Where the pool lives and what this daemon adopted from the previous one (issue 14)."""
    if not p.get("path"):
        return "pool in private memory: lost when the daemon stops"
    line = f"pool file {p['path']}; "
    if not p.get("adopted_blocks"):
        return line + "started cold"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(p.get("adopted_from", 0)))
    line += f"adopted {p['adopted_blocks']} blocks ({_size(p.get('adopted_bytes'))}) written until {when}"
    if p.get("unverified_blocks"):
        return line + f", {p['unverified_blocks']} not verified yet"
    return line + f", verified {_dur(p.get('verified_s'))} after start ({p.get('verify_failures', 0)} corrupt)"


def _kv_events(ev: Any) -> str:
    """The KV-event endpoints (--kv-events-address), or "off"."""
    if not isinstance(ev, dict) or not ev.get("endpoint"):
        return "off"
    topic = f", topic {ev['topic']!r}" if ev.get("topic") else ""
    return (f"{ev['endpoint']} (replay {ev.get('replay_endpoint', '?')}{topic}; "
            f"{ev.get('published', 0):,} published, {ev.get('dropped', 0):,} dropped)")


def cmd_status(args: argparse.Namespace, client: Any) -> int:
    t0 = time.monotonic()
    rtt = _call(client.ping)
    if not isinstance(rtt, (int, float)):
        rtt = time.monotonic() - t0
    st = _call(lambda: client.stats(detail=False))
    if args.json:
        emit_json({"address": args.address, "ping_s": rtt, "stats": st})
        return EXIT_OK
    d, pool, c = st.get("daemon", {}), st.get("pool", {}), st.get("counters", {})
    engines = st.get("engines", [])
    n_eng = len(engines) if isinstance(engines, list) else engines
    rows = [
        ("daemon", f"{d.get('id', '?')} (pid {d.get('pid', '?')}, version {d.get('version', '?')})"),
        ("address", d.get("address") or args.address),
        ("metrics", d.get("metrics_address") or "-"),
        ("kv events", _kv_events(d.get("kv_events"))),
        ("uptime", _dur(d.get("uptime_s"))),
        ("backends", ", ".join(_backend(b) for b in d.get("backends", [])) or "-"),
        ("ping", f"{rtt * 1000:.2f} ms"),
        ("pool", f"{_size(pool.get('used_bytes'))} used of {_size(pool.get('capacity_bytes'))} "
                 f"({_pct(pool.get('used_bytes'), pool.get('capacity_bytes'))}); "
                 f"{_size(pool.get('pinned_bytes'))} pinned of {_size(pool.get('total_bytes'))}"),
        ("warm restart", _persistence(st.get("persistence") or {})),
        ("engines", n_eng),
        ("namespaces", len(st.get("namespaces", []) or [])),
        ("hit rate", _hit_rate(c)),
        ("in flight", f"{st.get('in_flight_jobs', 0)} jobs, oldest {_dur(st.get('oldest_in_flight_s', 0))}"),
    ]
    rows += [(f"tier {t.get('name', '?')}", _tier_line(t)) for t in st.get("tiers", []) or []
             if isinstance(t, dict)]
    print(table(rows))
    return EXIT_OK


def _tier_line(t: dict[str, Any]) -> str:
    """One tier of STATS ``tiers`` (the pool is "dram"): what it holds, what it served, what went wrong."""
    if t.get("disabled"):
        return f"DISABLED: {t['disabled']}"
    parts = [f"{_size(t.get('resident_bytes'))} in {t.get('resident_blocks', 0)} blocks of "
             f"{_size(t.get('capacity_bytes'))}", f"{t.get('hits', 0)} hits"]
    if t.get("name") != "dram":
        dropped = sum((t.get("spills_dropped") or {}).values())
        parts += [f"{t.get('promotions', 0)} promoted ({t.get('promotion_failures', 0)} failed)",
                  f"{t.get('spills', 0)} spilled ({dropped} dropped)",
                  f"read {_size(t.get('read_bytes'))}, written {_size(t.get('write_bytes'))}",
                  f"{t.get('io_errors', 0)} I/O errors, {t.get('checksum_failures', 0)} bad checksums"]
        note = (t.get("notes") or {}).get("direct_io")
        if note:
            parts.append(f"direct I/O {note}")
    parts.append(f"{t.get('evictions', 0)} evicted")
    if t.get("admissions_refused"):
        parts.append(f"{t['admissions_refused']} refused")
    return "; ".join(parts)


def cmd_stats(args: argparse.Namespace, client: Any) -> int:
    st = _call(lambda: client.stats(detail=True))
    if args.json:
        emit_json(st)
        return EXIT_OK
    pool, c = st.get("pool", {}), st.get("counters", {})
    print("pool")
    prow = []
    for key in ("capacity_bytes", "total_bytes", "used_bytes", "pinned_bytes", "free_chunk_bytes"):
        if key in pool:
            prow.append((key, _size(pool[key]), pool[key]))
    for key, v in pool.items():
        if not key.endswith("_bytes") or key in {r[0] for r in prow}:
            continue
        prow.append((key, _size(v), v))
    print(table([("  " + a, b, f"{c_:,}" if isinstance(c_, int) else c_) for a, b, c_ in prow],
                header=("  state", "size", "bytes")))
    print()
    print("counters (since start)")
    crow = [("  " + k, f"{v:,}" if isinstance(v, int) else v) for k, v in sorted(c.items())]
    crow.append(("  hit rate (blocks)", _hit_rate(c)))
    print(table(crow))
    print()
    print(f"in flight: {st.get('in_flight_jobs', 0)} jobs, oldest {_dur(st.get('oldest_in_flight_s', 0))}; "
          f"engines: {len(st.get('engines', []) or [])}; namespaces: {len(st.get('namespaces', []) or [])}")
    return EXIT_OK


def cmd_engines(args: argparse.Namespace, client: Any) -> int:
    st = _call(lambda: client.stats(detail=True))
    engines = st.get("engines", []) or []
    if args.json:
        emit_json(engines)
        return EXIT_OK
    if not engines:
        print("no engines registered")
        return EXIT_OK
    rows = [(e.get("engine_id", "?"), e.get("namespace", "?"), f"{e.get('rank', '?')}/{e.get('world_size', '?')}",
             e.get("pid", "?"), e.get("backend", "-"), _dur(e.get("registered_s")), _dur(e.get("last_seen_s")),
             e.get("in_flight", 0))
            for e in engines]
    print(table(rows, header=("ENGINE", "NAMESPACE", "RANK", "PID", "BACKEND", "REGISTERED", "LAST SEEN",
                              "IN FLIGHT")))
    return EXIT_OK


def cmd_namespaces(args: argparse.Namespace, client: Any) -> int:
    st = _call(lambda: client.stats(detail=True))
    spaces = st.get("namespaces", []) or []
    if args.json:
        emit_json(spaces)
        return EXIT_OK
    if not spaces:
        print("no namespaces (nothing stored and no engine registered)")
        return EXIT_OK
    rows = [(n.get("namespace", "?"), n.get("world_size", "?"), f"{n.get('blocks', 0):,}", _size(n.get("bytes")))
            for n in spaces]
    print(table(rows, header=("NAMESPACE", "RANKS", "BLOCKS", "SIZE")))
    return EXIT_OK


def cmd_clear(args: argparse.Namespace, client: Any) -> int:
    res = _call(lambda: client.clear(namespace=args.namespace or ""))
    removed = getattr(res, "removed_blocks", None)
    in_flight = getattr(res, "in_flight_jobs", None)
    if isinstance(res, dict):
        removed, in_flight = res.get("removed_blocks"), res.get("in_flight_jobs")
    if args.json:
        emit_json({"namespace": args.namespace or "", "removed_blocks": removed, "in_flight_jobs": in_flight})
        return EXIT_OK
    scope = f"namespace {args.namespace!r}" if args.namespace else "all namespaces"
    print(f"cleared {scope}: removed {removed} blocks")
    if in_flight:
        print(f"{in_flight} jobs were in flight; their stores will not become visible")
    else:
        print("no jobs were in flight")
    return EXIT_OK


def _parse_keys(texts: Sequence[str]) -> list[bytes]:
    keys = []
    for t in texts:
        h = t.strip().lower().removeprefix("0x")
        try:
            k = bytes.fromhex(h)
        except ValueError:
            raise UsageError(f"not a hex key: {t!r}") from None
        if len(k) != KEY_SIZE:
            raise UsageError(f"key {t[:16]}... is {len(k)} bytes; block keys are {KEY_SIZE} bytes "
                              f"({2 * KEY_SIZE} hex digits)")
        keys.append(k)
    return keys


def _ago(ts: Any) -> str:
    if not isinstance(ts, (int, float)):
        return "?"
    return f"{_dur(max(0.0, time.time() - ts))} ago ({time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(ts))})"


#: What each EXPLAIN state means for the operator (index.py decides the state).
EXPLAIN_STATES = {
    "resident": "would hit",
    "storing": "a store is still copying it; not visible yet",
    "partial": "only some ranks hold it; a lookup misses until every rank does",
    "evicted": "evicted to make room",
    "failed": "its store failed",
    "never_seen": "never stored in this namespace (or forgotten: history keeps the last 100k)",
    "namespace_unknown": "no engine ever registered or stored in this namespace (check the namespace)",
}


def _explain_line(e: dict[str, Any]) -> tuple[str, str, str]:
    """(key, state, detail) for one EXPLAIN entry; unknown fields are shown as key=value."""
    key = e.get("key", "")
    key = key.hex() if isinstance(key, bytes) else str(key)
    state = str(e.get("state", "?"))
    detail = [EXPLAIN_STATES.get(state, "")]
    shown = {"key", "state"}
    if "stored_at" in e:
        detail.append(f"stored {_ago(e['stored_at'])}")
        shown.add("stored_at")
    if "at" in e:
        detail.append(f"{'evicted' if state == 'evicted' else state} {_ago(e['at'])}")
        shown.add("at")
    if e.get("pinned"):
        detail.append("pinned by a lease or a load")
    shown.add("pinned")
    if isinstance(e.get("ranks"), dict):
        detail.append("ranks: " + ", ".join(f"{r}={s}" for r, s in sorted(e["ranks"].items())))
        shown.add("ranks")
    for name, v in sorted(e.items()):
        if name not in shown and v not in (None, "", [], {}):
            detail.append(f"{name}={_jsonable(v)}")
    short = key[:16] + "..." if len(key) > 19 else key
    return short, state, "; ".join(d for d in detail if d)


def cmd_explain(args: argparse.Namespace, client: Any) -> int:
    keys = _parse_keys(args.keys)
    entries = _call(lambda: client.explain(args.namespace, keys))
    if args.json:
        emit_json(entries)
        return EXIT_OK
    print(table([_explain_line(e) for e in entries], header=("KEY", "STATE", "DETAIL")))
    return EXIT_OK


COMMANDS: dict[str, Callable[[argparse.Namespace, Any], int]] = {
    "status": cmd_status,
    "stats": cmd_stats,
    "engines": cmd_engines,
    "namespaces": cmd_namespaces,
    "clear": cmd_clear,
    "explain": cmd_explain,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvoffctl",
        description="Inspect and control a running kvoffd over its socket.",
        epilog="Exit codes: 0 ok, 1 the daemon refused the request, 2 a wrong command line, "
               "3 the daemon could not be reached.")
    p.add_argument("--address", default=None,
                   help="daemon address (default: $KVOFFD_ADDRESS, else the daemon's default, "
                        f"currently {default_address()})")
    p.add_argument("--timeout", type=_timeout, default=3.0,
                   help=f"seconds to wait for an answer (default 3, at most {MAX_TIMEOUT_S:g})")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("status", help="is it up; pool use, engines, hit rate, in-flight work")
    sub.add_parser("stats", help="every counter and pool figure as a table")
    sub.add_parser("engines", help="registered engine workers: namespace, rank, pid, last seen")
    sub.add_parser("namespaces", help="blocks and bytes per namespace")
    c = sub.add_parser("clear", help="drop cached blocks (all, or one namespace)")
    c.add_argument("--namespace", default="", help="only this namespace (default: everything)")
    e = sub.add_parser("explain", help="why would these keys miss: resident, evicted (when), never seen")
    e.add_argument("--namespace", required=True, help="the namespace the engine looks keys up in")
    e.add_argument("keys", nargs="+", metavar="KEY", help=f"block key in hex ({2 * KEY_SIZE} digits)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.address = args.address or os.environ.get("KVOFFD_ADDRESS") or default_address()
    client = None
    try:
        if args.command == "explain":
            _parse_keys(args.keys)  # a typo in a key is reported before any connection attempt
        client = connect(args.address, args.timeout)
        return COMMANDS[args.command](args, client)
    except Unreachable as e:
        print(f"kvoffctl: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except DaemonError as e:
        print(f"kvoffctl: {e}", file=sys.stderr)
        return EXIT_DAEMON_ERROR
    except UsageError as e:
        print(f"kvoffctl: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    finally:
        if client is not None:
            client.close()


if __name__ == "__main__":
    sys.exit(main())
