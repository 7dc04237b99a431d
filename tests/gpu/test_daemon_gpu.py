"""The CUDA path end to end: a real daemon (python -m kvoffd) and stand-in engines in other processes."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

BLOCKS = 512


def _keys(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [bytes(k) for k in rng.integers(0, 256, (n, 32), dtype=np.uint8)]


@pytest.fixture
def daemon(tmp_path):
    pytest.importorskip("zmq")
    from daemon import DaemonProc  # tests/support

    d = DaemonProc(f"ipc://{tmp_path}/gpu.sock", ["--pool-size", "4GiB", "--backend", "cuda", "--metrics-address",
                                                  "127.0.0.1:0"], log_path=tmp_path / "daemon.log")
    try:
        d.start(20)
    except RuntimeError as e:
        pytest.fail(f"daemon did not come up:\n{e}")
    yield d
    d.stop(signal.SIGTERM, 20)


def _engine(address: str, eid: str, ns: str, device: int = 0, layout: str = "blocks", rank: int = 0,
            world: int = 1):
    from support.standin import Engine, Spec

    e = Engine(Spec(layout=layout, num_blocks=BLOCKS, device=device))
    e("randomize", seed=hash((eid, device)) % 1000)
    e("connect", address=address)
    e("register", engine_id=eid, namespace=ns, rank=rank, world_size=world)
    return e


class Jobs:
    def __init__(self, eng, eid: str):
        self.eng, self.eid, self.n = eng, eid, 0

    def __call__(self, *js: tuple, timeout: float = 30.0) -> dict:
        out = []
        for kind, keys, ids, *ev in js:
            self.n += 1
            out.append((kind, self.n, keys, list(map(int, ids)), ev[0] if ev else -1))
        got = self.eng("jobs", engine_id=self.eid, jobs=out, timeout=timeout)
        return got["notices"]


def _all_ok(notices: dict) -> bool:
    return bool(notices) and all(v[0] for v in notices.values())


def test_store_clear_load_through_daemon(daemon):
    ns = "gpu-rt"
    e = _engine(daemon.address, "rt", ns)
    try:
        jobs = Jobs(e, "rt")
        keys, ids = _keys(200, 1), np.arange(0, 200)
        e("snapshot", tag="s", ids=ids.tolist())
        assert _all_ok(jobs(("store", keys, ids)))
        assert e("client", method="lookup", args=[ns, keys])["hits"] == 200
        e("scramble", ids=ids.tolist())
        assert _all_ok(jobs(("load", keys, ids)))
        assert e("compare", tag="s", ids=ids.tolist())
        other = np.arange(256, 456)  # and into other blocks
        assert _all_ok(jobs(("load", keys, other)))
        assert e("compare", tag="s", ids=other.tolist())
        e("client", method="clear", args=[ns])
        assert e("client", method="lookup", args=[ns, keys])["hits"] == 0
        notices = jobs(("load", keys[:4], ids[:4]))
        assert not any(v[0] for v in notices.values())  # nothing resident any more
        # stored again after the clear, loaded again, still exact
        assert _all_ok(jobs(("store", keys, ids)))
        e("scramble", ids=ids.tolist())
        assert _all_ok(jobs(("load", keys, ids)))
        assert e("compare", tag="s", ids=ids.tolist())
    finally:
        e.close()


def test_store_ordered_after_forward_through_daemon(daemon):
    """The engine's kernel writes the blocks, the store is sent at once with the ring event."""
    ns = "gpu-order"
    e = _engine(daemon.address, "ord", ns)
    try:
        jobs = Jobs(e, "ord")
        ids = np.array([3, 64, 200, 511])
        for it in range(40):
            value = it % 200 - 100
            ev = e("write_late", ids=ids.tolist(), value=value, cycles=4_000_000)
            keys = _keys(4, 1000 + it)
            assert _all_ok(jobs(("store", keys, ids, ev)))
            e("release", event=ev)
            e("scramble", ids=ids.tolist())
            assert _all_ok(jobs(("load", keys, ids)))
            raw = np.frombuffer(e("bytes", ids=ids.tolist()), dtype=np.int8)
            assert (raw == value).all(), f"iteration {it}: the store read bytes older than the event"
    finally:
        e.close()


def test_engine_killed_mid_transfer(daemon):
    good = _engine(daemon.address, "good", "gpu-kill")
    victim = _engine(daemon.address, "victim", "gpu-kill-v", layout="layers")
    try:
        ev = victim("record", sleep_cycles=2_000_000_000)
        keys = _keys(400, 7)
        victim.send("jobs", engine_id="victim", jobs=[("store", 1, keys, list(range(400)), ev)], timeout=5)
        time.sleep(0.1)
        victim.kill()
        jobs = Jobs(good, "good")
        for rnd in range(3):
            k, ids = _keys(200, 50 + rnd), np.arange(200 * rnd % 300, 200 * rnd % 300 + 200)
            good("snapshot", tag="g", ids=ids.tolist())
            assert _all_ok(jobs(("store", k, ids)))
            good("scramble", ids=ids.tolist())
            assert _all_ok(jobs(("load", k, ids)))
            assert good("compare", tag="g", ids=ids.tolist())
    finally:
        victim.close()
        good.close()


def _two_gpus() -> bool:
    from kvoffd.transfer import cuda_driver as cudart

    return cudart.driver().device_count() >= 2


def test_blocks_stored_from_gpu0_load_into_gpu1(daemon):
    if not _two_gpus():
        pytest.skip("needs two GPUs")
    ns = "gpu-x"
    a = _engine(daemon.address, "a0", ns, device=0)
    b = _engine(daemon.address, "b1", ns, device=1)
    try:
        keys, ids = _keys(256, 3), np.arange(0, 256)
        assert _all_ok(Jobs(a, "a0")(("store", keys, ids)))
        back = ids[::-1].copy()
        assert _all_ok(Jobs(b, "b1")(("load", keys, back)))
        assert a("digest", ids=ids[:64].tolist()) == b("digest", ids=back[:64].tolist())
    finally:
        a.close()
        b.close()


def test_tp2_lookup_hits_only_when_both_ranks_stored(daemon):
    if not _two_gpus():
        pytest.skip("needs two GPUs")
    ns = "gpu-tp2"
    r0 = _engine(daemon.address, "tp-r0", ns, device=0, rank=0, world=2)
    r1 = _engine(daemon.address, "tp-r1", ns, device=1, rank=1, world=2)
    try:
        keys, ids = _keys(128, 9), np.arange(10, 138)
        assert _all_ok(Jobs(r0, "tp-r0")(("store", keys, ids)))
        assert r0("client", method="lookup", args=[ns, keys])["hits"] == 0
        assert _all_ok(Jobs(r1, "tp-r1")(("store", keys[:100], ids[:100])))
        assert r0("client", method="lookup", args=[ns, keys])["hits"] == 100
    finally:
        r0.close()
        r1.close()

