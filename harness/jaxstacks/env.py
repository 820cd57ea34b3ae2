"""The virtual environments the JAX-stack workers run in, one per stack, built from pinned lists.

``.venv-tpu-inference`` and ``.venv-maxtext`` at the repository root (or
``$FUNCTIONAL_LOAD_JAXSTACKS_DIR/<name>``), Python 3.12 (jax 0.11+ needs it). Each is made with
``python3.12 -m venv``, then ``pip install --no-deps -r requirements-<stack>.txt`` (every package
pinned, no resolver: nothing unlisted is pulled), then this checkout, editable and without
dependencies (``pip install --no-deps -e``: the requirement lists already hold functional_load's
runtime dependencies, and torch only where the stack itself needs it). A marker file records the
Python version and the hash of the requirement list; an environment without a matching marker is
rebuilt from scratch. Each step is logged to ``<venv>-setup.log``; a failed step raises
:class:`SetupError` with the log's tail. Nothing is ever skipped.

    python -m harness.jaxstacks.env                  # both
    python -m harness.jaxstacks.env tpu-inference    # one
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MARKER = "functional_load-jaxstack.json"
PIP = "pip==26.3"
RUNTIME = ("safetensors", "einops", "ml_dtypes", "numpy", "tqdm", "huggingface_hub")  # functional_load's, less torch


@dataclass(frozen=True)
class Stack:
    name: str
    venv: str
    requirements: str
    check: str  # a Python statement that must run in the finished environment
    remove: tuple[str, ...] = ()  # distributions that must not be installed


STACKS = {
    "tpu-inference": Stack(
        "tpu-inference", ".venv-tpu-inference", "requirements-tpu-inference.txt",
        "import tpu_inference.models.jax.llama3, tpu_inference.models.jax.qwen3, vllm, torch, jax; "
        "print('tpu-inference', vllm.__version__, 'torch', torch.__version__, 'jax', jax.__version__)",
        remove=("libtpu",),
    ),
    "maxtext": Stack(
        "maxtext", ".venv-maxtext", "requirements-maxtext.txt",
        "import maxtext.models.models, maxtext.checkpoint_conversion.to_maxtext, orbax.checkpoint.experimental.v1, jax; "
        "import importlib.metadata as m; "
        "print('maxtext', m.version('maxtext'), 'orbax', m.version('orbax-checkpoint'), 'jax', jax.__version__)",
        remove=("libtpu", "torch"),
    ),
}


class SetupError(RuntimeError):
    """A JAX-stack environment could not be built."""


def venv_dir(stack: str) -> Path:
    base = os.environ.get("FUNCTIONAL_LOAD_JAXSTACKS_DIR")
    return Path(base) / STACKS[stack].venv if base else ROOT / STACKS[stack].venv


def python(stack: str) -> Path:
    return venv_dir(stack) / "bin" / "python"


def log_path(stack: str) -> Path:
    venv = venv_dir(stack)
    return venv.parent / f"{venv.name}-setup.log"


def base_python() -> str:
    """A working Python 3.12: ``$FUNCTIONAL_LOAD_PYTHON312``, else pyenv's newest 3.12, else
    ``python3.12`` on PATH (a pyenv shim on PATH may not run: each candidate is tried)."""
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates = [os.environ.get("FUNCTIONAL_LOAD_PYTHON312", "")]
    candidates += sorted(glob.glob(os.path.join(root, "versions", "3.12*", "bin", "python3.12")), reverse=True)
    candidates.append(shutil.which("python3.12") or "")
    for candidate in filter(None, candidates):
        done = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"], capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.strip() == "True":
            return candidate
    raise SetupError("no working Python 3.12 found (set FUNCTIONAL_LOAD_PYTHON312): jax 0.11+ and MaxText need it")


def expected_marker(stack: str) -> dict[str, str]:
    text = (HERE / STACKS[stack].requirements).read_bytes()
    return {"stack": stack, "requirements_sha256": hashlib.sha256(text).hexdigest(), "python": "3.12"}


def ready(stack: str) -> bool:
    marker = venv_dir(stack) / MARKER
    if not (python(stack).exists() and marker.exists()):
        return False
    try:
        recorded = json.loads(marker.read_text())
    except ValueError:
        return False
    return all(recorded.get(k) == v for k, v in expected_marker(stack).items())


def _run(args: list[str], log: Path) -> None:
    with open(log, "a") as out:
        out.write(f"$ {' '.join(args)}\n")
        out.flush()
        done = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    if done.returncode:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        raise SetupError(f"`{' '.join(args)}` failed with exit code {done.returncode}; last lines of {log}:\n{tail}")


def checkout_installed(stack: str) -> bool:
    """Whether this checkout of functional_load is what the environment imports."""
    probe = "import functional_load; print(functional_load.__file__)"
    done = subprocess.run([str(python(stack)), "-c", probe], capture_output=True, text=True, cwd=venv_dir(stack))
    return done.returncode == 0 and Path(done.stdout.strip()).resolve().is_relative_to(ROOT)


def size_bytes(path: Path) -> int:
    seen, total = set(), 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def ensure(stack: str, verbose: bool = True) -> Path:
    """The stack environment's python, building the environment first if needed (tpu-inference:
    about 4 minutes and 7 GB; maxtext: about 2 minutes and 1.3 GB). Raises SetupError when a step fails."""
    if stack not in STACKS:
        raise SetupError(f"unknown stack {stack!r}; known: {sorted(STACKS)}")
    spec, venv, log = STACKS[stack], venv_dir(stack), log_path(stack)
    if ready(stack):
        if not checkout_installed(stack):
            _run([str(python(stack)), "-m", "pip", "install", "--quiet", "--no-deps", "-e", str(ROOT)], log)
        return python(stack)
    log.write_text("")
    if verbose:
        print(f"building the {stack} environment in {venv} (log: {log})", file=sys.stderr, flush=True)
    start = time.perf_counter()
    _run([base_python(), "-m", "venv", "--clear", str(venv)], log)
    pip = [str(python(stack)), "-m", "pip"]
    _run([*pip, "install", "--quiet", "--upgrade", PIP], log)
    _run([*pip, "install", "--quiet", "--no-deps", "-r", str(HERE / spec.requirements)], log)
    present = subprocess.run([*pip, "show", *spec.remove], capture_output=True, text=True).stdout
    if "Name:" in present:
        raise SetupError(f"{stack}: {present.split()[1]} is installed, and must not be (see {spec.requirements})")
    _run([str(python(stack)), "-c", spec.check], log)
    _run([*pip, "install", "--quiet", "--no-deps", "-e", str(ROOT)], log)
    _run([str(python(stack)), "-c", f"import functional_load, {', '.join(RUNTIME)}; print(functional_load.__file__)"], log)
    seconds, size = round(time.perf_counter() - start, 1), size_bytes(venv)
    (venv / MARKER).write_text(json.dumps({**expected_marker(stack), "seconds": seconds, "bytes": size}, indent=1) + "\n")
    summary = f"built {stack}: {seconds} s, {size / 2**30:.2f} GiB"
    with open(log, "a") as out:
        out.write(summary + "\n")
    if verbose:
        print(summary, file=sys.stderr, flush=True)
    return python(stack)


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or list(STACKS)
    for name in names:
        print(ensure(name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
