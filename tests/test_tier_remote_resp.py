"""The cluster tier's RESP connection (kvoffd/cache/tiers/remote/resp.py) against a peer that stalls.

A large value waits in the kernel (blocking socket, ``SO_RCVTIMEO`` / ``SO_SNDTIMEO``, one
``MSG_WAITALL`` read): these tests hold the deadline and the late-copy rule on that path, where no
Python timeout polls. The peer is a real TCP socket on loopback driven step by step by the test (it
sends half a value, or never reads), so that the stall is where the test puts it, not where a
scheduler happens to leave it. Round trips with real servers are tests/test_tier_remote.py's.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from kvoffd.cache.tiers.remote.resp import KERNEL_WAIT, Broken, Connection

GRACE = 0.5  # one system call's wake-up past a deadline, on a loaded 2-core machine


class Peer:
    """One accepted loopback connection whose bytes the test sends by hand."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.sock: socket.socket | None = None

    def accept(self) -> socket.socket:
        self.sock, _ = self._listener.accept()
        return self.sock

    def close(self) -> None:
        for s in (self.sock, self._listener):
            if s is not None:
                s.close()


@pytest.fixture
def peer():
    p = Peer()
    yield p
    p.close()


def connected(peer: Peer) -> tuple[Connection, socket.socket]:
    conn = Connection("127.0.0.1", peer.port)
    conn.connect(time.monotonic() + 5)
    return conn, peer.accept()


@pytest.mark.parametrize("size", [KERNEL_WAIT - 1, KERNEL_WAIT, 4 << 20])
def test_values_either_side_of_the_kernel_wait_arrive_byte_exact(peer, size):
    conn, srv = connected(peer)
    head_n = 112
    value = np.random.default_rng(size).integers(0, 256, head_n + size, dtype=np.uint8).tobytes()
    sender = threading.Thread(target=srv.sendall, args=(b"$%d\r\n" % len(value) + value + b"\r\n+OK\r\n",))
    sender.start()
    head, dest = bytearray(head_n), np.zeros(size, np.uint8)
    assert conn.bulk_into(memoryview(head), memoryview(dest), time.monotonic() + 10) == len(value)
    sender.join()
    assert bytes(head) + dest.tobytes() == value
    assert conn.reply(time.monotonic() + 5) == b"OK"  # the stream position after the value is right
    conn.close()


def test_a_value_cut_off_midway_times_out_by_the_deadline(peer):
    conn, srv = connected(peer)
    size = 4 << 20
    srv.sendall(b"$%d\r\n" % size + bytes(size // 2))  # half the value, then nothing
    dest = np.zeros(size, np.uint8)
    t = time.monotonic()
    with pytest.raises(Broken, match="timed out"):
        conn.bulk_into(memoryview(bytearray(0)), memoryview(dest), t + 0.3)
    assert time.monotonic() - t < 0.3 + GRACE
    assert not conn.connected  # its stream position is unknown


def test_abort_from_another_thread_ends_a_read_and_nothing_lands_after(peer):
    conn, srv = connected(peer)
    size = 4 << 20
    srv.sendall(b"$%d\r\n" % size + b"\x01" * (size // 2))
    dest = np.zeros(size, np.uint8)
    errors: list[BaseException] = []

    def read() -> None:
        try:
            conn.bulk_into(memoryview(bytearray(0)), memoryview(dest), time.monotonic() + 60)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            errors.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 10
    while not dest[size // 2 - 1] and time.monotonic() < deadline:  # the first half landed: the read waits
        time.sleep(0.001)
    assert dest[size // 2 - 1] == 1
    conn.abort()
    reader.join(5)
    assert not reader.is_alive(), "an aborted read still waits"
    assert errors and isinstance(errors[0], Broken)
    landed = dest.copy()
    try:
        srv.sendall(b"\x02" * (size // 2))  # the rest arrives after the abort: it must land nowhere
    except OSError:
        pass
    assert np.array_equal(dest, landed)
    assert not (dest == 2).any()


def test_a_peer_that_stops_reading_times_a_large_send_out_by_the_deadline(peer):
    conn, srv = connected(peer)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    big = np.zeros(256 << 20, np.uint8)  # far beyond both sockets' buffers
    t = time.monotonic()
    with pytest.raises(Broken, match="timed out"):
        conn.send_parts([b"*3\r\n", memoryview(big), b"\r\n"], t + 0.3)
    assert time.monotonic() - t < 0.3 + GRACE
    assert not conn.connected


def test_a_small_send_and_reply_keep_working_after_a_large_value(peer):
    """The socket goes back to Python's timeouts for lines: a reply that never comes still times out."""
    conn, srv = connected(peer)
    size = 1 << 20
    srv.sendall(b"$%d\r\n" % size + bytes(size) + b"\r\n")
    assert conn.bulk_into(memoryview(bytearray(0)), memoryview(np.zeros(size, np.uint8)),
                          time.monotonic() + 10) == size
    conn.send(b"*1\r\n$4\r\nPING\r\n", time.monotonic() + 5)
    assert srv.recv(64) == b"*1\r\n$4\r\nPING\r\n"
    t = time.monotonic()
    with pytest.raises(Broken, match="timed out"):
        conn.reply(t + 0.2)
    assert time.monotonic() - t < 0.2 + GRACE
