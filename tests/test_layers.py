"""Imports flow one way: every import of every .py file (module level, function-local and TYPE_CHECKING
alike) goes along the layer table below, and no module reaches itself again through its imports.

The table is the one place the layers are written as data; the README's Layout section shows it, and
`test_readme_shows_the_table` keeps the two the same.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# folder -> the folders (besides itself) its modules may import, lowest floors first.
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "configs": (),
    "grpo": (),
    "cluster": ("configs",),
    "mcp_servers": ("configs",),
    "serve_apps": ("configs", "cluster", "mcp_servers"),
    "tasks": ("configs", "cluster", "serve_apps"),
    "envs": ("configs", "cluster", "serve_apps", "tasks"),
    "actors": ("configs", "grpo", "cluster", "envs"),
    "orchestration": ("configs", "grpo", "cluster", "actors"),
    "jobs": (
        "configs",
        "grpo",
        "cluster",
        "mcp_servers",
        "serve_apps",
        "tasks",
        "envs",
        "actors",
        "orchestration",
    ),
    "bench": (
        "configs",
        "grpo",
        "cluster",
        "mcp_servers",
        "serve_apps",
        "tasks",
        "envs",
        "actors",
        "orchestration",
        "jobs",
    ),
    "tests": (
        "configs",
        "grpo",
        "cluster",
        "mcp_servers",
        "serve_apps",
        "tasks",
        "envs",
        "actors",
        "orchestration",
        "jobs",
        "bench",
    ),
}


@dataclass(frozen=True)
class Edge:
    source: str  # importing module, e.g. "actors.models"
    target: str  # imported module (or package), e.g. "cluster.storage"
    path: str  # the importing file, relative to the repository
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.source} -> {self.target}"


def module_files() -> dict[str, Path]:
    """Every module of the layered folders: {"actors.models": path, "envs": envs/__init__.py, ...}."""
    out: dict[str, Path] = {}
    for folder in MAY_IMPORT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """`name`, or the longest package of ours above it; None for third-party names."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> Iterator[Edge]:
    """The modules of ours that `module` imports, wherever in the file the import stands."""
    rel = str(path.relative_to(ROOT))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), rel)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` the module itself
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for name in names:
            target = _resolve(name, modules)
            if target is not None and target != module:
                yield Edge(module, target, rel, node.lineno)


def all_edges() -> list[Edge]:
    modules = module_files()
    return sorted(
        {e for module, path in modules.items() for e in imports_of(module, path, modules)},
        key=lambda e: (e.path, e.line, e.target),
    )


def folder(module: str) -> str:
    return module.split(".")[0]


def test_the_table_is_one_way() -> None:
    """The table itself has floors: no folder may import, through others, a folder that may import it."""
    for name, allowed in MAY_IMPORT.items():
        unknown = set(allowed) - set(MAY_IMPORT)
        assert not unknown, f"MAY_IMPORT[{name!r}] names folders the table does not list: {sorted(unknown)}"
        assert name not in allowed, f"MAY_IMPORT[{name!r}] lists itself"
    try:
        list(TopologicalSorter(MAY_IMPORT).static_order())
    except CycleError as e:
        raise AssertionError(f"the layer table has a circle: {' -> '.join(e.args[1])}") from None


def test_every_package_is_in_the_table() -> None:
    """A new top-level package gets a row (and its place among the floors) before it gets code."""
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    missing = sorted(packages - set(MAY_IMPORT))
    assert not missing, f"top-level packages missing from MAY_IMPORT: {missing}"


def test_imports_go_down_the_table() -> None:
    edges = all_edges()
    assert len(edges) > 500, f"only {len(edges)} imports found: the scan is broken"  # the code has ~1,500
    wrong = [
        f"{e}: {folder(e.source)}/ may not import {folder(e.target)}/ (it may import: "
        f"{', '.join(MAY_IMPORT[folder(e.source)]) or 'nothing of ours'})"
        for e in edges
        if folder(e.source) != folder(e.target) and folder(e.target) not in MAY_IMPORT[folder(e.source)]
    ]
    assert not wrong, "imports against the layer table:\n" + "\n".join(wrong)


def test_no_import_circles() -> None:
    """No module imports itself back through others (function-local imports included: they only delay one)."""
    edges = all_edges()
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
    try:
        list(TopologicalSorter(graph).static_order())
    except CycleError as e:
        cycle = e.args[1]  # [a, b, ..., a]: each imports the one before it
        links = set(zip(cycle[1:], cycle, strict=False))
        where = [str(x) for x in edges if (x.source, x.target) in links]
        raise AssertionError("import circle:\n" + "\n".join(where)) from None


def readme_table() -> dict[str, tuple[str, ...]]:
    """{folder: may-import folders} from the README's Layout table (its third column)."""
    text = (ROOT / "README.md").read_text()
    layout = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, tuple[str, ...]] = {}
    for line in layout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.fullmatch(r"`(\w+)/`", cells[0]) if len(cells) == 3 else None
        if m and m.group(1) in MAY_IMPORT:
            rows[m.group(1)] = tuple(re.findall(r"`(\w+)/?`", cells[2]))
    return rows


def test_readme_shows_the_table() -> None:
    assert readme_table() == MAY_IMPORT, (
        "the README's Layout table (column 'may import') differs from tests/test_layers.py's MAY_IMPORT"
    )
