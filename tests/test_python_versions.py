"""``requires-python`` and the code agree: every module parses as Python 3.10, the oldest version
``pyproject.toml`` claims, and imports no standard-library module 3.10 lacks (``tomllib``) unless
behind a version check. Run by that interpreter itself (pyenv's 3.10 on this project's machines;
a missing one fails, it is not skipped)."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECK = r"""
import ast, pathlib, sys
newer = set(sys.argv[2].split(",")) - set(sys.stdlib_module_names)
problems = []
for path in sorted(pathlib.Path(sys.argv[1]).rglob("*.py")):
    tree = ast.parse(path.read_text(), str(path))  # a 3.10 parser: newer syntax is a SyntaxError
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "version_info" in ast.unparse(node.test):
            node.body = node.orelse = []  # a guarded import is fine
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
        problems += [f"{path}:{node.lineno}: {n}" for n in names if n.split(".")[0] in newer]
print("\n".join(problems))
"""


def _python310() -> str:
    root = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    found = sorted(glob.glob(f"{root}/versions/3.10*/bin/python3.10"))
    assert found, f"no Python 3.10 under {root}/versions (pyenv install 3.10): requires-python claims it"
    return found[-1]


def test_requires_python_is_the_oldest_version_the_code_runs_on() -> None:
    claimed = next(line for line in (ROOT / "pyproject.toml").read_text().splitlines() if line.startswith("requires-python"))
    assert '">=3.10"' in claimed, claimed
    done = subprocess.run(
        [_python310(), "-c", CHECK, str(ROOT / "functional_load"), ",".join(sorted(sys.stdlib_module_names))],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "", f"imports Python 3.10 lacks, unguarded:\n{done.stdout}"
