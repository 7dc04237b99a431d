"""KvoffdConnector on a real vLLM engine (CPU build, tiny random Llama, greedy): correctness and reuse."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from engine_helpers import (
    ENGINE_CHILD,
    PROMPTS,
    check_served,
    close_llm,
    core_of,
    drain,
    external_hits,
    generate,
    make_llm,
    vllm_metric,
)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def llm(tiny_model: str, daemon: Any) -> Iterator[Any]:
    engine = make_llm(tiny_model, daemon.address)
    yield engine
    close_llm(engine)


def test_outputs_identical_and_blocks_stored(llm: Any, reference: list[list[int]], daemon: Any) -> None:
    stored0 = daemon.stats()["counters"]["stored_blocks"]
    assert generate(llm, PROMPTS) == reference
    drain(llm)
    # 2 shared prefix blocks + 2 own blocks per prompt (prompt and decode blocks, never the last token's).
    assert daemon.stats()["counters"]["stored_blocks"] - stored0 == 2 + 2 * len(PROMPTS)


def test_reset_prefix_cache_then_external_hits(llm: Any, reference: list[list[int]], daemon: Any) -> None:
    generate(llm, PROMPTS)  # idempotent warm-up when run alone
    drain(llm)
    assert llm.reset_prefix_cache()
    vllm_hits0 = external_hits(llm)
    loaded0 = vllm_metric(llm, "vllm:kvoffd_load_blocks")
    host0 = vllm_metric(llm, "vllm:prompt_tokens_cached_by_source", source="host")
    daemon_hits0 = daemon.metric("kvoffd_lookup_blocks_total", result="hit")
    assert generate(llm, PROMPTS) == reference
    # Every whole block before each prompt's last token: (110-1)//32 + (119-1)//32 + ... = 3+3+3+4.
    assert external_hits(llm) - vllm_hits0 == 13 * 32
    assert daemon.metric("kvoffd_lookup_blocks_total", result="hit") - daemon_hits0 >= 13
    # The connector's own counters reach vLLM's metrics through the connector-stats hooks.
    assert vllm_metric(llm, "vllm:kvoffd_load_blocks") - loaded0 == 13
    # ... and the hits are attributed to host memory (get_external_cache_hit_sources).
    assert vllm_metric(llm, "vllm:prompt_tokens_cached_by_source", source="host") - host0 == 13 * 32
    drain(llm)
    # The connector holds nothing once the engine is idle: no leases, no jobs, no request state.
    conn = core_of(llm).scheduler.get_kv_connector()
    assert not conn._scheduler.state.reqs and not conn._scheduler.state.store_jobs
    assert daemon.stats()["leases"] == 0


def test_partial_prefix_hit_after_reset(llm: Any, tiny_model: str, daemon: Any) -> None:
    """A new prompt sharing only the 2-block prefix loads those 2 blocks and computes the rest."""
    prompt = PROMPTS[0][:70] + [(13 * j) % 500 + 3 for j in range(50)]
    ref = generate(llm, [prompt])  # with the prefix possibly local: fine, greedy is deterministic
    drain(llm)
    assert llm.reset_prefix_cache()
    h0 = external_hits(llm)
    assert generate(llm, [prompt]) == ref
    assert external_hits(llm) - h0 >= 2 * 32
    drain(llm)


def _run_child(tiny_model: str, address: str, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    child = ENGINE_CHILD
    proc = subprocess.run([sys.executable, str(child), tiny_model, address, json.dumps(configs), json.dumps(PROMPTS)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]


def test_new_process_hits_same_identity_only(llm: Any, tiny_model: str, reference: list[list[int]],
                                             daemon: Any) -> None:
    """Blocks stored by this engine serve a fresh engine in a fresh process (a multiprocess engine, as
    ``vllm serve`` runs it); a different dtype or block size is a different namespace (misses, never
    wrong tokens)."""
    generate(llm, PROMPTS)
    drain(llm)
    hits0 = daemon.metric("kvoffd_lookup_blocks_total", result="hit")
    same, bf16, bs64 = _run_child(tiny_model, daemon.address, [
        {"multiprocess": True}, {"dtype": "bfloat16"}, {"block_size": 64}])
    assert same["outputs"] == reference
    check_served(PROMPTS, same["external_hits"], same["cached_tokens"])
    assert same["kvoffd"]["lookup_timeouts"] == 0, same["kvoffd"]
    assert bf16["external_hits"] == 0
    assert bs64["external_hits"] == 0
    assert daemon.metric("kvoffd_lookup_blocks_total", result="hit") - hits0 >= same["external_hits"] // 32


def test_reset_connector_keeps_the_shared_cache(llm: Any, reference: list[list[int]], daemon: Any) -> None:
    """reset_prefix_cache(reset_connector=True) drops this engine's view, not blocks other engines share."""
    generate(llm, PROMPTS)
    drain(llm)
    resident = daemon.stats()["resident_blocks"]
    assert llm.reset_prefix_cache(reset_connector=True)
    assert daemon.stats()["resident_blocks"] == resident
    h0 = external_hits(llm)
    assert generate(llm, PROMPTS) == reference
    assert external_hits(llm) - h0 == 13 * 32
    drain(llm)
