"""The daemon's HTTP side: /metrics, /healthz, /readyz on the metrics address.

A few dozen lines on asyncio streams instead of a web framework: three GET routes, no bodies in,
served by the same loop as everything else (a scrape reads counters; it never waits on a copy).
Connections are capped (HTTP_MAX_CONNS) and short-lived (HTTP_TIMEOUT_S): any local user can reach
this port, and each connection costs the daemon a file descriptor (kvoffd/server/fdbudget.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvoffd.server.fdbudget import HTTP_BACKLOG, HTTP_MAX_CONNS, HTTP_TIMEOUT_S

if TYPE_CHECKING:  # reads the Server's public attributes only
    from kvoffd.server.loop import Server

log = logging.getLogger(__name__)


async def start_http(server: Server, host: str, port: int) -> asyncio.AbstractServer:
    routes: dict[str, Callable[[], tuple[int, str, bytes]]] = {
        "/metrics": lambda: (200, CONTENT_TYPE_LATEST, generate_latest(server.metrics.registry)),
        "/healthz": lambda: (200, "text/plain; charset=utf-8", b"ok\n"),
        "/readyz": lambda: _readyz(server),
    }

    fds = server.fds

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        fds.http_conns += 1
        try:
            if fds.http_conns > HTTP_MAX_CONNS:
                return  # refused: closed at once, so idle connections cannot eat the daemon's descriptors
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=HTTP_TIMEOUT_S)
            parts = head.split(b"\r\n", 1)[0].split()
            # latin-1 decodes any byte: a request line that is not UTF-8 is a 404, not a traceback
            method, path = ((parts[0].decode("latin-1"), parts[1].decode("latin-1").split("?", 1)[0])
                            if len(parts) >= 2 else ("", ""))
            route = routes.get(path)
            if method not in ("GET", "HEAD"):
                status, ctype, body = 405, "text/plain", b"method not allowed\n"
            elif route is None:
                status, ctype, body = 404, "text/plain", b"not found: try /metrics, /healthz, /readyz\n"
            else:
                status, ctype, body = route()
            reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}[status]
            writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                         "Connection: close\r\n\r\n".encode() + (body if method != "HEAD" else b""))
            await asyncio.wait_for(writer.drain(), timeout=HTTP_TIMEOUT_S)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # a scraper that hung up or sent garbage: nothing to answer, nothing to log per request
        except Exception:
            log.exception("HTTP request failed")
        finally:
            fds.http_conns -= 1
            writer.close()

    return await asyncio.start_server(handle, host, port, limit=16 << 10, backlog=HTTP_BACKLOG)


def _readyz(server: Server) -> tuple[int, str, bytes]:
    p = server.pool
    ready = server.ready.is_set() and p.capacity_bytes > 0
    body = {"ready": ready, "pool_capacity_bytes": p.capacity_bytes, "pool_total_bytes": p.nbytes,
            "pool_pinned_bytes": p.pinned_bytes,
            "pinned_fraction": round(p.pinned_bytes / p.nbytes, 4) if p.nbytes else 0.0,
            "engines": len(server.engines), "backends": [b.name for b in server.backends]}
    return (200 if ready else 503), "application/json", (json.dumps(body) + "\n").encode()
