"""``functional-load check-spec``: a spec proven against transformers' forward and real vLLM.

* Shipped specs pass: the tensor-parallel forward over the loaded ranks gives transformers' logits
  (Llama, Qwen3-MoE with and without expert parallelism), and real vLLM's rank states are
  identical (its recorded answers, tests/oracle/vllm/check-*.json; the CLI asks live vLLM).
* A wrong spec fails both checks, though ``verify`` passes it: an out-of-tree spec (on the search
  path for the check) that swaps gate and up in ``gate_up_proj`` loads without an error and
  verifies bit for bit against its own plan.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from functional_load.cli import main as cli_main
from functional_load.testing.checkspec import check_spec, report
from functional_load.testing.parity import env
from functional_load.testing.parity.record import Recorded

SWAPPED = """
name = "llama_swapped"
extends = "llama"
architectures = ["LlamaForCausalLM"]

[[stages]]
[stages.stacked]
".gate_proj" = [".gate_up_proj", 1]
".up_proj" = [".gate_up_proj", 0]
"""


@pytest.fixture
def swapped(tmp_path: Path) -> Path:
    path = tmp_path / "specs" / "llama_swapped.toml"
    path.parent.mkdir()
    path.write_text(SWAPPED)
    return path


@pytest.mark.parametrize("target", ["llama", "Qwen3MoeForCausalLM"])
def test_shipped_specs_pass_the_forward(target):
    checks = check_spec(target, tps=(1, 2, 8), vllm=False)
    forwards = [c for c in checks if c.what.startswith("forward")]
    assert len(forwards) == (6 if "Moe" in target else 3), report(checks)
    assert all(c.status == "ok" for c in forwards), report(checks)


def test_a_wrong_spec_fails_the_forward_though_verify_passes_it(swapped, tmp_path, monkeypatch):
    checks = check_spec(str(swapped), tps=(1, 2), vllm=False)
    assert [c.status for c in checks if c.what.startswith("forward")] == ["FAIL", "FAIL"], report(checks)
    from functional_load.testing.checkpoints import write_checkpoint

    model = write_checkpoint("llama", tmp_path / "llama", kv_heads=2)
    assert cli_main(["verify", str(model), "--tp", "2", "--spec", str(swapped)]) == 0  # its own plan: read right


def test_real_vllm_judges_the_spec(swapped):
    """vLLM's side replayed from its recorded answers (the CLI's check-spec asks live vLLM)."""
    checks = check_spec("gpt2", tps=(1, 2), oracle=Recorded())
    out = report(checks)
    assert "ok      vLLM:" in out and "identical" in out, out
    assert "skipped forward" in out  # no reference forward for gpt2: said, not hidden
    checks = check_spec(str(swapped), tps=(2,), oracle=Recorded())
    out = report(checks)
    assert "FAIL    vLLM:" in out and "DIFFERENT" in out and "FAIL    forward tp 2" in out, out


def test_the_cli_says_what_it_could_not_check_and_fails_on_a_failed_check(swapped, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("FUNCTIONAL_LOAD_VLLM_VENV", str(tmp_path / "no-such-venv"))
    with pytest.raises(SystemExit) as failed:
        cli_main(["check-spec", str(swapped), "--tp", "2"])
    assert failed.value.code == 1
    out = capsys.readouterr().out
    assert "skipped vLLM: no parity environment at" in out and "FAIL    forward tp 2" in out


def test_the_cli_names_the_extra_check_spec_needs(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    assert cli_main(["check-spec", "llama", "--tp", "1"]) == 2
    assert "pip install 'functional_load[check]'" in capsys.readouterr().err


def test_the_vllm_environment_outside_a_checkout(tmp_path, monkeypatch):
    """An installed functional_load (no pyproject.toml beside the package) keeps the vLLM
    environment in the user's cache and needs nothing of functional_load in it; only the load
    format's harness, which installs the checkout, asks for one."""
    monkeypatch.delenv("FUNCTIONAL_LOAD_VLLM_VENV", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert env.checkout() == env.ROOT and env.venv_dir() == env.ROOT / ".venv-vllm"  # this repository
    monkeypatch.setattr(env, "ROOT", tmp_path / "site-packages")
    assert env.checkout() is None
    assert env.venv_dir() == tmp_path / "cache" / "functional_load" / "venv-vllm"
    monkeypatch.setattr(env, "ready", lambda: True)
    assert env.ensure() == env.venv_dir() / "bin" / "python"
    with pytest.raises(env.SetupError, match="source checkout"):
        env.ensure(plugin=True)
