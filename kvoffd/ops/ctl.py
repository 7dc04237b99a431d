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
import os
import stat
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from kvoffd.ops.ctl_format import emit_json, fmt_dur, fmt_size, jsonable, table
from kvoffd.ops.ctl_status import hit_rate, status_rows
from kvoffd_client.client import DaemonUnavailable, KvoffdClient, KvoffdError
from kvoffd_client.paths import default_address
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
def _timeout(text: str) -> float:
    """--timeout: a finite number of seconds in (0, MAX_TIMEOUT_S]; nan and inf are usage errors."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < v <= MAX_TIMEOUT_S:  # (false for nan too)
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most {MAX_TIMEOUT_S:g} seconds, got {text}")
    return v


# --------------------------------------------------------------------------------------------------
# Commands. Each takes the parsed args and a connected client and returns an exit code.


def cmd_status(args: argparse.Namespace, client: Any) -> int:
    t0 = time.monotonic()
    rtt = _call(client.ping)
    if not isinstance(rtt, (int, float)):
        rtt = time.monotonic() - t0
    st = _call(lambda: client.stats(detail=False))
    if args.json:
        emit_json({"address": args.address, "ping_s": rtt, "stats": st})
        return EXIT_OK
    rows = status_rows(st, args.address, rtt)
    print(table(rows))
    return EXIT_OK


def cmd_ping(args: argparse.Namespace, client: Any) -> int:
    """A liveness check that needs only the daemon's socket (private to its user): the handshake and a
    PING, answered from the event loop. The deployments' liveness probes use it instead of /healthz on
    the metrics port, which every user who can reach that port shares (docs/security.md)."""
    rtt = _call(client.ping)
    if args.json:
        emit_json({"address": args.address, "ping_s": rtt})
    else:
        print(f"kvoffd at {args.address} answered in {rtt * 1000:.2f} ms")
    return EXIT_OK


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
            prow.append((key, fmt_size(pool[key]), pool[key]))
    for key, v in pool.items():
        if not key.endswith("_bytes") or key in {r[0] for r in prow}:
            continue
        prow.append((key, fmt_size(v), v))
    print(table([("  " + a, b, f"{c_:,}" if isinstance(c_, int) else c_) for a, b, c_ in prow],
                header=("  state", "size", "bytes")))
    print()
    print("counters (since start)")
    crow = [("  " + k, f"{v:,}" if isinstance(v, int) else v) for k, v in sorted(c.items())]
    crow.append(("  hit rate (blocks)", hit_rate(c)))
    print(table(crow))
    print()
    print(f"in flight: {st.get('in_flight_jobs', 0)} jobs, oldest {fmt_dur(st.get('oldest_in_flight_s', 0))}; "
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
             e.get("pid", "?"), e.get("backend", "-"), fmt_dur(e.get("registered_s")), fmt_dur(e.get("last_seen_s")),
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
    below = sorted({name for n in spaces for name in (n.get("tiers") or {})})  # tiers under the pool ("disk")
    rows = []
    for n in spaces:
        row = [n.get("namespace", "?"), n.get("world_size", "?"), f"{n.get('blocks', 0):,}", fmt_size(n.get("bytes"))]
        for name in below:
            held = (n.get("tiers") or {}).get(name) or {}
            row += [f"{held.get('blocks', 0):,}", fmt_size(held.get("bytes", 0))]
        rows.append(row)
    header = ["NAMESPACE", "RANKS", "POOL BLOCKS", "POOL SIZE"]
    for name in below:
        header += [f"{name.upper()} BLOCKS", f"{name.upper()} SIZE"]
    print(table(rows, header=header))
    return EXIT_OK


def cmd_clear(args: argparse.Namespace, client: Any) -> int:
    if args.namespace:  # a mistyped namespace would clear nothing and say so as a success
        known = [n.get("namespace") for n in (_call(lambda: client.stats(detail=True)).get("namespaces") or [])]
        if args.namespace not in known:
            raise DaemonError(f"no namespace {args.namespace!r} in the daemon; it holds "
                              + (", ".join(repr(k) for k in known) if known else "none")
                              + " (kvoffctl namespaces lists them)")
    res = _call(lambda: client.clear(namespace=args.namespace or ""))
    removed = getattr(res, "removed_blocks", None)
    in_flight = getattr(res, "in_flight_jobs", None)
    below = getattr(res, "removed_tier_blocks", None) or {}
    if isinstance(res, dict):
        removed, in_flight = res.get("removed_blocks"), res.get("in_flight_jobs")
        below = res.get("removed_tier_blocks") or {}
    if args.json:
        emit_json({"namespace": args.namespace or "", "removed_blocks": removed, "in_flight_jobs": in_flight,
                   "removed_tier_blocks": below})
        return EXIT_OK
    scope = f"namespace {args.namespace!r}" if args.namespace else "all namespaces"
    print(f"cleared {scope}: removed {removed} blocks from the pool"
          + "".join(f", {n} from the {name} tier" for name, n in sorted(below.items())))
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
    return f"{fmt_dur(max(0.0, time.time() - ts))} ago ({time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(ts))})"


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
    if e.get("held"):
        detail.append("held by a lease or a load")
    shown.add("held")
    if isinstance(e.get("ranks"), dict):
        detail.append("ranks: " + ", ".join(f"{r}={s}" for r, s in sorted(e["ranks"].items())))
        shown.add("ranks")
    for name, v in sorted(e.items()):
        if name not in shown and v not in (None, "", [], {}):
            detail.append(f"{name}={jsonable(v)}")
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


def cmd_vllm_config(args: argparse.Namespace, client: Any) -> int:
    """What to give ``vllm serve`` for this daemon's address (no connection needed)."""
    from kvoffd_client.vllm.launch import kv_transfer_config, vllm_serve_argument

    if args.json:
        emit_json(kv_transfer_config(args.address))
    else:
        print(vllm_serve_argument(args.address))
    return EXIT_OK


#: Commands that print without asking the daemon.
OFFLINE = {"vllm-config"}

COMMANDS: dict[str, Callable[[argparse.Namespace, Any], int]] = {
    "vllm-config": cmd_vllm_config,
    "status": cmd_status,
    "ping": cmd_ping,
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
    _common_options(p)
    common = argparse.ArgumentParser(add_help=False)  # the same options after the command too
    _common_options(common, after_command=True)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, parents=[common])

    command("status", "is it up; pool use, engines, hit rate, in-flight work")
    command("ping", "does it answer on its socket (exit 0), for liveness probes")
    command("stats", "every counter and pool figure as a table")
    command("engines", "registered engine workers: namespace, rank, pid, last seen")
    command("namespaces", "blocks and bytes per namespace, in the pool and each tier below it")
    c = command("clear", "drop cached blocks from every tier (all, or one namespace)")
    c.add_argument("--namespace", default="", help="only this namespace, in the pool and on disk (default: "
                   "everything)")
    e = command("explain", "why would these keys miss: resident, evicted (when), never seen")
    e.add_argument("--namespace", required=True, help="the namespace the engine looks keys up in")
    e.add_argument("keys", nargs="+", metavar="KEY", help=f"block key in hex ({2 * KEY_SIZE} digits)")
    command("vllm-config", "the --kv-transfer-config for vllm serve that points at this address")
    return p


def _common_options(p: argparse.ArgumentParser, *, after_command: bool = False) -> None:
    """--address, --timeout and --json. After the command they have no defaults of their own, so an
    option left out there keeps what was given before the command."""
    def default(value: Any) -> Any:
        return argparse.SUPPRESS if after_command else value

    p.add_argument("--address", default=default(None),
                   help="daemon address (default: $KVOFFD_ADDRESS, else the daemon's default, "
                        f"currently {default_address()})")
    p.add_argument("--timeout", type=_timeout, default=default(3.0),
                   help=f"seconds to wait for an answer (default 3, at most {MAX_TIMEOUT_S:g})")
    p.add_argument("--json", action="store_true", default=default(False), help="print JSON instead of tables")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.address = args.address or os.environ.get("KVOFFD_ADDRESS") or default_address()
    client = None
    try:
        if args.command == "explain":
            _parse_keys(args.keys)  # a typo in a key is reported before any connection attempt
        if args.command in OFFLINE:
            return COMMANDS[args.command](args, None)
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
