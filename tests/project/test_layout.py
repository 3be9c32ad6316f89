"""The layout rules, over the whole ``trioshed`` package: no module over 500 lines (a short list
of reasoned exemptions), no import cycle, product code independent of ``trioshed.testing``, Quart
only in ``trioshed/api/``, the API's protocol modules free of I/O, the API in rooms by concern
(no flat module beyond its app, its shared state and its package face), and the tests in rooms
that mirror the package's.

The import graph is read from the source (nothing is imported): every ``import`` and
``from … import`` at any depth of a module, in functions too, so a lazy import does not hide a
cycle. ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``
(its ``__init__``); the parent packages that Python imports on the way are not edges (a package
whose ``__init__`` re-exports its submodules would otherwise form a cycle with each of them).
Imports under ``if TYPE_CHECKING:`` do not run, so the runtime graph leaves them out; they are
still dependencies a reader follows, so a second test forbids cycles through them too.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

import trioshed

PACKAGE = Path(trioshed.__file__).parent
ROOT = PACKAGE.parent
MAX_LINES = 500

#: Modules allowed over MAX_LINES, each with its reason. Add one only when splitting would cut
#: one idea in two.
EXEMPT: dict[str, str] = {
    "trioshed/models/gguf_meta.py": "the GGUF parser: one format, kept whole",
}

#: TEMPORARY: modules being split while this rule landed. Delete each line (and then the dict)
#: once its split is merged; the test below fails on a line whose module is gone or short.
TEMPORARY_EXEMPT: dict[str, str] = {
}

#: Third-party packages of the HTTP edge, allowed only under ``trioshed/api/``.
HTTP_FRAMEWORK = {"quart", "quart_trio"}


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` at ``line``; ``typing_only`` under ``if TYPE_CHECKING:``."""

    source: str
    target: str
    line: int
    typing_only: bool


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name."""
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(source: str, name: str, known: set[str]) -> list[Edge]:
    """The imports of module ``name`` (its ``source``) of modules in ``known``, at any depth.

    ``import a.b`` is an edge to ``a.b``; ``from a import b`` to ``a.b`` when that is a module,
    else to ``a``. Relative imports are resolved against ``name`` (a package's ``__init__`` is
    named like the package).
    """
    is_package = any(other.startswith(name + ".") for other in known)
    found: list[Edge] = []

    def add(target: str, node: ast.stmt, typing_only: bool) -> None:
        if target in known and target != name:
            found.append(Edge(name, target, node.lineno, typing_only))

    def visit(node: ast.AST, typing_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, typing_only)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node, typing_only)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, base] if base else package)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in known else base, node, typing_only)
        for child in ast.iter_child_nodes(node):
            visit(child, typing_only)

    visit(ast.parse(source), False)
    return found


def import_graph(sources: Mapping[str, str], *, typing_too: bool) -> dict[str, dict[str, Edge]]:
    """``{module: {imported module: the first such import}}`` over ``{module: source}``; with
    ``typing_too`` the imports under ``if TYPE_CHECKING:`` count as well."""
    known = set(sources)
    graph: dict[str, dict[str, Edge]] = {}
    for name, source in sources.items():
        edges: dict[str, Edge] = {}
        for edge in imports_of(source, name, known):
            if typing_too or not edge.typing_only:
                edges.setdefault(edge.target, edge)
        graph[name] = edges
    return graph


def cycles(graph: Mapping[str, Mapping[str, Edge]]) -> list[list[Edge]]:
    """One cycle (its edges, in order) per strongly connected group of modules that import each
    other, found with Tarjan's algorithm; empty when the graph is acyclic."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(graph, group) for group in groups]


def _cycle_in(graph: Mapping[str, Mapping[str, Edge]], group: set[str]) -> list[Edge]:
    """The shortest cycle through the group's first module (breadth-first inside the group)."""
    start = min(group)
    came: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w, edge in sorted(graph[v].items()):
                if w not in group or w in came:
                    continue
                came[w] = edge
                if w == start:
                    path = [edge]
                    while path[0].source != start:
                        path.insert(0, came[path[0].source])
                    return path
                following.append(w)
        frontier = following
    raise AssertionError(f"no cycle in {sorted(group)}")  # a strongly connected group has one


def describe(cycle: list[Edge]) -> str:
    """``a -> b -> a`` with where each import is."""
    where = "; ".join(
        f"{edge.source} imports {edge.target} at line {edge.line}"
        + (" (under TYPE_CHECKING)" if edge.typing_only else "")
        for edge in cycle
    )
    return " -> ".join([edge.source for edge in cycle] + [cycle[0].source]) + f" ({where})"


def _sources() -> dict[str, str]:
    return {name: path.read_text() for name, path in modules().items()}


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


CYCLE_ADVICE = (
    "Move what both sides need into a module below both (e.g. models/names.py holds the name "
    "rule that models/store.py and models/catalogue.py share); an import inside a function "
    "does not break a cycle, it hides it."
)


def test_no_module_over_500_lines() -> None:
    exempt = EXEMPT | TEMPORARY_EXEMPT
    long = {
        _relative(path): lines
        for path in modules().values()
        if (lines := len(path.read_text().splitlines())) > MAX_LINES and _relative(path) not in exempt
    }
    assert not long, (
        f"modules over {MAX_LINES} lines: {long}. Split each by idea (sibling modules, or a "
        "package of them; one idea per module, 100-500 lines); only a module that is one idea "
        "which splitting would cut in two goes into EXEMPT in tests/project/test_layout.py, with its reason."
    )


@pytest.mark.parametrize("exempt", [EXEMPT, TEMPORARY_EXEMPT], ids=["EXEMPT", "TEMPORARY_EXEMPT"])
def test_every_exemption_is_needed(exempt: dict[str, str]) -> None:
    stale = {}
    for path, reason in exempt.items():
        assert reason.strip(), f"{path}: say why it may be long"
        file = ROOT / path
        if not file.is_file():
            stale[path] = "gone"
        elif (lines := len(file.read_text().splitlines())) <= MAX_LINES:
            stale[path] = f"{lines} lines"
    assert not stale, f"exemptions no longer needed: {stale}. Delete their lines from tests/project/test_layout.py."


def test_no_import_cycle() -> None:
    found = cycles(import_graph(_sources(), typing_too=False))
    assert not found, "import cycles:\n" + "\n".join(map(describe, found)) + "\n" + CYCLE_ADVICE


def test_no_import_cycle_through_type_checking_imports() -> None:
    """``if TYPE_CHECKING:`` imports do not run, but a cycle through one is still two modules
    that know each other: give the lower one a Protocol of what it needs instead. (Cycles of
    runtime imports alone are the test above's.)"""
    found = [c for c in cycles(import_graph(_sources(), typing_too=True)) if any(e.typing_only for e in c)]
    assert not found, (
        "import cycles through TYPE_CHECKING imports:\n" + "\n".join(map(describe, found)) + "\n"
        "Let the lower module declare what it needs (a Protocol, or a type moved down) instead of "
        "importing the higher one. " + CYCLE_ADVICE
    )


def test_only_testing_imports_testing() -> None:
    sources = _sources()
    known = set(sources)
    upward = [
        f"{edge.source} imports {edge.target} at line {edge.line}"
        for name, source in sources.items()
        if not (name == "trioshed.testing" or name.startswith("trioshed.testing."))
        for edge in imports_of(source, name, known)
        if edge.target == "trioshed.testing" or edge.target.startswith("trioshed.testing.")
    ]
    assert not upward, (
        f"product code imports the test helpers: {upward}. Move what it needs out of "
        "trioshed/testing/ into product code (as models/tiny_gguf.py holds the tiny model writer "
        "that provisioning uses) and let trioshed/testing/ import it from there."
    )


def _third_party_roots(source: str) -> set[str]:
    tree = ast.parse(source)
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level}
    return roots


def test_quart_only_in_the_api() -> None:
    outside = sorted(
        _relative(path)
        for path in PACKAGE.rglob("*.py")
        if not path.is_relative_to(PACKAGE / "api") and _third_party_roots(path.read_text()) & HTTP_FRAMEWORK
    )
    assert not outside, (
        f"{outside} import Quart: the HTTP edge lives in trioshed/api/. Keep the route or request "
        "handling there and pass plain values (or a Protocol) to the module outside it."
    )


#: The only modules directly in ``trioshed/api/``: the package's face, the app and what the routes
#: share. Everything else lives in a room whose one-line docstring says what it holds.
API_FLAT = {"__init__.py", "app.py", "state.py"}
#: The rooms of ``trioshed/api/``.
API_ROOMS = {"routes", "pipeline", "protocols", "openapi", "observe"}


def test_the_api_is_rooms_by_concern() -> None:
    api = PACKAGE / "api"
    flat = {path.name for path in api.glob("*.py")} - API_FLAT
    assert not flat, (
        f"flat modules in trioshed/api/: {sorted(flat)}. Put each in the room it belongs to: a route "
        "a client calls in routes/, the way a request travels in pipeline/, a protocol's "
        "translation in protocols/, the API's description in openapi/, what observes it in observe/."
    )
    rooms = {path.parent.name for path in api.glob("*/__init__.py")}
    assert rooms == API_ROOMS, f"trioshed/api/ rooms {sorted(rooms)}, expected {sorted(API_ROOMS)}"
    for room in rooms:
        doc = ast.get_docstring(ast.parse((api / room / "__init__.py").read_text()))
        assert doc and doc.strip(), f"trioshed/api/{room}/__init__.py: say in one line what lives there"


def test_tests_mirror_the_rooms() -> None:
    tests = ROOT / "tests"
    loose = sorted(path.name for path in tests.glob("test_*.py"))
    assert not loose, f"tests at the top of tests/: {loose}. Put each beside the room it tests (tests/<room>/)."
    for init in tests.rglob("__init__.py"):
        if init.parent != tests and "node_modules" not in init.parts:
            doc = ast.get_docstring(ast.parse(init.read_text()))
            assert doc and doc.strip(), f"{init.relative_to(ROOT)}: say in one line what the room tests"


def test_protocol_modules_do_no_io() -> None:
    for path in (PACKAGE / "api" / "protocols").glob("*.py"):
        assert not _third_party_roots(path.read_text()) & {"trio", "quart", "httpx", "hypercorn"}, path.name


SYNTHETIC = {
    "pkg": "",
    "pkg.low": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import High\n",
    "pkg.high": "import pkg.low\n",
    "pkg.a": "def f():\n    from pkg import b\n",
    "pkg.b": "from . import a\n",
    "pkg.c": "from pkg.b import something\n",
}


def test_the_checker_sees_lazy_relative_and_typing_only_imports() -> None:
    """The rules above are only as good as the graph: a cycle hidden in a function and written
    with a relative import is found, and a TYPE_CHECKING import counts only in the typing graph."""
    runtime = cycles(import_graph(SYNTHETIC, typing_too=False))
    assert [describe(c) for c in runtime] == [
        "pkg.a -> pkg.b -> pkg.a (pkg.a imports pkg.b at line 2; pkg.b imports pkg.a at line 1)"
    ]
    typing = cycles(import_graph(SYNTHETIC, typing_too=True))
    assert sorted(describe(c) for c in typing) == [
        "pkg.a -> pkg.b -> pkg.a (pkg.a imports pkg.b at line 2; pkg.b imports pkg.a at line 1)",
        "pkg.high -> pkg.low -> pkg.high (pkg.high imports pkg.low at line 1; "
        "pkg.low imports pkg.high at line 3 (under TYPE_CHECKING))",
    ]
    assert set(import_graph(SYNTHETIC, typing_too=False)["pkg.c"]) == {"pkg.b"}


SERVE_ALONE = """
import sys, trio
from trioshed.config import Settings
from trioshed.server import serve

async def main():
    async with trio.open_nursery() as nursery:
        await nursery.start(serve, Settings.from_env())
        nursery.cancel_scope.cancel()

trio.run(main)
print(" ".join(sorted(m for m in ("httpx", "psycopg", "psycopg_pool") if m in sys.modules)))
"""


def test_a_server_alone_imports_neither_the_fleet_client_nor_the_database_driver(tmp_path: Path) -> None:
    # httpx (which brings rich and pygments) and psycopg cost an idle server about 15 MB of RSS;
    # only a node in a fleet, or with a team database, needs them.
    (tmp_path / "models").mkdir()
    env = {**os.environ, "TRIOSHED_MODELS": str(tmp_path / "models"), "TRIOSHED_HOST": "127.0.0.1:0",
           "TRIOSHED_USAGE_DB": str(tmp_path / "usage.db")}  # fmt: skip
    for name in ("TRIOSHED_DATABASE", "TRIOSHED_FLEET_SECRET", "TRIOSHED_PEERS"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", SERVE_ALONE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1:] in ([], [""]), done.stdout
