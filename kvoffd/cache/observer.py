"""``IndexObserver``: the one seam through which the index tells what mirrors it (warm-restart slot
records, a lower tier, a KV-event stream) of each moment that matters; re-exported by index.py."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvoffd.cache.entries import Entry


class IndexObserver:
    """Something that mirrors the index: warm-restart slot records, a lower tier, a KV-event stream.

    One seam for all of them, so that none needs a branch in the server: the index calls every
    registered observer, on the loop thread, synchronously, at each moment below. Subclass it and
    override the moments you need (the others do nothing). Observers must not block and must not call
    back into the index from inside a call.
    """

    def committed(self, entries: Sequence[Entry]) -> None:
        """``entries`` just became visible: their copy completed and their bytes are in their slots."""

    def evicted(self, slot_bytes: int, entries: Sequence[Entry]) -> Sequence[Entry] | None:
        """The index chose ``entries`` to make room (eviction, or emptying a chunk for another slot
        size): their ``freeing`` follows at once. A lower tier keeps them from here.

        Returns the entries (a subset, or None) whose slots the observer *defers*: a deferred slot
        stays out of the pool (never handed out, its chunk never changes hands) until the observer
        gives it back with ``Index.deferral.release``, so a thread may still read its bytes after
        the call (a spill written straight from the pool, without a copy on the loop). The entries
        are dead all the same: invisible to lookups, their ``freeing`` told now (a slot record is
        invalidated before the slot can be reused, as for any free).
        """

    def unlinked(self, entries: Sequence[Entry]) -> None:
        """Committed ``entries`` left the index (CLEAR, found corrupt) while refs still hold them (a LOAD,
        a lease): they are gone now, but their slots are freed (``freeing``) only when the last ref drops."""

    def freeing(self, slot_bytes: int, entries: Sequence[Entry]) -> None:
        """The slots of ``entries`` go back to the pool right after this call and may be reused at once.

        The entries are already dead (evicted, cleared, discarded, drained, or a failed store's); their
        bytes are still in place during the call and only then. ``e.ready`` tells a committed one.
        """

    def cleared(self, namespace: str) -> None:
        """CLEAR removed every entry of ``namespace`` (told once per namespace, after its entries)."""
