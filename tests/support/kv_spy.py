"""A would-be subscriber of another user, run by tests/test_reliability_kv_events.py as uid 65534.

``python tests/support/kv_spy.py PUBLISH REPLAY [SERVER_PUBLIC_KEY]`` tries to read a daemon's KV-event
stream the way a router would (SUB for the live stream, a DEALER asking the replay socket for every
batch from 0) and prints one JSON line: for each socket how it went (``connected``; ``EACCES`` and the
like when the kernel refused the connect; ``handshake_failed`` when the daemon refused the ZeroMQ
handshake: no key, or a key it does not allow), how many batches it read and how many token ids they
held. With SERVER_PUBLIC_KEY it uses CURVE with a key pair of its own (one the daemon never allowed).
Each outcome is an event (a connect error, a handshake that succeeded or failed, the replay's end
marker), not a timeout, so the answer does not depend on the machine's speed; TIMEOUT_S is a safety net.
"""

from __future__ import annotations

import errno
import json
import socket
import sys
import time

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

END_SEQ = (-1).to_bytes(8, "big", signed=True)
TIMEOUT_S = 60.0
_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_AUTH,
           zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED}


def _connectable(endpoint: str) -> str:
    """What the kernel says to a plain connect ("connected" or the errno's name)."""
    if endpoint.startswith("ipc://"):
        s, addr = socket.socket(socket.AF_UNIX), endpoint[6:]
    else:
        host, port = endpoint[6:].rsplit(":", 1)
        s, addr = socket.socket(), (host, int(port))
    try:
        s.connect(addr)
        return "connected"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
    finally:
        s.close()


def _handshake(sock: zmq.Socket, mon: zmq.Socket, deadline: float) -> str:
    while time.monotonic() < deadline:
        if not mon.poll(200):
            continue
        ev = recv_monitor_message(mon)["event"]
        if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return "connected"
        if ev in _FAILED:
            return "handshake_failed"
    return "timeout"


def spy(publish: str, replay: str, server_key: bytes | None) -> dict:
    out: dict = {"batches": 0, "token_ids": 0}
    for name, ep in (("publish", publish), ("replay", replay)):
        out[name] = _connectable(ep)
    if out["publish"] != "connected" and out["replay"] != "connected":
        return out
    ctx = zmq.Context()
    deadline = time.monotonic() + TIMEOUT_S
    socks = {}
    for name, kind, ep in (("publish", zmq.SUB, publish), ("replay", zmq.DEALER, replay)):
        s = ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        if kind == zmq.SUB:
            s.setsockopt(zmq.SUBSCRIBE, b"")
        if server_key:
            s.curve_serverkey = server_key
            s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()
        mon = s.get_monitor_socket()
        s.connect(ep)
        out[name] = _handshake(s, mon, deadline)
        socks[name] = s
    if out["replay"] == "connected":
        r = socks["replay"]
        r.send_multipart([b"", (0).to_bytes(8, "big")])
        while time.monotonic() < deadline:
            if not r.poll(200):
                continue
            frames = r.recv_multipart()
            if frames[2] == END_SEQ:
                break
            out["batches"] += 1
            for e in msgpack.unpackb(frames[3], raw=False)[1]:
                out["token_ids"] += len(e.get("token_ids") or [])
    if out["publish"] == "connected":
        while socks["publish"].poll(0):
            socks["publish"].recv_multipart()
            out["live"] = out.get("live", 0) + 1
    ctx.destroy(0)
    return out


if __name__ == "__main__":
    key = sys.argv[3].encode() if len(sys.argv) > 3 else None
    print(json.dumps(spy(sys.argv[1], sys.argv[2], key)), flush=True)
