"""Every notebook in ``notebooks/`` runs top to bottom without an error.

Each notebook runs in a fresh IPython kernel, started with this interpreter
(``sys.executable``), with ``notebooks/`` as its working directory and a 300 s limit per cell.
A cell that raises fails the test, and the failure shows the cell and its traceback. The
committed notebooks have their outputs stripped, and that is checked too, so that the diffs stay
readable and no machine's output ends up in the repository. Nothing is written back to the
``.ipynb`` files.

Needs the ``test`` extra (``nbclient``, ``nbformat``, ``ipykernel``, ``matplotlib``).
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 300


def test_notebooks_exist() -> None:
    names = {path.name for path in NOTEBOOKS}
    assert {"tp_layouts.ipynb", "moe_and_quant_layouts.ipynb", "jax_serving.ipynb", "multinode_layouts.ipynb"} <= names, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_outputs_stripped(path: Path) -> None:
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    dirty = [i for i, cell in enumerate(notebook.cells) if cell.cell_type == "code" and (cell.outputs or cell.execution_count)]
    assert not dirty, f"{path.name}: cells {dirty} have outputs or execution counts; strip them before committing"


def _kernel_manager():
    """A manager for a kernel that runs in *this* interpreter. This is ipykernel's built-in
    ``python3`` spec, so a ``python3`` kernelspec registered elsewhere on the machine (another
    venv's, say) is not used."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    specs = KernelSpecManager(kernel_dirs=[])  # no installed specs: only the native one
    spec = specs.get_kernel_spec("python3")
    assert spec.argv[0] == sys.executable, f"kernel would run {spec.argv[0]}, not {sys.executable}"
    return KernelManager(kernel_name="python3", kernel_spec_manager=specs)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_notebook_runs(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    # The kernel inherits this environment. Keep JAX on the CPU, with the device count the
    # notebook itself asks for, and keep matplotlib's and IPython's caches out of $HOME.
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "mpl"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    monkeypatch.delenv("XLA_FLAGS", raising=False)

    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT_S,
        km=_kernel_manager(),
        resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},
    )
    start = time.perf_counter()
    failure = None
    try:
        client.execute()
    except CellExecutionError as exc:  # its message holds the failing cell's source and traceback
        failure = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))  # without IPython's colour codes
    if failure is not None:  # outside the except block, so the report shows only this message
        pytest.fail(f"{path.name} failed after {time.perf_counter() - start:.1f} s:\n{failure}", pytrace=False)
    print(f"{path.name}: {len(notebook.cells)} cells in {time.perf_counter() - start:.1f} s")
