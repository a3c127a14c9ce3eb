"""The code's layout (docs/DESIGN.md, "Code layout and dependency direction"): dependencies
point `ledger` <- `jobs` <- `service`, and no module of the service imports the demo's
tooling (`service/demo/`, left out of the Bento) when it is imported, only inside the
command that runs the demo. Read from the sources: no module is imported."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "service" / "demo"


def _imports(tree: ast.AST, module_level: bool) -> Iterator[tuple[str, int]]:
    """(imported module, line) of every absolute import; with `module_level`, those that
    run when the module is imported (not inside a function)."""
    for node in ast.iter_child_nodes(tree):
        if module_level and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, node.lineno
        yield from _imports(node, module_level)


def _sources(package: str) -> Iterator[tuple[Path, ast.AST]]:
    for path in sorted((ROOT / package).rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def test_dependencies_point_from_the_service_to_the_jobs_to_the_ledger() -> None:
    below = {"ledger": ("jobs", "service"), "jobs": ("service",)}
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {name}"
             for package, forbidden in below.items() for path, tree in _sources(package)
             for name, line in _imports(tree, module_level=False)
             if name.split(".")[0] in forbidden]
    assert wrong == []


def test_inside_jobs_the_orchestration_sits_on_top() -> None:
    """The learners, the guards, private mode and the evaluation never import the
    orchestration (the worker, the registry, the served model) that uses them; and no
    learner imports a guard."""
    below = {"jobs/learners": ("jobs.orchestration", "jobs.guard", "jobs.adaptive",
                               "jobs.eval"),
             "jobs/guard": ("jobs.orchestration",), "jobs/adaptive": ("jobs.orchestration",),
             "jobs/eval": ("jobs.orchestration",)}
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {name}"
             for package, forbidden in below.items() for path, tree in _sources(package)
             for name, line in _imports(tree, module_level=False)
             if any(name == f or name.startswith(f + ".") for f in forbidden)]
    assert wrong == []


def test_no_module_of_the_service_imports_the_demo_when_imported() -> None:
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {name}"
             for path, tree in _sources("service") if not path.is_relative_to(DEMO)
             for name, line in _imports(tree, module_level=True)
             if name == "service.demo" or name.startswith("service.demo.")]
    assert wrong == []
    # the one place that does, inside the `demo` command
    cli = ast.parse((ROOT / "service" / "cli.py").read_text())
    assert "service.demo.walkthrough" in {n for n, _ in _imports(cli, module_level=False)}
