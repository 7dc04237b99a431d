"""KvoffdConnector across model architectures on a real vLLM engine (CPU build, tiny random models).

For each architecture: greedy outputs with kvoffd equal those without it, cold, and equal those of
vLLM's own prefix cache after ``reset_prefix_cache()`` (the second round loads from the daemon) and
in a new engine process; and
the test shows what the connector did: blocks really loaded where it offloads, or its refusal and the
reason. ``docs/vllm.md`` (compatibility table) quotes these results. The Llama-style model is covered
in test_connector_e2e.py; sliding-window and hybrid models (several KV groups, HMA on) in
test_connector_hybrid.py.

One engine at a time, each closed before the next (2 CI cores), and one child process for the
new-engine phase of every architecture; the workload is the one of issue 12: a 300-token shared
prefix plus 20 random tokens per prompt, bf16, greedy, one prompt per ``generate`` call. vLLM's AMX
MLA kernels round differently with the batch around a request (a prompt alone and the same prompt
in a batch of three give other greedy tokens, without any connector), so every step must hold the
same requests in every run for tokens to be comparable: one prompt at a time fixes that, whatever
the load's timing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import (
    ENGINE_CHILD,
    build_tiny_mla,
    close_llm,
    connector_of,
    drain,
    external_hits,
    generate,
    issue_prompts,
    make_llm,
)

pytestmark = pytest.mark.vllm

PROMPTS = issue_prompts()


@dataclass(frozen=True)
class Arch:
    build: Callable[[Path], Path]
    block_size: int  # asked for; vLLM may override it (its reference CPU MLA forces 16)
    #: A piece of the reason the connector gives where vLLM never computes over cached KV with the
    #: backend it chose (prefix caching and chunked prefill both off); offloaded everywhere else.
    refused_without_reuse: str
    engine: dict[str, Any] = field(default_factory=dict)  # more engine arguments


ARCHS = {
    # vLLM's CPU platform picks AMX MLA on a CPU with AMX tiles (prefix caching on: offloaded) and its
    # reference MLA elsewhere, with prefix caching and chunked prefill off: that backend gives wrong
    # tokens when prefilling over a cached prefix (issue 12), so kvoffd refuses. The test reads
    # vLLM's decision from the engine, so it holds on either CPU.
    "deepseek-v2-mla": Arch(build_tiny_mla, 32, "prefix caching and chunked prefill both off"),
    # vLLM's reference CPU MLA asked for by name: what a CPU without AMX runs, on any CPU.
    "deepseek-v2-mla-reference": Arch(build_tiny_mla, 32, "prefix caching and chunked prefill both off",
                                      {"attention_backend": "CPU_MLA"}),
}


def _each(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy outputs, one prompt per generate call (see the module docstring)."""
    return [generate(llm, [p])[0] for p in prompts]


def _vllm_reuses_cached_kv(llm: Any) -> tuple[bool, int]:
    """vLLM's own decision for this engine: (computes over cached KV, block size it runs with)."""
    vc = llm.llm_engine.vllm_config
    reuse = bool(vc.cache_config.enable_prefix_caching or vc.scheduler_config.enable_chunked_prefill)
    return reuse, int(vc.cache_config.block_size)


def _loadable_blocks(block_size: int) -> int:
    """Whole blocks before each prompt's last token: what a fully warm daemon serves."""
    return sum((len(p) - 1) // block_size for p in PROMPTS)


@dataclass
class Run:
    reference: list[list[int]]  # without kvoffd
    reference_hit: list[list[int]]  # without kvoffd, the prefixes served by vLLM's own prefix cache
    cold: list[list[int]]  # with kvoffd, daemon empty for this model
    loaded: list[list[int]]  # with kvoffd, after reset_prefix_cache(): served from the daemon
    loaded_tokens: int  # vLLM's external-hit counter over the loaded round
    stored_blocks: int  # the daemon's counter over this engine's life
    refused: str | None  # KvoffdConnector.refused
    vllm_reuses: bool  # vLLM computes prompts over cached KV with the backend it chose
    block_size: int  # what vLLM ran the model with
    fresh: dict[str, Any] = field(default_factory=dict)  # a new engine process (engine_child.py)


def _run(arch: Arch, model: str, daemon: Any) -> Run:
    ref_llm = make_llm(model, dtype="bfloat16", block_size=arch.block_size, **arch.engine)
    try:
        reference = _each(ref_llm, PROMPTS)
        reference_hit = _each(ref_llm, PROMPTS)  # the prefixes from vLLM's own prefix cache
    finally:
        close_llm(ref_llm)
    stored0 = daemon.stats()["counters"]["stored_blocks"]
    llm = make_llm(model, daemon.address, dtype="bfloat16", block_size=arch.block_size, **arch.engine)
    try:
        refused = getattr(connector_of(llm), "refused", None)
        reuses, block_size = _vllm_reuses_cached_kv(llm)
        cold = _each(llm, PROMPTS)
        drain(llm)
        assert llm.reset_prefix_cache()
        hits0 = external_hits(llm)
        loaded = _each(llm, PROMPTS)
        hits = int(external_hits(llm) - hits0)
        drain(llm)
    finally:
        close_llm(llm)
    stored = daemon.stats()["counters"]["stored_blocks"] - stored0
    return Run(reference, reference_hit, cold, loaded, hits, stored, refused, reuses, block_size)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, daemon: Any) -> dict[str, Run]:
    """Every architecture in this process, then one new process that starts a fresh engine for each."""
    models = {name: str(arch.build(tmp_path_factory.mktemp(name))) for name, arch in ARCHS.items()}
    out = {name: _run(arch, models[name], daemon) for name, arch in ARCHS.items()}
    child = ENGINE_CHILD
    cfgs = [{"model": models[n], "dtype": "bfloat16", "block_size": a.block_size, "one_by_one": True, **a.engine} for n, a in ARCHS.items()]
    proc = subprocess.run([sys.executable, str(child), "-", daemon.address, json.dumps(cfgs), json.dumps(PROMPTS)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    fresh = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    for name, result in zip(ARCHS, fresh, strict=True):
        out[name].fresh = result
    return out


@pytest.mark.parametrize("name", list(ARCHS))
def test_architecture(name: str, runs: dict[str, Run]) -> None:
    arch, run = ARCHS[name], runs[name]
    print(f"{name}: vllm_reuses_cached_kv={run.vllm_reuses} block_size={run.block_size} refused={run.refused!r} "
          f"stored={run.stored_blocks} loaded_tokens={run.loaded_tokens} "
          f"new_process_loaded_tokens={run.fresh['external_hits']}")
    # A prefix computed over cached KV need not give the cold run's tokens: vLLM's AMX MLA kernels
    # round differently once the prefix comes from its own prefix cache (the same engine, no
    # connector). kvoffd's loads must give exactly what vLLM's own cache gives.
    assert run.cold == run.reference
    if run.vllm_reuses:
        assert run.loaded == run.reference_hit
        assert run.fresh["outputs"] == run.reference_hit
        assert run.refused is None
        assert run.stored_blocks > 0
        # After the reset the first prompt's whole blocks come from the daemon, in this engine and in
        # a new process (the other prompts share its prefix, then in vLLM's own cache).
        first = (len(PROMPTS[0]) - 1) // run.block_size * run.block_size
        assert first <= run.loaded_tokens <= _loadable_blocks(run.block_size) * run.block_size
        assert first <= run.fresh["external_hits"] <= _loadable_blocks(run.block_size) * run.block_size
    else:
        assert run.loaded == run.reference and run.fresh["outputs"] == run.reference
        assert run.refused is not None and arch.refused_without_reuse in run.refused
        assert run.fresh["refused"] is not None and arch.refused_without_reuse in run.fresh["refused"]
        assert run.stored_blocks == 0 and run.loaded_tokens == 0 and run.fresh["external_hits"] == 0
