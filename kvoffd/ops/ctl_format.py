"""How ``kvoffctl`` writes figures: sizes, durations, percentages, text tables and ``--json``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvoffd.units import format_size


def fmt_size(n: Any) -> str:
    return format_size(float(n)) if isinstance(n, (int, float)) else "-"


def fmt_dur(s: Any) -> str:
    if not isinstance(s, (int, float)):
        return "-"
    s = float(s)
    if s < 1:
        return f"{s * 1000:.0f}ms"
    if s < 120:
        return f"{s:.1f}s"
    if s < 7200:
        return f"{s / 60:.1f}m"
    if s < 172800:
        return f"{s / 3600:.1f}h"
    return f"{s / 86400:.1f}d"


def fmt_backend(b: Any) -> str:
    """``cpu (threads 2, process_vm_readv)`` from the daemon's description of one backend."""
    if not isinstance(b, dict):
        return str(b)
    rest = [f"{k} {v}" if k != "method" else str(v) for k, v in b.items() if k != "name"]
    return f"{b.get('name', '?')} ({', '.join(rest)})" if rest else str(b.get("name", "?"))


def fmt_pct(part: Any, whole: Any) -> str:
    try:
        return f"{100.0 * float(part) / float(whole):.1f}%" if float(whole) > 0 else "-"
    except (TypeError, ValueError):
        return "-"


def table(rows: Sequence[Sequence[Any]], header: Sequence[str] | None = None) -> str:
    """Left-aligned text columns; numbers right-aligned."""
    cells = [[str(c) for c in r] for r in rows]
    if header:
        cells.insert(0, list(header))
    if not cells:
        return ""
    widths = [max(len(r[i]) for r in cells if i < len(r)) for i in range(max(map(len, cells)))]
    numeric = [all(_looks_numeric(r[i]) for r in cells[1 if header else 0:] if i < len(r)) for i in range(len(widths))]
    out = []
    for r in cells:
        parts = [c.rjust(widths[i]) if numeric[i] else c.ljust(widths[i]) for i, c in enumerate(r)]
        out.append("  ".join(parts).rstrip())
    return "\n".join(out)


def _looks_numeric(s: str) -> bool:
    return bool(s) and (s.replace(".", "", 1).replace("%", "").replace(",", "").lstrip("-").isdigit())


def jsonable(obj: Any) -> Any:
    if isinstance(obj, bytes):
        return obj.hex()
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if hasattr(obj, "__dataclass_fields__"):
        return {k: jsonable(getattr(obj, k)) for k in obj.__dataclass_fields__ if k != "seq"}
    return obj


def emit_json(obj: Any) -> None:
    print(json.dumps(jsonable(obj), indent=2, sort_keys=True))
