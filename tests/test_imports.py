"""The house's floors, read from every import in the code (lazy ones and those under
`TYPE_CHECKING` too): `rlboost/` (the core) imports neither `workers/` nor `trainer/`; `workers/`
does not import `trainer/`; no product module imports the benchmarks wing; and no module imports
itself back through another (an import circle). The three folders install as `rlboost.workers`,
`rlboost.trainer` and `rlboost.benchmarks` (pyproject.toml's package-dir): a module's floor is its
folder, not its import name's first part."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("rlboost", "workers", "trainer")
PACKAGES = (*PRODUCT, "benchmarks")
# (importer's package, imported package) pairs that go up a floor
FORBIDDEN = {("rlboost", "workers"), ("rlboost", "trainer"), ("workers", "trainer"),
             *((p, "benchmarks") for p in PRODUCT)}


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if package != "rlboost":  # trainer/x.py is rlboost.trainer.x
                parts = ("rlboost", *parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def floor(module: str) -> str:
    """`rlboost.workers.main` -> workers; `rlboost.checkpoint` -> rlboost."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PACKAGES[1:] else parts[0]


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every project module `name` imports, at any depth of its code: a lazy import is an import
    too, and so is one under `TYPE_CHECKING` (a module that names another's types to check them
    depends on it as surely as one that runs it)."""
    found: set[str] = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join([*package[:len(package) - node.level + 1], *([node.module] if node.module else [])]) \
                if node.level else node.module
            # `from pkg import sub` is an import of the submodule (as import-linter reads it);
            # `from pkg import name` one of the package
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    out = set()
    for m in found:
        while m and m not in known:
            m = m.rpartition(".")[0]
        if m and m != name:
            out.add(m)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, path, known) for name, path in known.items()}


def test_no_import_goes_up_a_floor():
    wrong = sorted(f"{a} imports {b}" for a, deps in graph().items() for b in deps
                   if (floor(a), floor(b)) in FORBIDDEN)
    assert wrong == []


def test_no_import_circle():
    g = graph()
    circles, index, low, stack, on = [], {}, {}, [], set()

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert circles == []


def test_the_checker_sees_a_circle_and_a_floor(tmp_path, monkeypatch):
    """The rules above can fail: a planted circle and an upward import are both found, the circle
    closed by an import under `TYPE_CHECKING` and the floor broken by one inside a function."""
    for package, body in (("rlboost", "def f():\n    from rlboost.workers import b\n"),
                          ("workers", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import rlboost.a\n")):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / ("a.py" if package == "rlboost" else "b.py")).write_text(body)
    for package in ("trainer", "benchmarks"):
        (tmp_path / package).mkdir()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    g = graph()
    assert g["rlboost.a"] == {"rlboost.workers.b"} and "rlboost.a" in g["rlboost.workers.b"]
    assert (floor("rlboost.a"), floor("rlboost.workers.b")) in FORBIDDEN
