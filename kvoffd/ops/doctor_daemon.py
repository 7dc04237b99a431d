"""``kvoffd doctor``'s daemon checks: the address (a UNIX socket's directory, its owner and mode: who
can reach the daemon and who can pose as it; a tcp:// address open to the network) and whether a
daemon answers there now.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat

from kvoffd.ops.doctor_result import FAIL, PASS, SKIP, WARN, Context, Result
from kvoffd.ops.doctor_settings import daemon_view
from kvoffd.pool.format import exact_size
from kvoffd.runtime import shared_dir_advice


def _owner(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def check_socket_dir(ctx: Context) -> Result:
    addr = ctx.address
    if not addr.startswith("ipc://"):
        if addr.startswith("tcp://") and not any(h in addr for h in ("127.", "localhost", "[::1]")):
            return Result("socket", WARN, f"address {addr} is reachable from the network: anyone who connects can "
                          "read cached KV blocks and clear the cache",
                          "use an ipc:// address (the default), or bind tcp:// to 127.0.0.1")
        return Result("socket", SKIP, f"address {addr} is not a UNIX socket; no directory to check")
    path = addr[len("ipc://"):]
    d = os.path.dirname(os.path.abspath(path))
    fix_mode = (f"chmod 0700 {d} (or 0750 with a group the engines' user is in; the systemd unit's "
                "RuntimeDirectory does this); chown it to the daemon's user")
    try:
        st = os.stat(d)
    except FileNotFoundError:
        parent = os.path.dirname(d)
        if os.access(parent, os.W_OK | os.X_OK):
            return Result("socket", PASS, f"{d} does not exist yet; the daemon creates it (0700) on start")
        return Result("socket", FAIL, f"{d} does not exist and this user cannot create it in {parent}",
                      f"create it: install -d -m 0700 -o <daemon user> {d}, or set --address/KVOFFD_ADDRESS to a "
                      "directory the daemon's user owns")
    except PermissionError:
        return Result("socket", FAIL, f"cannot look into {os.path.dirname(d)} to reach {d}",
                      "run the doctor (and the engines) as the daemon's user or a member of its group")
    mode = stat.S_IMODE(st.st_mode)
    who = f"{d} is {mode:04o}, owner {_owner(st.st_uid)}, group {_group(st.st_gid)}"
    if mode & 0o022:  # never advise changing a shared directory's mode (/tmp)
        fix_mode = shared_dir_advice(d, st, "--address", ["ipc:///run/kvoffd/kvoffd.sock (as root or from "
                                                          "systemd's RuntimeDirectory=kvoffd)"])
    if not stat.S_ISDIR(st.st_mode):
        return Result("socket", FAIL, f"{d} is not a directory", fix_mode)
    if mode & 0o002 and not mode & stat.S_ISVTX:
        return Result("socket", FAIL, who + "; anyone can replace the socket and pose as the daemon", fix_mode)
    if mode & 0o007:
        return Result("socket", FAIL, who + "; every user on this host can reach the socket (and read cached KV "
                      "blocks or clear them)", fix_mode)
    if mode & 0o020:
        return Result("socket", WARN, who + f"; members of group {_group(st.st_gid)} can replace the socket",
                      fix_mode)
    if st.st_uid != os.geteuid():
        return Result("socket", WARN, who + f"; you are {_owner(os.geteuid())}: the daemon must run as "
                      f"{_owner(st.st_uid)}, and engines need group access to connect", fix_mode)
    note = f"; group {_group(st.st_gid)} may connect" if mode & 0o050 else ""
    return Result("socket", PASS, who + note)


def check_daemon(ctx: Context) -> Result:
    """Whether a daemon answers at the address (informative: the doctor usually runs before one starts).
    Asked once per run (kvoffd/ops/doctor_settings.py): the pool-file check uses the same answer."""
    if ctx.daemon_error is None:
        ctx.daemon, ctx.daemon_error = daemon_view(ctx.address)
    v = ctx.daemon
    if v is not None:
        pool = f"its pool {exact_size(v.pool_bytes)} in " + (v.pool_path or "private memory")
        return Result("daemon", PASS, f"kvoffd {v.version} (pid {v.pid}) answers at {ctx.address}; {v.engines} "
                      f"engines registered; {pool}")
    if not ctx.daemon_error:
        return Result("daemon", SKIP, f"no daemon socket at {ctx.address} (not started yet)")
    return Result("daemon", WARN, ctx.daemon_error,
                  "start kvoffd, or remove a stale socket left by a daemon that died")
