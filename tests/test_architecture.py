"""docs/architecture.md's table against the code: each module of the package imports
only from the rooms listed above it (no cycle, no import from a lower room up to a
higher one), lazy imports inside functions included."""

from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "bnswap"

#: The rooms, ground floor first, as docs/architecture.md lists them.
ROOMS = ["functional", "_swap", "_graph", "layers", "adapters", "_compat", "registry", "ort",
         "plan", "convert", "lightning", "__init__", "app"]


def _room(dotted: str) -> str:
    parts = dotted.split(".")
    assert parts[0] == "bnswap", dotted
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: pathlib.Path) -> set[str]:
    """Every bnswap module ``path`` imports (module level or inside functions)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "bnswap")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != "bnswap":
                continue
            for a in node.names:  # "from bnswap.ort import _compat" imports a submodule
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in _MODULE_NAMES else node.module)
    return found


def _module_names() -> set[str]:
    return {".".join(p.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__")
            for p in PKG.rglob("*.py")}


_MODULE_NAMES = _module_names()


def _modules() -> list[tuple[str, pathlib.Path]]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        out.append((".".join(rel.parts).removesuffix(".__init__"), path))
    return out


@pytest.mark.parametrize("name,path", _modules(), ids=[m for m, _ in _modules()])
def test_imports_only_from_rooms_below(name, path):
    room = _room(name)
    assert room in ROOMS, f"{name}: not a room of docs/architecture.md"
    for target in _imports(path):
        other = _room(target)
        if other == room and room in ("ort", "app", "adapters"):
            continue  # inside a package (checked for cycles below)
        if room == "__init__" and other in ("lightning", "ort"):
            continue  # loaded on first use by the package's __getattr__ (not imported)
        assert ROOMS.index(other) < ROOMS.index(room), (
            f"{name} imports {target}: {other!r} is not below {room!r} in the house")


def test_no_import_cycle():
    graph = {name: {t for t in _imports(path)} for name, path in _modules()}
    seen: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state = seen.get(node)
        if state == 2:
            return
        assert state != 1, "import cycle: " + " -> ".join(stack + [node])
        seen[node] = 1
        for nxt in graph.get(node, ()):
            if nxt != node and nxt in graph and not (node == "bnswap" and
                                                     nxt in ("bnswap.lightning", "bnswap.ort")):
                visit(nxt, stack + [node])
        seen[node] = 2

    for name in graph:
        visit(name, [])
