"""The folders are the subsystems and imports go one way: launch.py -> pipelines -> mpp; in mpp, data and model at
the bottom, training and evaluation above them; in pipelines, the run machinery, then the evaluations, then the
stages, then the command line. A module may import its own sub-package and anything below it, never above it nor a
sibling sub-package of its own level (docs/architecture.md draws it)."""

import ast
from pathlib import Path

from conftest import ROOT

# Each module (by dotted prefix, the longest that matches) and its level.
LEVELS = {
    "mpp.errors": 0, "mpp.metrics": 0, "mpp.rundir": 0, "mpp.model.variants": 0,
    "mpp.config": 1,
    "mpp.data": 2, "mpp.model": 2,
    "mpp.training": 3, "mpp.evaluation": 3,
    "pipelines.run": 4, "pipelines.comparison": 4,
    "pipelines.evaluations": 5,
    "pipelines.stages": 6, "pipelines.parts": 6,
    "pipelines.commands": 7,
    "pipelines.cli": 8, "pipelines.reference": 8, "pipelines.__main__": 9,
}


def unit(module: str) -> str:
    """The prefix of LEVELS that `module` belongs to."""
    return max((prefix for prefix in LEVELS if module == prefix or module.startswith(prefix + ".")), key=len)


def imports(path: Path, module: str) -> set[str]:
    """The project modules `path` (the module `module`) imports, absolute, the lazy ones inside functions included."""
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return {name for name in found if name.split(".")[0] in ("mpp", "pipelines") and any(
        name == prefix or name.startswith(prefix + ".") for prefix in LEVELS)}


def modules():
    for top in ("mpp", "pipelines"):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            yield path, ".".join(parts if parts[-1] != "__init__" else parts[:-1])


def test_every_module_has_a_level():
    assert [module for _, module in modules() if module not in ("mpp", "pipelines") and not any(
        module == prefix or module.startswith(prefix + ".") for prefix in LEVELS)] == []


def test_imports_go_one_way():
    upward = []
    for path, module in modules():
        if module in ("mpp", "pipelines"):
            continue
        own = unit(module)
        for target in imports(path, module):
            other = unit(target)
            if other == own:
                continue
            if LEVELS[other] > LEVELS[own] or (LEVELS[other] == LEVELS[own]):
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_the_library_never_imports_the_stages():
    assert [f"{module} -> {target}" for path, module in modules() if module.startswith("mpp")
            for target in imports(path, module) if target.startswith("pipelines")] == []


def test_every_function_reads_on_one_screen():
    # At most 70 lines, docstring included: a longer one has parts that want names of their own (issue 35).
    long = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for folder in ("mpp", "pipelines", "benchmarks", "tests") for path in sorted((ROOT / folder).rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 70]
    assert not long, long
