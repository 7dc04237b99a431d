"""The shape of the code is measured, not hoped for (docs/architecture.md; the rules of the developers' guide):

* no class in ``kvoffd/`` or ``client/kvoffd_client/`` spans more than 400 lines, counting its own lines
  plus those of every project-defined class it inherits from (transitively): a mixin split into its own
  file still counts against the class that uses it. Abstract interfaces are aside: ``typing.Protocol``
  subclasses, ``abc.ABC``/``ABCMeta`` classes, ``msgspec.Struct`` subclasses and enums are neither
  reported nor counted into their subclasses;
* ``kvoffd/server/`` reaches the cache through one door: it imports nothing of ``kvoffd/cache/`` but
  ``kvoffd.cache.keyspace`` (imports inside functions and under ``TYPE_CHECKING`` count too);
* every package of ``kvoffd/`` has a ``README.md`` (what it holds, in -> out, where a new class goes).

Bases are resolved the way Python resolves them, by the module's imports (``from x import Y as Z``,
``import x.y as m`` then ``m.Y``, relative imports, re-exports by a package's ``__init__``), not by the
base's name alone. A synthetic tree with an offending mixin and an offending import shows the scan bites.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_CLASS_LINES = 400
# (folder scanned, its top package's dotted name)
SOURCES = (("kvoffd", "kvoffd"), ("client/kvoffd_client", "kvoffd_client"))
# Bases that make a class an abstract interface (by their resolved dotted name).
_ABSTRACT_BASES = {
    "typing.Protocol", "typing_extensions.Protocol", "abc.ABC", "msgspec.Struct",
    "enum.Enum", "enum.IntEnum", "enum.StrEnum", "enum.Flag", "enum.IntFlag", "enum.ReprEnum",
}
_ABSTRACT_METACLASSES = {"abc.ABCMeta", "enum.EnumMeta", "enum.EnumType"}
_SERVER, _CACHE, _DOOR = "kvoffd.server", "kvoffd.cache", "kvoffd.cache.keyspace"


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    is_package: bool
    # local name -> dotted target ("pkg.mod" for a module alias, "pkg.mod.Name" for an imported name)
    bound: dict[str, str] = field(default_factory=dict)
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)


@dataclass(frozen=True)
class Offender:
    cls: str  # module.Class
    path: str
    own: int
    total: int
    bases: tuple[str, ...]  # the project-defined ancestors counted, each "module.Class (lines)"

    def __str__(self) -> str:
        inherited = ", ".join(self.bases) or "no project-defined bases"
        return f"{self.cls} ({self.path}): {self.total} lines = {self.own} own + {inherited}"


def _absolute(module: Module, level: int, target: str | None) -> str:
    """The dotted name a relative import ``from <level dots><target> import ...`` means in ``module``."""
    if level == 0:
        return target or ""
    parts = module.name.split(".")
    if not module.is_package:
        parts = parts[:-1]
    if level > 1:
        parts = parts[: len(parts) - (level - 1)]
    return ".".join([*parts, target] if target else parts)


def _imports(module: Module) -> list[tuple[ast.AST, str, list[str]]]:
    """Every import anywhere in the module (functions, ``if TYPE_CHECKING:``), as (node, module, names):
    ``import a.b`` gives ("a.b", []), ``from a import b, c`` gives ("a", ["b", "c"])."""
    found = []
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            found += [(node, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node, _absolute(module, node.level, node.module), [a.name for a in node.names]))
    return found


def load(root: Path) -> dict[str, Module]:
    """The project's modules under ``root`` by dotted name, each with its bindings and classes."""
    modules: dict[str, Module] = {}
    for folder, package in SOURCES:
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("").parts
            is_package = rel[-1] == "__init__"
            name = ".".join([package, *(rel[:-1] if is_package else rel)])
            modules[name] = Module(name, path, ast.parse(path.read_text(), str(path)), is_package)
    for m in modules.values():
        for node in m.tree.body:  # module-level bindings are what a base expression can name
            if isinstance(node, ast.ClassDef):
                m.classes[node.name] = node
        for node in ast.walk(m.tree):
            if isinstance(node, ast.ClassDef):
                m.classes.setdefault(node.name, node)  # a nested class, reachable by its own module's bases
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        m.bound[a.asname] = a.name
                    else:
                        top = a.name.split(".")[0]
                        m.bound.setdefault(top, top)
            elif isinstance(node, ast.ImportFrom):
                src = _absolute(m, node.level, node.module)
                for a in node.names:
                    if a.name != "*":
                        m.bound[a.asname or a.name] = f"{src}.{a.name}"
    return modules


def _dotted(expr: ast.expr) -> str | None:
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        head = _dotted(expr.value)
        return f"{head}.{expr.attr}" if head else None
    if isinstance(expr, ast.Subscript):  # Generic[T], Protocol[T]
        return _dotted(expr.value)
    return None


def _canonical(modules: dict[str, Module], dotted: str, depth: int = 0) -> str:
    """Follow re-exports: ``kvoffd.cache.Index`` (bound in cache/__init__ from .index) -> ``kvoffd.cache.index.Index``;
    a module-alias prefix ``m.Y`` is expanded by the caller. Names outside the project come back as given."""
    if depth > 20:
        return dotted
    mod, _, name = dotted.rpartition(".")
    m = modules.get(mod)
    if m is None:
        return dotted
    if name in m.classes:
        return dotted
    if name in m.bound and m.bound[name] != dotted:
        return _canonical(modules, m.bound[name], depth + 1)
    return dotted


def resolve(modules: dict[str, Module], module: Module, expr: ast.expr) -> str | None:
    """The dotted name of the class a base (or metaclass) expression names in ``module``."""
    dotted = _dotted(expr)
    if dotted is None:
        return None
    head, _, rest = dotted.partition(".")
    if head in module.classes and not rest:
        return f"{module.name}.{head}"
    if head not in module.bound:
        return _canonical(modules, dotted)  # a builtin (object, Exception) or an unknown name
    return _canonical(modules, module.bound[head] + (f".{rest}" if rest else ""))


@dataclass
class ClassInfo:
    name: str  # module.Class
    path: Path
    own: int
    bases: list[str]  # resolved dotted names, project or not
    metaclass: str | None


def classes(modules: dict[str, Module]) -> dict[str, ClassInfo]:
    out = {}
    for m in modules.values():
        for cname, node in m.classes.items():
            meta = next((resolve(modules, m, k.value) for k in node.keywords if k.arg == "metaclass"), None)
            bases = [b for b in (resolve(modules, m, e) for e in node.bases) if b]
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            own = node.end_lineno - first + 1
            out[f"{m.name}.{cname}"] = ClassInfo(f"{m.name}.{cname}", m.path, own, bases, meta)
    return out


def _is_abstract(infos: dict[str, ClassInfo], name: str, seen: frozenset = frozenset()) -> bool:
    if name in _ABSTRACT_BASES:
        return True
    info = infos.get(name)
    if info is None or name in seen:
        return False
    if info.metaclass in _ABSTRACT_METACLASSES:
        return True
    return any(_is_abstract(infos, b, seen | {name}) for b in info.bases)


def _ancestors(infos: dict[str, ClassInfo], name: str) -> list[str]:
    """The project-defined, non-abstract classes ``name`` inherits from, each once (a diamond counts once)."""
    order, stack = [], list(infos[name].bases)
    while stack:
        b = stack.pop(0)
        if b in infos and b not in order and b != name:
            if not _is_abstract(infos, b):
                order.append(b)
            stack += infos[b].bases
    return order


def oversized(root: Path, limit: int = MAX_CLASS_LINES) -> list[Offender]:
    infos = classes(load(root))
    found = []
    for name, info in infos.items():
        if _is_abstract(infos, name):
            continue
        anc = _ancestors(infos, name)
        total = info.own + sum(infos[a].own for a in anc)
        if total > limit:
            found.append(Offender(name, str(info.path.relative_to(root)), info.own, total,
                                  tuple(f"{a} ({infos[a].own})" for a in anc)))
    return sorted(found, key=lambda o: -o.total)


def _is_door(target: str) -> bool:
    return target == _DOOR or target.startswith(_DOOR + ".")


def _in_cache(target: str) -> bool:
    return target == _CACHE or target.startswith(_CACHE + ".")


def server_reaches_cache(root: Path) -> list[str]:
    """Each import in kvoffd/server/ of anything in kvoffd/cache/ other than kvoffd.cache.keyspace."""
    found = []
    for m in load(root).values():
        if not (m.name == _SERVER or m.name.startswith(_SERVER + ".")):
            continue
        for node, target, names in _imports(m):
            if not names:  # import target
                bad = [target] if _in_cache(target) and not _is_door(target) else []
            elif _is_door(target):  # from kvoffd.cache.keyspace import ...
                bad = []
            elif _in_cache(target):  # from kvoffd.cache import keyspace (a module) or anything else
                bad = [n for n in names if not _is_door(f"{target}.{n}")]
            else:  # from kvoffd import cache
                bad = [n for n in names if _in_cache(f"{target}.{n}")]
            if bad:
                what = f"from {target} import {', '.join(names)}" if names else f"import {target}"
                found.append(f"{m.path.relative_to(root)}:{node.lineno}: {what}")
    return found


def packages_without_readme(root: Path) -> list[str]:
    base = root / "kvoffd"
    return [str(d.relative_to(root)) for d in sorted([base, *base.rglob("*")])
            if d.is_dir() and (d / "__init__.py").exists() and not (d / "README.md").exists()]


# --- the tree as it is -----------------------------------------------------------------------------------


def test_no_class_over_400_lines_with_its_bases():
    offenders = oversized(ROOT)
    assert not offenders, (f"{len(offenders)} classes over {MAX_CLASS_LINES} lines (own + project-defined bases):\n"
                           + "\n".join(f"  {o}" for o in offenders))


def test_the_server_reaches_the_cache_only_through_the_keyspace():
    found = server_reaches_cache(ROOT)
    assert not found, ("kvoffd/server/ imports kvoffd/cache/ other than kvoffd.cache.keyspace:\n"
                       + "\n".join(f"  {f}" for f in found))


def test_every_package_has_a_readme():
    missing = packages_without_readme(ROOT)
    assert not missing, "packages of kvoffd/ without a README.md:\n" + "\n".join(f"  {d}/" for d in missing)


# --- the scan bites --------------------------------------------------------------------------------------


def _write(root: Path, rel: str, text: str) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def _body(n: int) -> str:
    """``n`` lines of methods."""
    return "".join(f"    def m{i}(self):\n        return {i}\n" for i in range(n // 2))


def test_the_scan_reports_a_mixin_and_an_import(tmp_path):
    """A tree where a 250-line mixin, imported under another name through a package's re-export, makes a
    200-line class 450 lines; a 500-line Protocol, a big msgspec Struct and a big enum are aside; the
    server imports the cache's index inside a function (reported) and the keyspace (allowed)."""
    for pkg in ("kvoffd", "kvoffd/server", "kvoffd/cache", "client/kvoffd_client"):
        _write(tmp_path, f"{pkg}/__init__.py", "")
        _write(tmp_path, f"{pkg}/README.md", "x\n")
    _write(tmp_path, "kvoffd/cache/__init__.py", "from .mix import Mixin\n")
    _write(tmp_path, "kvoffd/cache/mix.py", "class Mixin:\n" + _body(250))
    _write(tmp_path, "kvoffd/cache/keyspace.py", "class Keyspace:\n    pass\n")
    _write(tmp_path, "kvoffd/cache/index.py",
           "import typing\nimport msgspec\nimport enum\nfrom kvoffd.cache import Mixin as Helper\n\n\n"
           "class Index(Helper):\n" + _body(200)
           + "\n\nclass Tier(typing.Protocol):\n" + _body(500)
           + "\n\nclass Msg(msgspec.Struct):\n" + _body(500)
           + "\n\nclass Sub(Msg):\n" + _body(300)
           + "\n\nclass Kind(enum.IntEnum):\n" + "".join(f"    K{i} = {i}\n" for i in range(500)))
    _write(tmp_path, "kvoffd/cache/small.py", "from . import mix\n\n\nclass Small(mix.Mixin):\n" + _body(100))
    _write(tmp_path, "client/kvoffd_client/c.py", "class Fine:\n" + _body(390))
    _write(tmp_path, "kvoffd/server/handlers.py",
           "from kvoffd.cache.keyspace import Keyspace\nfrom kvoffd.cache import keyspace\n\n\n"
           "def handle():\n    from kvoffd.cache.index import Index\n    return Index, Keyspace, keyspace\n")
    _write(tmp_path, "kvoffd/server/other.py", "from ..cache import mix\n")
    (tmp_path / "kvoffd/server/README.md").unlink()

    offenders = oversized(tmp_path)
    by_name = {o.cls: o for o in offenders}
    assert set(by_name) == {"kvoffd.cache.index.Index"}, offenders
    assert by_name["kvoffd.cache.index.Index"].total == 201 + 251
    assert "kvoffd.cache.mix.Mixin (251)" in str(by_name["kvoffd.cache.index.Index"])
    # a base named through a module alias (mix.Mixin) counts too
    assert "kvoffd.cache.small.Small" in {o.cls for o in oversized(tmp_path, limit=300)}

    reached = server_reaches_cache(tmp_path)
    assert len(reached) == 2, reached
    assert "kvoffd/server/handlers.py:6: from kvoffd.cache.index import Index" in reached
    assert "kvoffd/server/other.py:1: from kvoffd.cache import mix" in reached

    assert packages_without_readme(tmp_path) == ["kvoffd/server"]
