"""Units for people: sizes as the daemon prints them. A leaf module, so that every layer may import it."""

from __future__ import annotations


def format_size(n: float) -> str:
    """``n`` bytes in binary units with one decimal ("1.5 GiB"); whole bytes below 1 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
