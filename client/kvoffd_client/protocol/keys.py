"""Keys and block ids as they travel: one binary each, ``KEY_SIZE``-byte keys and little-endian int32
ids back to back; packing, splitting, and the checks messages run on them (``keyblob``, ``idblob``)."""

from __future__ import annotations

import functools
import struct
import sys
from array import array
from collections.abc import Sequence

from kvoffd_client.protocol.codes import ErrorCode, ProtocolError
from kvoffd_client.protocol.limits import KEY_SIZE, MAX_KEYS

_BIG_ENDIAN = sys.byteorder == "big"
_CHUNK = 1024
_CHUNK_STRUCT = struct.Struct(f"{KEY_SIZE}s" * _CHUNK)


@functools.lru_cache(maxsize=_CHUNK)
def _tail_struct(n: int) -> struct.Struct:
    return struct.Struct(f"{KEY_SIZE}s" * n)


def split_keys(blob: bytes) -> list[bytes]:
    n = len(blob) // KEY_SIZE
    if n <= 1:
        return [blob] if n else []
    out: list[bytes] = []
    full = n - n % _CHUNK
    for off in range(0, full * KEY_SIZE, _CHUNK * KEY_SIZE):
        out += _CHUNK_STRUCT.unpack_from(blob, off)
    if n > full:
        out += _tail_struct(n - full).unpack_from(blob, full * KEY_SIZE)
    return out


def pack_keys(keys: Sequence[bytes] | bytes | bytearray | memoryview) -> bytes:
    """One binary of the keys back to back (given one already, checked and returned as bytes)."""
    if isinstance(keys, (bytes, bytearray, memoryview)):
        blob = bytes(keys)
        if len(blob) % KEY_SIZE:
            raise ValueError(f"every key must be exactly {KEY_SIZE} bytes")
        return blob
    blob = b"".join(keys)
    if len(blob) != KEY_SIZE * len(keys) or set(map(len, keys)) - {KEY_SIZE}:
        raise ValueError(f"every key must be exactly {KEY_SIZE} bytes")
    return blob


def pack_ids(ids: Sequence[int] | array) -> bytes:
    a = ids if isinstance(ids, array) and ids.typecode == "i" else array("i", ids)
    if _BIG_ENDIAN:
        a = array("i", a)
        a.byteswap()
    return a.tobytes()


def keyblob(v: Sequence[bytes] | bytes, name: str = "keys") -> bytes:
    """Keys travel as one binary, KEY_SIZE bytes each, back to back: checking that is O(1), and
    splitting it (struct, in C) costs a fraction of unpacking thousands of separate msgpack items.
    A sequence of keys or a bytes-like blob (a sender's convenience) is packed here."""
    if type(v) is not bytes:
        try:
            v = pack_keys(v)
        except (TypeError, ValueError):
            raise ProtocolError(ErrorCode.BAD_KEY, f"{name}: every key must be exactly {KEY_SIZE} bytes") from None
    elif len(v) % KEY_SIZE:
        raise ProtocolError(ErrorCode.BAD_KEY, f"{name} must be one binary of {KEY_SIZE}-byte keys back to back")
    if len(v) > MAX_KEYS * KEY_SIZE:
        raise ProtocolError(ErrorCode.TOO_MANY, f"{name} holds {len(v) // KEY_SIZE} keys; at most {MAX_KEYS}")
    return v


def idblob(v: Sequence[int] | bytes, name: str = "block_ids") -> bytes:
    """Block ids travel as one binary of little-endian int32 (a sequence of ints is packed here)."""
    if type(v) is not bytes:
        try:
            v = pack_ids(v)
        except (TypeError, OverflowError):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{name} must be 32-bit integers") from None
    elif len(v) % 4:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{name} must be one binary of little-endian int32")
    if len(v) > MAX_KEYS * 4:
        raise ProtocolError(ErrorCode.TOO_MANY, f"{name} holds {len(v) // 4} entries; at most {MAX_KEYS}")
    return v


def count_keys(keys: bytes) -> int:
    return len(keys) // KEY_SIZE

