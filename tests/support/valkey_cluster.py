"""The real Valkey/Redis servers and clusters the tests start: bench/support/valkey_cluster.py's (one
definition, shared with the cluster-tier benches, which never import tests/)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "bench") not in sys.path:  # bench/support, as tests/conftest.py puts it
    sys.path.append(str(ROOT / "bench"))

from support.valkey_cluster import (  # noqa: E402, F401 - one definition, shared with bench/
    Node,
    Servers,
    command,
    free_port,
    make_certs,
    server_binary,
    tls_server_binary,
)
