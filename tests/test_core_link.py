"""The client's link (kvoffd_client.link): its LinkState follows the handshake, step by step.

A fake daemon (a bare ROUTER on a trusted ipc path) answers, or does not, exactly when the test says,
so every transition is driven, none is waited out: HELLO sent (greeting), HELLO_OK (ready), the
daemon forgetting the client (hello_required: down, then a new HELLO), a refused HELLO (down, with the
reason), the socket going away (no longer ready), close (closed).
"""

from __future__ import annotations

import time

import pytest
import zmq
from kvtest import wait_until

from kvoffd_client import protocol as P
from kvoffd_client.client import DaemonUnavailable, KvoffdClient, LinkState

WAIT_S = 20.0  # generous for a loaded machine; nothing is timed


@pytest.fixture
def fake(tmp_path):
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"ipc://{d}/kvoffd.sock")
    yield sock, f"ipc://{d}/kvoffd.sock"
    sock.close(0)


def _next_hello(sock: zmq.Socket, client: KvoffdClient) -> tuple[bytes, P.Hello]:
    """Drive the client until the fake daemon has its next HELLO (other frames are dropped)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        client.poll(0)
        if sock.poll(20):
            ident, body = sock.recv_multipart()
            msg = P.decode(body)
            if isinstance(msg, P.Hello):
                return ident, msg
    pytest.fail("the client sent no HELLO")


def test_link_state_follows_the_handshake(fake):
    sock, address = fake
    c = KvoffdClient(address, heartbeat=False, timeout_s=5.0)
    try:
        assert c.link_state is LinkState.DOWN and not c.connected
        ident, hello = _next_hello(sock, c)
        assert c.link_state is LinkState.GREETING
        assert hello.pid > 0 and hello.start_ticks == P.start_ticks(hello.pid) > 0

        sock.send_multipart([ident, P.encode(P.HelloOk(seq=hello.seq, daemon_id="fake-1"))])
        assert wait_until(lambda: (c.poll(10), c.link_state)[1] is LinkState.READY, WAIT_S)
        assert c.hello is not None and c.daemon_id == "fake-1" and c.refusal == ""

        # the daemon forgot this client: down at once, and a new HELLO goes out
        sock.send_multipart([ident, P.encode(P.Error(seq=0, code=P.ErrorCode.HELLO_REQUIRED.value,
                                                     message="who are you"))])
        ident, hello = _next_hello(sock, c)
        assert c.link_state is LinkState.GREETING

        # that HELLO is refused: down, with the reason (seen by the poll that took the refusal: a
        # later one may already retry)
        sock.send_multipart([ident, P.encode(P.Error(seq=hello.seq, code=P.ErrorCode.UNAUTHORIZED.value,
                                                     message="bad token"))])
        seen: list[LinkState] = []

        def refused() -> bool:
            c.poll(10)
            if c.refusal:
                seen.append(c.link_state)
            return bool(seen)

        assert wait_until(refused, WAIT_S)
        assert seen[0] is LinkState.DOWN and "bad token" in c.refusal
    finally:
        c.close()
    assert c.link_state is LinkState.CLOSED
    c.close()  # twice: a no-op
    with pytest.raises(DaemonUnavailable):  # at once: a closed client never touches its socket
        c.request(P.Ping(), timeout_s=WAIT_S)
    assert c.take_notices() == [] and not c.connected


def test_a_ready_link_goes_down_with_the_socket(fake):
    sock, address = fake
    c = KvoffdClient(address, heartbeat=False, timeout_s=5.0)
    try:
        ident, hello = _next_hello(sock, c)
        sock.send_multipart([ident, P.encode(P.HelloOk(seq=hello.seq, daemon_id="fake-2"))])
        assert wait_until(lambda: (c.poll(10), c.link_state)[1] is LinkState.READY, WAIT_S)
        sock.close(0)  # the daemon's end of the connection closes, as when it exits
        assert wait_until(lambda: (c.poll(10), c.link_state)[1] is not LinkState.READY, WAIT_S)
        assert c.link_state in (LinkState.DOWN, LinkState.GREETING) and not c.connected
    finally:
        c.close()
