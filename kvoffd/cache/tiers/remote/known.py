"""``Known``: the (namespace identity, key) pairs this node knows the cluster holds (it published them, or a
probe found them), bounded, in numpy arrays, every verb taking a whole batch.

Why a table and not a dict: it answers ``RemoteTier.contains``/``probe`` on the event loop (a LOOKUP asks
about up to 1,024 keys past its local hits) and the Publisher's "already there?" for every admitted batch,
so a Python step per key is a stall of the loop per block; a dict of 48-byte keys also costs ~200 bytes a
pair. Here a pair is a 64-bit fingerprint, a 64-bit stamp and a 32-bit namespace tag (20 bytes).

Layout, as the disk tier's index (kvoffd/cache/tiers/diskindex.py): buckets of ``BUCKET`` lanes; a pair
lives in one of two buckets picked by its fingerprint's bits, the emptier one when added. No probing and so
no tombstone: a removal empties its lane. The fingerprint: the key's four words times four odd
multipliers, summed (one matrix product for a batch), xor its namespace's word, folded, made odd (0 is an
empty lane); the multipliers and the words (a keyed hash of the identity) come from a secret of this
process, so that no client can aim a collision at keys it does not know the fingerprints of.

Bounded: ``cap`` lanes (rounded up to whole buckets), never more. A new pair takes a free lane of its two
buckets; when both are full it replaces the oldest of those 16 (the smallest stamp: each add stamps its
lane from a counter, an add of a pair already there refreshes it): the oldest go, as sampled among 16,
like a clock, not exactly in order. No time-to-live: a pair stays until evicted, discarded or cleared.

A hint, never a source of bytes: a false "yes" (two pairs with one 64-bit fingerprint, about ``len / 2^64``
per key asked) costs a failed read (every fetched value is verified) or a block not published; a false
"no" (evicted early) costs a probe or a publish. Neither loads a wrong byte.

Threads: the writers (``add``, ``discard``, ``drop_namespace``, ``clear``) hold a lock; the readers (``has``,
``leading``: the loop) take none. A lane's fingerprint is one aligned 8-byte store, so a reader sees a pair
there or not, at worst one that another thread is adding or removing at that moment, as with a dict.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import struct
import sys
import threading

import numpy as np

BUCKET = 8
FEW = 4  # reads of at most this many keys take the scalar path (a numpy call costs microseconds)
_KEY = 32
_M64 = (1 << 64) - 1
_SHIFT = 29
_FOLD_INT = 0xFF51AFD7ED558CCD  # odd: the fold's multiply is a bijection
_S, _S32, _ONE, _FOLD = np.uint64(_SHIFT), np.uint64(32), np.uint64(1), np.uint64(_FOLD_INT)
_WORDS = struct.Struct("<4Q")
_LANES = np.arange(BUCKET, dtype=np.intp)
_LITTLE = sys.byteorder == "little"  # a fingerprint's two 32-bit halves read as a view of it
_HALVES = np.array([1, 0], dtype=np.uint32)  # the low half's bit 0 is always 1: not a bucket's bit


def fingerprints(mults: np.ndarray, word: int, keys: bytes) -> np.ndarray:
    """The fingerprint (uint64, odd, so never 0) of each 32-byte key of the binary ``keys``: its four words
    times ``mults`` (four odd numbers), summed modulo 2^64 (one matrix product), xor the namespace's ``word``,
    then folded (shift, multiply, shift) so that every bit, the buckets' low bits included, depends on every
    bit of the key: keys that count in a few bytes still spread over the buckets. Keys that differ in one word never share
    one (an odd multiplier and the fold are bijections)."""
    h = np.frombuffer(keys, dtype="<u8").reshape(-1, 4) @ mults
    h ^= np.uint64(word)
    h ^= h >> _S32
    h *= _FOLD
    h ^= h >> _S
    h |= _ONE
    return h


def fingerprint(mults: tuple[int, ...], word: int, keys: bytes, at: int = 0) -> int:
    """``fingerprints`` of the key at offset ``at`` of a binary, in plain Python: the same number."""
    k0, k1, k2, k3 = _WORDS.unpack_from(keys, at)
    h = (k0 * mults[0] + k1 * mults[1] + k2 * mults[2] + k3 * mults[3]) & _M64
    h ^= word
    h ^= h >> 32
    h = (h * _FOLD_INT) & _M64
    h ^= h >> _SHIFT
    return h | 1


class Known:
    """At most ``cap`` (namespace identity, key) pairs (module docstring); keys are passed as the binary of
    32-byte keys, as the protocol carries them, and an optional bool mask ``where`` picks some of them."""

    def __init__(self, cap: int = 1 << 20, secret: bytes | None = None):
        self.nbuckets = max(2, math.ceil(max(1, cap) / BUCKET))
        self.cap = self.nbuckets * BUCKET
        self._fp = np.zeros(self.cap, dtype=np.uint64)
        self._fp_rows = self._fp.reshape(self.nbuckets, BUCKET)
        self._fp_view = memoryview(self._fp)  # read without numpy by the scalar path
        self._stamp = np.zeros(self.cap, dtype=np.uint64)  # the add that last stamped the lane
        self._tag = np.zeros(self.cap, dtype=np.uint32)  # its namespace's tag (drop_namespace)
        self._seq = 1
        self._used = 0
        self._lock = threading.Lock()
        self._ns_lock = threading.Lock()
        self._secret = secret if secret is not None else secrets.token_bytes(16)  # tests pass one: reproducible
        raw = hashlib.blake2b(b"multipliers", digest_size=32, key=self._secret).digest()
        self._mults_int = tuple(int.from_bytes(raw[i:i + 8], "little") | 1 for i in range(0, 32, 8))
        self._mults = np.array(self._mults_int, dtype=np.uint64)
        self._ns: dict[bytes, tuple[int, int]] = {}  # namespace identity -> (tag, word)

    def _word(self, ns_id: bytes) -> tuple[int, int]:
        got = self._ns.get(ns_id)
        if got is None:  # a namespace's first time: its own tag, whichever threads ask at once
            word = int.from_bytes(hashlib.blake2b(ns_id, digest_size=8, key=self._secret).digest(), "little")
            with self._ns_lock:
                got = self._ns.setdefault(ns_id, (len(self._ns) + 1, word))
        return got

    def _fingerprints(self, ns_id: bytes, keys: bytes) -> np.ndarray:
        return fingerprints(self._mults, self._word(ns_id)[1], keys)

    def _pairs(self, fp: np.ndarray) -> np.ndarray:
        """(n, 2) bucket numbers: the fingerprint's low 32-bit half less its bit 0 (always 1) and its high half,
        modulo the buckets (now and then both the same bucket: the key then has 8 lanes, read and written
        alike)."""
        if _LITTLE:
            return (fp.view(np.uint32).reshape(-1, 2) >> _HALVES) % np.uint32(self.nbuckets)
        halves = np.stack([(fp & np.uint64(0xFFFFFFFF)) >> _ONE, fp >> np.uint64(32)], axis=1)
        return halves % np.uint64(self.nbuckets)

    def _candidates(self, fp: np.ndarray) -> np.ndarray:
        """(n, 2 * BUCKET) lane numbers: the fingerprint's two buckets."""
        return (self._pairs(fp).astype(np.intp)[:, :, None] * BUCKET + _LANES).reshape(len(fp), 2 * BUCKET)

    def _present(self, ns_id: bytes, keys: bytes) -> np.ndarray:
        fp = self._fingerprints(ns_id, keys)
        match = np.take(self._fp_rows, self._pairs(fp), axis=0) == fp[:, None, None]  # (n, 2, BUCKET)
        words = match.view(np.uint64).reshape(len(fp), 2)  # a bucket's BUCKET (8) bools as one word
        return (words[:, 0] | words[:, 1]) != 0

    def _present_one(self, word: int, keys: bytes, at: int) -> bool:
        """The scalar path: one key's two buckets read through a memoryview (the same buckets as ``_pairs``)."""
        h = fingerprint(self._mults_int, word, keys, at)
        nb = self.nbuckets
        b0, b1 = ((h & 0xFFFFFFFF) >> 1) % nb, (h >> 32) % nb
        fps = self._fp_view
        return h in fps[b0 * BUCKET:(b0 + 1) * BUCKET].tolist() or h in fps[b1 * BUCKET:(b1 + 1) * BUCKET].tolist()

    # -- readers (no lock) ------------------------------------------------------------------------------
    def has(self, ns_id: bytes, keys: bytes) -> np.ndarray:
        """A bool per key: known held."""
        n = len(keys) // _KEY
        if not self._used or not n:
            return np.zeros(n, dtype=bool)
        if n <= FEW:
            word = self._word(ns_id)[1]
            return np.array([self._present_one(word, keys, i * _KEY) for i in range(n)], dtype=bool)
        return self._present(ns_id, keys)

    def leading(self, ns_id: bytes, keys: bytes) -> int:
        """How many leading keys are known held (the run stops at the first one that is not)."""
        n = len(keys) // _KEY
        if not self._used or not n:
            return 0
        if n <= FEW:
            word = self._word(ns_id)[1]
            return next((i for i in range(n) if not self._present_one(word, keys, i * _KEY)), n)
        held = self._present(ns_id, keys)
        first = int(held.argmin())
        return n if held[first] else first

    # -- writers (the lock) -----------------------------------------------------------------------------
    def add(self, ns_id: bytes, keys: bytes, where: np.ndarray | None = None) -> None:
        """Know these keys (those of ``where``) held, the later ones of the batch as the newer."""
        tag, word = self._word(ns_id)
        fp = fingerprints(self._mults, word, keys)
        if where is not None:
            fp = fp[np.asarray(where, dtype=bool)]
        n = len(fp)
        if not n:
            return
        with self._lock:
            stamps = np.arange(self._seq, self._seq + n, dtype=np.uint64)
            self._seq += n
            if n > 1:  # a key said twice: once, with its last stamp
                uniq, first_rev = np.unique(fp[::-1], return_index=True)
                if len(uniq) < n:
                    keep = np.sort(n - 1 - first_rev)
                    fp, stamps = fp[keep], stamps[keep]
            pos = self._candidates(fp)
            lanes = self._fp[pos]
            match = lanes == fp[:, None]
            found = match.any(axis=1)
            if found.any():  # there already: refreshed
                self._stamp[pos[found, match[found].argmax(axis=1)]] = stamps[found]
            self._place(fp[~found], stamps[~found], pos[~found], tag)

    def _place(self, fp: np.ndarray, stamps: np.ndarray, pos: np.ndarray, tag: int) -> None:
        """New pairs into their candidate lanes: a free lane of the emptier bucket, else the oldest of the 16;
        two pairs choosing one lane in a round: the first takes it, the other chooses again."""
        active = np.arange(len(fp))
        for _ in range(2 * BUCKET + 1):
            if not active.size:
                break
            p = pos[active]
            free = self._fp[p] == 0
            f1, f2 = free[:, :BUCKET].sum(axis=1), free[:, BUCKET:].sum(axis=1)
            half = np.where(f2 > f1, BUCKET, 0)
            lane_free = half + np.argmax(np.take_along_axis(free, half[:, None] + _LANES, axis=1), axis=1)
            has_free = np.maximum(f1, f2) > 0
            oldest = np.argmin(self._stamp[p], axis=1)
            rows = np.arange(active.size)
            target = p[rows, np.where(has_free, lane_free, oldest)]
            _, first = np.unique(target, return_index=True)
            w, wp = active[first], target[first]
            self._used += int(has_free[first].sum())  # an eviction replaces a pair: no change
            self._fp[wp] = fp[w]
            self._stamp[wp] = stamps[w]
            self._tag[wp] = tag
            left = np.ones(active.size, dtype=bool)
            left[first] = False
            active = active[left]

    def discard(self, ns_id: bytes, keys: bytes, where: np.ndarray | None = None) -> None:
        """Forget these keys (those of ``where``)."""
        fp = self._fingerprints(ns_id, keys)
        if where is not None:
            fp = fp[np.asarray(where, dtype=bool)]
        if not len(fp) or not self._used:
            return
        with self._lock:
            pos = self._candidates(fp)
            at = np.unique(pos[self._fp[pos] == fp[:, None]])
            self._fp[at] = 0
            self._used -= len(at)

    def drop_namespace(self, ns_ids: set[bytes]) -> int:
        """Forget every pair of these namespace identities (a CLEAR); returns how many. One pass over the
        table's tags."""
        tags = [self._ns[i][0] for i in ns_ids if i in self._ns]
        if not tags:
            return 0
        with self._lock:
            at = np.flatnonzero((self._fp != 0) & np.isin(self._tag, tags))
            self._fp[at] = 0
            self._used -= len(at)
            return len(at)

    def clear(self) -> None:
        """Forget everything (one fill of the fingerprints: 8 bytes a lane)."""
        with self._lock:
            self._fp.fill(0)
            self._used = 0

    def __len__(self) -> int:
        return self._used
