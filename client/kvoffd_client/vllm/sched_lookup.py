"""The scheduler's lookups (a mixin of ``KvoffdScheduler``, whose state it reads): sent without
waiting, answered "not yet" until the reply is in; what the daemon confirmed (``_known``) and what
failed to load (``_negative``); leases dropped and orphaned lookups reaped."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from kvoffd_client import protocol as P
from kvoffd_client.vllm.common import log
from kvoffd_client.vllm.sched_state import PendingLookup, RequestState

if TYPE_CHECKING:
    from vllm.v1.request import Request

#: ~8 MiB of confirmed keys
MAX_KNOWN = 1 << 17


class LookupPlanner:
    def _is_negative(self, key: bytes, now: float) -> bool:
        exp = self._negative.get(key)
        if exp is None:
            return False
        if exp <= now:
            del self._negative[key]
            return False
        return True

    def _confirm(self, keys: list[bytes], now: float) -> None:
        known = self._known
        for k in keys:
            known[k] = now
            known.move_to_end(k)
        while len(known) > MAX_KNOWN:
            known.popitem(last=False)

    def _is_known(self, key: bytes, now: float) -> bool:
        t = self._known.get(key)
        return t is not None and now - t < self.s.known_ttl_s

    def _drop_lookup(self, st: RequestState, *, release: bool = True) -> None:
        lk, st.lookup = st.lookup, None
        if lk is None or self.client is None:
            return
        self._unprefetch(lk)
        if lk.hits < 0:  # still in flight: its lease (if any) is released when the reply lands
            self._orphans[lk.seq] = time.monotonic() + self.s.lookup_timeout_ms / 1000
        elif lk.lease_id and release:
            self.client.release(lk.lease_id)
            self.stats.add("leases_released")

    def _unprefetch(self, lk: PendingLookup) -> None:
        if lk.prefetch:
            lk.prefetch = False
            self._prefetched -= 1

    def _reap_orphans(self) -> None:
        if not self._orphans or self.client is None:
            return
        now = time.monotonic()
        for seq, give_up in list(self._orphans.items()):
            reply = self.client.take_reply(seq)
            if isinstance(reply, P.LookupResult) and reply.lease_id:
                self.client.release(reply.lease_id)
                self.stats.add("leases_released")
            if reply is not None or now > give_up:
                if reply is None:
                    self.client.forget(seq)
                del self._orphans[seq]

    def _log_miss(self, st: RequestState, first: int, end: int) -> None:
        """At DEBUG, name a lookup's missed keys so an operator can ask the daemon why
        (``kvoffctl explain``, docs/operations.md): the first key that missed and the last key asked,
        in hex. Only called with debug logging on: no hex work on the scheduler's step otherwise."""
        keys = self._daemon_keys(st)[0]
        if first >= min(end, len(keys)) or self.identity is None:
            return
        ns, a, b = self.identity.namespace, keys[first].hex(), keys[min(end, len(keys)) - 1].hex()
        log.debug("kvoffd: request %s missed %d of its lookup's keys; first missed key %s, last key %s "
                  "(kvoffctl explain --namespace %s %s %s)", st.request.request_id,
                  min(end, len(keys)) - first, a, b, ns, a, b)

    def _send_lookup(self, st: RequestState, start: int, limit: int, now: float, prefetch: bool = False) -> bool:
        assert self.client is not None and self.identity is not None
        keys, all_packed = self._daemon_keys(st)
        G = self._ngroups
        end = min(limit, len(keys) // G)
        if self._negative:  # usually empty: then no per-key work here at all
            for i in range(start * G, end * G):
                if self._is_negative(keys[i], now):
                    end = i // G
                    break
        if end <= start:
            return False
        # one slice of the packed keys: no join of a long prompt's keys on the scheduler's step. With
        # several groups the daemon's "leading hits" counts keys, so whole blocks are hits // G.
        packed = bytes(memoryview(all_packed)[start * G * P.KEY_SIZE:end * G * P.KEY_SIZE])
        seq = self.client.send_lookup(self.identity.namespace, packed, self.s.lease_ms)
        if seq is None:
            return False
        st.lookup = PendingLookup(seq=seq, start=start, sent_at=now, prefetch=prefetch)
        self._prefetched += prefetch
        self.stats.add("lookups")
        return True

    def on_new_request(self, request: Request) -> None:
        st = self._state(request)
        if not (self.enabled and self.s.prefetch_lookups) or self.client is None:
            return
        if self._prefetched >= self.s.max_prefetch or not self.client.connected:
            return
        limit = min((request.num_tokens - 1) // self.block_size, len(self._keys(st)))
        if limit > 0:
            self._send_lookup(st, 0, limit, time.monotonic(), prefetch=True)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.enabled or self.client is None:
            return 0, False
        st = self._state(request)
        if st.no_external:
            return 0, False
        bs = self.block_size
        start = num_computed_tokens // bs
        # Whole blocks only, and never the block holding the last prompt token: vLLM must compute
        # at least one token itself to sample from.
        limit = min((request.num_tokens - 1) // bs, len(self._keys(st)))
        if limit <= start:
            self._drop_lookup(st)
            return 0, False
        now = time.monotonic()
        lk = st.lookup
        if lk is not None and lk.hits >= 0:
            stale = (now - lk.answered_at) * 1000 > 0.8 * self.s.lease_ms
            if lk.start > start or stale:
                self._drop_lookup(st)
                lk = None
        if lk is None:
            if not self.client.connected:
                self.client.take_notices()  # drives reconnection
                return 0, False
            if not self._send_lookup(st, start, limit, now):
                return 0, False
            lk = st.lookup
            assert lk is not None
        if lk.hits < 0:
            reply = self.client.take_reply(lk.seq)
            if reply is None:
                if (now - lk.sent_at) * 1000 > self.s.lookup_timeout_ms:
                    self.stats.add("lookup_timeouts")
                    self._drop_lookup(st)
                    return 0, False
                return None, False  # ask again next step
            if not isinstance(reply, P.LookupResult):
                self._unprefetch(lk)
                st.lookup = None
                return 0, False
            G = self._ngroups
            lk.hits, lk.lease_id, lk.answered_at = reply.hits // G, reply.lease_id, now
            self._confirm(self._daemon_keys(st)[0][lk.start * G:lk.start * G + reply.hits], now)
            self.stats.add("lookup_miss_blocks", max(0, limit - start - reply.hits))
            if log.isEnabledFor(logging.DEBUG):
                self._log_miss(st, lk.start * G + reply.hits, limit * G)
        n = max(0, min(lk.start + lk.hits, limit) - start)
        if n == 0:
            self._drop_lookup(st)
            return 0, False
        st.offer_start = start
        st.offer_sync = self.sync_budget.take(n, now)
        return n * bs, not st.offer_sync
