"""docs/architecture.md's table against the code, and the code against the table.

Each module of the package imports only what its row allows ("may import"): static
imports anywhere in the file (module level or inside functions, absolute or relative)
and dynamic ones (``importlib.import_module("bnswap...")``, the registry's lazy
entries). No cycle; the Lightning callback and the demo application use public names
only; ``bnswap/__init__.py`` loads the callback and the ORT backend on first use only.
The page's table is :data:`ALLOWED`, row for row, each row's layer the length of its
longest import chain; no module is over 800 lines, and the page names every one over 600.
"""

from __future__ import annotations

import ast
import functools
import itertools
import pathlib
import re
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "bnswap"
PAGE = ROOT / "docs" / "architecture.md"

#: row -> the rows it may import, as docs/architecture.md's table says (a row is a
#: module of the package, or a folder: ``ort``, ``app``, ``adapters``, ``_compat``).
ALLOWED: dict[str, set[str]] = {
    "functional": set(),
    "kernels": set(),
    "_warn": {"_log"},
    "_rows": set(),
    "_patterns": set(),
    "_log": set(),
    "extras": set(),
    "_swap": {"functional", "_warn"},
    "_graph": {"functional"},
    "_node_kernels": {"kernels", "_graph"},
    "layers": {"functional", "_swap"},
    "_global_batch": set(),
    "sync": {"functional", "_swap", "_global_batch"},
    "adapters": {"functional", "sync"},
    "_compat": {"_swap", "_graph", "_warn"},
    "programs": {"_graph", "_node_kernels", "_warn", "_rows", "_compat", "kernels"},
    "registry": {"_swap", "layers", "adapters", "sync"},
    "ort": {"functional", "_swap", "_log", "extras"},
    "backends": {"_swap", "ort"},
    "plan": {"_swap", "_warn", "_rows", "_patterns", "registry", "sync", "backends", "kernels"},
    "convert": {"_warn", "_log", "_patterns", "plan", "programs"},
    "lightning": {"backends", "convert", "extras", "layers", "plan", "sync"},
    "__init__": {
        "functional",
        "_swap",
        "_graph",
        "layers",
        "_compat",
        "_patterns",
        "registry",
        "plan",
        "convert",
        "lightning",
        "ort",
        "programs",
    },
    "app": {"__init__", "lightning", "extras"},
}
PACKAGES = {"ort", "app", "adapters", "_compat"}  # rows that are folders: their modules may import
# each other (cycles are still checked)
PUBLIC_ONLY = {"lightning", "app"}
LAZY_ONLY = {"__init__": {"lightning", "ort"}, "backends": {"ort"}}  # inside functions only


def _name(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__")


MODULES = {_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _row(dotted: str) -> str:
    parts = dotted.split(".")
    assert parts[0] == "bnswap", dotted
    return parts[1] if len(parts) > 1 else "__init__"


class _Imports(ast.NodeVisitor):
    """(target module, imported name or None, inside a function) for every import."""

    def __init__(self, module: str, is_package: bool):
        self.package = module if is_package else module.rpartition(".")[0]
        self.found: list[tuple[str, str | None, bool]] = []
        self._depth = 0

    def _add(self, target: str, name: str | None) -> None:
        if target.split(".")[0] == "bnswap":
            self.found.append((target, name, self._depth > 0))

    def visit_FunctionDef(self, node):
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node):
        """``if TYPE_CHECKING:`` imports never run: for type checkers only (the rest of
        the ``if`` statement is visited as usual)."""
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
        ):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node):
        for a in node.names:
            self._add(a.name, None)

    def visit_ImportFrom(self, node):
        base = node.module or ""
        if node.level:
            parts = self.package.split(".")
            parent = ".".join(parts[: len(parts) - node.level + 1])
            base = f"{parent}.{base}" if base else parent
        for a in node.names:
            sub = f"{base}.{a.name}"
            self._add(sub if sub in MODULES else base, a.name)

    def visit_Call(self, node):
        fn = node.func
        called = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
        if (
            called in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            self._add(node.args[0].value, None)
        self.generic_visit(node)

    def visit_Assign(self, node):  # the registry's "module:function" entries
        if isinstance(node.value, ast.Dict):
            for v in node.value.values:
                if isinstance(v, ast.Constant) and isinstance(v.value, str) and ":" in v.value:
                    mod = v.value.split(":")[0]
                    if mod in MODULES:
                        self._add(mod, None)
        self.generic_visit(node)

    visit_AnnAssign = visit_Assign


def _imports(name: str) -> list[tuple[str, str | None, bool]]:
    path = MODULES[name]
    visitor = _Imports(name, path.name == "__init__.py")
    visitor.visit(ast.parse(path.read_text()))
    return visitor.found


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_only_what_its_row_allows(name):
    row = _row(name)
    assert row in ALLOWED, f"{name}: not a row of docs/architecture.md"
    for target, imported, lazy in _imports(name):
        other = _row(target)
        if other == row and row in PACKAGES:
            continue
        assert other in ALLOWED[row], (
            f"{name} imports {target}: docs/architecture.md lets {row!r} import "
            f"{sorted(ALLOWED[row])} only"
        )
        if other in LAZY_ONLY.get(row, ()):
            assert lazy, f"{name} imports {target} at module level (only on first use)"
        if row in PUBLIC_ONLY and other != row:
            private = [p for p in target.split(".")[1:] if p.startswith("_")]
            assert not private and not (imported or "").startswith("_"), (
                f"{name} imports a private name: {target} {imported or ''}"
            )


def test_only_the_synchronized_layers_and_the_log_import_torch_distributed():
    """docs/architecture.md: torch.distributed is imported in bnswap/sync.py and
    bnswap/_global_batch.py (the synchronized layers: groups and collectives) and
    bnswap/_log.py (the rank, to log once per job) only; in the app, bnswap/app/cli.py
    ends the process group a multi-device job made."""
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in names):
                found.append(name)
    assert sorted(set(found)) == [
        "bnswap._global_batch",
        "bnswap._log",
        "bnswap.app.cli",
        "bnswap.sync",
    ]


def test_no_import_cycle():
    graph = {name: {t for t, _, _ in _imports(name)} & set(MODULES) for name in MODULES}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        if state.get(node) == 2:
            return
        assert state.get(node) != 1, "import cycle: " + " -> ".join([*path, node])
        state[node] = 1
        for nxt in sorted(graph[node]):
            # the package face loads these on first use (its __getattr__): no cycle
            if not (node == "bnswap" and nxt in ("bnswap.lightning", "bnswap.ort")) and nxt != node:
                visit(nxt, [*path, node])
        state[node] = 2

    for name in sorted(MODULES):
        visit(name, [])


def test_the_checker_sees_what_it_must():
    """The visitor itself, on sources it must flag (a check that cannot fail is none)."""
    cases = {
        "def f():\n    from bnswap.plan import plan\n": ("bnswap.plan", True),
        "from .plan import plan\n": ("bnswap.plan", False),
        "import importlib\nimportlib.import_module('bnswap.plan')\n": ("bnswap.plan", False),
        "from bnswap import registry\n": ("bnswap.registry", False),
    }
    for source, (target, lazy) in cases.items():
        visitor = _Imports("bnswap._swap", False)
        visitor.visit(ast.parse(source))
        assert (target, lazy) in [(t, z) for t, _, z in visitor.found], source


def test_dir_of_the_package_lists_its_public_names_only():
    """``dir(bnswap)`` (tab completion): every public name and submodule, none of what
    ``bnswap/__init__.py`` imports for itself (a newcomer saw Any, annotations, importlib)."""
    import bnswap

    names = dir(bnswap)
    assert set(bnswap.__all__) | {"__version__", "ort", "programs", "layers"} <= set(names)
    assert not {"Any", "annotations", "importlib", "types"} & set(names)
    assert names == sorted(names)


def _page_table() -> dict[str, tuple[int, set[str]]]:
    """docs/architecture.md's table: row -> (its layer, the rows it may import). A row is
    named by its first column (``functional.py``, ``_compat/``, ``adapters/timm.py``); what
    it may import is every `name` of the last column outside parentheses (those hold
    why or when)."""
    rows: dict[str, tuple[int, set[str]]] = {}
    for line in PAGE.read_text().splitlines():
        m = re.match(r"^\| (\d+) \| `([^`]+)` \| .* \| (.*) \|$", line)
        if not m:
            continue
        name = m.group(2).split("/")[0].removesuffix(".py")
        may = m.group(3)
        while re.search(r"\([^()]*\)", may):
            may = re.sub(r"\([^()]*\)", "", may)
        assert name not in rows, f"docs/architecture.md: two rows for {name}"
        rows[name] = (int(m.group(1)), set(re.findall(r"`([^`]+)`", may)))
    return rows


@functools.cache
def _layer(row: str) -> int:
    return 1 + max((_layer(r) for r in ALLOWED[row]), default=-1)


def test_the_page_holds_this_table():
    """The page says what this test enforces: the same rows, each allowed the same
    imports, on the layer its longest import chain puts it, the rows in layer order (a
    row imports from rows above it only)."""
    page = _page_table()
    assert set(page) == set(ALLOWED), sorted(set(page) ^ set(ALLOWED))
    for row, (layer, may) in page.items():
        assert may == ALLOWED[row], (row, sorted(may ^ ALLOWED[row]))
        assert layer == _layer(row), (row, layer, _layer(row))
    assert [layer for layer, _ in page.values()] == sorted(layer for layer, _ in page.values())


def test_the_table_reader_sees_what_it_must():
    """The page's reader on a row it must read (names in parentheses are no imports)."""
    line = "| 4 | `backends.py` | the seam | `_swap`; `ort` inside functions (`wrap`, when `x`) |"
    m = re.match(r"^\| (\d+) \| `([^`]+)` \| .* \| (.*) \|$", line)
    assert m and m.group(2) == "backends.py"
    may = re.sub(r"\([^()]*\)", "", m.group(3))
    assert set(re.findall(r"`([^`]+)`", may)) == {"_swap", "ort"}


def test_no_module_is_over_800_lines_and_the_page_names_the_long_ones():
    """Issue 47: no module of the package over 800 lines; docs/architecture.md says why
    each one over 600 stays whole (its "Long modules" table names exactly those)."""
    lengths = {str(p.relative_to(PKG)): len(p.read_text().splitlines()) for p in PKG.rglob("*.py")}
    assert max(lengths.values()) <= 800, {p: n for p, n in lengths.items() if n > 800}
    section = PAGE.read_text().split("## Long modules", 1)[1]
    named = set(re.findall(r"^\| `([^`]+\.py)` \|", section, flags=re.M))
    assert named == {p for p, n in lengths.items() if n > 600}


# ------------------------------------------------------------ the path through the door
def _path(call, *parts: object) -> list[str]:
    """The rows (:data:`ALLOWED`) whose functions ``call()`` hands one of ``parts`` (the
    model and its modules, or the program, its graph modules and nodes) as an argument,
    in the order called, each function at its first such call (a loop over layers or nodes
    walks its body once), a row called again straight away counted once: the path of the
    object through the package, as it runs."""
    ids = {id(p) for p in parts}
    path: list[str] = []
    seen: set[object] = set()

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        try:
            rel = pathlib.Path(code.co_filename).resolve().relative_to(PKG)
        except ValueError:
            return
        args = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if code not in seen and any(id(frame.f_locals.get(a)) in ids for a in args):
            seen.add(code)
            row = _row(_name(PKG / rel))
            if not path or path[-1] != row:
                path.append(row)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return path


def _climbs(path: list[str]) -> int:
    return sum(_layer(b) > _layer(a) for a, b in itertools.pairwise(path))


def _one_layer_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))


def _program(model: torch.nn.Module) -> torch.export.ExportedProgram:
    return torch.export.export(model.eval(), (torch.randn(2, 3, 8, 8),))


def _program_parts(program: object) -> list[object]:
    """The program (an ExportedProgram or a GraphModule), its graph modules and nodes."""
    gm = getattr(program, "graph_module", program)
    graphs = [g for g in (getattr(m, "graph", None) for m in gm.modules()) if g is not None]
    return [program, *gm.modules(), *(n for g in graphs for n in g.nodes)]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("fn", ["convert", "plan", "revert"])
def test_a_module_crosses_at_most_four_modules_and_climbs_at_most_twice(fn):
    """Issue 47: the path of a model's objects through ``bnswap.convert`` / ``plan`` /
    ``revert`` (a model of one BatchNorm layer: each step once): the door hands it to the
    module road, which asks the backend and the swap primitive; it crosses at most 4 of
    the package's modules and goes back up a layer at most twice."""
    import bnswap

    model = _one_layer_model()
    if fn == "revert":
        bnswap.convert(model)
    path = _path(lambda: getattr(bnswap, fn)(model), *model.modules())
    assert path[:2] == ["convert", "plan"], path
    assert "programs" not in path, path
    assert len(set(path)) <= 4 and _climbs(path) <= 2, path


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("fn", ["convert", "plan"])
def test_a_program_crosses_at_most_four_modules_and_climbs_at_most_twice(fn):
    """Issue 47: the same for an exported program of one batch-norm node: the door hands
    it to the program road, which reads and rewrites its nodes below it."""
    import bnswap

    ep = _program(_one_layer_model())
    path = _path(lambda: getattr(bnswap, fn)(ep), *_program_parts(ep))
    assert path[:2] == ["convert", "programs"], path
    assert "plan" not in path, path
    assert len(set(path)) <= 4 and _climbs(path) <= 2, path
