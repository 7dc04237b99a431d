"""The scheduler's lookups: sent without waiting, answered "not yet" until the reply is in (unless
the engine has nothing else to run: then the reply is waited for, briefly, instead of an empty
step); what the daemon confirmed and what failed to load (``SchedulerState.known``) cut what is
asked; orphaned lookups reaped and their leases released."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from kvoffd_client import protocol as P
from kvoffd_client.vllm.logs import log
from kvoffd_client.vllm.sched_state import PendingLookup, RequestState, SchedulerState

if TYPE_CHECKING:
    from vllm.v1.request import Request


class LookupPlanner:
    """vLLM's ``on_new_request`` and ``get_num_new_matched_tokens`` over the scheduler's state."""

    def __init__(self, state: SchedulerState):
        self.state = state

    def reap_orphans(self) -> None:
        """Release the leases of lookups abandoned in flight whose replies came; forget the rest once
        given up on."""
        state = self.state
        client = state.client
        if not state.orphans or client is None:
            return
        now = time.monotonic()
        for seq, give_up in list(state.orphans.items()):
            reply = client.take_reply(seq)
            if isinstance(reply, P.LookupResult) and reply.lease_id:
                client.release(reply.lease_id)
                state.stats.add("leases_released")
            if reply is not None or now > give_up:
                if reply is None:
                    client.forget(seq)
                del state.orphans[seq]

    def _log_miss(self, st: RequestState, first: int, end: int) -> None:
        """At DEBUG, name a lookup's missed keys so an operator can ask the daemon why
        (``kvoffctl explain``, docs/operations.md): the first key that missed and the last key asked,
        in hex. Only called with debug logging on: no hex work on the scheduler's step otherwise."""
        identity = self.state.identity
        keys = self.state.daemon_keys(st)[0]
        if first >= min(end, len(keys)) or identity is None:
            return
        ns, a, b = identity.namespace, keys[first].hex(), keys[min(end, len(keys)) - 1].hex()
        log.debug("kvoffd: request %s missed %d of its lookup's keys; first missed key %s, last key %s "
                  "(kvoffctl explain --namespace %s %s %s)", st.request.request_id,
                  min(end, len(keys)) - first, a, b, ns, a, b)

    def send(self, st: RequestState, start: int, limit: int, now: float, prefetch: bool = False) -> bool:
        """LOOKUP blocks ``[start, limit)`` of the request, cut at the first negative key."""
        state = self.state
        assert state.client is not None and state.identity is not None
        keys, all_packed = state.daemon_keys(st)
        G = state.ngroups
        end = min(limit, len(keys) // G)
        if state.known.negative:  # usually empty: then no per-key work here at all
            for i in range(start * G, end * G):
                if state.known.is_negative(keys[i], now):
                    end = i // G
                    break
        if end <= start:
            return False
        # one slice of the packed keys: no join of a long prompt's keys on the scheduler's step. With
        # several groups the daemon's "leading hits" counts keys, so whole blocks are hits // G.
        packed = bytes(memoryview(all_packed)[start * G * P.KEY_SIZE:end * G * P.KEY_SIZE])
        seq = state.client.send_lookup(state.identity.namespace, packed, state.s.lease_ms)
        if seq is None:
            return False
        st.lookup = PendingLookup(seq=seq, start=start, sent_at=now, prefetch=prefetch)
        state.prefetched += prefetch
        state.stats.add("lookups")
        return True

    def on_new_request(self, request: Request) -> None:
        state = self.state
        st = state.request(request)
        if not (state.enabled and state.s.prefetch_lookups) or state.client is None:
            return
        if state.prefetched >= state.s.max_prefetch or not state.client.connected:
            return
        limit = min((request.num_tokens - 1) // state.block_size, len(state.keys(st)))
        if limit > 0:
            self.send(st, 0, limit, time.monotonic(), prefetch=True)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self.state
        if not state.enabled or state.client is None:
            return 0, False
        st = state.request(request)
        if st.no_external:
            return 0, False
        bs = state.block_size
        start = num_computed_tokens // bs
        # Whole blocks only, and never the block holding the last prompt token: vLLM must compute
        # at least one token itself to sample from.
        limit = min((request.num_tokens - 1) // bs, len(state.keys(st)))
        if limit <= start:
            state.drop_lookup(st)
            return 0, False
        now = time.monotonic()
        lk = self._current(st, start, now)
        if lk is None:
            if not state.client.connected:
                state.client.take_notices()  # drives reconnection
                return 0, False
            if not self.send(st, start, limit, now):
                return 0, False
            lk = st.lookup
            assert lk is not None
        if lk.hits < 0 and not self._answered(st, lk, start, limit, now):
            return (None, False) if st.lookup is lk else (0, False)
        n = max(0, min(lk.start + lk.hits, limit) - start)
        if n == 0:
            state.drop_lookup(st)
            return 0, False
        st.offer_start = start
        st.offer_sync = state.sync_budget.take(n, now)
        return n * bs, not st.offer_sync

    def _current(self, st: RequestState, start: int, now: float) -> PendingLookup | None:
        """The request's lookup, unless its answer starts past ``start`` or its lease is nearly over."""
        lk = st.lookup
        if lk is not None and lk.hits >= 0:
            stale = (now - lk.answered_at) * 1000 > 0.8 * self.state.s.lease_ms
            if lk.start > start or stale:
                self.state.drop_lookup(st)
                lk = None
        return lk

    def _wait_idle(self, lk: PendingLookup) -> P.Message | None:
        """Wait for the reply while the engine has nothing else to run: answering "not yet" would
        cost the request a whole empty step (the workers run the connector's hooks, then vLLM's
        engine loop sleeps 1 ms) where the daemon answers a lookup in a fraction of that. Bounded
        by what is left of the step's ``lookup_wait_ms``, shared by every request it schedules."""
        state = self.state
        client = state.client
        assert client is not None
        t0 = time.monotonic()
        deadline = t0 + state.wait_left_s
        while (reply := client.take_reply(lk.seq)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            client.poll(max(1, int(left * 1000)))  # wakes when any frame arrives
        spent = time.monotonic() - t0
        state.wait_left_s = max(0.0, state.wait_left_s - spent)
        state.stats.add("lookup_waits")
        state.stats.add("lookup_wait_us", int(spent * 1e6))
        return reply

    def _answered(self, st: RequestState, lk: PendingLookup, start: int, limit: int, now: float) -> bool:
        """Take the lookup's reply if it is in. False: no answer (yet: ``st.lookup`` is still ``lk``;
        or never: timed out or refused, and ``st.lookup`` is gone)."""
        state = self.state
        assert state.client is not None
        reply = state.client.take_reply(lk.seq)
        if reply is None and state.wait_left_s > 0 and state.idle_except(st.request.request_id):
            reply = self._wait_idle(lk)
        if reply is None:
            if (now - lk.sent_at) * 1000 > state.s.lookup_timeout_ms:
                state.stats.add("lookup_timeouts")
                state.drop_lookup(st)
            return False  # (still in flight: ask again next step)
        if not isinstance(reply, P.LookupResult):
            state.unprefetch(lk)
            st.lookup = None
            return False
        G = state.ngroups
        lk.hits, lk.lease_id, lk.answered_at = reply.hits // G, reply.lease_id, now
        state.known.confirm(state.daemon_keys(st)[0][lk.start * G:lk.start * G + reply.hits], now)
        state.stats.add("lookup_miss_blocks", max(0, limit - start - reply.hits))
        if log.isEnabledFor(logging.DEBUG):
            self._log_miss(st, lk.start * G + reply.hits, limit * G)
        return True
