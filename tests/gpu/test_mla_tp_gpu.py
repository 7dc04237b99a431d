"""Issue 12 point 3 on a GPU: MLA latents of TP ranks 0 and 1 stored once, loaded into both ranks.

Two stand-in engines (bench/support/standin.py) in their own processes on the one GPU act as TP ranks 0
and 1 of an MLA model (one 576-wide latent per token: 18,432-byte pages of 16 tokens, as vLLM's
MLAAttentionSpec gives), each exporting its own KV memory by CUDA IPC to a real daemon running the
CUDA backend. They register one namespace with ``replicas=2``: rank 0 stores, the daemon holds one
copy per block, and both ranks load it byte-exact into their own (scrambled) blocks. Rank 1's STORE
and a rank of another layout are refused.
"""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCKS = 512
N = 200


@pytest.fixture
def make_daemon(tmp_path):
    """Start a real daemon on the CUDA backend (LRU: no admission refusals); returns its address."""
    from daemon import DaemonProc  # tests/support

    procs: list[DaemonProc] = []

    def start(pool: str) -> str:
        d = DaemonProc(f"ipc://{tmp_path}/mla{len(procs)}.sock", ["--pool-size", pool, "--backend", "cuda",
                                                                   "--eviction-policy", "lru", "--metrics-address",
                                                                   "127.0.0.1:0"],
                       log_path=tmp_path / f"daemon{len(procs)}.log")
        procs.append(d)
        try:
            d.start(20)
        except RuntimeError as e:
            pytest.fail(f"daemon did not come up:\n{e}")
        return d.address

    yield start
    for d in procs:
        d.stop(signal.SIGTERM, 20)


def _mla_engine(address: str, rank: int, head_dim: int = 288):
    """A TP rank of a tiny MLA model: 8 layers of [B, 1, 16, 2*head_dim] bf16 (576 = 512 latent + 64 rope)."""
    from support.standin import Engine, Spec

    e = Engine(Spec(layout="layers", num_blocks=BLOCKS, layers=8, heads=1, tokens=16, head_dim=head_dim))
    e("randomize", seed=100 + rank)
    e("connect", address=address)
    return e


def _register(e, rank: int, head_dim: int = 288) -> None:
    e("register", engine_id=f"mla-r{rank}-{head_dim}", namespace="gpu-mla", rank=rank, world_size=2, replicas=2)


def _jobs(eng, rank: int, *jobs: tuple, lease_id: int = 0) -> dict:
    got = eng("jobs", engine_id=f"mla-r{rank}-288", jobs=list(jobs), lease_id=lease_id, timeout=60.0)
    return got["notices"]


def test_mla_tp2_one_copy_in_the_daemon_both_ranks_load_it(make_daemon):
    daemon_address = make_daemon("2GiB")
    keys = [bytes(k) for k in np.random.default_rng(12).integers(0, 256, (N, 32), dtype=np.uint8)]
    src, dst = list(range(N)), list(range(256, 256 + N))
    r0, r1 = _mla_engine(daemon_address, 0), _mla_engine(daemon_address, 1)
    other = _mla_engine(daemon_address, 1, head_dim=256)
    try:
        _register(r0, 0)
        _register(r1, 1)
        assert r0("export")["block_bytes"] == 8 * 18432
        want = r0("digest", ids=src)
        assert r1("digest", ids=dst) != want  # rank 1 holds other bytes before it loads
        assert _jobs(r0, 0, ("store", 1, keys, src, -1)) == {1: (True, "", "", [])}
        stats = r0("client", method="stats")
        ns = next(x for x in stats["namespaces"] if x["namespace"] == "gpu-mla")
        assert (ns["blocks"], ns["ranks"], ns["replicas"]) == (N, [0], 2)  # one copy per block
        assert stats["pool"]["used_bytes"] == N * 8 * 18432
        lease = r0("client", method="lookup", args=["gpu-mla", keys], kwargs={"lease_ms": 60_000})
        assert lease["hits"] == N and lease["world_size"] == 2
        r0("scramble", ids=src)
        assert _jobs(r1, 1, ("load", 2, keys, dst, -1), lease_id=lease["lease_id"])[2][0]
        assert _jobs(r0, 0, ("load", 3, keys, src, -1), lease_id=lease["lease_id"])[3][0]
        assert r1("digest", ids=dst) == want, "rank 1 did not get rank 0's copy byte-exact"
        assert r0("digest", ids=src) == want
        explained = r0("client", method="explain", args=["gpu-mla", keys[:8]])
        assert all(e["state"] == "resident" and not e["held"] for e in explained)  # both shares consumed
        ok, code, _, failed = _jobs(r1, 1, ("store", 4, keys[:4], dst[:4], -1))[4]
        assert not ok and code == "bad_field" and failed == [0, 1, 2, 3]  # rank 1 never writes the copy
        with pytest.raises(RuntimeError, match="another layout"):  # 512-wide rows: not rank 0's bytes
            _register(other, 1, head_dim=256)
    finally:
        for e in (r0, r1, other):
            e.close()


def test_a_copy_rank_1_is_loading_is_not_evicted_by_rank_0s_stores(make_daemon):
    """Rank 1's LOAD is gated on its own CUDA event (a ~3 s sleep kernel), so it holds its pin on the
    shared copy while rank 0 fills the pool past capacity: the daemon evicts other blocks, never the
    copy being read, and rank 1 gets it byte-exact once its gate opens."""
    address = make_daemon("16MiB")  # 113 slots of 147,456 bytes
    rng = np.random.default_rng(13)
    a, c, d = ([bytes(k) for k in rng.integers(0, 256, (n, 32), dtype=np.uint8)] for n in (64, 120, 40))
    r0, r1 = _mla_engine(address, 0), _mla_engine(address, 1)
    try:
        _register(r0, 0)
        _register(r1, 1)
        src, dst = list(range(64)), list(range(400, 464))
        want = r0("digest", ids=src)
        assert _jobs(r0, 0, ("store", 1, a, src, -1))[1][0]
        gate = r1("record", sleep_cycles=6_000_000_000)
        r1.send("jobs", engine_id="mla-r1-288", jobs=[("load", 2, a, dst, gate)], timeout=60.0)

        def pinned() -> bool:
            return all(e.get("held") for e in r0("client", method="explain", args=["gpu-mla", a]))

        for _ in range(3000):  # the LOAD reached the daemon: its pins are taken before its gate opens
            if pinned():
                break
        assert pinned(), "rank 1's LOAD never pinned the copy"
        assert _jobs(r0, 0, ("store", 3, c, list(range(100, 220)), -1))[3][1] == "pool_full"
        assert _jobs(r0, 0, ("store", 4, d, list(range(300, 340)), -1))[4][0]  # evicts 40 blocks of c
        stats = r0("client", method="stats")
        assert stats["counters"]["evicted_blocks"] == 40
        assert pinned(), "the gate opened before the stores ran: the drill proved nothing (raise sleep_cycles)"
        assert r0("client", method="lookup", args=["gpu-mla", a])["hits"] == 64  # none of the copy evicted
        notices = r1.answer(timeout=120.0)["notices"]
        assert notices[2][0], notices
        r1("release", event=gate)
        assert r1("digest", ids=dst) == want
    finally:
        r0.close()
        r1.close()
