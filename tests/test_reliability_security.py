"""Drill: security. Who may address what, and every per-client bound (docs/security.md).

Already covered elsewhere and not repeated here: socket directory 0700 / socket 0600 and a second
daemon refusing the socket (tests/test_core_config.py::test_socket_directory_and_socket_are_private);
``tcp://*`` rewritten to loopback unless --allow-remote (test_core_config.py::test_tcp_binds_loopback_unless_told);
frames between 8 and 16 MiB answered frame_too_large, out-of-range block ids, another connection
naming an engine for LOAD (tests/test_core_validation.py). Six tests here began as failing tests
for bugs this drill found (docs/security.md, "Findings from the drills"); they pass since the fixes.
"""

from __future__ import annotations

import os
import socket
import time

import pytest
from daemon import DaemonProc
from kvtest import chain_keys, wait_until
from reliability_util import RawPeer, ShmEngine, fd_count, record

from kvoffd.server.limits import (
    HARD_FRAME_LIMIT,
    MAX_ENGINES_PER_CONN,
    MAX_JOBS_PER_CONN,
    MAX_LEASES_PER_CONN,
)
from kvoffd_client import protocol as P
from kvoffd_client.client import KvoffdClient


@pytest.fixture
def peer_of():
    made: list[RawPeer] = []

    def make(address: str, hello: bool = True) -> RawPeer:
        p = RawPeer(address)
        if hello:
            p.hello()
        made.append(p)
        return p

    yield make
    for p in made:  # leave no engine behind in the shared daemon (a raw peer has no pidfd to end it)
        try:
            stats = p.ask(P.Stats(), 1)
            if stats.get("op") == "stats_result":
                for e in stats["stats"]["engines"]:
                    if e["pid"] == 0 and e["engine_id"].startswith("sec-"):
                        p.send_msg(P.Unregister(engine_id=e["engine_id"]))
                p.barrier(1)
        except (TimeoutError, KeyError):
            pass
        p.close()


def _register(peer: RawPeer, engine_id: str, eng: ShmEngine, namespace: str = "sec", **kw) -> dict:
    return peer.ask(P.Register(engine_id=engine_id, namespace=namespace, memory=eng.memory, layout=eng.layout,
                               **kw))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _non_loopback_ipv4() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            ip = s.getsockname()[0]
    except OSError:
        return None
    return None if ip.startswith("127.") else ip


# --- network exposure --------------------------------------------------------------------------------------


def test_tcp_wildcard_listens_on_loopback_only(tmp_path, monkeypatch):
    """The config test checks the rewrite; this checks the live socket the kernel has."""
    port = _free_port()
    monkeypatch.setenv("KVOFFD_AUTH_TOKEN_FILE", str(tmp_path / "run" / "auth-token"))  # daemon and client
    proc = DaemonProc(f"tcp://*:{port}", ["--pool-size", "16MiB", "--metrics-address", "off"]).start()
    c = KvoffdClient(f"tcp://127.0.0.1:{port}", heartbeat=False)
    try:
        assert c.connect(20)
        assert c.stats()["daemon"]["address"] == f"tcp://127.0.0.1:{port}"
        listening = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                for line in list(f)[1:]:
                    local, state = line.split()[1], line.split()[3]
                    if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                        listening.append(local.rsplit(":", 1)[0])
        assert listening == ["0100007F"], f"port {port} listens on {listening}, not only 127.0.0.1"
        ip = _non_loopback_ipv4()
        if ip:
            with socket.socket() as s, pytest.raises(OSError):
                s.settimeout(2)
                s.connect((ip, port))
    finally:
        c.close()
        proc.stop()


# --- memory: only what the engine registered ---------------------------------------------------------------


def test_register_refuses_segments_past_the_region(daemon, peer_of, shm):
    p = peer_of(daemon.address)
    eng = shm(8, 4096, tag="bounds")
    lay = dict(eng.layout)
    for layout in ({**lay, "num_blocks": 9},  # one block too many
                   {"num_blocks": 8, "segments": [[4096, 4096, 4096]]},  # shifted by one block
                   {"num_blocks": 1, "segments": [[eng.size - 4095, 0, 4096]]},  # one byte past the end
                   {"num_blocks": 2, "segments": [[0, 1 << 62, 4096]]}):  # the stride flies off
        r = p.ask(P.Register(engine_id="sec-bounds", namespace="sec-bounds", memory=eng.memory, layout=layout))
        assert r["op"] == "error" and r["code"] in ("memory_unreachable", "layout_mismatch"), (layout, r)
    r = p.ask(P.Register(engine_id="sec-bounds", namespace="sec-bounds", layout=lay,
                         memory={"kind": "cpu_fd", "fd": eng.fd, "size": eng.size + 4096}))  # claims more than the file holds
    assert r["code"] == "memory_unreachable"


def test_register_refuses_memory_named_by_path(daemon, peer_of, shm, tmp_path):
    """Defect 3 (issue 18): the daemon must never open memory by name with its own rights; a client
    hands it a descriptor or nothing. Before the fix a client could name any /dev/shm/kvoffd-* file,
    another engine's included (and, through a symlinked directory, files elsewhere)."""
    eng = shm(16, 4096, tag="bypath")
    path = f"/dev/shm/kvoffd-{os.getpid()}-sec-bypath"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, eng.size)
        p = peer_of(daemon.address)
        r = p.ask(P.Register(engine_id="sec-bypath", namespace="sec-bypath", layout=eng.layout,
                             memory={"kind": "cpu_shm", "path": path, "size": eng.size}))
        assert r["op"] == "error" and r["code"] == "memory_unreachable", r
    finally:
        os.close(fd)
        os.unlink(path)


def test_failed_reregistration_keeps_the_engine(daemon, peer_of, shm):
    p = peer_of(daemon.address)
    eng = shm(8, 4096, tag="rereg")
    assert _register(p, "sec-rereg", eng, "sec-rereg")["op"] == "registered"
    r = p.ask(P.Register(engine_id="sec-rereg", namespace="sec-rereg", layout=eng.layout,
                         memory={"kind": "cpu_fd", "token": "0" * 32, "size": eng.size}))
    assert r["code"] == "memory_unreachable"
    keys = chain_keys(2, b"rereg")
    eng.fill([0, 1], keys)
    p.send_msg(P.Store(engine_id="sec-rereg", job_id=1, keys=keys, block_ids=[0, 1]))
    r = p.recv_until(lambda r: r.get("job_id") == 1, 2.0)[-1]
    assert r["op"] == "notice" and r["ok"], f"the engine was lost by a refused REGISTER: {r}"


def test_refused_registration_leaves_no_namespace(daemon, peer_of, shm):
    p = peer_of(daemon.address)
    eng = shm(8, 4096, tag="poison")
    r = p.ask(P.Register(engine_id="sec-poison-x", namespace="sec-poison", world_size=4, layout=eng.layout,
                         memory={"kind": "cpu_fd", "token": "0" * 32, "size": eng.size}))
    assert r["code"] == "memory_unreachable"
    # the namespace's real engine (world size 1) must still be able to register
    r = _register(p, "sec-poison-0", eng, "sec-poison")
    assert r["op"] == "registered", f"a refused REGISTER poisoned the namespace: {r}"


# --- jobs, engines and leases: only one's own ---------------------------------------------------------------


def test_engines_belong_to_their_connection(daemon, peer_of, shm):
    owner, other = peer_of(daemon.address), peer_of(daemon.address)
    eng = shm(8, 4096, tag="own")
    assert _register(owner, "sec-own", eng, "sec-own")["op"] == "registered"
    keys = chain_keys(2, b"sec-own")
    for msg in (P.Store(engine_id="sec-own", job_id=1, keys=keys, block_ids=[0, 1]),
                P.Load(engine_id="sec-own", job_id=1, keys=keys, block_ids=[0, 1]),
                P.Unregister(engine_id="sec-own"),
                P.Register(engine_id="sec-own", namespace="sec-own", memory=eng.memory, layout=eng.layout)):
        r = other.ask(msg)
        assert r["op"] == "error" and r["code"] == "foreign_engine", (msg.op, r)
    assert [e["engine_id"] for e in daemon.client().stats()["engines"] if e["engine_id"] == "sec-own"]
    eng.fill([0, 1], keys)
    owner.send_msg(P.Store(engine_id="sec-own", job_id=1, keys=keys, block_ids=[0, 1]))
    assert owner.recv_until(lambda r: r.get("op") == "notice")[-1]["ok"]
    assert other.recv(0.2) is None, "another connection received the owner's notice"


def test_a_job_refused_for_its_engine_fails_at_once(daemon):
    """Right after a daemon restart the client re-registers asynchronously; a LOAD that arrives first is
    refused not_registered. The ERROR must name the job so the request fails now, not 30 s later."""
    c = daemon.client(job_deadline_s=30.0)
    for engine in ("sec-nobody",):
        t0 = time.monotonic()
        c.submit_load(engine, 1, chain_keys(2, b"refused"), [0, 1])
        got = c.wait_notices({1}, 3.0)
        assert got and not got[0].ok and got[0].code == "not_registered", \
            f"no notice for a refused job after {time.monotonic() - t0:.1f} s"


def test_job_ids_are_per_connection_and_never_replayed_while_in_flight(make_daemon, peer_of, shm):
    d = make_daemon("256MiB", name="jobs")
    a, b = peer_of(d.address), peer_of(d.address)
    big_a = shm(4, 32 << 20, layers=2, tag="jobs-a")  # 32 MiB blocks: a 4-block job moves 128 MiB
    small_b = shm(4, 4096, tag="jobs-b")
    assert _register(a, "sec-ja", big_a, "sec-ja")["op"] == "registered"
    assert _register(b, "sec-jb", small_b, "sec-jb")["op"] == "registered"
    ka, kb = chain_keys(4, b"ja"), chain_keys(4, b"jb")
    big_a.fill(range(4), ka)
    small_b.fill(range(4), kb)
    a.send_msg(P.Store(engine_id="sec-ja", job_id=7, keys=ka, block_ids=range(4)))
    assert a.recv_until(lambda r: r.get("op") == "notice")[-1]["ok"]
    big_a.poison(range(4))
    # job 7 of A in flight; A replays it at once; B uses the same id for its own engine
    a.send_msg(P.Load(engine_id="sec-ja", job_id=8, keys=ka, block_ids=range(4)))
    dup_seq = a.send_msg(P.Load(engine_id="sec-ja", job_id=8, keys=ka, block_ids=range(4)))
    b.send_msg(P.Store(engine_id="sec-jb", job_id=8, keys=kb, block_ids=range(4)))
    rb = b.recv_until(lambda r: r.get("op") == "notice")
    assert rb[-1]["job_id"] == 8 and rb[-1]["ok"]
    ra = a.recv_until(lambda r: r.get("op") == "notice", 30)
    dup = [r for r in ra if r.get("seq") == dup_seq]
    assert dup and dup[0]["op"] == "error" and dup[0]["code"] == "duplicate_job" and dup[0]["job_id"] == 8
    assert ra[-1]["job_id"] == 8 and ra[-1]["ok"]
    assert a.recv(0.3) is None, "a job got two notices"
    assert big_a.matches(range(4), ka).all()
    # once over, a job id may be used again
    a.send_msg(P.Load(engine_id="sec-ja", job_id=8, keys=ka[:1], block_ids=[0]))
    assert a.recv_until(lambda r: r.get("op") == "notice")[-1]["ok"]


def test_a_lease_is_released_only_by_its_owner(daemon, peer_of, shm):
    owner, other = peer_of(daemon.address), peer_of(daemon.address)
    eng = shm(4, 4096, tag="lease")
    assert _register(owner, "sec-lease", eng, "sec-lease")["op"] == "registered"
    keys = chain_keys(4, b"sec-lease")
    eng.fill(range(4), keys)
    owner.send_msg(P.Store(engine_id="sec-lease", job_id=1, keys=keys, block_ids=range(4)))
    assert owner.recv_until(lambda r: r.get("op") == "notice")[-1]["ok"]
    lease = owner.ask(P.Lookup(namespace="sec-lease", keys=keys, lease_ms=60_000))["lease_id"]
    assert lease
    other.send_msg(P.Release(lease_id=lease))
    other.barrier()
    entries = daemon.client().explain("sec-lease", keys)
    assert all(e.get("held") for e in entries), "another connection released the owner's lease"


def test_a_load_naming_a_lease_consumes_it_only_with_its_blocks(daemon, peer_of, shm):
    """Issue 19 item 16: a zero-key LOAD (or one of other keys) naming someone else's lease id must not
    release it; the worker's LOAD of the leased blocks does (another connection, by design)."""
    owner, other = peer_of(daemon.address), peer_of(daemon.address)
    a, b = shm(8, 4096, tag="lease-a"), shm(8, 4096, tag="lease-b")
    assert _register(owner, "sec-lz-a", a, "sec-lz")["op"] == "registered"
    assert _register(other, "sec-lz-b", b, "sec-lz")["op"] == "registered"
    keys, others = chain_keys(4, b"sec-lz"), chain_keys(2, b"sec-lz-other")
    a.fill(range(6), keys + others)
    owner.send_msg(P.Store(engine_id="sec-lz-a", job_id=1, keys=keys + others, block_ids=range(6)))
    assert owner.recv_until(lambda r: r.get("op") == "notice")[-1]["ok"]
    lease = owner.ask(P.Lookup(namespace="sec-lz", keys=keys, lease_ms=60_000))["lease_id"]
    assert lease
    other.send_msg(P.Load(engine_id="sec-lz-b", job_id=2, keys=b"", block_ids=b"", lease_id=lease))
    other.send_msg(P.Load(engine_id="sec-lz-b", job_id=3, keys=others, block_ids=[0, 1], lease_id=lease))
    other.recv_until(lambda r: r.get("op") == "notice" and r.get("job_id") == 3)
    assert daemon.client().stats()["leases"] >= 1
    assert all(e.get("held") for e in daemon.client().explain("sec-lz", keys)), "a keyless LOAD took the lease"
    other.send_msg(P.Load(engine_id="sec-lz-b", job_id=4, keys=keys[2:], block_ids=[4, 5], lease_id=lease))
    assert other.recv_until(lambda r: r.get("op") == "notice" and r.get("job_id") == 4)[-1]["ok"]
    assert not any(e.get("held") for e in daemon.client().explain("sec-lz", keys)), "the LOAD kept the lease"


# --- per-connection bounds ---------------------------------------------------------------------------------


def test_lease_bound_per_connection(make_daemon, peer_of, shm):
    d = make_daemon("16MiB", name="leases")
    p = peer_of(d.address)
    eng = shm(4, 4096, tag="leases")
    assert _register(p, "sec-leases", eng, "sec-leases")["op"] == "registered"
    keys = chain_keys(1, b"leases")
    eng.fill([0], keys)
    p.send_msg(P.Store(engine_id="sec-leases", job_id=1, keys=keys, block_ids=[0]))
    assert p.recv_until(lambda r: r.get("op") == "notice")[-1]["ok"]
    t0 = time.monotonic()
    for _ in range(MAX_LEASES_PER_CONN + 10):
        p.send_msg(P.Lookup(namespace="sec-leases", keys=keys, lease_ms=600_000))
    replies = p.barrier(60)
    leased = [r for r in replies if r["op"] == "lookup_result" and r["lease_id"]]
    refused = [r for r in replies if r["op"] == "error"]
    assert len(leased) == MAX_LEASES_PER_CONN and len(refused) == 10
    assert all(r["code"] == "too_many" for r in refused)
    assert p.ask(P.Lookup(namespace="sec-leases", keys=keys))["hits"] == 1  # served, without a lease
    other = d.client()
    assert other.lookup("sec-leases", keys, lease_ms=1000).lease_id  # others are not limited by it
    p.send_msg(P.Release(lease_id=leased[0]["lease_id"]))
    assert p.ask(P.Lookup(namespace="sec-leases", keys=keys, lease_ms=1000))["lease_id"]  # room again
    record("bound_leases", max_leases=MAX_LEASES_PER_CONN, refused=len(refused),
           seconds=round(time.monotonic() - t0, 2))


def test_engine_bound_per_connection(make_daemon, peer_of, shm):
    d = make_daemon("16MiB", name="engines")
    p = peer_of(d.address)
    eng = shm(4, 4096, tag="engines")
    for i in range(MAX_ENGINES_PER_CONN):
        assert _register(p, f"sec-e{i}", eng, f"sec-e{i}")["op"] == "registered"
    r = _register(p, "sec-e-extra", eng, "sec-e-extra")
    assert r["op"] == "error" and r["code"] == "too_many"
    assert p.ask(P.Ping())["op"] == "pong"
    assert len(d.client().stats()["engines"]) == MAX_ENGINES_PER_CONN
    assert p.ask(P.Unregister(engine_id="sec-e0"))["op"] == "ok"
    assert _register(p, "sec-e-extra", eng, "sec-e-extra")["op"] == "registered"


def test_job_bound_per_connection(make_daemon, peer_of, shm):
    """4,096 jobs in flight on one connection, then too_many; the daemon stays responsive."""
    d = make_daemon("128MiB", "--copy-threads", "1", name="jobs-bound")
    p = peer_of(d.address)
    eng = shm(1, 32 << 20, layers=1, tag="jobs-bound")  # one 32 MiB block: each job copies 32 MiB
    assert _register(p, "sec-jobs", eng, "sec-jobs")["op"] == "registered"
    keys = chain_keys(1, b"jobs-bound")
    p.send_msg(P.Store(engine_id="sec-jobs", job_id=0, keys=keys, block_ids=[0]))
    assert p.recv_until(lambda r: r.get("op") == "notice")[-1]["ok"]
    n = MAX_JOBS_PER_CONN + 200
    frames = [P.encode(P.Load(seq=10 + i, engine_id="sec-jobs", job_id=i + 1, keys=keys, block_ids=[0]))
              for i in range(n)]
    t0 = time.monotonic()
    for f in frames:
        p.send(f)
    refused: list[dict] = []
    watcher = d.client()
    deadline = time.monotonic() + 60
    while not refused and time.monotonic() < deadline:
        r = p.recv(1.0)
        if r and r["op"] == "error":
            refused.append(r)
    assert refused and refused[0]["code"] == "too_many" and refused[0]["job_id"] > MAX_JOBS_PER_CONN // 2
    t1 = time.monotonic()
    watcher.ping(5)  # another client is served while 4,096 copies queue
    ping_s = time.monotonic() - t1
    in_flight = watcher.stats()["engines"][0]["in_flight"]  # accepted jobs (in_flight_jobs: started ones)
    assert in_flight >= MAX_JOBS_PER_CONN - 200
    record("bound_jobs", max_jobs=MAX_JOBS_PER_CONN, first_refused_job=refused[0]["job_id"],
           in_flight_when_refused=in_flight, other_client_ping_ms=round(ping_s * 1000, 1),
           seconds_to_refusal=round(t1 - t0, 2))
    d.stop()  # the 4,000 queued 32 MiB copies are not worth waiting for


def test_frame_past_the_hard_limit_drops_only_that_peer(daemon, peer_of):
    """Between 8 and 16 MiB: frame_too_large (test_core_validation). Past 16 MiB libzmq cuts the peer off."""
    bad = peer_of(daemon.address)
    bad.send(b"\0" * (HARD_FRAME_LIMIT + 1))
    assert bad.recv(1.0) is None
    c = daemon.client()
    assert c.ping(5) < 5
    fresh = peer_of(daemon.address)
    assert fresh.ask(P.Ping())["op"] == "pong"


def test_connection_churn_does_not_leak_descriptors(make_daemon):
    d = make_daemon("16MiB", name="churn")
    pid = d.proc.pid
    before = fd_count(pid)
    for _ in range(300):
        p = RawPeer(d.address)
        p.hello(pid=os.getpid(), start_ticks=P.start_ticks())
        p.close()
    c = d.client()
    assert wait_until(lambda: fd_count(pid) <= before + 20, 2), \
        f"daemon fds {before} -> {fd_count(pid)} after 300 closed connections"
    assert c.ping(5) < 5
