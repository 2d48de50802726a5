"""The package's shape: ``cepe --help`` imports no torch, imports form no cycle, and no module imports
another module's private (underscore) names.

The import graph is read statically with ``ast`` from every ``import`` statement in the package, at module
level *and* inside functions (a function-level import still ties the two modules together: it only
postpones the cost), plus ``importlib.import_module("cepe....")`` calls with a literal name. An edge goes to
the module named (``from cepe.x import y`` is an edge to ``cepe.x``, and to ``cepe.x.y`` when that is a
module); a parent package's ``__init__`` is not counted as imported by its children (the package
``__init__`` files export lazily and import nothing of their own).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "cepe"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """``(imported module, imported names)`` for every import in ``path`` that resolves into the package."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [a.name for a in node.names]
            found.append((target, names))
            found += [(f"{target}.{n}", []) for n in names if f"{target}.{n}" in modules]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.args[0].value, []))
    return [(t, n) for t, n in found if t in modules and t != name]


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: {t for t, _ in _imports(m, p, modules)} for m, p in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w) :] + [w]
            if w not in state and (cycle := visit(w)):
                return cycle
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (cycle := visit(v)):
            return cycle
    return None


def test_no_import_cycles_in_the_package():
    graph = import_graph()
    assert "cepe.modeling" in graph and graph["cepe.cli"], "the graph was read"
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_imports_private_names_of_another():
    modules = _modules()
    bad = [
        f"{m} imports {t}.{n}"
        for m, p in modules.items()
        for t, names in _imports(m, p, modules)
        for n in names
        if n.startswith("_") and not n.startswith("__")
    ]
    assert not bad, bad


_CHECK_HELP = """
import contextlib, io, json, sys
from cepe.cli import build_parser, main
commands = sorted(build_parser()._subparsers._group_actions[0].choices)
for argv in [["--help"]] + [[c, "--help"] for c in commands]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main(argv)
heavy = sorted(m for m in ("torch", "transformers", "accelerate", "safetensors") if m in sys.modules)
print(json.dumps({"commands": commands, "heavy": heavy}))
"""


@pytest.mark.multiproc
def test_cli_help_imports_no_torch():
    """``cepe --help`` and every ``cepe <command> --help`` run without importing torch or transformers."""
    out = subprocess.run(
        [sys.executable, "-c", _CHECK_HELP], capture_output=True, text=True, check=True, cwd=ROOT
    )
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"train", "eval", "bench", "bench-store", "serve", "main", "generate"} <= set(res["commands"])
    assert res["heavy"] == []


_CHECK_HARNESS_HELP = """
import contextlib, io, json, sys
from cepe.eval.harness_cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
    main(["--help"])
heavy = sorted(m for m in ("torch", "transformers", "cepe.eval.harness") if m in sys.modules)
print(json.dumps({"help": "--model" in out.getvalue(), "heavy": heavy}))
"""


@pytest.mark.multiproc
def test_harness_command_line_help_imports_no_torch():
    """``cepe-lm-eval --help`` prints lm-eval's help without importing torch or the model."""
    pytest.importorskip("lm_eval")
    out = subprocess.run(
        [sys.executable, "-c", _CHECK_HARNESS_HELP], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"help": True, "heavy": []}
