"""Log lines a client can cause, at most one per kind per interval.

Why: whatever a client can make the daemon say once per frame it can make it say thousands of times a
second, a traceback each time if it finds a bug. Each kind (an error code, "internal") gets one line
per interval; the next line that gets through says how many were held back.
"""

from __future__ import annotations

import logging
import time


class RateLimitedLog:
    """``log(kind, level, msg, *args)``: ``msg % args`` at ``level``, unless a line of that ``kind`` was
    written less than ``every_s`` ago (then it is only counted). ``kind`` must come from a fixed set (an
    error code), never from the client: the table holds one entry per kind."""

    def __init__(self, logger: logging.Logger, every_s: float):
        self._log = logger
        self.every_s = every_s
        self._last: dict[str, float] = {}  # kind -> monotonic time of its last line
        self._held: dict[str, int] = {}  # kind -> lines not written since

    def __call__(self, kind: str, level: int, msg: str, *args: object, exc_info: bool = False) -> bool:
        """True if the line was written."""
        if not self._log.isEnabledFor(level):
            return False
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self.every_s:
            self._held[kind] = self._held.get(kind, 0) + 1
            return False
        held = self._held.pop(kind, 0)
        self._last[kind] = now
        if held:
            msg = f"{msg} (and {held} more like it since the last such line, not logged)"
        self._log.log(level, msg, *args, exc_info=exc_info)
        return True
