"""The CUDA backend against a stand-in engine in another process (CUDA IPC for real).

Each test drives ``CudaBackend`` directly from an asyncio loop in this process (the "daemon") while
the engine lives in a spawned child, as in production.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from kvoffd.pool.allocator import Pool
from kvoffd.transfer.base import Direction, MappedMemory

S, L = Direction.STORE, Direction.LOAD
BLOCKS = 512  # small cache: 32 layers x 64 KiB pages = 2 MiB per block -> 1 GiB per engine


def small(layout: str, **kw) -> object:
    from support.standin import Spec

    return Spec(layout=layout, num_blocks=BLOCKS, **kw)


async def _attach(backend, eng, name: str) -> MappedMemory:
    from kvoffd_client.protocol import parse_layout

    info = eng("export")
    nb, segs = parse_layout(info["layout"])
    return await asyncio.get_running_loop().run_in_executor(None, backend.attach, name, info["memory"], None, nb, segs)


def _run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def pool():
    p = Pool(4 << 30)
    yield p
    p.close()


@pytest.fixture
def backend(pool):
    from kvoffd.transfer.cuda import CudaBackend, CudaTuning

    b = CudaBackend(pool, CudaTuning(pin=False))
    yield b
    b.close()


@pytest.fixture(scope="module")
def engines():
    from support.standin import Engine

    made = {}

    def get(layout: str):
        if layout not in made:
            made[layout] = Engine(small(layout))
        return made[layout]

    yield get
    for e in made.values():
        e.close()


def test_import_without_cuda_is_cheap():
    import kvoffd.transfer.cuda as cuda

    assert cuda.CudaBackend.kinds(None) == ("cuda_ipc", "cuda_vmm")  # type: ignore[arg-type]


def test_attach_gives_a_typed_mapping(pool, backend, engines):
    """The server reads ``num_events`` off the mapping (a STORE's event must lie below it)."""
    from kvoffd.transfer.cuda_mapping import CudaMapping

    eng = engines("blocks")

    async def go():
        m = await _attach(backend, eng, "t-typed")
        try:
            assert isinstance(m, CudaMapping) and m.num_events == len(m.events) > 0
        finally:
            backend.detach(m)
        assert m.detached and m.closed
        backend.detach(m)  # twice: a no-op

    _run(go())


def test_batch_cuts_bound_runs_and_bytes():
    """A job's runs go to the driver in calls of at most ``batch_runs`` runs and about ``batch_bytes``
    (a call passes it by less than one run), every run exactly once and in order. Needs no GPU."""
    from kvoffd.transfer.cuda import CudaTuning, batch_cuts

    rng = np.random.default_rng(5)
    tuning = CudaTuning(batch_runs=7, batch_bytes=1000)
    for n in (1, 2, 7, 8, 50, 301):
        lens = rng.integers(1, 400, n).astype(np.uint64)
        cuts = batch_cuts(lens, tuning)
        assert cuts[0][0] == 0 and cuts[-1][1] == n
        assert all(b == c for (_, b), (c, _) in zip(cuts, cuts[1:], strict=False))
        for a, b in cuts:
            assert 0 < b - a <= tuning.batch_runs
            assert int(lens[a:b].sum()) < tuning.batch_bytes + int(lens.max())
    one = np.full(5, 10, dtype=np.uint64)
    assert batch_cuts(one, tuning) == [(0, 5)]  # a small job: one call


def test_driver_bindings():
    from kvoffd.transfer import cuda_driver as cudart

    drv = cudart.driver()
    assert drv.device_count() >= 1
    uuid = drv.device_uuid(0)
    assert uuid.startswith("GPU-") and drv.ordinal_of(uuid) == 0
    assert drv.has_batch, f"driver {drv.version} lacks cuMemcpyBatchAsync"
    drv.use_device(0)
    lo, hi = drv.stream_priority_range()
    assert hi <= lo


@pytest.mark.parametrize("layout", ["blocks", "layers"])
def test_store_clear_load_byte_exact(layout, pool, backend, engines):
    eng = engines(layout)

    async def go():
        backend.start()
        m = await _attach(backend, eng, f"t-{layout}")
        try:
            rng = np.random.default_rng(3)
            for rnd in range(3):
                eng("randomize", seed=100 + rnd)
                ids = np.sort(rng.choice(BLOCKS, 200, replace=False))
                slots = rng.permutation(np.array(pool.alloc(m.slot_bytes, 200), dtype=np.int64))
                eng("snapshot", tag="x", ids=ids.tolist())
                await backend.submit(S, m, ids, slots)
                # pool holds exactly the engine's bytes
                k = [0, 77, 199]
                assert b"".join(pool.view(int(s), m.slot_bytes).tobytes() for s in slots[k]) == \
                    eng("bytes", ids=ids[k].tolist())
                eng("scramble", ids=ids.tolist())  # "clear" the engine side
                await backend.submit(L, m, ids, slots)
                assert eng("compare", tag="x", ids=ids.tolist())
                other = np.sort(np.setdiff1d(np.arange(BLOCKS), ids)[:200])
                await backend.submit(L, m, other, slots)  # into other blocks
                assert eng("compare", tag="x", ids=other.tolist())
                pool.free(m.slot_bytes, slots.tolist())
        finally:
            backend.detach(m)

    _run(go())


def test_store_waits_for_the_engines_writes(pool, backend, engines):
    """A kernel writes blocks, the store is issued right after: the pool must see the new bytes."""
    eng = engines("blocks")

    async def go():
        backend.start()
        m = await _attach(backend, eng, "t-order")
        try:
            slots = np.array(pool.alloc(m.slot_bytes, 4), dtype=np.int64)
            ids = np.array([5, 99, 300, 511])
            stale = 0
            for it in range(150):
                value = it % 250 - 120
                ev = eng("write_late", ids=ids.tolist(), value=value, cycles=3_000_000)
                await backend.submit(S, m, ids, slots, event=ev)
                eng("release", event=ev)
                got = np.stack([pool.view(int(s), m.slot_bytes) for s in slots]).view(np.int8)
                stale += int(not (got == value).all())
            assert stale == 0, f"{stale} of 150 stores read bytes older than the event"
            pool.free(m.slot_bytes, slots.tolist())
        finally:
            backend.detach(m)

    _run(go())


def test_killed_engine_leaves_daemon_serving(pool, backend, engines):
    from support.standin import Engine

    good = engines("blocks")
    victim = Engine(small("layers"))

    async def go():
        backend.start()
        mv = await _attach(backend, victim, "t-victim")
        mg = await _attach(backend, good, "t-good")
        ids = np.arange(0, 400)
        sv = np.array(pool.alloc(mv.slot_bytes, 400), dtype=np.int64)
        # the victim's store waits on an event behind a ~1 s kernel; kill it meanwhile
        ev = victim("record", sleep_cycles=2_000_000_000)
        job = asyncio.ensure_future(backend.submit(S, mv, ids, sv, event=ev))
        await asyncio.sleep(0.05)
        victim.kill()
        await asyncio.sleep(0.2)
        backend.abort(mv)  # what the server does when it sees the engine's process exit
        done, _ = await asyncio.wait([job], timeout=10)
        assert done, "the dead engine's job neither finished nor failed"
        print("victim job:", job.exception() or "completed")
        await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, backend.detach, mv), 30)
        pool.free(mv.slot_bytes, sv.tolist())
        # the other engine still round-trips byte-exactly
        good("randomize", seed=9)
        gids = np.arange(100, 300)
        sg = np.array(pool.alloc(mg.slot_bytes, 200), dtype=np.int64)
        good("snapshot", tag="g", ids=gids.tolist())
        t = time.perf_counter()
        await backend.submit(S, mg, gids, sg)
        good("scramble", ids=gids.tolist())
        await backend.submit(L, mg, gids, sg)
        assert time.perf_counter() - t < 10
        assert good("compare", tag="g", ids=gids.tolist())
        pool.free(mg.slot_bytes, sg.tolist())
        backend.detach(mg)

    try:
        _run(go())
    finally:
        victim.close()


def test_bad_memory_is_refused(backend):
    from kvoffd.transfer.base import AttachError
    from kvoffd_client.protocol import CudaIpc, Segment

    segs = [Segment(0, 1 << 20, 1 << 20)]
    with pytest.raises(AttachError):
        backend.attach("x", CudaIpc(handle=b"\0" * 64, size=1 << 30,
                                    device_uuid="GPU-00000000-0000-0000-0000-000000000000", events=[]), None, 4, segs)
    with pytest.raises(AttachError):
        backend.attach("x", CudaIpc(handle=b"short", size=1 << 30, device_uuid="GPU-0"), None, 4, segs)


def test_two_gpus_share_the_pool(pool, backend):
    from support.standin import Engine

    from kvoffd.transfer import cuda_driver as cudart

    if cudart.driver().device_count() < 2:
        pytest.skip("needs two GPUs")
    e0, e1 = Engine(small("blocks", device=0)), Engine(small("layers", device=1))

    async def go():
        backend.start()
        m0, m1 = await _attach(backend, e0, "g0"), await _attach(backend, e1, "g1")
        assert m0.slot_bytes == m1.slot_bytes
        e0("randomize", seed=5)
        ids = np.arange(0, 256)
        slots = np.array(pool.alloc(m0.slot_bytes, 256), dtype=np.int64)
        await backend.submit(S, m0, ids, slots)
        await backend.submit(L, m1, ids[::-1].copy(), slots)
        # block i of GPU 0 == block 255-i of GPU 1, byte for byte (the layouts differ; the slots don't)
        assert e0("digest", ids=ids[:32].tolist()) == e1("digest", ids=ids[::-1][:32].tolist())
        pool.free(m0.slot_bytes, slots.tolist())
        backend.detach(m0)
        backend.detach(m1)

    try:
        _run(go())
    finally:
        e0.close()
        e1.close()


def test_jobs_past_their_deadline_never_start(pool, engines):
    """Issue 18, defect 1 on the GPU: a job is checked against its deadline where it reaches a stream.

    1. A large LOAD's tail waits for a submit thread (all of them held busy by the test) until past
       the job's deadline: the tail never starts, and the job fails ``JobExpired`` only once its head
       (enqueued in time) is done. 2. A gated LOAD whose event fires while the poller is held (the
       test holds the lock each sweep takes, as a frozen daemon would) until past the deadline: it
       never starts. Both started late before the fix (the deadline was checked on arrival only).
       The deadline is checked before every batch call (``CudaBackend._enqueue``).
    """
    import threading

    from kvoffd.transfer.base import JobExpired
    from kvoffd.transfer.cuda import CudaBackend, CudaTuning

    eng = engines("blocks")
    b = CudaBackend(pool, CudaTuning(pin=False, head_bytes=16 << 20))  # a head of a few blocks; the rest via the pool

    async def go():
        b.start()
        m = await _attach(b, eng, "t-late")
        ids = np.arange(0, 200)
        slots = np.array(pool.alloc(m.slot_bytes, 200), dtype=np.int64)
        try:
            head = b.tuning.head_blocks(len(m.segments), m.slot_bytes)
            assert head < 100
            eng("randomize", seed=11)
            eng("snapshot", tag="pool_head", ids=ids[:head].tolist())
            await b.submit(S, m, ids, slots)  # the pool holds the randomized bytes
            eng("scramble", ids=ids.tolist())
            eng("snapshot", tag="engine_tail", ids=ids[head:].tolist())
            eng("snapshot", tag="engine_gated", ids=ids[100:104].tolist())

            gate = threading.Event()
            busy = [b._submit.submit(gate.wait, 30) for _ in range(b.tuning.submit_threads)]
            expires = time.monotonic_ns() + 200_000_000
            fut = b.submit(L, m, ids, slots, -1, expires)
            while time.monotonic_ns() <= expires:
                await asyncio.sleep(0.01)
            gate.set()
            for f in busy:
                f.result(10)
            with pytest.raises(JobExpired):
                await asyncio.wait_for(fut, 30)
            assert eng("compare", tag="pool_head", ids=ids[:head].tolist()), "the head (started in time) did not land"
            assert eng("compare", tag="engine_tail", ids=ids[head:].tolist()), "the tail started after its deadline"

            gated = ids[100:104]
            ev = eng("record", sleep_cycles=200_000_000)  # the event fires after a ~0.1 s kernel
            with b.poller.lock:  # every sweep takes this lock: the poller cannot see the gate meanwhile
                expires = time.monotonic_ns() + 50_000_000
                fut = b.submit(L, m, gated, slots[100:104], ev, expires)
                eng("sync")  # the event has fired
                while time.monotonic_ns() <= expires:
                    time.sleep(0.005)
            with pytest.raises(JobExpired):
                await asyncio.wait_for(fut, 30)
            eng("release", event=ev)
            assert eng("compare", tag="engine_gated", ids=gated.tolist()), "a gated job started after its deadline"
        finally:
            pool.free(m.slot_bytes, slots.tolist())
            b.detach(m)

    try:
        _run(go())
    finally:
        b.close()
