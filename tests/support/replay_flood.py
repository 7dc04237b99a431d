"""Replay requests nobody reads, run by tests/test_reliability_kv_events.py (as another user).

``python tests/support/replay_flood.py REPLAY PEERS REQUESTS`` opens PEERS DEALER connections to a
KV-event replay endpoint; each asks REQUESTS times for every batch from 0 and then reads nothing. It prints one JSON line once
every request is written to its socket, then holds the connections until its stdin closes, so the
replies the daemon queued for them stay unread for as long as the test measures.
"""

from __future__ import annotations

import json
import sys
import time

import zmq
from zmq.utils.monitor import recv_monitor_message


def flood(replay: str, peers: int, requests: int) -> dict:
    ctx = zmq.Context()
    ctx.setsockopt(zmq.MAX_SOCKETS, peers + 64)
    socks, t0 = [], time.monotonic()
    for _ in range(peers):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, 1)  # read nothing, queue next to nothing here: the daemon's side holds it
        s.setsockopt(zmq.RCVBUF, 4096)
        mon = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        s.connect(replay)
        for _ in range(requests):
            s.send_multipart([b"", (0).to_bytes(8, "big")])
        socks.append((s, mon))
    for _, mon in socks:  # each request is on the wire once its connection's handshake is done
        recv_monitor_message(mon)
    print(json.dumps({"peers": peers, "requests": peers * requests, "seconds": round(time.monotonic() - t0, 3)}), flush=True)
    sys.stdin.read()
    ctx.destroy(0)
    return {}


if __name__ == "__main__":
    flood(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
