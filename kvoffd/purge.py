"""`kvoffd purge`: give back the memory of a stopped daemon's pool.

A daemon's pool is a set of files on tmpfs (/dev/shm by default), kept when the daemon stops so that
the next start adopts its blocks (a warm restart). Those files are RAM until removed, and a try-out
(`make run`, then Ctrl-C) or a script leaves them there. This command removes them, holding the
pool's lock while it does: a pool a running daemon holds is never touched, and is named instead.

    kvoffd purge                     the pool of the daemon at --address (KVOFFD_ADDRESS, else the
                                     default address), and the one at --pool-path (KVOFFD_POOL_PATH)
    kvoffd purge --stale             every pool of this user that no daemon can come back for (what
                                     each daemon's start removes: kvoffd/pool/reap.py says how
                                     it decides)
    kvoffd purge --all               every pool of this user in /dev/shm that no running daemon holds
                                     (the stopped daemons' next starts are cold)
    --dry-run                        say what would go, remove nothing

Exit codes: 0 done (also when there was nothing to remove); 1 a running daemon holds the pool asked
for (nothing of it removed), or a --pool-path that is not a kvoffd pool file; 2 a wrong command line.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvoffd.config import ConfigError, check_address
from kvoffd.pool.format import pool_beside_socket
from kvoffd.pool.reap import (
    PoolHeld,
    ShmPool,
    held_by,
    is_pool_file,
    pools_of,
    remove_place_if_empty,
    remove_pool,
    shm_pools,
    stale_reason,
)
from kvoffd.units import format_size
from kvoffd_client.paths import default_address


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvoffd purge",
        description="Remove a stopped kvoffd's pool files and give their memory back (they are kept in "
                    "/dev/shm when the daemon stops, so that its next start is warm). A pool a running "
                    "daemon holds is never removed. Run it as the daemon's user.")
    p.add_argument("--address", default=None,
                   help="The address of the daemon whose pool goes. Default: KVOFFD_ADDRESS, else the "
                        "daemon's default address")
    p.add_argument("--pool-path", default=None,
                   help="Its --pool-path, when it was given one. Default: KVOFFD_POOL_PATH")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--stale", action="store_true",
                       help="Every pool of this user that no daemon can come back for (its socket directory "
                            "is gone), as each daemon's start removes them")
    which.add_argument("--all", action="store_true",
                       help="Every pool of this user in /dev/shm that no running daemon holds")
    p.add_argument("--dry-run", action="store_true", help="Say what would be removed; remove nothing")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.stale or args.all:
        return _many(args.all, args.dry_run)
    address = args.address if args.address is not None else os.environ.get("KVOFFD_ADDRESS") or default_address()
    try:
        address = check_address(address, allow_remote=True)
    except ConfigError as e:
        print(f"kvoffd purge: {e}", file=sys.stderr)
        return 2
    pool_path = args.pool_path if args.pool_path is not None else os.environ.get("KVOFFD_POOL_PATH", "")
    if pool_path and pool_path != "none" and not os.path.isabs(pool_path):
        print(f"kvoffd purge: --pool-path must be an absolute path, got {pool_path!r}", file=sys.stderr)
        return 2
    return _of_address(address, "" if pool_path == "none" else pool_path, args.dry_run)


def _of_address(address: str, pool_path: str, dry_run: bool) -> int:
    """The pools of the daemon at ``address``: its directories in /dev/shm, a file at the old name, one
    kept beside its socket, and ``pool_path``."""
    rc, freed, found = 0, 0, 0
    if pool_path and os.path.lexists(pool_path) and not is_pool_file(pool_path):
        print(f"{pool_path} is not a kvoffd pool file: left alone")
        rc = 1
        pool_path = ""
    places = pools_of(address)
    files = [p for p in (pool_path, pool_beside_socket(address)) if p and os.path.lexists(p)
             and all(p != q.path for q in places)]
    for p in places + [ShmPool(f, "", "", 0) for f in files]:
        found += 1
        what = p.directory or p.path
        if dry_run:
            pid = held_by(p.path)
            print(f"would remove {what}" if not pid else f"{what} is held by a running kvoffd (pid {pid}): kept")
            continue
        try:
            n = remove_pool(p)
            remove_place_if_empty(os.path.dirname(p.path))  # a --pool-path in a default directory
        except PoolHeld as e:
            print(f"{e}: kept; stop that daemon first (Ctrl-C, or systemctl stop kvoffd), then run this again")
            rc = 1
            continue
        except OSError as e:
            print(f"cannot remove {what}: {e.strerror}")
            rc = 1
            continue
        if n is None:
            continue  # gone meanwhile
        freed += n
        print(f"removed {what} ({format_size(n)} of memory given back)")
    if not found:
        print(f"no pool of the daemon at {address} (as this user)" + (f" nor at {pool_path}" if pool_path else "")
              + ": nothing to remove")
    elif freed:
        print(f"{format_size(freed)} given back")
    return rc


def _many(everything: bool, dry_run: bool) -> int:
    freed = 0
    for p in shm_pools():
        what = p.directory or p.path
        why = stale_reason(p.address) if p.address else ""
        if not everything and not why:
            continue
        pid = held_by(p.path)
        if pid:
            print(f"{what} is held by a running kvoffd (pid {pid}): kept")
            continue
        if dry_run:
            print(f"would remove {what} ({format_size(p.nbytes)}): "
                  + (why or (f"the pool of {p.address}" if p.address else "no address recorded")))
            continue
        try:
            n = remove_pool(p, still=None if everything else lambda a=p.address: bool(stale_reason(a)))
        except PoolHeld as e:
            print(f"{e}: kept")
            continue
        except OSError as e:
            print(f"cannot remove {what}: {e.strerror}")
            continue
        if n is None:
            continue  # gone meanwhile, or no longer stale
        freed += n
        print(f"removed {what} ({format_size(n)}" + (f"; {why}" if why else "") + ")")
    if not dry_run:
        print(f"{format_size(freed)} given back")
    return 0
