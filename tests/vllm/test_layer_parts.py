"""Where a layer-wise load cuts a block (kvoffd_client.vllm.layerwise.LayerParts), checked against the
bytes: for vLLM-shaped KV tensors (per-layer, block-outermost, kernel-block split, aliased layers),
the parts the daemon copies (kvoffd.transfer.base.Runs.cut over the REGISTER layout) hold exactly
the bytes of the layers each layer's wait covers. No engine: torch CPU tensors in one storage."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvoffd.transfer.base import MappedMemory  # noqa: E402
from kvoffd_client.memory.layout import describe_layout  # noqa: E402
from kvoffd_client.protocol import Segment  # noqa: E402
from kvoffd_client.vllm.layerwise import LayerParts  # noqa: E402

pytestmark = pytest.mark.vllm


def _per_layer(layers: int, nb: int, ratio: int = 1) -> dict[str, torch.Tensor]:
    """vLLM's flash layout: per layer a [K|V, blocks*ratio, 16/ratio tokens, 2 heads, 8] plane pair in
    one buffer, seen blocks first (dim 0 = kernel blocks: two runs per block, its K and its V)."""
    per = 2 * nb * 16 * 2 * 8
    buf = torch.zeros(layers * per, dtype=torch.float16)
    return {f"model.layers.{i}.self_attn.attn":
            buf[i * per:(i + 1) * per].view(2, nb * ratio, 16 // ratio, 2, 8).transpose(0, 1)
            for i in range(layers)}


def _block_outermost(layers: int, nb: int) -> dict[str, torch.Tensor]:
    """One buffer [blocks, layers, K|V, 16, 2, 8]; each layer a strided view (block-contiguous)."""
    buf = torch.zeros(nb, layers, 2, 16, 2, 8, dtype=torch.float16)
    return {f"model.layers.{i}.self_attn.attn": buf[:, i] for i in range(layers)}


def _check_bytes(kv: dict[str, torch.Tensor], nb: int, lp: LayerParts) -> None:
    """Each part's runs for block b cover exactly the bytes of its layers' block b, and a layer's
    ``need`` reaches the part holding it."""
    lay = describe_layout(kv, nb)
    segs = [Segment(*s) for s in lay["segments"]]
    m = MappedMemory(engine_id="e", kind="cpu_fd", size=1 << 40, num_blocks=nb, segments=segs,
                     slot_bytes=sum(s.length for s in segs))
    parts = m.parts(list(lp.cuts))
    first = next(iter(kv.values()))
    base = first.untyped_storage().data_ptr()
    esz = first.element_size()
    b = nb - 1
    covered = []
    for runs in parts:
        got = set()
        for off, stride, length in zip(runs.offset, runs.stride, runs.length, strict=True):
            got.update(range(int(off + b * stride), int(off + b * stride + length)))
        covered.append(got)
    for name, t in kv.items():
        ratio = t.shape[0] // nb
        blk = t[b * ratio:(b + 1) * ratio]
        offs = np.zeros(blk.shape, dtype=np.int64)
        for d, st in enumerate(blk.stride()):
            shape = [1] * blk.dim()
            shape[d] = blk.shape[d]
            offs = offs + np.arange(blk.shape[d]).reshape(shape) * st
        addrs = {int(blk.data_ptr() - base + o * esz + k) for o in offs.ravel() for k in range(esz)}
        need = lp.needed(name)
        assert addrs <= set().union(*covered[:need]), f"{name}: its bytes are not all in its first {need} parts"
        assert not addrs & set().union(*covered[need:]), f"{name}: some of its bytes land after its wait"


def test_per_layer_views_one_part_per_layer():
    kv = _per_layer(6, 10)
    lay = describe_layout(kv, 10)
    lp = LayerParts.of(kv, 10, sum(s[2] for s in lay["segments"]))
    assert lp is not None and lp.parts == 6
    assert [lp.needed(f"model.layers.{i}.self_attn.attn") for i in range(6)] == [1, 2, 3, 4, 5, 6]
    assert lp.needed("not.a.layer") == 6
    _check_bytes(kv, 10, lp)


def test_layers_grouped_when_more_than_max_parts():
    kv = _per_layer(40, 4)
    bb = sum(s[2] for s in describe_layout(kv, 4)["segments"])
    lp = LayerParts.of(kv, 4, bb, max_parts=8)
    assert lp is not None and lp.parts == 8
    need = [lp.needed(f"model.layers.{i}.self_attn.attn") for i in range(40)]
    # the last layer alone, the 39 others in 7 even groups (5 or 6 layers)
    assert need == sorted(need) and need[0] == 1 and need[-1] == 8 and need.count(8) == 1
    assert all(5 <= need.count(g) <= 6 for g in range(1, 8))
    _check_bytes(kv, 4, lp)


def test_block_outermost_is_cut_inside_its_one_run():
    kv = _block_outermost(4, 8)
    lay = describe_layout(kv, 8)
    assert len(lay["segments"]) == 1  # every layer of a block is one run
    lp = LayerParts.of(kv, 8, lay["segments"][0][2])
    assert lp is not None and lp.parts == 4
    _check_bytes(kv, 8, lp)


def test_kernel_block_split():
    kv = _per_layer(3, 6, ratio=2)
    bb = sum(s[2] for s in describe_layout(kv, 6)["segments"])
    lp = LayerParts.of(kv, 6, bb)
    assert lp is not None and lp.parts == 3
    _check_bytes(kv, 6, lp)


def test_aliased_layers_share_a_part_and_one_view_is_not_cut():
    kv = _per_layer(3, 5)
    kv["model.layers.3.self_attn.attn"] = kv["model.layers.1.self_attn.attn"]  # KV shared by two layers
    bb = sum(s[2] for s in describe_layout(kv, 5)["segments"])
    lp = LayerParts.of(kv, 5, bb)
    assert lp is not None and lp.parts == 3
    assert lp.needed("model.layers.3.self_attn.attn") == lp.needed("model.layers.1.self_attn.attn") == 2
    one = dict(list(_per_layer(1, 5).items()))
    assert LayerParts.of(one, 5, sum(s[2] for s in describe_layout(one, 5)["segments"])) is None
    assert LayerParts.of(kv, 5, bb + 1) is None  # bytes that do not add up: whole loads
