"""Drill: isolation between users and processes (issue 18, defects 3, 7, 8 and 9; docs/security.md).

- 3: over tcp:// only holders of the daemon's token may talk, and no client can make the daemon map
  memory it could not open itself (memory arrives as a sealed memfd's descriptor, never by path).
- 7: neither the daemon nor a client uses a socket directory another user owns or can write; the
  client caps the frames it accepts.
- 8: nothing is unlinked by pid: an engine in another pid namespace keeps its memory across daemon
  restarts, and a dead engine's memory is freed once the daemon unmaps it.
- 9: registered memory cannot shrink (F_SEAL_SHRINK is required), so no copy can fault (SIGBUS),
  including on the memmove path that Docker's default seccomp forces.

Tests run as root; "another user" is uid 65534, reached by chown or by a forked child that drops to it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import subprocess
import time

import pytest
import zmq
from daemon import DaemonProc
from kvtest import chain_keys, start_daemon, wait_until
from reliability_util import RawPeer, anyone_maps, fd_count, maps_mention, record, wire_memory

from kvoffd.server.fdserver import MAX_PENDING_FDS_PER_PID
from kvoffd_client import protocol as P
from kvoffd_client.client import KvoffdClient
from kvoffd_client.fdpass import FdRefused, send_fd, send_fds
from kvoffd_client.memory.cpu_fd import create_sealed_memfd

NOBODY = 65534

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_nobody(fn) -> dict:
    """Run ``fn()`` in a forked child that has become uid/gid 65534; returns what it returned (JSON)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no shared ZeroMQ context, just the attack
        os.close(r)
        code = 0
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            out = fn()
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out, code = {"crash": repr(e)}, 1
        os.write(w, json.dumps(out).encode())
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


# --- defect 3: tcp:// is authenticated, memory is never named by path ---------------------------------------


def test_tcp_refuses_other_users_and_path_memory(tmp_path, monkeypatch, shm):
    """A process of another uid reaches the tcp:// port: it must learn nothing and map nothing.

    Before the fix it said HELLO without any secret and registered the victim engine's 0600 file as
    its own memory: the daemon (running as the victim's user) mapped it, and the attacker could read
    and write the victim's live KV through STORE and LOAD.
    """
    token_file = tmp_path / "run" / "auth-token"
    monkeypatch.setenv("KVOFFD_AUTH_TOKEN_FILE", str(token_file))  # the daemon's flag and the client's
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    d = start_daemon(address, "16MiB")
    victim_path = f"/dev/shm/kvoffd-{os.getpid()}-victim-{port}"  # a KV file as the old connector made it
    fd = os.open(victim_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 16 * 4096)
        os.pwrite(fd, b"secret" * 100, 0)
        assert oct(token_file.stat().st_mode & 0o777) == "0o600"
        owner = d.client()  # the daemon's user, with the token: served
        eng = shm(16, 4096, tag="tcp-owner")
        assert owner.register("tcp-owner", "tcp", 0, 1, eng.memory, eng.layout).backend == "cpu"
        fd_socket = owner.hello.fd_socket
        layout = {"num_blocks": 16, "segments": [[0, 4096, 4096]]}

        def attack() -> dict:
            out: dict = {}
            try:
                token_file.read_text()
                out["token_file"] = "read"
            except OSError as e:
                out["token_file"] = errno.errorcode[e.errno]
            try:
                send_fd(fd_socket, os.memfd_create("x"), 4096)
                out["fd_socket"] = "accepted"
            except OSError as e:
                out["fd_socket"] = type(e).__name__
            sock = zmq.Context().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            for i, msg in enumerate((P.Hello(seq=1, pid=os.getpid()), P.Hello(seq=2, token="0" * 64),
                                     P.Register(seq=3, engine_id="thief", namespace="tcp", layout=layout,
                                                memory={"kind": "cpu_shm", "path": victim_path, "size": 65536}))):
                sock.send(P.encode(msg))
                reply = P.decode(sock.recv()) if sock.poll(5000) else None
                out[f"reply{i}"] = reply.to_wire() if reply is not None else None
            sock.close()
            return out

        got = _as_nobody(attack)
        assert got.get("token_file") == "EACCES", got
        assert got.get("fd_socket") in ("PermissionError", "UntrustedSocket"), got
        for i in range(2):
            assert got[f"reply{i}"]["code"] == "unauthorized", got
        assert got["reply2"]["op"] == "error", f"the daemon took memory from an unauthenticated peer: {got}"
        assert not maps_mention(d.proc.pid, victim_path), "the daemon mapped the victim's file"
        assert [e["engine_id"] for e in owner.stats()["engines"]] == ["tcp-owner"]
        record("isolation_tcp", attacker=got)
    finally:
        os.close(fd)
        os.unlink(victim_path)
        d.stop()


def test_fd_must_be_a_sealed_memfd_of_the_declared_size(daemon, shm, tmp_path):
    """Only a memfd sealed against shrinking, holding what REGISTER declares, is mapped."""
    p = RawPeer(daemon.address)
    try:
        fd_socket = p.hello()["fd_socket"]
        layout = {"num_blocks": 4, "segments": [[0, 4096, 4096]]}
        plain = os.open(tmp_path / "plain", os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(plain, 4 * 4096)
        unsealed = os.memfd_create("kvoffd-unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(unsealed, 4 * 4096)
        small = create_sealed_memfd(4096, "small")
        try:
            for what, fd in (("a regular file", plain), ("an unsealed memfd", unsealed), ("too small", small)):
                mem = {"kind": "cpu_fd", "token": send_fd(fd_socket, fd, 4 * 4096), "size": 4 * 4096}
                r = p.ask(P.Register(engine_id="iso-fd", namespace="iso-fd", memory=mem, layout=layout))
                assert r["op"] == "error" and r["code"] == "memory_unreachable", (what, r)
            # a token is good for one REGISTER
            good = shm(4, 4096, tag="iso-once")
            mem = wire_memory(fd_socket, good.memory)
            assert p.ask(P.Register(engine_id="iso-fd", namespace="iso-fd", memory=mem, layout=layout))["op"] \
                == "registered"
            r = p.ask(P.Register(engine_id="iso-fd", namespace="iso-fd", memory=mem, layout=layout))
            assert r["code"] == "memory_unreachable", r
            p.ask(P.Unregister(engine_id="iso-fd"))
        finally:
            for fd in (plain, unsealed, small):
                os.close(fd)
    finally:
        p.close()


def test_fd_socket_bounds_what_a_client_can_leave_there(make_daemon, shm):
    """Descriptors waiting for REGISTER are bounded per process, counted in descriptors (a batch that
    would pass the bound is refused at its count, before a descriptor travels); descriptors sent with
    the count are closed; a mapped engine costs the daemon no descriptor (attach keeps none)."""
    d = make_daemon("16MiB", name="iso-bounds")
    c = d.client()
    fd_socket = c.hello.fd_socket
    eng = shm(4, 4096, tag="iso-bounds")
    base = fd_count(d.proc.pid)
    tokens = [send_fd(fd_socket, eng.fd, eng.size) for _ in range(8)]
    assert len(set(tokens)) == 8
    with pytest.raises(FdRefused) as e:  # 8 wait already: a whole batch more does not fit this process
        send_fds(fd_socket, [eng.fd] * MAX_PENDING_FDS_PER_PID, [eng.size] * MAX_PENDING_FDS_PER_PID)
    assert e.value.code == "too_many" and f"at most {MAX_PENDING_FDS_PER_PID} per process" in e.value.message
    # two descriptors in the message that says how many follow: both refused and closed
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(fd_socket)
        socket.send_fds(s, [b"\x82\xa1v\x01\xa5count\x02"], [eng.fd, eng.fd])
        assert b"bad_frame" in s.recv(512)
    assert wait_until(lambda: fd_count(d.proc.pid) == base + 8, 5), fd_count(d.proc.pid)
    # registering consumes the waiting descriptors: mapped, then closed
    for i, t in enumerate(tokens):
        c.request(P.Register(engine_id=f"iso-b{i}", namespace="iso-b", memory={"kind": "cpu_fd", "token": t,
                                                                               "size": eng.size},
                             layout=eng.layout))
    assert len(c.stats()["engines"]) == 8
    assert wait_until(lambda: fd_count(d.proc.pid) == base, 5), "a mapped engine keeps a descriptor open"


# --- defect 7: socket directories of other users ------------------------------------------------------------


def _start(address: str, tmp_path) -> DaemonProc:
    return DaemonProc(address, ["--pool-size", "16MiB", "--metrics-address", "off"]).spawn()


@pytest.mark.parametrize("squat", ["owned_by_nobody", "writable_by_others"])
def test_daemon_refuses_a_socket_directory_it_does_not_control(tmp_path, squat):
    """Before the fix the daemon only warned and served there; the squatter could then replace its
    socket with a fake daemon, or keep it from starting."""
    d = tmp_path / "kvoffd-squat"
    d.mkdir()
    if squat == "owned_by_nobody":
        os.chown(d, NOBODY, NOBODY)
    else:
        d.chmod(0o777)
    proc = _start(f"ipc://{d}/kvoffd.sock", tmp_path)
    try:
        rc = proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the daemon served from a directory {squat.replace('_', ' ')}")
    err = proc.log(0)
    assert rc == 1 and "cannot start" in err and str(d) in err, err
    assert not (d / "kvoffd.sock").exists()


def _fake_daemon(path: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"ipc://{path}")
    return sock


def _serve_hello(fake: zmq.Socket, client: KvoffdClient, timeout_s: float) -> bytes | None:
    """Drive the client (its HELLO goes out only once the connection is up: IMMEDIATE) and answer its
    HELLO like a daemon would; the client's routing id, or None when no HELLO came in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        client.poll(0)
        if fake.poll(20):
            ident, body = fake.recv_multipart()
            fake.send_multipart([ident, P.encode(P.HelloOk(seq=P.decode(body).seq, daemon_id="fake"))])
            return ident
    return None


@pytest.mark.parametrize("squat", ["directory_of_nobody", "socket_of_nobody", "directory_writable_by_all"])
def test_client_never_talks_to_a_socket_another_user_controls(tmp_path, squat):
    """Before the fix the client said HELLO to whatever listened there: a fake daemon answered, learnt
    the engines' memory, and reported loads done with nothing written."""
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    path = str(d / "kvoffd.sock")
    fake = _fake_daemon(path)
    if squat == "directory_of_nobody":
        os.chown(d, NOBODY, NOBODY)
    elif squat == "socket_of_nobody":
        os.chown(path, NOBODY, NOBODY)
    else:
        d.chmod(0o777)
    c = KvoffdClient(f"ipc://{path}", heartbeat=False, timeout_s=1.0)
    try:
        assert _serve_hello(fake, c, 2.0) is None, "the client said HELLO to a socket another user controls"
        assert not c.connect(0.5)
    finally:
        c.close()
        fake.close(0)


def test_client_drops_a_peer_that_sends_oversized_frames(tmp_path):
    path = str(tmp_path / "big.sock")
    fake = _fake_daemon(path)  # trusted: root's socket in root's 0700 directory
    c = KvoffdClient(f"ipc://{path}", heartbeat=False, timeout_s=5.0)
    try:
        ident = _serve_hello(fake, c, 10.0)
        assert ident is not None and c.connect(5.0)
        fake.send_multipart([ident, b"\x00" * (64 << 20)])
        assert wait_until(lambda: not c.connected, 10), "the client took a 64 MiB frame"
    finally:
        c.close()
        fake.close(0)


# --- defect 8: nothing is unlinked by pid ------------------------------------------------------------------


def test_engine_in_another_pid_namespace_survives_daemon_restarts(tmp_path, engines):
    """Before the fix every daemon start (and every UNREGISTER) unlinked /dev/shm/kvoffd-<pid>-* files
    whose pid it could not see: a live engine in another pid namespace lost its KV file and could never
    register again. With memory passed as a descriptor there is no file to lose."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                                                         capture_output=True).returncode:
        pytest.skip("cannot make a pid namespace here (unshare(1) missing or not permitted)")
    address = f"ipc://{tmp_path}/ns.sock"
    d = start_daemon(address, "32MiB")
    try:
        # the engine's pid in its namespace is one that no process has in the daemon's (the old code
        # then took the engine for dead and unlinked its KV file at the next daemon start)
        free = next(p for p in range(20000, 30000) if not os.path.exists(f"/proc/{p}"))
        wrapper = ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c",
                   f'echo {free - 1} > /proc/sys/kernel/ns_last_pid; "$@"', "sh"]
        eng = engines(address, "iso-ns", namespace="iso-ns", blocks=16, wrapper=wrapper)
        keys = chain_keys(4, b"iso-ns")
        eng("fill", ids=[0, 1, 2, 3], seed=5)
        want = eng("digest", ids=[0, 1, 2, 3])
        assert eng.store(1, keys, [0, 1, 2, 3])["ok"]
        d.stop()
        d = start_daemon(address, "32MiB")  # a fresh daemon: the engine re-registers by itself
        c = d.client()
        assert wait_until(lambda: [e["engine_id"] for e in c.stats()["engines"]] == ["iso-ns"], 10), d.log()
        assert eng.store(2, keys, [0, 1, 2, 3])["ok"]
        assert eng.load(3, keys, [4, 5, 6, 7])["ok"]
        assert eng("digest", ids=[4, 5, 6, 7]) == want
    finally:
        d.stop()


def test_dead_engine_memory_is_freed(make_daemon, engines):
    d = make_daemon("32MiB", name="iso-free")
    c = d.client()
    eng = engines(d.address, "iso-free", namespace="iso-free", blocks=16)
    memfd = "/memfd:kvoffd-iso-free (deleted)"
    assert maps_mention(d.proc.pid, memfd)
    eng.kill()
    assert wait_until(lambda: not c.stats()["engines"], 5)
    assert wait_until(lambda: not anyone_maps(memfd), 5), "the dead engine's memory is still held"


# --- defect 9: registered memory cannot shrink -------------------------------------------------------------


@pytest.mark.parametrize("copier", ["process_vm_readv", "memmove"])
def test_a_client_cannot_shrink_registered_memory(tmp_path, shm, copier):
    """Under Docker's default seccomp the copies use memmove, which faults (SIGBUS) on a page past the
    end of a shrunk file: before the fix a client truncating its registered file killed the daemon
    (exit -7). Now the memory must be sealed against shrinking, so the truncation itself fails."""
    env = {**os.environ, "KVOFFD_TEST_FORCE_MEMMOVE": "1" if copier == "memmove" else "0"}
    d = start_daemon(f"ipc://{tmp_path}/shrink.sock", "32MiB", env=env)
    try:
        c = d.client()
        assert [b["method"] for b in c.stats()["daemon"]["backends"] if b["name"] == "cpu"] == [copier]
        eng = shm(64, 8192, tag=f"shrink-{copier}")
        c.register("iso-shrink", "iso-shrink", 0, 1, eng.memory, eng.layout)
        keys = chain_keys(64, b"shrink")
        eng.fill(range(64), keys)
        c.submit_store("iso-shrink", 1, keys, list(range(64)))
        assert c.wait_notices({1}, 10)[0].ok
        refused = []
        for fd in (eng.fd, os.open(f"/proc/self/fd/{eng.fd}", os.O_RDWR)):  # also through a fresh open
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 4096)
            refused.append(True)
            if fd != eng.fd:
                os.close(fd)
        with pytest.raises(PermissionError):  # nor can the seals be lifted or changed
            fcntl.fcntl(eng.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        assert os.fstat(eng.fd).st_size == eng.size
        eng.poison(range(64))
        c.submit_load("iso-shrink", 2, keys, list(range(64)))
        assert c.wait_notices({2}, 10)[0].ok
        assert eng.matches(range(64), keys).all()
        assert d.proc.poll() is None
        record(f"isolation_shrink_{copier}", truncations_refused=len(refused))
    finally:
        assert d.stop() == 0, f"the daemon did not stop cleanly:\n{d.log()}"


def test_a_shared_socket_directory_gets_advice_that_leaves_it_alone(tmp_path):
    """Issue 33 point 1: `--address ipc:///tmp/x.sock` was refused with "run 'chmod 700 /tmp'", advice
    that breaks the machine. The refusal (and the doctor) name private directories instead."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # what /tmp is: sticky, everyone's
    proc = _start(f"ipc://{shared}/kvoffd.sock", tmp_path)
    try:
        rc = proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail("the daemon served from a shared directory")
    err = proc.log(0)
    assert rc == 1 and "cannot start" in err, err
    assert "chmod" not in err and "mkdir -m 700" in err and "leave its mode alone" in err, err
    from kvoffd.ops import doctor_daemon
    from kvoffd.ops.doctor_result import Context

    r = doctor_daemon.check_socket_dir(Context(pool_size=64 << 20, pool_size_source="test", bandwidth_bytes=0,
                                               ipc=False, gpu_timeout_s=60, address=f"ipc://{shared}/kvoffd.sock"))
    assert r.status == doctor_daemon.FAIL and "chmod" not in r.fix and "mkdir -m 700" in r.fix, r
