"""A connection flood on an HTTP port, run as its own process (as another user, under setpriv) by
tests/test_reliability_metrics_flood.py.

``python tests/support/http_flood.py HOST PORT MODE HOLD`` keeps HOLD connections open at all times, at
full speed: each one the server closes is replaced at once. MODE: ``idle`` (connect, send nothing),
``slow`` (a request head never finished), ``unread`` (a whole /metrics request, hung up on once the answer comes, unread).
It prints ``ready`` once it has opened HOLD connections (or tried to), and, when its stdin closes, one
JSON line: connections opened, refused, replaced after the server closed them.
"""

from __future__ import annotations

import json
import resource
import select
import socket
import sys
import threading
import time

SEND = {"idle": b"", "slow": b"GET /metrics HTTP/1.1\r\nHost: x\r\n", "unread": b"GET /metrics HTTP/1.1\r\n\r\n"}


def flood(host: str, port: int, mode: str, hold: int, stop: threading.Event) -> dict:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    hold = min(hold, hard - 64)
    poller = select.poll()
    held: dict[int, socket.socket] = {}
    opened = refused = replaced = 0
    announced = False
    t0 = time.monotonic()
    while not stop.is_set():
        while len(held) < hold:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.settimeout(1.0)
            try:
                s.connect((host, port))
                if SEND[mode]:
                    s.send(SEND[mode])
            except OSError:
                refused += 1
                s.close()
                break
            s.setblocking(False)
            held[s.fileno()] = s
            poller.register(s.fileno(), select.POLLIN | select.POLLHUP | select.POLLERR)
            opened += 1
        if not announced:
            print("ready", flush=True)
            announced = True
        for fd, _ in poller.poll(1):  # closed by the server, or answered (hung up on, unread)
            s = held[fd]
            poller.unregister(fd)
            del held[fd]
            s.close()
            replaced += 1
    for s in held.values():
        s.close()
    return {"mode": mode, "hold": hold, "opened": opened, "refused": refused, "replaced": replaced,
            "seconds": round(time.monotonic() - t0, 3)}


if __name__ == "__main__":
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    print(json.dumps(flood(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), stop)), flush=True)
