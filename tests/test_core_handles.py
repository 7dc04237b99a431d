"""Moving a CPU KV allocation into shared memory: every view the engine computes in must move with it.

vLLM binds the registered per-layer tensors to attention layers, but a layer may keep a view of its
own (MLA squeezes the head dim: ``kv_cache.squeeze(1)``). Before this was handled, such a layer kept
computing in the old allocation while the daemon stored and loaded the new one: wrong tokens on every
MLA model (issue 12). These tests use a real daemon and real shared memory.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kvtest import chain_keys


def _mla_like(nb: int = 8, bs: int = 16, width: int = 576):
    """Two layers' [blocks, 1, block_size, 576] views of one allocation, and layers holding squeezed views."""
    import torch

    # One allocation, per-layer views without a ``_base`` (as vLLM's views reach the connector).
    storage = torch.zeros(2 * nb * bs * width).untyped_storage()
    shape, stride = (nb, 1, bs, width), (bs * width, bs * width, width, 1)
    kv = {f"l{i}": torch.empty(0).set_(storage, i * nb * bs * width, shape, stride) for i in range(2)}
    layers = [SimpleNamespace(kv_cache=t.squeeze(1), impl=SimpleNamespace(scratch=[t[:, 0]])) for t in kv.values()]
    return kv, layers


def test_views_held_by_layers_move_and_the_daemon_copies_what_they_compute(make_daemon) -> None:
    import torch

    from kvoffd_client.client import KvoffdClient
    from kvoffd_client.memory.cpu_fd import release_cpu_kv_caches, share_cpu_kv_caches
    from kvoffd_client.memory.layout import describe_layout

    kv, layers = _mla_like()
    d = make_daemon("16MiB", name="views")
    c = KvoffdClient(d.address)
    memory = None
    try:
        assert c.connect(5)
        memory = share_cpu_kv_caches(kv, "views", holders=layers)
        c.register("mv-0", "mv", 0, 1, memory, describe_layout(kv, 8))
        # The "model" writes blocks 0-1 through the layers' own views ...
        for i, layer in enumerate(layers):
            layer.kv_cache[0:2] = torch.arange(2 * 16 * 576, dtype=torch.float32).view(2, 16, 576) + i
        keys = chain_keys(2, b"mv")
        c.submit_store("mv-0", 1, keys, [0, 1])
        assert all(n.ok for n in c.wait_notices({1}, 5.0))
        # ... the daemon stores those bytes and loads them into blocks 5-6, where the layers read them.
        c.submit_load("mv-0", 2, keys, [5, 6])
        assert all(n.ok for n in c.wait_notices({2}, 5.0))
        for layer in layers:
            assert torch.equal(layer.kv_cache[5:7], layer.kv_cache[0:2])
            assert layer.kv_cache[5:7].abs().sum() > 0
            assert layer.impl.scratch[0].untyped_storage().data_ptr() == layer.kv_cache.untyped_storage().data_ptr()
    finally:
        c.close()
        if memory is not None:
            release_cpu_kv_caches(memory)


def test_a_view_the_connector_cannot_see_refuses_the_move() -> None:
    """Unprovable (a tensor nobody told us about still uses the allocation): refuse, leave vLLM as it was."""
    import os

    from kvoffd_client.memory.cpu_fd import StaleViewError, share_cpu_kv_caches

    kv, layers = _mla_like()
    hidden = kv["l0"].view(-1)[:10]  # e.g. a backend's private view the connector cannot find
    before = {n: t.untyped_storage().data_ptr() for n, t in kv.items()}
    fds = set(os.listdir("/proc/self/fd"))
    with pytest.raises(StaleViewError, match="1 tensor"):
        share_cpu_kv_caches(kv, "hidden", holders=layers)
    assert {n: t.untyped_storage().data_ptr() for n, t in kv.items()} == before
    assert layers[0].kv_cache.untyped_storage().data_ptr() == before["l0"] == hidden.untyped_storage().data_ptr()
    assert set(os.listdir("/proc/self/fd")) <= fds  # the memfd is closed again: nothing leaks
