"""The cluster tier's client: blocks shared across nodes through a Valkey/Redis cluster (or one plain
server), spoken in RESP2 on plain sockets so that a block goes from and into its pool slot with one
kernel copy (``sendmsg`` of the slot, ``recv_into`` the slot), on per-shard threads, never on the loop.

* ``resp``: one connection (timeouts on every call, AUTH, optional TLS);
* ``slots``: CRC16 hash slots;
* ``address``: ``redis://`` / ``rediss://`` URLs and the password file;
* ``tls``: the one TLS context of ``rediss://`` (``--remote-tls-ca``, client certificate, checked name);
* ``breaker``: the per-shard circuit breaker;
* ``cluster``: the slot map, MOVED/ASK, refresh, per-shard lanes (a thread and a connection each);
* ``valueformat``: the value's header (magic, version, length, namespace identity, key, checksum, MAC);
* ``store``: ``RemoteStore``, the batched operations the tier uses (probe, fetch into slots, publish
  from slots, delete) and their counters.

Why a hand-written client: measured on the 2-core VM (../shared/research/remote-tier.md §2.1 and
bench/remote_tier.py), redis-py with hiredis packs a 2 MiB SET at 0.45 GB/s and copies every GET into a
new bytes object; this path SETs and GETs at the server's own speed.
"""
