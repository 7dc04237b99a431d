"""VMM memory (kind ``cuda_vmm``) and sleep mode, the parts that run without a GPU.

The wire checks of the new kind; a CPU daemon's refusal of it (it serves no CUDA); the daemon's claim of
the pieces' descriptors from the one batch the token names, which must match the pieces (the fd
socket's batches themselves: tests/test_core_fd_batch.py); and sleep/wake on the
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


def _vmm(pieces: list[tuple[int, int]], size: int = MiB2, offset: int = 0, token: str = "t") -> dict:
    return {"kind": "cuda_vmm", "token": token, "size": size, "offset": offset, "device_uuid": "GPU-0",
            "pieces": [{"offset": o, "size": s} for o, s in pieces]}


def test_a_tiled_vmm_range_decodes():
    m = P.decode(_register(_vmm([(0, MiB2), (MiB2, MiB2)], size=3 << 20, offset=1 << 20)), requests_only=True)
    assert isinstance(m.memory, P.CudaVmm) and m.memory.token == "t"
    assert [(p.offset, p.size) for p in m.memory.pieces] == [(0, MiB2), (MiB2, MiB2)]
    assert m.memory.KIND == "cuda_vmm" and "cuda_vmm" in P.MEMORY_KINDS
    assert client_vmm.MAX_PIECES == P.MAX_VMM_PIECES == P.MAX_BATCH_FDS  # the client refuses what the wire would
    assert P.MAX_VMM_PIECES * (20 << 20) >= 320 << 30  # a 320 GiB KV cache of torch's 20 MiB segments


def test_thousands_of_pieces_decode():
    pieces = [(i * MiB2, MiB2) for i in range(P.MAX_VMM_PIECES)]
    m = P.decode(_register(_vmm(pieces, size=P.MAX_VMM_PIECES * MiB2)), requests_only=True)
    assert len(m.memory.pieces) == P.MAX_VMM_PIECES


@pytest.mark.parametrize("memory, says", [
    (_vmm([(0, MiB2), (2 * MiB2, MiB2)]), "must tile the range"),  # a gap
    (_vmm([(MiB2, MiB2)]), "must tile the range"),  # not from 0
    (_vmm([(0, MiB2)], size=MiB2, offset=1), "exceeds"),  # the region runs past the pieces
    (_vmm([(i * MiB2, MiB2) for i in range(P.MAX_VMM_PIECES + 1)]), f"length <= {P.MAX_VMM_PIECES}"),
    (_vmm([]), "length >= 1"),
    ({**_vmm([(0, MiB2)]), "pieces": [{"offset": 0, "size": 0}]}, ">= 1"),
    ({k: v for k, v in _vmm([(0, MiB2)]).items() if k != "token"}, "token"),  # no descriptors named
    (_vmm([(0, MiB2)], token=""), "length >= 1"),
])
def test_bad_vmm_memory_is_a_clear_refusal(memory, says):
    with pytest.raises(P.ProtocolError) as e:
        P.decode(_register(memory), requests_only=True)
    assert e.value.code is P.ErrorCode.BAD_FIELD and says in e.value.message, e.value.message


def test_a_cpu_daemon_refuses_vmm_memory_and_serves_on(daemon):
    c = daemon.client()
    with pytest.raises(KvoffdError) as e:
        c.request(P.decode(_register(_vmm([(0, MiB2)])), requests_only=True), 5)
    assert e.value.code == "memory_unreachable" and "not served here" in str(e.value)
    assert c.ping(5) >= 0


@pytest.mark.parametrize("pieces, says", [
    ([(0, MiB2), (MiB2, MiB2)], "lists 2 pieces; the token names 3 descriptors"),
    ([(0, MiB2), (MiB2, 2 * MiB2), (3 * MiB2, MiB2)], "memory.pieces[1] is 4194304 bytes"),
])
def test_a_batch_that_does_not_match_the_pieces_is_refused(tmp_path, pieces, says):
    """The daemon's Registrar takes piece i's descriptor from position i of the batch the token names
    (a real fd socket): a count or a size that differs refuses the REGISTER and takes nothing, so the
    claim's descriptors are closed by the refusal (``Registrar._register`` closes what it claimed)."""
    from kvoffd.server.fdserver import FdServer
    from kvoffd.server.register import Registrar

    async def scenario() -> tuple[P.ProtocolError, int, int]:
        srv = FdServer(str(tmp_path / "fd.sock"))
        srv.start(asyncio.get_running_loop())
        try:
            mine = [os.memfd_create("vmm-piece") for _ in range(3)]
            token = await asyncio.to_thread(fdpass.send_fds, srv.path, mine, [MiB2] * 3)
            for fd in mine:
                os.close(fd)
            reg = Registrar(sessions=types.SimpleNamespace(fd_handover=srv), keyspace=None, metrics=None,
                            fds=None, by_kind={})
            memory = P.CudaVmm(token=token, pieces=[P.VmmPiece(offset=o, size=s) for o, s in pieces],
                               size=MiB2, device_uuid="GPU-0")
            handover = reg._claim(memory)
            before = len(os.listdir("/proc/self/fd"))
            with pytest.raises(P.ProtocolError) as e:
                reg._handed(memory, handover)
            kept = len(handover.fds)
            handover.close()
            return e.value, kept, before - len(os.listdir("/proc/self/fd"))
        finally:
            srv.close()

    err, kept, closed = asyncio.run(scenario())
    assert err.code is P.ErrorCode.BAD_FIELD and says in err.message, err.message
    assert kept == 3 and closed == 3, "a refused claim leaves the descriptors to the refusal, which closes them"


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


_NOFILE_PROBE = """
import resource, sys
from kvoffd_client.memory import cuda_vmm
soft, hard = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
try:
    cuda_vmm._room_for_more(0)
except cuda_vmm.VmmNotExportable as e:
    print("refused", e)
else:
    print("soft", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


@pytest.mark.parametrize("soft, hard, says", [(300, 4096, "soft 600"), (300, 300, "refused")])  # 300 < 64 + 256
def test_the_export_makes_room_for_its_descriptors(soft, hard, says):
    """An engine exports one descriptor per piece: before its soft RLIMIT_NOFILE would run out the export
    raises it (never past the hard limit), and where the hard limit is the bound it refuses in one line."""
    import subprocess
    import sys

    from kvtest import ROOT

    out = subprocess.run([sys.executable, "-c", _NOFILE_PROBE, str(soft), str(hard)], capture_output=True,
                         text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT}/client"}, timeout=60)
    assert says in out.stdout, out.stdout + out.stderr
    if says == "refused":
        assert "hard RLIMIT_NOFILE" in out.stdout
