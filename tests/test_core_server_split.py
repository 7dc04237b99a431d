"""The server's split holds (issue 13, R1): handlers never import the loop, and no import cycle joins
the server's modules. Read from the source (the imports each module states), so it needs no daemon.
The layers between packages are import-linter's contracts (tests/test_core_layering.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVER = ROOT / "kvoffd" / "server"
#: the handlers' modules: what the daemon knows and how it answers, given reply/spawn callables
HANDLERS = ("sessions", "register", "jobs", "job", "verify", "admin", "limits", "endpoint", "pidwatch")


def _imports(path: Path) -> set[str]:
    """Project modules ``path`` imports (``kvoffd.*``), at any depth of the file (lazy imports too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m == "kvoffd" or m.startswith("kvoffd.")}


def test_handlers_never_import_the_loop():
    for name in HANDLERS:
        assert "kvoffd.server.loop" not in _imports(SERVER / f"{name}.py"), f"kvoffd/server/{name}.py imports the loop"


def test_no_import_cycle_among_the_servers_modules():
    graph = {f"kvoffd.server.{p.stem}": {m for m in _imports(p) if m.startswith("kvoffd.server.")}
             for p in SERVER.glob("*.py")}
    done: set[str] = set()

    def visit(mod: str, path: list[str]) -> None:
        assert mod not in path, f"import cycle: {' -> '.join(path[path.index(mod):] + [mod])}"
        if mod in done:
            return
        for dep in graph.get(mod, ()):
            visit(dep, path + [mod])
        done.add(mod)

    for mod in graph:
        visit(mod, [])
