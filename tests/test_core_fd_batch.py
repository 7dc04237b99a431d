"""The fd socket's batches (issue 16): many descriptors, one token, and never one descriptor left behind.

A ``cuda_vmm`` KV cache is one descriptor per 20 MiB piece, thousands of them; they reach the daemon as
one batch on its real fd socket (kvoffd/server/fdserver.py) and come back as one token. What must hold,
counted in the daemon's /proc/<pid>/fd: every descriptor received is either kept under the token until
a REGISTER claims it (once) or closed, whatever the client does: a claim, a REGISTER that is refused
(a CPU daemon does not serve ``cuda_vmm``: the token is consumed all the same), a client that dies
mid-batch, a batch that does not match its count, a batch over the daemon's descriptor budget (refused
before any descriptor travels). Expiry and the batch timeout are driven on the same FdServer class in
this process (their clocks are 30 s and 10 s; ``expire`` takes the time to judge by).
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import socket
import subprocess
import sys
import time

import msgspec
import pytest
from kvtest import ROOT, start_daemon, wait_until
from reliability_util import fd_count

from kvoffd.server import fdserver
from kvoffd_client import fdpass
from kvoffd_client import protocol as P
from kvoffd_client.errors import KvoffdError
from kvoffd_client.memory.cpu_fd import create_sealed_memfd
from kvoffd_client.memory.local import LocalMemory

MiB2 = 2 << 20
N = 300


@pytest.fixture(scope="module")
def fdd(tmp_path_factory):
    """A daemon of its own (its descriptor count is this module's alone) and one client of it."""
    d = start_daemon(f"ipc://{tmp_path_factory.mktemp('fdbatch')}/fdb.sock", "16MiB")
    c = d.client()
    yield d, c
    c.close()
    d.stop()


def _memfds(n: int, size: int = 4096) -> list[int]:
    return [create_sealed_memfd(size, f"batch{i}") for i in range(n)]


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _back_to(pid: int, base: int) -> bool:
    return wait_until(lambda: fd_count(pid) == base, 10)


def _vmm_register(token: str, n: int, size: int = MiB2) -> P.Register:
    return P.Register(engine_id="fdb", namespace="fdb", layout={"num_blocks": 4, "segments": [[0, 4096, 4096]]},
                      memory={"kind": "cuda_vmm", "token": token, "size": size, "device_uuid": "GPU-0",
                              "pieces": [{"offset": i * size, "size": size} for i in range(n)]})


def _raw(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(path)
    return s


def _reply(s: socket.socket) -> P.FdReply:
    return msgspec.msgpack.decode(s.recv(P.MAX_FD_MESSAGE), type=P.FdReply)


def _head(s: socket.socket, count: int) -> P.FdReply:
    s.send(msgspec.msgpack.encode({"v": 1, "count": count}))
    return _reply(s)


def test_three_hundred_descriptors_are_one_token_claimed_once(fdd):
    """300 memfds in one batch (3 messages) are one token; the daemon holds them until a REGISTER names
    it. A CPU daemon refuses the ``cuda_vmm`` REGISTER as before, but the token is consumed and its 300
    descriptors closed; the same token does not work twice."""
    d, c = fdd
    pid = d.proc.pid
    base = fd_count(pid)
    mine = _memfds(N)
    try:
        token = fdpass.send_fds(c.hello.fd_socket, mine, [MiB2] * N)
    finally:
        _close(mine)
    assert _back_to(pid, base + N), "the batch's descriptors are the daemon's until a REGISTER claims them"
    with pytest.raises(KvoffdError) as e:
        c.request(_vmm_register(token, N), 10)
    assert e.value.code == "memory_unreachable" and "not served here" in e.value.message, e.value.message
    assert _back_to(pid, base), f"{fd_count(pid) - base} descriptors of a refused REGISTER left in the daemon"
    with pytest.raises(KvoffdError) as e:  # claimed once: as cpu_fd now, the token is unknown
        c.request(P.Register(engine_id="fdb", namespace="fdb", layout={"num_blocks": 1, "segments": [[0, 4096, 4096]]},
                             memory={"kind": "cpu_fd", "token": token, "size": 4096}), 10)
    assert e.value.code == "memory_unreachable" and "unknown or expired" in e.value.message, e.value.message


def test_cpu_fd_memory_is_one_descriptor(fdd):
    """``cpu_fd`` is a batch of one: a REGISTER naming a batch of two is refused and both are closed; a
    batch of one registers (and its memfd is closed once mapped)."""
    d, c = fdd
    pid = d.proc.pid
    base = fd_count(pid)
    two = _memfds(2, 16 * 4096)
    layout = {"num_blocks": 16, "segments": [[0, 4096, 4096]]}
    try:
        token = fdpass.send_fds(c.hello.fd_socket, two, [16 * 4096] * 2)
        with pytest.raises(KvoffdError) as e:
            c.request(P.Register(engine_id="fdb-cpu", namespace="fdb", layout=layout,
                                 memory={"kind": "cpu_fd", "token": token, "size": 16 * 4096}), 10)
        assert e.value.code == "bad_field" and "one descriptor" in e.value.message, e.value.message
        assert _back_to(pid, base)
        reg = c.register("fdb-cpu", "fdb", 0, 1, LocalMemory(P.CpuFd(token="", size=16 * 4096), [two[0]]), layout)
        assert reg.backend == "cpu"
        assert _back_to(pid, base), "a mapped cpu_fd engine keeps its descriptor"
        c.unregister("fdb-cpu", timeout_s=10)
    finally:
        _close(two)


_HALF = """
import os, socket, sys
import msgspec
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
s.send(msgspec.msgpack.encode({"v": 1, "count": 300}))
assert b"ready" in s.recv(2048)
fds = [os.memfd_create("half") for _ in range(128)]
socket.send_fds(s, [msgspec.msgpack.encode({"sizes": [4096] * 128})], fds)
print("sent", flush=True)
sys.stdin.read()
"""


def test_a_client_that_dies_mid_batch_leaves_nothing(fdd):
    """A client announces 300, sends 128 and is killed (SIGKILL): the 128 the daemon received are closed
    and the 300 it promised are free again (the next batch of 300 from this process is taken)."""
    d, c = fdd
    pid = d.proc.pid
    base = fd_count(pid)
    child = subprocess.Popen([sys.executable, "-c", _HALF, c.hello.fd_socket], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert child.stdout.readline().strip() == "sent"
        assert wait_until(lambda: fd_count(pid) == base + 1 + 128, 10), fd_count(pid) - base  # its socket too
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    finally:
        child.kill()
        child.wait()
    assert _back_to(pid, base), f"{fd_count(pid) - base} descriptors of a dead client left in the daemon"
    mine = _memfds(N)
    try:
        token = fdpass.send_fds(c.hello.fd_socket, mine, [4096] * N)
    finally:
        _close(mine)
    with pytest.raises(KvoffdError):  # consumes it
        c.request(_vmm_register(token, N), 10)
    assert _back_to(pid, base)


def test_a_short_batch_then_close_leaves_nothing(fdd):
    """Half of what was announced, then the connection closed without the rest: all closed."""
    d, c = fdd
    pid = d.proc.pid
    base = fd_count(pid)
    mine = _memfds(100)
    try:
        with _raw(c.hello.fd_socket) as s:
            assert _head(s, 200).ready == 200
            socket.send_fds(s, [msgspec.msgpack.encode({"sizes": [4096] * 100})], mine)
            assert wait_until(lambda: fd_count(pid) == base + 1 + 100, 10), fd_count(pid) - base
    finally:
        _close(mine)
    assert _back_to(pid, base)


@pytest.mark.parametrize("case", ["more than announced", "sizes do not match", "descriptors with the count",
                                  "not msgpack", "count zero", "count over the maximum", "wrong version"])
def test_a_malformed_batch_is_refused_and_closed(fdd, case):
    d, c = fdd
    pid = d.proc.pid
    base = fd_count(pid)
    mine = _memfds(11)
    try:
        with _raw(c.hello.fd_socket) as s:
            if case == "more than announced":
                assert _head(s, 10).ready == 10
                socket.send_fds(s, [msgspec.msgpack.encode({"sizes": [4096] * 11})], mine)
                want = ("bad_frame", "more descriptors than the 10 announced")
            elif case == "sizes do not match":
                assert _head(s, 11).ready == 11
                socket.send_fds(s, [msgspec.msgpack.encode({"sizes": [4096] * 10})], mine)
                want = ("bad_frame", "gives 10 sizes")
            elif case == "descriptors with the count":
                socket.send_fds(s, [msgspec.msgpack.encode({"v": 1, "count": 11})], mine)
                want = ("bad_frame", "with no descriptor")
            elif case == "not msgpack":
                s.send(b"\xc1")
                want = ("bad_frame", "not an fd-socket batch")
            elif case == "count zero":
                s.send(msgspec.msgpack.encode({"v": 1, "count": 0}))
                want = ("bad_field", ">= 1")
            elif case == "count over the maximum":
                s.send(msgspec.msgpack.encode({"v": 1, "count": P.MAX_BATCH_FDS + 1}))
                want = ("bad_field", f"<= {P.MAX_BATCH_FDS}")
            else:
                s.send(msgspec.msgpack.encode({"v": 2, "count": 1}))
                want = ("version_mismatch", "version 2")
            r = _reply(s)
            assert (r.error, want[1] in r.message) == (want[0], True), r
            assert s.recv(P.MAX_FD_MESSAGE) == b"", "the daemon closes the connection after a refusal"
    finally:
        _close(mine)
    assert _back_to(pid, base), f"{fd_count(pid) - base} descriptors of a refused batch left in the daemon"


def _nofile(n: int):
    def set_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
    return set_limit


def test_a_batch_over_the_descriptor_budget_is_refused_before_it_travels(tmp_path):
    """At RLIMIT_NOFILE 1,024 (reserve 256, and REGISTER's reserve above it) a batch of 600 would reach
    into the reserve: refused with one clear error at its count, so not one descriptor reaches the daemon;
    a batch of 300 fits and is taken."""
    d = start_daemon(f"ipc://{tmp_path}/budget.sock", "16MiB", preexec_fn=_nofile(1024))
    c = d.client()
    mine = _memfds(600)
    try:
        pid = d.proc.pid
        base = fd_count(pid)
        with pytest.raises(fdpass.FdRefused) as e:
            fdpass.send_fds(c.hello.fd_socket, mine, [4096] * 600)
        assert e.value.code == "too_many" and "reserve of file descriptors" in e.value.message, e.value.message
        assert "RLIMIT_NOFILE 1024" in e.value.message
        assert _back_to(pid, base)
        assert "refused a batch of 600 descriptors" in d.log()
        token = fdpass.send_fds(c.hello.fd_socket, mine[:N], [MiB2] * N)
        assert _back_to(pid, base + N)
        with pytest.raises(KvoffdError):
            c.request(_vmm_register(token, N), 10)
        assert _back_to(pid, base)
    finally:
        _close(mine)
        c.close()
        d.stop()


# --- the same FdServer in this process: its clocks and bounds driven directly ------------------------------


def _own_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _serve(tmp_path, scenario, **kw):
    async def run():
        srv = fdserver.FdServer(str(tmp_path / "fd.sock"), **kw)
        srv.start(asyncio.get_running_loop())
        try:
            return await scenario(srv)
        finally:
            srv.close()
    return asyncio.run(run())


def test_an_expired_batch_closes_all_its_descriptors(tmp_path):
    async def scenario(srv):
        mine = _memfds(N)
        base = _own_fds() - N
        token = await asyncio.to_thread(fdpass.send_fds, srv.path, mine, [4096] * N)
        _close(mine)
        assert _own_fds() == base + N and srv.held == N
        srv.expire(time.monotonic() + fdserver.TOKEN_TTL_S + 1)
        assert _own_fds() == base and srv.held == 0 and srv.pending == 0
        assert srv.claim(token) is None

    _serve(tmp_path, scenario)


def test_a_batch_that_stops_halfway_is_refused_at_its_deadline(tmp_path):
    """128 of 300 sent, then nothing: at the batch deadline the client is told and the 128 are closed."""
    async def scenario(srv):
        mine = _memfds(128)
        s = _raw(srv.path)
        base = _own_fds()  # (this end of the connection included; the server has not accepted it yet)
        try:
            assert (await asyncio.to_thread(_head, s, N)).ready == N
            await asyncio.to_thread(socket.send_fds, s, [msgspec.msgpack.encode({"sizes": [4096] * 128})], mine)
            while srv.receiving < 128:  # the loop reads it (no clock involved)
                await asyncio.sleep(0.01)
            assert _own_fds() == base + 1 + 128  # (the server's end of the connection)
            srv.expire(time.monotonic() + fdserver.BATCH_TIMEOUT_S + 1)
            r = await asyncio.to_thread(_reply, s)
            assert r.error == "bad_frame" and "128 of the 300" in r.message, r
            assert _own_fds() == base and srv.held == 0
        finally:
            s.close()
            _close(mine)

    _serve(tmp_path, scenario)


def test_waiting_descriptors_are_bounded_per_process_in_descriptors(tmp_path):
    """The bound counts descriptors, not tokens: with room for 500 a process's second batch of 300 is
    refused (before it travels) until the first is claimed; batches promised count too."""
    async def scenario(srv):
        mine = _memfds(N)
        try:
            t1 = await asyncio.to_thread(fdpass.send_fds, srv.path, mine, [4096] * N)
            with pytest.raises(fdpass.FdRefused) as e:
                await asyncio.to_thread(fdpass.send_fds, srv.path, mine, [4096] * N)
            assert e.value.code == "too_many" and "at most 500 per process" in e.value.message
            srv.claim(t1).close()
            s = _raw(srv.path)  # a batch announced but not sent holds its promise
            assert (await asyncio.to_thread(_head, s, N)).ready == N
            with pytest.raises(fdpass.FdRefused):
                await asyncio.to_thread(fdpass.send_fds, srv.path, mine[:201], [4096] * 201)
            s.close()
            while srv.held:
                await asyncio.sleep(0.01)
            t3 = await asyncio.to_thread(fdpass.send_fds, srv.path, mine, [4096] * N)
            srv.claim(t3).close()
            assert srv.held == 0
        finally:
            _close(mine)

    _serve(tmp_path, scenario, per_pid=500)
