"""Cache identity: which engines may share KV bytes, and how block hashes become daemon keys.

vLLM's block hashes cover token ids (plus LoRA, multimodal, cache-salt extras) but not the model,
the dtype, the layout or the parallel rank. Two engines may reuse each other's blocks only when the
bytes of a block mean the same thing to both, so the namespace is a fingerprint of everything that
shapes those bytes. Any difference gives a different namespace: a miss, never a wrong token.

Both connector roles compute the namespace from the same configs, so the scheduler's LOOKUP and the
workers' REGISTER agree without talking to each other. The TP/PP rank is not in the namespace: the
daemon keys blocks by (namespace, rank, key) and a lookup hits only when every rank holds the block.
Where vLLM says runs of TP ranks hold identical KV (an MLA model's latents, ``tp_replicas``), the
daemon keeps one copy per run instead: its first rank stores it and every rank of the run loads it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvoffd_client.protocol import KEY_SIZE, MAX_NAME
from kvoffd_client.vllm.groups import GroupKind, KVGroup, UnsupportedGroups, kv_groups
from kvoffd_client.vllm.weights import (
    WeightsChanged,
    WeightsUnknown,
    fingerprint_checkpoint,
    process_start_time,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)

#: Bumped whenever the way keys or namespaces are derived changes (old entries then simply miss).
KEY_FORMAT_VERSION = 1

#: Hash algorithms whose seed is random per process unless PYTHONHASHSEED is set.
_PROCESS_SEEDED_ALGOS = ("xxhash", "xxhash_cbor")


class UnsupportedConfig(Exception):
    """The engine's configuration cannot be offloaded safely; the connector falls back to no offload."""


@dataclass(frozen=True)
class CacheIdentity:
    """What the connector needs to address the daemon: the namespace and the key geometry."""

    namespace: str
    block_size: int  # tokens per vLLM (manager) block
    hashes_per_block: int  # request.block_hashes entries per block (block_size // hash_block_size)
    world_size: int  # ranks that must all hold a block for it to hit (tp * pp * pcp)
    fields: dict[str, Any]  # the fingerprinted inputs, for the log line and `docs/vllm.md`
    groups: tuple[KVGroup, ...] = ()  # vLLM's KV-cache groups (several with HMA: kvoffd_client.vllm.groups)
    replicas: int = 1  # consecutive ranks holding identical KV, stored once (``tp_replicas``); 1: none

    def stores(self, rank: int) -> bool:
        """Whether this rank sends STOREs: each rank does, except that of a run of replicas only the
        first does (the daemon refuses the others' stores and loads the first's copy into all)."""
        return rank % self.replicas == 0

    @property
    def num_groups(self) -> int:
        return max(1, len(self.groups))


def fold_key(block_hash: bytes) -> bytes:
    """A vLLM block hash as a daemon key (exactly KEY_SIZE bytes); sha256 hashes pass through."""
    if len(block_hash) == KEY_SIZE:
        return block_hash
    return hashlib.blake2b(block_hash, digest_size=KEY_SIZE).digest()


#: Module-level functions of ``vllm.v1.core.kv_cache_utils`` that decide what a request's block
#: hashes are: the root seed, the extra keys (multimodal, LoRA, prompt embeds, cache salt) and how the
#: hasher walks a request. Their code (not their docstrings or formatting) is in the namespace.
_HASH_INPUT_FUNCTIONS = (
    "resolve_none_hash_seed",
    "generate_block_hash_extra_keys",
    "_gen_mm_extra_hash_keys",
    "_gen_lora_extra_hash_keys",
    "_gen_prompt_embeds_extra_hash_keys",
    "get_request_block_hasher",
)


def _code_digest(fn: Any) -> str:
    """The function's code as an AST without docstrings: comments, layout and docs do not count."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(getattr(body[0], "value", None), ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree, annotate_fields=False).encode()).hexdigest()[:16]


def hash_compat(algo: str) -> str:
    """A fingerprint of how this vLLM turns tokens into block hashes, in place of its version number.

    Two vLLM releases whose hashes agree share cached blocks (0.32 -> 0.33 changed none of this), and
    any change that could give one block two meanings changes the fingerprint: the hash function's
    output on a probe chain (root seed, parent, tokens, extra keys), and the code that builds the extra
    keys and walks a request. Anything unreadable counts as a change ("unknown" never matches a real
    fingerprint, so the worst case is a cold cache).
    """
    try:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils as ku

        fn = get_hash_fn_by_name(algo)
        root = fn(ku.resolve_none_hash_seed(fn))
        probe = ku.hash_block_tokens(fn, root, (1, 2, 3, 4), ("salt", ("lora", "a", "/p"), ("mm", 0)))
        probe = ku.hash_block_tokens(fn, probe, range(5, 9), None)
        parts = [algo, bytes(probe).hex()] + [f"{n}={_code_digest(getattr(ku, n))}" for n in _HASH_INPUT_FUNCTIONS]
    except Exception as e:  # pragma: no cover - a vLLM this code does not know
        import vllm

        log.warning("kvoffd: cannot fingerprint vLLM's block hashing (%s); keying on the vLLM version", e)
        return f"vllm-{getattr(vllm, '__version__', 'unknown')}"
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _platform() -> str:
    try:
        from vllm.platforms import current_platform

        return current_platform._enum.name.lower()
    except Exception:
        return "unknown"


def _cpu_attention_isa(dtype: Any, block_size: int, head_size: int, cache_dtype: str) -> str:
    """The CPU attention kernel packs a page differently per ISA (vec, amx, neon, ...)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(dtype, block_size, head_size, cache_dtype))
    except Exception:
        return "unknown"


def _hf_config_digest(vllm_config: VllmConfig) -> str:
    """Architecture, layer count, rope and every other model knob that changes KV values."""
    try:
        d = vllm_config.model_config.hf_config.to_dict()
    except Exception:
        return "unknown"
    # The path the config was read from is not a property of the model.
    for k in ("_name_or_path", "transformers_version", "_commit_hash"):
        d.pop(k, None)
    blob = json.dumps(d, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _short_model(model: str) -> str:
    base = model.rstrip("/").split("/")[-1] or "model"
    return re.sub(r"[^A-Za-z0-9._-]", "_", base)[:48]


def check_hash_stability(vllm_config: VllmConfig) -> None:
    """Raise UnsupportedConfig when block hashes would differ between processes or restarts."""
    algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
    if algo in _PROCESS_SEEDED_ALGOS and not os.environ.get("PYTHONHASHSEED"):
        raise UnsupportedConfig(
            f"prefix_caching_hash_algo={algo!r} seeds its block hashes randomly per process unless "
            "PYTHONHASHSEED is set, so blocks stored by one engine could never be found by another "
            "(or after a restart). Set PYTHONHASHSEED to the same value for every engine, or use the "
            "default sha256. kvoffd offload is disabled for this engine."
        )


def check_prefix_reuse(vllm_config: VllmConfig) -> None:
    """Raise UnsupportedConfig when vLLM never computes a prompt over KV already in its cache.

    A loaded block is only useful if the attention backend then prefills the rest of the prompt over
    it, exactly what vLLM's own prefix caching and chunked prefill do. A platform turns both off for
    a backend that cannot do that correctly (vLLM's CPU platform does it for the reference CPU MLA
    backend, whose prefill over a cached prefix gives wrong tokens even through vLLM's own
    ExampleConnector). With both off nothing vouches for that path, so kvoffd does not offer it
    either: a miss, never a wrong token.
    """
    cc, sc = vllm_config.cache_config, vllm_config.scheduler_config
    if not getattr(cc, "enable_prefix_caching", True) and not getattr(sc, "enable_chunked_prefill", True):
        raise UnsupportedConfig(
            "vLLM runs this model with prefix caching and chunked prefill both off, so its attention "
            "backend never computes a prompt over KV already in the cache and loaded blocks could not be "
            "used safely (vLLM's CPU platform does this for MLA models). kvoffd offload is disabled for "
            "this engine; turn prefix caching or chunked prefill on where the backend supports it."
        )


def tp_replicas(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> int:
    """How many consecutive TP ranks hold byte-identical KV, so one stored copy serves them all (1: none).

    An MLA model keeps one latent vector per token, computed from activations every TP rank has, so
    each rank's cache is the same bytes. kvoffd stores it once only where vLLM itself says so
    (``KVCacheConfig.kv_tp_replicas``, from each layer spec's ``max_tp_shards``) and the model is
    MLA throughout (``use_mla``, every layer an ``MLAAttentionSpec``), not from a model list. Decode
    or prefill context parallelism splits the tokens of a block across ranks: not replicated.
    """
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    tp = int(pc.tensor_parallel_size)
    replicas = int(getattr(kv_cache_config, "kv_tp_replicas", 1) or 1)  # absent before vLLM 0.32: none
    if tp < 2 or replicas < 2 or tp % replicas or not getattr(mc, "use_mla", False):
        return 1
    if int(getattr(pc, "decode_context_parallel_size", 1) or 1) > 1 or \
            int(getattr(pc, "prefill_context_parallel_size", 1) or 1) > 1:
        return 1
    specs = [s for g in kv_cache_config.kv_cache_groups
             for s in (getattr(g.kv_cache_spec, "kv_cache_specs", None) or {"": g.kv_cache_spec}).values()]
    if not specs or not all(isinstance(s, MLAAttentionSpec) for s in specs):
        return 1
    return replicas


def _weights_version(vllm_config: VllmConfig) -> str:
    """``kvoffd_weights_version``: the operator's own name for the weights, in place of the fingerprint
    (RL updates and sleep level 2 change weights in memory, which no file shows; docs/vllm.md)."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    extra = (getattr(ktc, "kv_connector_extra_config", None) if ktc is not None else None) or {}
    return str(extra.get("kvoffd_weights_version") or "")


def _loading_began_after() -> float | None:
    """A time before this engine began loading its weights (for ``WeightsChanged``), or None.

    vLLM's engine-core and worker processes are started for the engine, so their start precedes the
    load. An in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) lives in an older process that may
    well have written or downloaded the checkpoint itself: nothing here dates its load, so no check.
    """
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0":
        return None
    return process_start_time()


def _checkpoint_path(vllm_config: VllmConfig) -> str:
    """Where the engine's weights are: the model path, or its hub snapshot in the local cache."""
    mc, lc = vllm_config.model_config, vllm_config.load_config
    model = str(mc.model)
    if os.path.exists(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id=model, revision=mc.revision, cache_dir=lc.download_dir,
                                 local_files_only=True)
    except Exception as e:
        raise WeightsUnknown(f"{model} is neither a local path nor a snapshot in the local hub cache ({e})") from None


def weights_identity(vllm_config: VllmConfig) -> str:
    """What the namespace says about the weights: the operator's version, else a fingerprint of the
    checkpoint files (kvoffd_client.vllm.weights). Raises UnsupportedConfig when neither is known."""
    explicit = _weights_version(vllm_config)
    if explicit:
        return f"version:{explicit}"
    load_format = str(getattr(vllm_config.load_config, "load_format", "auto"))
    if load_format == "dummy":  # vLLM's dummy weights come from one fixed seed: a config names them
        return "dummy"
    try:
        path = _checkpoint_path(vllm_config)
        fp = fingerprint_checkpoint(path, loaded_after=_loading_began_after())
    except (WeightsUnknown, WeightsChanged, OSError) as e:
        raise UnsupportedConfig(
            f"cannot tell which weights this engine computes its KV with: {e}. Blocks are keyed by tokens, "
            "not weights, so kvoffd offload is disabled for this engine; set kv_connector_extra_config."
            "kvoffd_weights_version to a name that changes whenever the weights do.") from None
    log.debug("kvoffd: weights %s: %d files, %.1f GB, %d bytes sampled in %.3f s", path, fp.files,
              fp.bytes_on_disk / 1e9, fp.sampled_bytes, fp.seconds)
    return f"files:{fp.digest}"


def cache_identity(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> CacheIdentity:
    """Fingerprint the engine's KV bytes. Raises UnsupportedConfig for what we cannot offload."""
    check_hash_stability(vllm_config)
    check_prefix_reuse(vllm_config)
    kinds = _offloadable_groups(kv_cache_config)
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    block_size, hash_block = _block_sizes(vllm_config, kv_cache_config, spec)
    fields = _identity_fields(vllm_config, kv_cache_config, spec, block_size, hash_block)
    if len(kinds) > 1 or kinds[0].kind is not GroupKind.FULL:
        fields["groups"] = [g.describe() for g in kinds]
    replicas = tp_replicas(vllm_config, kv_cache_config)
    if replicas > 1:  # one copy per run of ranks: not the same entries as a copy per rank
        fields["stored_once_per_ranks"] = replicas
    if fields["platform"] == "cpu":
        fields["cpu_isa"] = _cpu_attention_isa(getattr(spec, "dtype", None), int(spec.block_size),
                                               fields["head_size"], fields["cache_dtype"])
    digest = hashlib.sha256(json.dumps(_digested(fields), sort_keys=True).encode()).hexdigest()[:32]
    namespace = f"vllm{KEY_FORMAT_VERSION}:{_namespace_label(vllm_config, fields)}:{digest}"[:MAX_NAME]
    world_size = fields["tp"] * fields["pp"] * fields["pcp"]
    return CacheIdentity(namespace=namespace, block_size=block_size, hashes_per_block=block_size // hash_block,
                         world_size=world_size, fields=fields, groups=kinds, replicas=replicas)


def _namespace_label(vllm_config: VllmConfig, fields: dict[str, Any]) -> str:
    """The readable part of the namespace. Like the digest, it leaves the model's path out when the
    weights are named by their bytes (the HF model type instead), so copies share."""
    if "model" not in _digested(fields):
        return _short_model(str(getattr(vllm_config.model_config.hf_config, "model_type", "") or "model"))
    return _short_model(str(vllm_config.model_config.model))


def _digested(fields: dict[str, Any]) -> dict[str, Any]:
    """The fields the namespace digests. Weights named by their files' bytes make the model's path and
    revision redundant, and leaving those out lets the same checkpoint share from another directory,
    mount or node; weights named by the operator or vLLM's dummy seed keep them."""
    if str(fields.get("weights", "")).startswith("files:"):
        return {k: v for k, v in fields.items() if k not in ("model", "revision")}
    return fields


def _offloadable_groups(kv_cache_config: KVCacheConfig) -> list[Any]:
    """The KV-cache groups' kinds, or UnsupportedConfig for groups the connector cannot offload."""
    try:
        kinds = kv_groups(kv_cache_config)
    except UnsupportedGroups as e:
        raise UnsupportedConfig(f"{e}. Offload is disabled for this engine.") from None
    if len({int(g.kv_cache_spec.page_size_bytes) for g in kv_cache_config.kv_cache_groups}) > 1:
        raise UnsupportedConfig("the KV-cache groups have different page sizes. Offload is disabled for this engine.")
    return kinds


def _block_sizes(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, spec: Any) -> tuple[int, int]:
    """(tokens per block, tokens per block hash): a DCP-sharded block spans every DCP rank's tokens."""
    block_size = int(spec.block_size)
    if getattr(spec, "dcp_sharded", False):
        dcp = int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1)
        block_size *= dcp
    hash_block = int(kv_cache_config.hash_block_size or vllm_config.cache_config.hash_block_size
                     or block_size)
    if block_size % hash_block:
        raise UnsupportedConfig(f"block size {block_size} is not a multiple of the hash block size {hash_block}")
    return block_size, hash_block


def _identity_fields(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, spec: Any, block_size: int,
                     hash_block: int) -> dict[str, Any]:
    """Everything that decides the KV bytes of a block (the namespace digests them)."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    fields: dict[str, Any] = {
        "key_format": KEY_FORMAT_VERSION,
        "hash_compat": hash_compat(str(cc.prefix_caching_hash_algo)),
        "model": str(mc.model),
        "revision": str(mc.revision),
        "hf_config": _hf_config_digest(vllm_config),
        "quantization": str(mc.quantization),
        "dtype": str(mc.dtype),
        "cache_dtype": str(cc.cache_dtype),
        "platform": _platform(),
        "attention_backend": str(getattr(getattr(vllm_config, "attention_config", None), "backend", None)),
        "layout": str(kv_cache_config.kv_cache_layout or getattr(cc, "kv_cache_layout", None) or "default"),
        "spec": type(spec).__name__,
        "spec_dtype": str(getattr(spec, "dtype", None)),
        "num_kv_heads": int(getattr(spec, "num_kv_heads", 0)),
        "head_size": int(getattr(spec, "head_size", 0)),
        "head_size_v": int(getattr(spec, "head_size_v", 0) or 0),
        "page_size_bytes": int(spec.page_size_bytes),
        "num_layers": sum(len(g.layer_names) for g in kv_cache_config.kv_cache_groups),
        "block_size": block_size,
        "hash_block_size": hash_block,
        "hash_algo": str(cc.prefix_caching_hash_algo),
        "tp": int(pc.tensor_parallel_size),
        "pp": int(pc.pipeline_parallel_size),
        "pcp": int(getattr(pc, "prefill_context_parallel_size", 1) or 1),
        "dcp": int(getattr(pc, "decode_context_parallel_size", 1) or 1),
        "kv_tp_replicas": int(getattr(kv_cache_config, "kv_tp_replicas", 1) or 1),
    }
    fields["weights"] = weights_identity(vllm_config)
    return fields


def worker_rank(vllm_config: VllmConfig) -> int:
    """This worker's rank among the ranks that share one engine's blocks (tp + tp*(pcp + pcp*pp))."""
    try:
        from vllm.distributed import parallel_state as ps

        tp_rank = ps.get_tensor_model_parallel_rank()
        tp = vllm_config.parallel_config.tensor_parallel_size
        pp_rank = ps.get_pp_group().rank_in_group
        pcp = int(getattr(vllm_config.parallel_config, "prefill_context_parallel_size", 1) or 1)
        pcp_rank = ps.get_pcp_group().rank_in_group if pcp > 1 else 0
        return tp_rank + tp * (pcp_rank + pcp * pp_rank)
    except Exception:
        return 0
