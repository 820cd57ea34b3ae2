"""Real JAX stacks load their own models through ``load_jax(model, target=..., mapping=...)``.

tpu-inference 0.32 (its JAX ``llama3`` and ``qwen3`` models, meshes data 2 x model 4 and data 4 x
model 2) and MaxText 0.2.5 (its llama3.1 and qwen3 decoders, scanned and unscanned, fsdp 4 x
tensor 2), each in its own environment (built on first use, about 10 minutes for both; a failed
install fails this test, never skips it). In each, the stack builds its abstract parameter tree;
the shipped target map fills it; every leaf equals the stack's own loader's bit for bit; the
stack's own forward over our arrays gives transformers' float32 logits within 1e-5; and the bytes
read are at most 1.1 x what the process's shards hold (``functional_load.testing.jaxstacks.check``).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from functional_load.testing.jaxstacks import check, env

STACKS = sorted(check.CASES)


@pytest.fixture(scope="module", params=STACKS)
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    stack = request.param
    python = env.ensure(stack)  # builds the stack's environment when it is missing; raises if it cannot
    work = tmp_path_factory.mktemp(stack)
    done = subprocess.run(
        [str(python), "-m", "functional_load.testing.jaxstacks.check", stack, "--workdir", str(work)],
        capture_output=True, text=True, cwd=env.ROOT, timeout=1200,
    )
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert rows, f"the check printed nothing (exit {done.returncode}):\n{done.stderr[-4000:]}"
    return stack, rows


def test_every_case_ran(results: tuple[str, list[dict]]) -> None:
    stack, rows = results
    assert [r["case"] for r in rows] == [f"{stack} {c.name}" for c in check.CASES[stack]]


def test_arrays_equal_the_stacks_own_loader_and_logits_match(results: tuple[str, list[dict]]) -> None:
    _, rows = results
    failed = [r for r in rows if not r["ok"]]
    assert not failed, json.dumps(failed, indent=1)[:6000]
    compared = [r for r in rows if "own_differences" in r]
    assert compared and all(r["own_differences"] == [] for r in compared)


def test_bytes_read_are_bounded_by_the_shards(results: tuple[str, list[dict]]) -> None:
    _, rows = results
    for r in rows:
        assert 0 < r["bytes_read"] <= 1.1 * r["shard_bytes"], r
