"""Cluster hash slots: CRC16 (XMODEM, as the cluster specification defines it) of the key, or of its
``{hash tag}``, modulo 16384. kvoffd's keys carry no hash tag (one namespace must spread over every
shard), but the rule is implemented whole so that any key routes as the server expects.

XMODEM is CRC-CCITT (polynomial 0x1021) from 0, which the standard library computes in C
(``binascii.crc_hqx``): 0.3 ms for the 1,024 keys of a probe or a fetch on the 2-core dev VM, where
a table-driven Python loop took 15 ms on their path (tests/test_tier_remote.py holds it to the
server's own CLUSTER KEYSLOT and the specification's check value)."""

from __future__ import annotations

import binascii

SLOTS = 16384


def crc16(data: bytes) -> int:
    return binascii.crc_hqx(data, 0)


def key_slot(key: bytes) -> int:
    s = key.find(b"{")
    if s >= 0:
        e = key.find(b"}", s + 1)
        if e > s + 1:
            key = key[s + 1:e]
    return crc16(key) % SLOTS
