"""Jobs in parts on the GPU (issue 32), through a real daemon (python -m kvoffd, CUDA backend).

* A LOAD in parts: when ``wait_landed`` says part p is in, the bytes of parts 0..p are already the
  stored ones in the engine's memory (read back on another stream at that moment), and all of them
  once the notice came.
* A STORE in parts behind a "forward" (kvoffd_client.vllm.layerwise.StepSaves): every layer is
  written only after a long GPU sleep on the compute stream, and the daemon copies each part once
  its event fired: what it stored is the final bytes, never the stale ones the blocks held before.
"""

from __future__ import annotations

import signal

import numpy as np
import pytest

torch = pytest.importorskip("torch")

LAYERS, NB, N = 8, 64, 24
SHAPE = (2, 16, 8, 128)  # K|V, tokens, heads, head dim per block of one layer (bf16: 64 KiB)


@pytest.fixture
def daemon(tmp_path):
    pytest.importorskip("zmq")
    from daemon import DaemonProc  # tests/support

    d = DaemonProc(f"ipc://{tmp_path}/gpu.sock", ["--pool-size", "1GiB", "--backend", "cuda", "--metrics-address",
                                                  "127.0.0.1:0"], log_path=tmp_path / "daemon.log")
    d.start(20)
    yield d
    d.stop(signal.SIGTERM, 20)


def _caches() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    per = NB * int(np.prod(SHAPE))
    buf = torch.zeros(LAYERS * per, dtype=torch.bfloat16, device="cuda")
    return buf, {f"model.layers.{i}.self_attn.attn": buf[i * per:(i + 1) * per].view(NB, *SHAPE)
                 for i in range(LAYERS)}


def _register(d, kv):
    from kvoffd_client.memory.cuda_ipc import export_kv_caches
    from kvoffd_client.vllm.layerwise import LayerParts

    exp = export_kv_caches(kv, NB)
    c = d.client()
    assert c.supports_parts
    c.register("lw-gpu", "lw-gpu", 0, 1, exp.memory, exp.layout)
    bb = sum(s[2] for s in exp.layout["segments"])
    lp = LayerParts.of(kv, NB, bb, max_parts=LAYERS)
    assert lp is not None and lp.parts == LAYERS
    return c, exp, lp


def _keys(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [bytes(k) for k in rng.integers(0, 256, (n, 32), dtype=np.uint8)]


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).cpu().numpy()


def test_load_in_parts_is_visible_as_each_part_lands(daemon):
    buf, kv = _caches()
    c, exp, lp = _register(daemon, kv)
    try:
        names = list(kv)
        src, dst = list(range(N)), list(range(N, 2 * N))
        for t in kv.values():
            t[src] = torch.randn(N, *SHAPE, device="cuda").to(torch.bfloat16)
        torch.cuda.synchronize()
        keys = _keys(N, 1)
        c.submit_store("lw-gpu", 1, keys, src, event=exp.ring.record())
        assert c.wait_notices({1}, 30)[0].ok
        want = {n: _bits(kv[n][src]) for n in names}
        for t in kv.values():
            t[dst] = 0
        torch.cuda.synchronize()
        c.submit_load("lw-gpu", 2, keys, dst, cuts=lp.cuts)
        side = torch.cuda.Stream()
        for p in range(1, lp.parts + 1):
            assert c.wait_landed({2}, p, 30) == set()
            with torch.cuda.stream(side):  # what a kernel launched now would read
                for n in names[:p]:
                    assert np.array_equal(_bits(kv[n][dst]), want[n]), f"part {p}: {n} not in place"
        (nt,) = c.wait_notices({2}, 30)
        assert nt.ok, nt
        for n in names:
            assert np.array_equal(_bits(kv[n][dst]), want[n])
    finally:
        c.close()
        exp.close()


def test_store_in_parts_copies_each_part_after_its_layers(daemon):
    from kvoffd_client.vllm.layerwise import StepSaves

    buf, kv = _caches()
    c, exp, lp = _register(daemon, kv)
    try:
        names = list(kv)
        ids = list(range(N))
        for t in kv.values():
            t[ids] = 7  # stale bytes: what a copy that ran early would store
        torch.cuda.synchronize()
        final = {n: torch.randn(N, *SHAPE, device="cuda").to(torch.bfloat16) for n in names}
        torch.cuda.synchronize()
        saves = StepSaves(lp, store_parts=4)
        job = 5
        for n in names:  # the forward: each layer written after a long kernel, its hook after it
            torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time per layer
            kv[n][ids] = final[n]
            saves.saved(n, exp.ring, job)
        cuts, events, holds = saves.finish(exp.ring, job)
        assert len(cuts) == 3 and len(events) == 4 and len(set(holds)) == 4
        keys = _keys(N, 2)
        c.submit_store("lw-gpu", job, keys, ids, event=events[-1], cuts=cuts, events=events)
        (nt,) = c.wait_notices({job}, 60)
        assert nt.ok, nt
        for e in holds:
            exp.ring.release(e)
        want = {n: _bits(final[n]) for n in names}
        dst = list(range(N, 2 * N))
        for t in kv.values():
            t[dst] = 0
        torch.cuda.synchronize()
        c.submit_load("lw-gpu", job + 1, keys, dst)
        assert c.wait_notices({job + 1}, 30)[0].ok
        for n in names:
            assert np.array_equal(_bits(kv[n][dst]), want[n]), f"{n}: the store copied before the layer was written"
    finally:
        c.close()
        exp.close()
