"""Issue 27 point 1 on a real engine: new weights written to the same model path never get the old
weights' KV; the same weights, restarted, do.

The redeploy of a fine-tuned checkpoint to ``/models/current``: serve, stop vLLM, write new weights
into the same directory (same config, same file sizes, every tensor different), start vLLM again on
the same daemon. Before the weights were part of the namespace this loaded 12 blocks of the old
weights' KV and changed the greedy tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import (
    Daemon,
    build_tiny_llama,
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


def _serve(model: str, daemon: Daemon) -> tuple[list[list[int]], int, str]:
    """One engine's life: greedy outputs, tokens loaded from the daemon, the namespace it used."""
    llm = make_llm(model, daemon.address)
    try:
        hits0 = external_hits(llm)
        out = [generate(llm, [p])[0] for p in PROMPTS]
        hits = int(external_hits(llm) - hits0)
        drain(llm)
        conn = connector_of(llm)
        assert conn.refused is None, conn.refused
        namespace = conn._scheduler.state.identity.namespace
    finally:
        close_llm(llm)
    return out, hits, namespace


def test_new_weights_at_the_same_path_miss_and_the_same_weights_hit(tmp_path: Path, daemon: Daemon) -> None:
    model_dir = build_tiny_llama(tmp_path / "current", seed=0)
    weights = model_dir / "model.safetensors"
    size_a, bytes_a = weights.stat().st_size, weights.read_bytes()
    model = str(model_dir)

    out_a, hits, ns_a = _serve(model, daemon)
    assert hits == 0  # a daemon that never saw this model
    stored = daemon.stats()["counters"]["stored_blocks"]
    assert stored > 0

    # The redeploy: new weights written over the old ones, config and sizes unchanged.
    build_tiny_llama(model_dir, seed=1)
    assert weights.stat().st_size == size_a and weights.read_bytes() != bytes_a
    out_b, hits, ns_b = _serve(model, daemon)
    assert hits == 0, "blocks of the old weights were loaded for the new ones"
    assert ns_b != ns_a
    # ... and the tokens are those of the new weights on a daemon that never saw any of this
    (tmp_path / "cold").mkdir()
    cold = Daemon(tmp_path / "cold").start()
    try:
        out_b_cold, cold_hits, _ = _serve(model, cold)
    finally:
        cold.stop()
    assert cold_hits == 0 and out_b == out_b_cold
    assert out_b != out_a  # the weights really differ

    # The old weights back (a rollback): the same bytes are the same weights, and their blocks load.
    weights.write_bytes(bytes_a)
    out_a2, hits, ns_a2 = _serve(model, daemon)
    assert ns_a2 == ns_a
    assert hits > 0
    assert out_a2 == out_a


def test_the_same_checkpoint_at_another_path_shares(tmp_path: Path, daemon: Daemon) -> None:
    """The namespace names the weights by their bytes, not by where they lie: the same checkpoint
    copied to another directory (another mount, another node's disk) finds the blocks."""
    import shutil

    first = build_tiny_llama(tmp_path / "a" / "llama", seed=3)
    out_a, _, ns_a = _serve(str(first), daemon)
    second = tmp_path / "b" / "llama"
    shutil.copytree(first, second)
    out_b, hits, ns_b = _serve(str(second), daemon)
    assert ns_b == ns_a and hits > 0 and out_b == out_a


def test_cache_salt_separates_tenants(tmp_path: Path, daemon: Daemon) -> None:
    """vLLM puts ``cache_salt`` into the first block's hash, so it is in every key: a prompt stored
    under salt A loads nothing under salt B (or none), and loads again under A. One engine, its own
    prefix cache emptied before each request, so that every hit comes from the daemon."""
    from engine_helpers import greedy
    from vllm.inputs import TokensPrompt

    model = str(build_tiny_llama(tmp_path / "salted", seed=5))
    prompt = PROMPTS[0]
    llm = make_llm(model, daemon.address)

    def serve(salt: str | None) -> tuple[list[int], int]:
        drain(llm)
        assert llm.reset_prefix_cache()
        hits0 = external_hits(llm)
        tp = TokensPrompt(prompt_token_ids=prompt) if salt is None else \
            TokensPrompt(prompt_token_ids=prompt, cache_salt=salt)
        out = list(llm.generate([tp], greedy(20), use_tqdm=False)[0].outputs[0].token_ids)
        return out, int(external_hits(llm) - hits0)

    try:
        out_a, hits = serve("tenant-a")
        assert hits == 0
        for other in ("tenant-b", None):
            out, hits = serve(other)
            assert hits == 0, f"salt {other!r} loaded tenant-a's blocks"
            assert out == out_a  # the same weights and prompt: the same tokens, computed
        out, hits = serve("tenant-a")
        assert hits == (len(prompt) - 1) // 32 * 32 and out == out_a
    finally:
        close_llm(llm)
