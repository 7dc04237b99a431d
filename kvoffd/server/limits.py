"""Every bound and timer of the server, in one place (docs/security.md, "Bounds per client").

Each bound is what a client can make the daemon hold: a client that goes past one gets ``too_many``
and the daemon keeps serving everyone else. The figures next to each say why it is far above what a
real engine uses.
"""

from __future__ import annotations

import os

from kvoffd_client import protocol as P

# --- timers ------------------------------------------------------------------------------------------
HEARTBEAT_S = 2.0  # told to clients in HELLO_OK: they ping this often
IDLE_CONN_S = 600.0  # a connection that holds nothing and said nothing this long is forgotten
QUIET_CONN_S = 3 * HEARTBEAT_S  # a connection silent this long is no longer protected from eviction
ROOM_SCAN_EVERY_S = 0.25  # a full table of live clients: newcomers refused without a scan in between
HOUSEKEEPING_S = 0.1  # Server.tick: lease expiry, silent engines, the systemd watchdog
STALL_S = 0.5  # housekeeping this long after the last: the daemon was stopped or blocked (Sessions.expire)
REAP_EVERY_S = 1.0  # idle connections, descriptor calibration, sent big replies: once a second
VERSION_WARN_EVERY_S = 60.0  # HELLOs of another protocol version: one WARNING per interval
REFUSAL_LOG_EVERY_S = 10.0  # refused requests: one line per error code per interval (kvoffd.server.ratelog)
INTERNAL_LOG_EVERY_S = 60.0  # internal errors: one traceback per interval, the rest counted

# --- connections and the socket ---------------------------------------------------------------------
#: client connections known at once. KVOFFD_TEST_MAX_CONNS lowers it, for tests only (a burst past the
#: bound then needs hundreds of sockets, not thousands).
MAX_CONNS = int(os.environ.get("KVOFFD_TEST_MAX_CONNS", "4096"))
HARD_FRAME_LIMIT = 2 * P.MAX_FRAME_BYTES  # libzmq drops the peer above this; between the two: ERROR
RCVHWM = 100  # messages queued per peer; bounds a flooding client's memory
DRAIN_BATCH = 256  # messages handled per loop callback

# --- per connection ---------------------------------------------------------------------------------
MAX_JOBS_PER_CONN = 4096
MAX_LEASES_PER_CONN = 8192
MAX_ENGINES_PER_CONN = 64
MAX_LEASED_KEYS_PER_CONN = 1 << 20  # entries (per rank) held by one connection's leases: ~8 MiB
MAX_LEASED_KEYS = 1 << 23  # ...and by all leases: ~64 MiB
MAX_EXPLAIN_KEYS = 4096  # an EXPLAIN reply is ~100 bytes per key

# --- replies not yet read ---------------------------------------------------------------------------
TRACKED_REPLY_BYTES = 4096  # replies this big are counted until libzmq has sent them
MAX_UNREAD_REPLY_BYTES_PER_PEER = 16 << 20  # big replies queued to a peer that is not reading
MAX_UNREAD_REPLY_BYTES = 256 << 20  # ...to all peers

# --- copy descriptors -------------------------------------------------------------------------------
# One run per block and segment. A per-layer layout has 2 x num_layers segments (160 for 80 layers;
# hybrid models a few hundred; split heads 2 x layers x kv heads, 1,280 for 80 layers of 8), so these
# are far above any real model. What a job costs is bounded by its runs.
MAX_SEGMENTS = 4096  # segments per block (REGISTER layout)
MAX_RUNS_PER_JOB = 1 << 24  # blocks x segments per STORE/LOAD: above 160 segments x 65,536 keys
