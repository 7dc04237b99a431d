"""In-process vLLM engines wired to kvoffd, and the tiny random models they run: what the vLLM benches
(bench/sync_ttft.py, engine_overhead.py, make_tiny_model.py), the vLLM tests (tests/vllm, through
tests/vllm/engine_helpers.py) and the engine child process (engine_child.py) share."""

from __future__ import annotations

import gc
import importlib.util
import os
import time
from pathlib import Path
from typing import Any

HAVE_VLLM = importlib.util.find_spec("vllm") is not None

# Must be set before vllm is imported anywhere in this process.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BLOCK = 32


# --------------------------------------------------------------------------------------------------
# model


def build_tiny_llama(path: Path, seed: int = 0) -> Path:
    """A 2-layer random Llama (head_dim 32: the CPU attention kernels reject 16). ~0.4 M params."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(str(path), safe_serialization=True)
    return path


#: The sliding window of the tiny sliding-window models: two 32-token blocks, so that a 200-token
#: prefix leaves most of its blocks outside the window (vLLM frees them with HMA on).
WINDOW = 64


def build_tiny_gemma3(path: Path, seed: int = 0, sliding: int = 3, full: int = 1) -> Path:
    """A Gemma-3-style text model: ``sliding`` sliding-window layers, then ``full`` full-attention layers.

    3 + 1 gives 4 KV groups of one layer each; 5 + 2 gives groups of 2, 2, 1 sliding and 2 full layers
    (uneven groups, as real Gemma-3 sizes get)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=sliding + full,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                           sliding_window=WINDOW,
                           layer_types=["sliding_attention"] * sliding + ["full_attention"] * full,
                           bos_token_id=1, eos_token_id=2, pad_token_id=0)
    Gemma3ForCausalLM(cfg).save_pretrained(str(path), safe_serialization=True)
    return path


def build_tiny_mistral(path: Path, seed: int = 0) -> Path:
    """A Mistral-style model whose every layer is a sliding window (one sliding KV group)."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    cfg = MistralConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                        sliding_window=WINDOW, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                        tie_word_embeddings=False)
    MistralForCausalLM(cfg).save_pretrained(str(path), safe_serialization=True)
    return path


def build_tiny_qwen3_next(path: Path, seed: int = 0) -> Path:
    """A Qwen3-Next-style hybrid: 3 gated-delta-net (linear attention) layers, then 1 full-attention layer,
    MoE MLPs. The CPU linear-attention kernel needs 128-wide heads; bf16 weights."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                          linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=128,
                          linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=64, shared_expert_intermediate_size=64, decoder_sparse_step=1,
                          full_attention_interval=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                          bos_token_id=1, eos_token_id=2, pad_token_id=0)
    Qwen3NextForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(path), safe_serialization=True)
    return path


def build_tiny_mla(path: Path, seed: int = 0) -> Path:
    """A 2-layer random DeepSeek-V2-style MLA model (latent 512 + rope 64 = the 576 the CPU MLA kernel
    needs), dense MLPs only. A wider init than the default keeps greedy margins clear of rounding."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None,
                           qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, first_k_dense_replace=2,
                           n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=64, num_experts_per_tok=2,
                           initializer_range=0.2, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                           pad_token_id=0, tie_word_embeddings=False)
    DeepseekV2ForCausalLM(cfg).save_pretrained(str(path), safe_serialization=True)
    return path


# --------------------------------------------------------------------------------------------------
# engines


def make_llm(model: str, address: str | None = None, *, dtype: str = "float32", block_size: int = BLOCK,
             max_model_len: int = 1024, max_num_seqs: int = 16,
             extra: dict[str, Any] | None = None, kv_bytes: int = 32 << 20, **kw: Any):
    """An in-process vLLM engine; with ``address``, wired to kvoffd through KvoffdConnector."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = None
    if address is not None:
        ktc = KVTransferConfig(kv_connector="KvoffdConnector", kv_connector_module_path="kvoffd_client.vllm",
                               kv_role="kv_both", kv_load_failure_policy="recompute",
                               # a loaded 2-core CI box can take longer than the defaults (500 ms)
                               # to answer a lookup or a fresh process's handshake; these tests check
                               # what is served, not how fast. Loads are asynchronous unless a test
                               # asks for same-step loads (test_connector_sync_load.py): the exact hit
                               # counts asserted here are the asynchronous path's (a same-step load's
                               # blocks are shared by the requests scheduled after it in vLLM's cache).
                               kv_connector_extra_config={"kvoffd_address": address,
                                                          "kvoffd_lookup_timeout_ms": 10_000,
                                                          "kvoffd_connect_timeout_s": 10.0,
                                                          "kvoffd_sync_load_bytes": 0,
                                                          "kvoffd_sync_load_timeout_ms": 10_000, **(extra or {})})
    return LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype=dtype, max_model_len=max_model_len,
               block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=1024, kv_cache_memory_bytes=kv_bytes,
               seed=0, disable_log_stats=False, **{"kv_transfer_config": ktc, **kw})


def close_llm(llm: Any) -> None:
    """Shut an in-process engine down fully (the worker connector is a process global in vLLM)."""
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        ensure_kv_transfer_shutdown()
        del llm
        gc.collect()


def core_of(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core


def drain(llm: Any, timeout: float = 30.0) -> None:
    """Step the engine until it holds no request (delayed frees waiting for store acknowledgements).

    ``LLM.generate`` returns once outputs are complete; a delay-free connector may still hold blocks
    for a few steps, which in-process mode only advances when someone steps the engine.
    """
    client = llm.llm_engine.engine_core
    sched = core_of(llm).scheduler
    deadline = time.monotonic() + timeout
    while sched.has_requests():
        if time.monotonic() > deadline:
            raise TimeoutError("the engine still holds requests")
        client.get_output()
        time.sleep(0.001)


def vllm_metric(llm: Any, name: str, **labels: str) -> float:
    """A counter from vLLM's own metrics (what `vllm serve` exposes on /metrics), summed over labels."""
    return sum(getattr(m, "value", 0) or 0 for m in llm.get_metrics()
               if m.name == name and all(m.labels.get(k) == v for k, v in labels.items()))


def external_hits(llm: Any) -> float:
    """vLLM's own counter of tokens served from the connector (vllm:external_prefix_cache_hits)."""
    return vllm_metric(llm, "vllm:external_prefix_cache_hits")


# --------------------------------------------------------------------------------------------------
# workload


def shared_prefix_prompts(n: int = 4, prefix: int = 70, seed: int = 0) -> list[list[int]]:
    """Prompts sharing a 70-token prefix (2 full blocks), each with its own 40..67-token tail."""
    base = [(7 * j + seed) % 500 + 3 for j in range(prefix)]
    return [base + [(11 * i + j + seed) % 500 + 3 for j in range(40 + 9 * i)] for i in range(n)]


def greedy(max_tokens: int = 20):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)


def generate(llm: Any, prompts: list[list[int]], max_tokens: int = 20) -> list[list[int]]:
    from vllm.inputs import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy(max_tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def generate_cached(llm: Any, prompts: list[list[int]], max_tokens: int = 20) -> tuple[list[list[int]], int]:
    """The outputs, and the prompt tokens vLLM did not compute: its own prefix cache's plus the
    connector's (``RequestOutput.num_cached_tokens``)."""
    from vllm.inputs import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy(max_tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], sum(o.num_cached_tokens or 0 for o in outs)


PROMPTS = shared_prefix_prompts()
PREFIX_BLOCKS = 2  # PROMPTS share 70 tokens: two whole blocks


def check_served(prompts: list[list[int]], external: float, cached: int) -> None:
    """A fresh engine (vLLM's own cache empty) whose every block is in kvoffd: whatever the timing, every
    whole block before each prompt's last token is served without compute (``cached``); from kvoffd
    (``external``), except the shared prefix of a prompt scheduled after another one's load of it
    landed, which vLLM then finds in its own cache. Which prompts share a step depends on when their
    lookups' answers arrive: on a loaded host a fresh multiprocess engine schedules some a step later
    (288 of 416 tokens external, seen once in three loaded make test runs)."""
    whole = sum((len(p) - 1) // BLOCK for p in prompts) * BLOCK
    assert cached == whole, (cached, whole)
    assert whole - (len(prompts) - 1) * PREFIX_BLOCKS * BLOCK <= external <= whole, (external, whole)


def issue_prompts(n: int = 3, prefix: int = 300, tail: int = 20, seed: int = 0) -> list[list[int]]:
    """A 300-token shared prefix plus 20 random tokens per prompt (the workload of issue 12)."""
    import random

    rng = random.Random(seed)
    base = [rng.randrange(3, 500) for _ in range(prefix)]
    return [base + [rng.randrange(3, 500) for _ in range(tail)] for _ in range(n)]


def connector_of(llm: Any) -> Any:
    """The scheduler-role KvoffdConnector of an in-process engine."""
    return core_of(llm).scheduler.get_kv_connector()
