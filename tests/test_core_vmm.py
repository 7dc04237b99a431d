"""VMM memory (kind ``cuda_vmm``) and sleep mode, the parts that run without a GPU.

The wire checks of the new kind; a CPU daemon's refusal of it (it serves no CUDA); the daemon's claim of
the pieces' descriptors, which must leave nothing behind when one token is unknown; and sleep/wake on the
CPU path: UNREGISTER is answered only once the daemon has unmapped the engine's memory, the blocks
survive, a re-registration of new memory loads them byte-exact, and cycles leak no descriptor or mapping.
The CUDA half is tests/gpu/test_vmm.py.
"""

from __future__ import annotations

import asyncio
import os
import types

import msgpack
import pytest
from kvtest import chain_keys
from reliability_util import ShmEngine, maps_mention

from kvoffd_client import fdpass
from kvoffd_client import protocol as P
from kvoffd_client.errors import KvoffdError
from kvoffd_client.memory import cuda_vmm as client_vmm

MiB2 = 2 << 20


def _register(memory: dict) -> bytes:
    return msgpack.packb({"op": "register", "seq": 4, "engine_id": "e", "namespace": "n", "memory": memory,
                          "layout": {"num_blocks": 4, "segments": [[0, 4096, 4096]]}})


def _vmm(pieces: list[tuple[str, int, int]], size: int = MiB2, offset: int = 0) -> dict:
    return {"kind": "cuda_vmm", "size": size, "offset": offset, "device_uuid": "GPU-0",
            "pieces": [{"token": t, "offset": o, "size": s} for t, o, s in pieces]}


def test_a_tiled_vmm_range_decodes():
    m = P.decode(_register(_vmm([("a", 0, MiB2), ("b", MiB2, MiB2)], size=3 << 20, offset=1 << 20)),
                 requests_only=True)
    assert isinstance(m.memory, P.CudaVmm) and [p.token for p in m.memory.pieces] == ["a", "b"]
    assert m.memory.KIND == "cuda_vmm" and "cuda_vmm" in P.MEMORY_KINDS
    assert client_vmm.MAX_PIECES == P.MAX_VMM_PIECES  # the client refuses what the wire would


@pytest.mark.parametrize("memory, says", [
    (_vmm([("a", 0, MiB2), ("b", 2 * MiB2, MiB2)]), "must tile the range"),  # a gap
    (_vmm([("a", MiB2, MiB2)]), "must tile the range"),  # not from 0
    (_vmm([("a", 0, MiB2)], size=MiB2, offset=1), "exceeds"),  # the region runs past the pieces
    (_vmm([("a", 0, MiB2), ("a", MiB2, MiB2)]), "one token twice"),
    (_vmm([(str(i), i * MiB2, MiB2) for i in range(P.MAX_VMM_PIECES + 1)]), "length <= 8"),
    (_vmm([]), "length >= 1"),
    ({**_vmm([("a", 0, MiB2)]), "pieces": [{"token": "a", "offset": 0, "size": 0}]}, ">= 1"),
    ({**_vmm([("a", 0, MiB2)]), "pieces": [{"fd": 3, "offset": 0, "size": MiB2}]}, "token"),  # no fd numbers
])
def test_bad_vmm_memory_is_a_clear_refusal(memory, says):
    with pytest.raises(P.ProtocolError) as e:
        P.decode(_register(memory), requests_only=True)
    assert e.value.code is P.ErrorCode.BAD_FIELD and says in e.value.message, e.value.message


def test_a_cpu_daemon_refuses_vmm_memory_and_serves_on(daemon):
    c = daemon.client()
    with pytest.raises(KvoffdError) as e:
        c.request(P.decode(_register(_vmm([("a", 0, MiB2)])), requests_only=True), 5)
    assert e.value.code == "memory_unreachable" and "not served here" in str(e.value)
    assert c.ping(5) >= 0


def test_an_unknown_piece_token_closes_the_claimed_descriptors(tmp_path):
    """The daemon's Registrar claims every piece's descriptor from a real fd socket; one unknown token
    refuses the REGISTER and closes the descriptors already claimed (nothing held, nothing leaked)."""
    from kvoffd.server.fdserver import FdServer
    from kvoffd.server.register import Registrar

    async def scenario() -> tuple[list[int], P.ProtocolError]:
        srv = FdServer(str(tmp_path / "fd.sock"))
        srv.start(asyncio.get_running_loop())
        try:
            mine = [os.memfd_create("vmm-piece") for _ in range(2)]
            tokens = [await asyncio.to_thread(fdpass.send_fd, srv.path, fd, MiB2) for fd in mine]
            for fd in mine:
                os.close(fd)
            before = set(os.listdir("/proc/self/fd"))
            reg = Registrar(sessions=types.SimpleNamespace(fd_handover=srv), index=None, pool=None, metrics=None,
                            fds=None, by_kind={})
            memory = P.CudaVmm(pieces=[P.VmmPiece(token=tokens[0], offset=0, size=MiB2),
                                       P.VmmPiece(token=tokens[1], offset=MiB2, size=MiB2),
                                       P.VmmPiece(token="f" * 32, offset=2 * MiB2, size=MiB2)],
                               size=MiB2, device_uuid="GPU-0")
            with pytest.raises(P.ProtocolError) as e:
                reg._backend_memory(memory)
            after = set(os.listdir("/proc/self/fd"))
            return sorted(int(f) for f in before - after), e.value
        finally:
            srv.close()

    closed, err = asyncio.run(scenario())
    assert err.code is P.ErrorCode.MEMORY_UNREACHABLE and "pieces[2]" in err.message
    assert len(closed) == 2, "the two claimed descriptors must be closed by the refusal"


def _fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


#: mappings a daemon's threads may add or drop between two cycles (stacks, malloc arenas); a leak of one
#: mapping per cycle passes it within 20 cycles
MAPS_SLACK = 8


def _maps_count(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for _ in f)


def test_sleep_wake_cycles_keep_blocks_and_leak_nothing(daemon):
    """Sleep = drain, UNREGISTER (answered once unmapped), free; wake = new memory, REGISTER. Blocks
    stored before a sleep load byte-exact into the new memory; 20 cycles leave the daemon's fds as they
    were after the first, each cycle's memory unmapped once UNREGISTER is answered, and its mappings not growing with the cycles
    (the count itself moves by a few as the daemon's threads come and go: an exact count flaked)."""
    c = daemon.client()
    dpid = daemon.proc.pid
    keys = chain_keys(16, salt=b"sleep")
    ns = "sleepy"
    eng = ShmEngine(64, 8192, tag="sleep")
    c.register("sl-0", ns, 0, 1, eng.memory, eng.layout)
    eng.fill(range(16), keys)
    c.submit_store("sl-0", 1, keys, list(range(16)))
    assert all(n.ok for n in c.wait_notices({1}, 10))
    job = 2
    baseline: tuple[int, int] | None = None
    for cycle in range(20):
        c.unregister("sl-0", timeout_s=10)
        assert not maps_mention(dpid, eng.tag), f"cycle {cycle}: the memory is still mapped after UNREGISTER's OK"
        eng.close()
        eng = ShmEngine(64, 8192, tag=f"wake{cycle}")  # new memory, as after vLLM's wake
        eng.poison(range(64))
        c.register("sl-0", ns, 0, 1, eng.memory, eng.layout)
        assert c.lookup(ns, keys).hits == 16
        ids = list(range(20, 36))
        c.submit_load("sl-0", job, keys, ids)
        assert all(n.ok for n in c.wait_notices({job}, 10))
        job += 1
        assert eng.matches(ids, keys).all(), f"cycle {cycle}: loaded bytes differ"
        now = (_fd_count(dpid), _maps_count(dpid))
        if baseline is None:
            baseline = now
        assert now[0] == baseline[0], f"cycle {cycle}: daemon fds {now[0]} grew from {baseline[0]}"
        assert now[1] <= baseline[1] + MAPS_SLACK, f"cycle {cycle}: daemon maps {now[1]} grew from {baseline[1]}"
    c.unregister("sl-0", timeout_s=10)
    eng.close()



def test_the_vmm_structs_match_cuda_h():
    """``CUmemAllocationProp``, ``CUmemAccessDesc`` and ``CUmemLocation`` as cuda.h (12.x, 13.x) lays them
    out; the daemon's and the client's bindings are separate (the client never imports the daemon)."""
    import ctypes

    from kvoffd.transfer import cuda_vmm as daemon_vmm

    for prop in (daemon_vmm.AllocationProp, client_vmm._Prop):
        assert ctypes.sizeof(prop) == 32
        assert [getattr(prop, f).offset for f in ("type", "requestedHandleTypes", "location",
                                                  "win32HandleMetaData", "allocFlags")] == [0, 4, 8, 16, 24]
    assert ctypes.sizeof(daemon_vmm.AccessDesc) == 12 and daemon_vmm.AccessDesc.flags.offset == 8
    assert ctypes.sizeof(daemon_vmm.MemLocation) == 8
    assert daemon_vmm.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR == client_vmm.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR == 1
