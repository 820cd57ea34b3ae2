"""The package's shape: folders in pipeline order, no import cycles, small modules, deferred
imports only for heavy third-party libraries, no dispatch on class names."""

from __future__ import annotations

import ast
from pathlib import Path

import functional_load

PACKAGE = Path(functional_load.__file__).parent
MODULES = sorted(PACKAGE.rglob("*.py"))
STAGES = ["model", "layout", "quant", "checkpoint", "plan", "io", "transform", "output"]  # in pipeline order


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def internal_imports(path: Path, top_level_only: bool) -> set[str]:
    """Modules of functional_load that ``path`` imports (at module level, or anywhere)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("functional_load"):
                if node.module:  # ``from . import x`` imports x, not the package's own names
                    found.add(target)
                found.update(f"{target}.{a.name}" for a in node.names)
    return {m for m in found if m in {module_name(p) for p in MODULES}}


def test_no_import_cycles() -> None:
    graph = {module_name(p): internal_imports(p, top_level_only=False) for p in MODULES}
    cycles, state, stack = [], {}, []

    def visit(u: str) -> None:
        state[u] = 1
        stack.append(u)
        for v in graph[u]:
            if v == u or u.startswith(v + ".") or v.startswith(u + "."):
                continue  # a package and its own modules
            if state.get(v) == 1:
                cycles.append(stack[stack.index(v):] + [v])
            elif not state.get(v):
                visit(v)
        stack.pop()
        state[u] = 2

    for module in graph:
        if not state.get(module):
            visit(module)
    assert not cycles, cycles


def test_stages_import_only_earlier_stages() -> None:
    """model -> layout -> quant -> checkpoint -> plan -> io -> transform -> output: arrows point one way."""
    for path in MODULES:
        name = module_name(path).split(".")
        if len(name) < 2 or name[1] not in STAGES:
            continue
        stage = STAGES.index(name[1])
        for target in internal_imports(path, top_level_only=False):
            parts = target.split(".")
            if len(parts) > 1 and parts[1] in STAGES:
                assert STAGES.index(parts[1]) <= stage, f"{module_name(path)} (stage {name[1]}) imports later stage {target}"


def test_modules_are_small() -> None:
    big = {str(p.relative_to(PACKAGE)): n for p in MODULES if (n := len(p.read_text().splitlines())) > 400}
    assert not big, big


MAX_FUNCTION_LINES = 60


def test_functions_are_short() -> None:
    """No function (nested ones included, docstring counted) over 60 lines."""
    long = {}
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"] = lines
    assert not long, long


def test_deferred_imports_are_third_party_only() -> None:
    """A function-level import of the package's own modules would hide a cycle; only heavy
    third-party libraries (torch, jax, transformers...) and the jitted kernels are deferred."""
    # jax, imported only when a kernel runs; the test harness (torch, transformers) only when the CLI's check-spec runs
    allowed = {"functional_load.quant.fp8_kernels", "functional_load.testing.checkspec"}
    for path in MODULES:
        deferred = internal_imports(path, top_level_only=False) - internal_imports(path, top_level_only=True)
        assert deferred <= allowed, f"{path.relative_to(PACKAGE)}: {sorted(deferred - allowed)}"


def test_no_dispatch_on_class_names() -> None:
    for path in MODULES:
        text = path.read_text().replace('if __name__ == "__main__":', "")
        assert ").__name__ ==" not in text and ").__name__ in" not in text, path


def test_public_api_fits_on_one_screen() -> None:
    init = (PACKAGE / "__init__.py").read_text().splitlines()
    assert len(init) <= 70
    assert len(functional_load.__all__) <= 25
    for name in functional_load.__all__:
        assert getattr(functional_load, name) is not None
