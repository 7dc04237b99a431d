"""A real vLLM engine (CPU build, tiny random Llama, greedy) over a daemon whose pool is too small for
its prompts, with a disk tier under it (issue 15 point 3): the first round's blocks overflow the pool
to disk; after vLLM's own prefix cache is reset, the second round is served from disk (promoted into
the pool, then loaded), and the outputs are identical to an engine without any connector."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
from engine_helpers import Daemon, close_llm, drain, external_hits, generate, make_llm

pytestmark = pytest.mark.vllm

PROMPTS = [[random.Random(s).randrange(3, 500) for _ in range(480)] for s in range(8)]  # 8 x 15 blocks


@pytest.fixture(scope="module")
def disk_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    work = tmp_path_factory.mktemp("kvoffd-disk")
    d = Daemon(work, pool="1MiB", extra=("--disk-path", str(work / "disk"), "--disk-size", "256MiB",
                                         "--eviction-policy", "lru")).start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def disk_reference(tiny_model: str) -> list[list[int]]:
    llm = make_llm(tiny_model)
    try:
        return generate(llm, PROMPTS)
    finally:
        close_llm(llm)


def test_second_round_is_served_from_disk(tiny_model: str, disk_daemon: Any, disk_reference: list) -> None:
    llm = make_llm(tiny_model, disk_daemon.address)
    try:
        assert generate(llm, PROMPTS) == disk_reference
        drain(llm)
        st = disk_daemon.stats()
        pool_blocks = st["pool"]["capacity_bytes"] // st["engines"][0]["slot_bytes"]
        assert st["counters"]["stored_blocks"] > pool_blocks, "the prompts must not fit the pool"
        disk = next(t for t in st["tiers"] if t["name"] == "disk")
        assert disk["spills"] > 0, disk
        hits0, promoted0 = disk_daemon.metric("kvoffd_tier_hits_total", tier="disk"), disk["promotions"]
        vllm_hits0 = external_hits(llm)
        assert llm.reset_prefix_cache()
        assert generate(llm, PROMPTS) == disk_reference
        drain(llm)
        disk = next(t for t in disk_daemon.stats()["tiers"] if t["name"] == "disk")
        assert disk_daemon.metric("kvoffd_tier_hits_total", tier="disk") > hits0
        assert disk["promotions"] > promoted0 and disk["promotion_failures"] == 0, disk
        assert external_hits(llm) > vllm_hits0
    finally:
        close_llm(llm)
