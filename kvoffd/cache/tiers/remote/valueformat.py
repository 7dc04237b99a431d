"""What one block is in the store: its key and its value's header.

Key: ``kvoffd:1:<namespace identity, 32 hex>:<block key, 64 hex>``: the namespace identity (a 16-byte
BLAKE2b of the table's namespace, rank, world size and layout) scopes every key, so that another
model, layout, TP size or cache salt never reads these bytes. No hash tag: a namespace spreads over
every shard.

Value: a fixed 112-byte header, then the block's bytes (the pool slot as is):

    magic "KVOR" | version u8 | flags u8 (bit 0: MAC) | reserved u16 | payload length u64 |
    namespace identity 16 B | block key 32 B | checksum u32 | header crc32 u32 | MAC 32 B (zeros
    without) | reserved 8 B (zeros)

Verified on fetch before a block may be used: magic, version, length, identity and key equal to the
ones asked for (a value copied under another key is caught), the header's own crc32 (every header byte,
the MAC and the reserved ones included, so that no flipped byte passes unseen), ``kvoffd.cache.checksum.block_sum`` of
the payload (the pool's own checksum: GB/s beside the network, catches torn or flipped bytes) and,
with ``--remote-key-file``, an HMAC-SHA256 of the header and the payload keyed by the secret the
cluster's daemons share, so that a store others can write to cannot poison the cache (HMAC-SHA256,
not keyed BLAKE2b: with SHA extensions it measured 1.0 GB/s on this VM against BLAKE2b's 0.43).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import zlib

from kvoffd.cache import checksum
from kvoffd.cache.checksum import block_sum

MAGIC = b"KVOR"
VERSION = 1
FLAG_MAC = 1
_HEAD = struct.Struct("<4sBBHQ16s32sII32s8s")
_HCRC_AT = 68
HEADER = _HEAD.size
_MAC_AT = HEADER - 8 - 32
assert HEADER == 112
_ZERO_MAC = bytes(32)
_PAD = bytes(8)
_MASK32 = 0xFFFFFFFF


def _with_hcrc(head: bytes) -> bytes:
    """``head`` (its crc field zero) with its crc32 in place."""
    return head[:_HCRC_AT] + struct.pack("<I", zlib.crc32(head)) + head[_HCRC_AT + 4:]


class KeyFileError(ValueError):
    pass


def namespace_id(namespace: str, rank: int, world_size: int, layout: tuple[int, ...]) -> bytes:
    h = hashlib.blake2b(digest_size=16, person=b"kvoffd-remote-1")
    h.update(repr((namespace, int(rank), int(world_size), tuple(int(x) for x in layout))).encode())
    return h.digest()


def store_key(ns_id: bytes, key: bytes) -> bytes:
    return b"kvoffd:1:" + ns_id.hex().encode() + b":" + key.hex().encode()


def read_key_file(path: str) -> bytes:
    """The MAC secret: the file's bytes (at least 16), not readable by others."""
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            secret = f.read(4096)
    except OSError as e:
        raise KeyFileError(f"--remote-key-file {path}: {e.strerror}") from e
    if st.st_mode & 0o004:
        raise KeyFileError(f"--remote-key-file {path}: readable by every user (chmod 600 it)")
    secret = secret.strip()
    if len(secret) < 16:
        raise KeyFileError(f"--remote-key-file {path}: the secret must be at least 16 bytes")
    return secret


class Codec:
    """Builds and checks headers for one secret (None: checksum only). Thread-safe (no state)."""

    def __init__(self, secret: bytes | None = None):
        self._secret = secret

    @property
    def mac(self) -> bool:
        return self._secret is not None

    @property
    def verify_inline(self) -> bool:
        """Whether a fetched value is verified on the thread that read it rather than handed to a check
        thread: with the compiled checksum and no MAC, summing the bytes just received (in that core's
        cache, one call without the GIL) costs less than the hand-off; an HMAC-SHA256 (1-2 GB/s a
        thread) runs on the check threads, in parallel (bench/remote_get_ladder.py)."""
        return self._secret is None and checksum.KERNEL == "c"

    def _mac(self, head: bytes | memoryview, payload: memoryview) -> bytes:
        m = hmac.new(self._secret, digestmod=hashlib.sha256)
        m.update(head[:_HCRC_AT])
        m.update(payload)
        return m.digest()

    def header(self, ns_id: bytes, key: bytes, payload: memoryview, payload_sum: int = -1) -> bytes:
        """The value's header. ``payload_sum``: the payload's ``block_sum`` where the caller has it (the
        pool's own checksum of the block, ``Entry.checksum``: summed once, when the block was sealed,
        and a block whose bytes changed since is refused by whoever fetches it, not published with a
        fresh sum); any other value (-1, a legacy crc32 record): summed here."""
        flags = FLAG_MAC if self._secret is not None else 0
        crc = payload_sum if 0 <= payload_sum <= _MASK32 else block_sum(payload)
        head = _HEAD.pack(MAGIC, VERSION, flags, 0, len(payload), ns_id, key, crc, 0, _ZERO_MAC, _PAD)
        if self._secret is not None:
            head = head[:_MAC_AT] + self._mac(head, payload) + head[_MAC_AT + 32:]
        return _with_hcrc(head)

    def verify(self, head: bytes | bytearray | memoryview, ns_id: bytes, key: bytes, payload: memoryview) -> str:
        """"" when the header and the payload are the ones written for (ns_id, key); else why not."""
        try:
            magic, ver, flags, res, n, ns, k, crc, hcrc, mac, pad = _HEAD.unpack(head)
        except struct.error:
            return "header"
        if magic != MAGIC or ver != VERSION or flags & ~FLAG_MAC or res or pad != _PAD:
            return "header"
        if zlib.crc32(bytes(head[:_HCRC_AT]) + bytes(4) + bytes(head[_HCRC_AT + 4:])) != hcrc:
            return "header"
        if n != len(payload) or ns != ns_id or k != key:
            return "identity"
        if self._secret is not None and (not flags & FLAG_MAC
                                         or not hmac.compare_digest(mac, self._mac(head, payload))):
            return "mac"
        if block_sum(payload) != crc:
            return "checksum"
        return ""
