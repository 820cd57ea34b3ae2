"""Real JAX stacks' own models, filled by ``load_jax(model, target=..., mapping=...)``: replayed.

tpu-inference 0.32 (its JAX ``llama3`` and ``qwen3`` models, meshes data 2 x model 4 and data 4 x
model 2) and MaxText 0.2.5 (its llama3.1 and qwen3 decoders, scanned and unscanned, fsdp 4 x
tensor 2) answered once, in their own environments, what their own code builds and loads
(``tests/oracle/jaxstacks/<stack>.json``, ``python -m harness.jaxstacks.record
--refresh``): the abstract target tree, every leaf of their own loader (digest and placement), and
their own forward's logits. Here, with no stack installed, each recorded target is rebuilt, the
shipped map fills it, and every leaf must equal the own loader's bit for bit (dtype, shape,
placement, bytes); the recorded logits must be transformers' float32 logits (computed now) within
1e-5; the bytes read at most 1.1 x what the process's shards hold. An answer whose inputs changed
(the checkpoint, the case, the stack's pins, the oracle's code; for a case answered over
functional_load's arrays, those arrays) fails the run as stale, naming the refresh command.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from functional_load.testing import records
from harness.jaxstacks import replay, tiny
from harness.jaxstacks.cases import all_cases


@dataclass(frozen=True)
class Replayed:
    workdir: Path
    answers: dict[str, Any]
    seen: dict[str, dict[str, Any]]

    def verdict(self, name: str, answer: Any = None) -> dict[str, Any]:
        _, case = all_cases()[name]
        reference = np.load(tiny.reference_path(self.workdir / case.checkpoint))
        return replay.compare(case, answer or self.answers[name], self.seen[name], reference)


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> Replayed:
    work = tmp_path_factory.mktemp("jaxstacks")
    answers = replay.expected(work)  # records.StaleRecordError when an answer's key changed
    rows = replay.run_observe(work)
    stale = replay.stale_inputs(answers, rows)
    if stale:
        raise records.stale_error("JAX-stack", stale, replay.COMMAND)
    return Replayed(work, answers, {row["case"]: row for row in rows})


def test_every_case_ran(replayed: Replayed) -> None:
    assert list(replayed.seen) == list(all_cases())
    assert {name.split()[0] for name in replayed.seen} == {"tpu-inference", "maxtext"}


def test_the_rebuilt_targets_are_the_stacks(replayed: Replayed) -> None:
    problems = {name: replayed.verdict(name)["target"] for name in replayed.seen}
    assert not any(problems.values()), problems


def test_arrays_equal_the_stacks_own_loader(replayed: Replayed) -> None:
    own = [name for name, (_, case) in all_cases().items() if case.own]
    assert own and all(replayed.answers[name]["own"] for name in own)
    problems = {name: replayed.verdict(name)["own"] for name in own}
    assert not any(problems.values()), json.dumps(problems, indent=1)[:6000]


def test_the_stacks_logits_match_transformers(replayed: Replayed) -> None:
    checked = [name for name, (_, case) in all_cases().items() if case.reference]
    assert checked
    verdicts = {name: replayed.verdict(name) for name in replayed.seen}
    assert not any(v["logits"] for v in verdicts.values()), {n: v["logits"] for n, v in verdicts.items() if v["logits"]}
    assert all(verdicts[name]["max_logit_diff"] <= 1e-5 for name in checked)


def test_bytes_read_are_bounded_by_the_shards(replayed: Replayed) -> None:
    for name, row in replayed.seen.items():
        assert 0 < row["bytes_read"] <= 1.1 * row["shard_bytes"], (name, row["bytes_read"], row["shard_bytes"])
        assert not replayed.verdict(name)["bytes"]


def test_an_altered_recorded_digest_fails_the_comparison(replayed: Replayed, tmp_path: Path) -> None:
    """Negative control: a copy of the record with one leaf's digest changed."""
    name = next(n for n, (_, case) in all_cases().items() if case.own)
    stack = name.split()[0]
    record = records.read(replay.STORE / f"{stack}.json")
    leaf = sorted(record["cases"][name]["answer"]["own"])[0]
    digest = record["cases"][name]["answer"]["own"][leaf]["digest"]
    digest[2] = ("0" if digest[2][0] != "0" else "1") + digest[2][1:]
    records.write(tmp_path / f"{stack}.json", record)
    altered = replay.load_store(tmp_path)[name]["answer"]
    assert replayed.verdict(name, altered)["own"] == [f"{leaf}: values differ from the own loader's"]
    assert not replayed.verdict(name)["own"]


def test_an_altered_recorded_logit_fails_the_comparison(replayed: Replayed) -> None:
    name = next(n for n, (_, case) in all_cases().items() if case.reference)
    altered = copy.deepcopy(replayed.answers[name])
    altered["logits"][3][7] += 1e-4
    assert replayed.verdict(name, altered)["logits"]


def test_a_changed_input_makes_the_answer_stale(replayed: Replayed, tmp_path: Path) -> None:
    for stack in ("tpu-inference", "maxtext"):
        record = records.read(replay.STORE / f"{stack}.json")
        if stack == "maxtext":
            first = next(iter(record["cases"]))
            record["cases"][first]["key"] = "0" * 64
        records.write(tmp_path / f"{stack}.json", record)
    with pytest.raises(records.StaleRecordError, match="record --refresh"):
        replay.expected(replayed.workdir, store=tmp_path)
    over_ours = {n: a for n, a in replayed.answers.items() if "inputs" in a}
    assert over_ours and not replay.stale_inputs(over_ours, list(replayed.seen.values()))
    changed = {n: {**a, "inputs": {**a["inputs"], "x": ["float32", [1], "0"]}} for n, a in over_ours.items()}
    assert replay.stale_inputs(changed, list(replayed.seen.values())) == list(changed)
