"""``IndexObserver``: the one seam through which the index tells what mirrors it (warm-restart slot
records, a KV-event stream) of each moment that matters; re-exported by index.py. Observers mirror,
never drive: what leaves the pool to make room is returned to the index's caller instead
(``StorePlan.victims``), which spills it or frees it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvoffd.cache.entries import Entry


class IndexObserver:
    """Something that mirrors the index: warm-restart slot records, a KV-event stream.

    One seam for all of them, so that none needs a branch in the server: the index calls every
    registered observer, on the loop thread, synchronously, at each moment below. Subclass it and
    override the moments you need (the others do nothing). Observers must not block and must not call
    back into the index from inside a call.
    """

    def committed(self, entries: Sequence[Entry]) -> None:
        """``entries`` just became visible: their copy completed and their bytes are in their slots."""

    def unlinked(self, entries: Sequence[Entry]) -> None:
        """Committed ``entries`` left the index (CLEAR, found corrupt) while refs still hold them (a LOAD,
        a lease): they are gone now, but their slots are freed (``freeing``) only when the last ref drops."""

    def freeing(self, slot_bytes: int, entries: Sequence[Entry]) -> None:
        """The slots of ``entries`` may be written again right after this call: they go back to the pool
        (or went back already for the STORE that evicted them, whose copy starts after this call).

        The entries are already dead (evicted, cleared, discarded, drained, or a failed store's); their
        bytes are still in place during the call and only then. ``e.ready`` tells a committed one.
        """

    def cleared(self, namespace: str) -> None:
        """CLEAR removed every entry of ``namespace`` (told once per namespace, after its entries)."""
