"""Cluster hash slots: CRC16 (XMODEM, as the cluster specification defines it) of the key, or of its
``{hash tag}``, modulo 16384. kvoffd's keys carry no hash tag (one namespace must spread over every
shard), but the rule is implemented whole so that any key routes as the server expects."""

from __future__ import annotations

SLOTS = 16384


def _table() -> list[int]:
    out = []
    for i in range(256):
        c = i << 8
        for _ in range(8):
            c = ((c << 1) ^ 0x1021) if c & 0x8000 else (c << 1)
        out.append(c & 0xFFFF)
    return out


_T = _table()


def crc16(data: bytes) -> int:
    c = 0
    for b in data:
        c = ((c << 8) & 0xFFFF) ^ _T[((c >> 8) ^ b) & 0xFF]
    return c


def key_slot(key: bytes) -> int:
    s = key.find(b"{")
    if s >= 0:
        e = key.find(b"}", s + 1)
        if e > s + 1:
            key = key[s + 1:e]
    return crc16(key) % SLOTS
