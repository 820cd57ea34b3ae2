"""The JAX-stack environments' inputs, without building them: pinned lists, markers, key paths.

Building the environments (about 10 minutes, 9 GB) and their smoke runs are
``python -m harness.jaxstacks.env`` and ``... .smoke <stack>``; see
``harness/jaxstacks/NOTES.md``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import pytest

from harness.jaxstacks import common, env

PIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*==[0-9][A-Za-z0-9.+!-]*$")


@pytest.mark.parametrize("stack", sorted(env.STACKS))
def test_requirements_are_exact_pins(stack: str) -> None:
    lines = [line for line in (env.HERE / env.STACKS[stack].requirements).read_text().splitlines() if line and not line.startswith("#")]
    assert lines and all(PIN.match(line) for line in lines), [line for line in lines if not PIN.match(line)]
    names = {line.split("==")[0].lower().replace("_", "-") for line in lines}
    assert not names & set(env.STACKS[stack].remove), names & set(env.STACKS[stack].remove)
    assert {n.replace("_", "-") for n in env.RUNTIME} <= names  # functional_load's runtime dependencies are pinned too


def test_marker_must_match_the_requirements(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUNCTIONAL_LOAD_JAXSTACKS_DIR", str(tmp_path))
    venv = env.venv_dir("maxtext")
    assert venv == tmp_path / ".venv-maxtext" and not env.ready("maxtext")
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / env.MARKER).write_text(json.dumps({**env.expected_marker("maxtext"), "seconds": 1.0}))
    assert env.ready("maxtext")
    (venv / env.MARKER).write_text(json.dumps({**env.expected_marker("maxtext"), "requirements_sha256": "0"}))
    assert not env.ready("maxtext")


def test_key_paths_and_meshes() -> None:
    tree = {"model": {"layers": [{"w": 1}, {"w": 2}], "norm": {0: 3}}}
    assert list(common.flatten(tree)) == ["model.layers.0.w", "model.layers.1.w", "model.norm.0"]
    assert common.key_str(jax.tree_util.GetAttrKey("kernel")) == "kernel"
    assert common.parse_mesh("fsdp=4,tensor=2") == {"fsdp": 4, "tensor": 2}
    with pytest.raises(ValueError):
        common.parse_mesh("fsdp4")
