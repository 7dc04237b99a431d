"""The REGISTER layout: where each block sits in an engine's KV memory, worked out from the tensors.

For one block, the byte runs it occupies: ``[offset, stride, length]`` per run, block b at
``offset + b*stride``. Worked out from the tensors' strides, so every vLLM layout (layer-major
LBHNC/LBNHC, block-outermost BLNHC, split heads, kernel-block splitting, aliased layers) is covered
without naming layouts. The daemon treats the bytes as opaque. Used by both memory kinds
(``cpu_fd`` and ``cuda_ipc``).

torch is imported lazily: this module is imported by the connector in vLLM's API server too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def storage_of(tensors: dict[str, torch.Tensor]) -> tuple[Any, int]:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors.values()}
    if len(storages) != 1:
        raise ValueError(f"kvoffd needs every KV tensor in one allocation; found {len(storages)}")
    base, storage = next(iter(storages.items()))
    return storage, base


def _block_runs(t: torch.Tensor) -> tuple[int, list[int]]:
    """Run length (bytes) and the run offsets (bytes, from the tensor's start) of one dim-0 slice."""
    isz = t.element_size()
    shape, strides = list(t.shape[1:]), list(t.stride()[1:])
    expected, d = 1, len(shape) - 1
    while d >= 0 and (strides[d] == expected or shape[d] == 1):
        expected *= shape[d]
        d -= 1
    run = expected * isz
    offsets = [0]
    for dim in range(d, -1, -1):  # the dims that do not fold into one run
        offsets = [o + i * strides[dim] * isz for i in range(shape[dim]) for o in offsets]
    return run, sorted(offsets)


def describe_layout(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> dict[str, Any]:
    """The REGISTER layout for vLLM's per-layer KV views (dim 0 = kernel blocks).

    A manager block may span ``ratio`` kernel blocks (vLLM's kernel-block splitting); aliased layers
    (one view registered under two names) are described once.
    """
    if not kv_caches:
        raise ValueError("no KV tensors to describe")
    _, base = storage_of(kv_caches)
    seen: set[tuple] = set()
    segments: list[list[int]] = []
    dtypes = set()
    for t in kv_caches.values():
        sig = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if sig in seen:
            continue
        seen.add(sig)
        dtypes.add(str(t.dtype).replace("torch.", ""))
        if t.shape[0] % num_blocks:
            raise ValueError(f"a KV tensor has {t.shape[0]} blocks, not a multiple of num_blocks={num_blocks}")
        ratio = t.shape[0] // num_blocks
        stride0 = t.stride(0) * t.element_size()
        run, offsets = _block_runs(t)
        start = t.data_ptr() - base
        for j in range(ratio):
            for o in offsets:
                segments.append([start + j * stride0 + o, ratio * stride0, run])
    segments = _coalesce(segments)
    first = next(iter(kv_caches.values()))
    return {"num_blocks": num_blocks, "segments": segments,
            "desc": f"{len(seen)} views {'/'.join(sorted(dtypes))} shape {list(first.shape)} "
                    f"stride {list(first.stride())}"}


def _coalesce(segments: list[list[int]]) -> list[list[int]]:
    """Merge runs that continue each other within a block (block-outermost layouts become one run)."""
    out: list[list[int]] = []
    for off, stride, length in segments:
        if out and out[-1][1] == stride and out[-1][0] + out[-1][2] == off:
            out[-1][2] += length
        else:
            out.append([off, stride, length])
    return out
