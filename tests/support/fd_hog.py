"""A process that hogs the daemon's fd socket: ``python tests/support/fd_hog.py PATH N``.

It keeps N connections to the fd socket (a SOCK_SEQPACKET UNIX socket) open and silent, opening a new
one at once for each the daemon closes, until its stdin closes; then it prints one JSON line (how many
it opened, how many the daemon closed). It prints ``{"held": N}`` once N are open at the same time. Run
by tests/test_reliability_hostile_peers.py as the daemon's own user (the fd socket is private to it).
"""

from __future__ import annotations

import json
import selectors
import socket
import sys


def hog(path: str, n: int) -> dict:
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, None)
    held: set[socket.socket] = set()
    stats = {"opened": 0, "closed_by_daemon": 0, "connect_failed": 0}
    announced = False
    while True:
        while len(held) < n:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.settimeout(1.0)
            try:
                s.connect(path)
            except OSError:  # a full backlog: try again after the next event
                s.close()
                stats["connect_failed"] += 1
                break
            s.setblocking(False)
            held.add(s)
            sel.register(s, selectors.EVENT_READ, s)
            stats["opened"] += 1
        if not announced and len(held) >= n:
            announced = True
            print(json.dumps({"held": n}), flush=True)
        for key, _ in sel.select(0.05 if len(held) < n else 1.0):
            if key.data is None:
                if not sys.stdin.read(1):
                    for s in held:
                        s.close()
                    return stats
                continue
            s = key.data
            try:
                if s.recv(4096):
                    continue  # a refusal's reason: the close follows
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                pass
            sel.unregister(s)
            held.discard(s)
            s.close()
            stats["closed_by_daemon"] += 1


if __name__ == "__main__":
    print(json.dumps(hog(sys.argv[1], int(sys.argv[2]))), flush=True)
