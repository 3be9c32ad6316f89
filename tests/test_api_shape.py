"""The shape of ``trioshed.api``: no import cycle, no module over ~500 lines, and the
protocol modules free of I/O (no quart, no trio, no httpx)."""

from __future__ import annotations

import ast
from pathlib import Path

import trioshed.api

API = Path(trioshed.api.__file__).parent
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for path in API.rglob("*.py"):
        parts = path.relative_to(API.parent.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path, known: set[str]) -> set[str]:
    """The ``trioshed.api`` modules ``path`` imports, at any depth in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found |= {n for n in names if n in known}
    return found


def test_no_import_cycle() -> None:
    modules = _modules()
    graph = {name: _imports(path, set(modules)) - {name} for name, path in modules.items()}
    done: set[str] = set()

    def visit(name: str, stack: list[str]) -> None:
        if name in stack:
            raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(name) :], name]))
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, [*stack, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_no_module_over_500_lines() -> None:
    long = {str(p.relative_to(API)): n for p in API.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_protocol_modules_do_no_io() -> None:
    for path in (API / "protocols").glob("*.py"):
        tree = ast.parse(path.read_text())
        roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not roots & {"trio", "quart", "httpx", "hypercorn"}, path.name
