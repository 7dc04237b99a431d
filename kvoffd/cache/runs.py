"""The ``Run`` shortcut: how a LOOKUP checks keys a STORE wrote together without one probe per key.

Every commit records its keys as one binary (a ``Run``); after one dict probe finds a key, the keys
that follow it in the request are compared with the keys that followed it in its run in one memcmp,
while no member of the run has left. Scattered keys fall back to one probe per key.
"""

from __future__ import annotations

from itertools import takewhile
from typing import TYPE_CHECKING

from kvoffd_client.protocol import KEY_SIZE, split_keys

if TYPE_CHECKING:
    from kvoffd.cache.entries import Entry


class Run:
    """The keys one commit made visible in one table, in the order the STORE listed them.

    A LOOKUP that finds one of them compares the keys that follow it in the request with the keys
    that follow it here as two binaries (one memcmp) instead of one dict probe per key: a prompt
    stored in a few chunks is checked in a few steps, and a lease takes the matching entries as one
    list slice. When any member stops being visible the run forgets its keys and entries
    (``invalidate``): the shortcut never reports a key that is not there, and a run costs memory only
    while all its blocks are resident.
    """

    __slots__ = ("keys", "entries")

    def __init__(self, keys: bytes, entries: list[Entry]):
        self.keys = keys
        self.entries = entries

    def invalidate(self) -> None:
        self.keys = b""
        self.entries = []


_K = KEY_SIZE
_RUN_MISSES = 2  # runs in a row that match no further key: the keys are scattered, probe them all


def leading(visible: dict[bytes, Entry], keys: bytes, n: int, want: bool) -> tuple[int, list[Entry]]:
    """How many of the first ``n`` keys of the binary ``keys`` are in ``visible`` (and, if
    ``want``, their entries in order).

    Keys a STORE wrote together usually come back together (a prompt's blocks): after a key is
    found, the keys that follow it are compared with those that followed it in its run, as binaries.
    Scattered keys (blocks stored one per step while decoding) fall back to one dict probe per key,
    run in C by ``takewhile``.
    """
    i = 0
    misses = 0
    got: list[Entry] = []
    while i < n:
        e = visible.get(keys[i * _K:(i + 1) * _K])
        if e is None:
            break
        if want:
            got.append(e)
        i += 1
        run = e.run
        rk = run.keys  # empty once invalidated
        j = e.run_at + 1
        m = min(n - i, len(rk) // _K - j)
        if m <= 0 or keys[i * _K:(i + 1) * _K] != rk[j * _K:(j + 1) * _K]:
            misses += 1
            if misses >= _RUN_MISSES:
                rest = list(takewhile(visible.__contains__, split_keys(keys[i * _K:n * _K])))
                if want:
                    got += map(visible.__getitem__, rest)
                i += len(rest)
                break
            continue
        misses = 0
        mine, theirs = keys[i * _K:(i + m) * _K], rk[j * _K:(j + m) * _K]
        c = m if mine == theirs else common_keys(mine, theirs)
        if want:
            got += run.entries[j:j + c]
        i += c
    return i, got


def common_keys(a: bytes, b: bytes) -> int:
    """Leading keys two key binaries of the same length share (binary search; memcmp per step)."""
    lo, hi = 0, len(a) // _K - 1  # the last key differs, or a == b would have been taken
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid * _K] == b[:mid * _K]:
            lo = mid
        else:
            hi = mid - 1
    return lo
