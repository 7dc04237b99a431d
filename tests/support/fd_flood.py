"""A connection flood, run as its own process by tests/test_reliability_fd_budget.py.

``python tests/support/fd_flood.py ipc:///path/kvoffd.sock|seqpacket:///path/kvoffd.sock.fd|tcp://127.0.0.1:PORT
ATTEMPTS HOLD [linger]`` opens
up to ATTEMPTS bare stream connections that never send a byte, holding at most HOLD open at once (the
oldest is closed to make room), and prints one JSON line: how many connected and how many were
refused. With ``linger`` it then keeps the last HOLD open until its stdin closes. Its own process, so the flood neither shares the GIL with the client being measured nor
spends the test process's file descriptors. Run it under ``setpriv --reuid 65534 ...`` to flood as
another user: a connect the kernel refuses (EACCES on a private directory) counts as refused, and
``errors`` says which errors were seen.
"""

from __future__ import annotations

import collections
import errno
import json
import resource
import socket
import sys
import time


def flood(target: str, attempts: int, hold: int, linger: bool = False) -> dict:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    hold = min(hold, hard - 64)
    kind = socket.SOCK_STREAM
    if target.startswith("ipc://"):
        family, addr = socket.AF_UNIX, target[6:]
    elif target.startswith("seqpacket://"):  # the fd socket
        family, addr, kind = socket.AF_UNIX, target[12:], socket.SOCK_SEQPACKET
    else:
        host, port = target[6:].rsplit(":", 1)
        family, addr = socket.AF_INET, (host, int(port))
    held: collections.deque[socket.socket] = collections.deque()
    connected = refused = 0
    peak = 0
    errors: collections.Counter[str] = collections.Counter()
    t0 = time.monotonic()
    for _ in range(attempts):
        while len(held) >= hold:
            held.popleft().close()
        s = socket.socket(family, kind)
        s.settimeout(0.2)
        try:
            s.connect(addr)
        except OSError as e:  # EACCES (another user's directory), ENOENT, ECONNREFUSED, a full backlog's timeout
            refused += 1
            errors[errno.errorcode.get(e.errno, "timeout") if e.errno else "timeout"] += 1
            s.close()
            continue
        connected += 1
        held.append(s)
        peak = max(peak, len(held))
    out = {"attempts": attempts, "connected": connected, "refused": refused, "peak_held": peak,
           "seconds": round(time.monotonic() - t0, 3), "errors": dict(errors)}
    if linger:
        print(json.dumps(out), flush=True)
        sys.stdin.read()
    for s in held:
        s.close()
    return out


if __name__ == "__main__":
    linger = sys.argv[4:5] == ["linger"]
    result = flood(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), linger)
    if not linger:
        print(json.dumps(result), flush=True)
