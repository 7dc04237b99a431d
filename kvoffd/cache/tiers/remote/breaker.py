"""A circuit breaker per shard: after a connection failure or a timeout the shard is skipped (its keys
are misses at once, no connect attempt, no wait) until a cool-down passes; then one call may try it
(half-open): success closes the breaker, failure opens it again with a longer cool-down, capped at
``max_cooldown`` so that a shard that came back is used again within that time (the tests hold it to
1 s). Thread-safe: the lanes of one shard share it."""

from __future__ import annotations

import threading
import time


class Breaker:
    CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"

    def __init__(self, base_cooldown: float = 0.05, max_cooldown: float = 0.5,
                 clock=time.monotonic):
        self.base_cooldown = base_cooldown
        self.max_cooldown = max_cooldown
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0  # consecutive
        self._open_until = 0.0
        self._trial = False  # a half-open trial call is out
        self.opened = 0  # times it opened (counted)

    @property
    def state(self) -> str:
        with self._lock:
            if not self._failures:
                return self.CLOSED
            return self.HALF_OPEN if self._clock() >= self._open_until else self.OPEN

    def allow(self) -> bool:
        """May a call go to the shard now? In the half-open state only one trial at a time."""
        with self._lock:
            if not self._failures:
                return True
            if self._clock() < self._open_until or self._trial:
                return False
            self._trial = True
            return True

    def success(self) -> None:
        with self._lock:
            self._failures = 0
            self._trial = False

    def failure(self) -> None:
        with self._lock:
            if not self._failures:
                self.opened += 1
            self._failures += 1
            self._trial = False
            cool = min(self.base_cooldown * (2 ** min(self._failures - 1, 16)), self.max_cooldown)
            self._open_until = self._clock() + cool
