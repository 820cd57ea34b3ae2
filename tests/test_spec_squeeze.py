"""``squeeze = true`` on a replicated parameter: the checkpoint may store it with extra leading
dimensions of size 1, which vLLM's loader squeezes away (ERNIE-4.5's
``mlp.moe_statics.e_score_correction_bias`` ``[1, E]`` into ``mlp.gate.e_score_correction_bias``
``[E]``, ernie45_moe.py:496-500)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers  # noqa: F401  (required by the test extra: a missing one fails, never skips)

from functional_load.errors import PlanError
from functional_load.layout.parallel import Parallel
from functional_load.layout.sharding import Replicated


def test_squeezed_part_reads_the_stored_shape() -> None:
    part = Replicated(squeeze=True).part((8,), None, None, Parallel(2, 1), (1, 8))
    assert part is not None and part.expected == (1, 8)
    assert part.pairs[0][:2] == (((0, 1), (0, 8)), ((0, 8),))
    assert Replicated(squeeze=True).part((8,), None, None, Parallel(2, 1), (8,)).expected == (8,)  # as stored in [E]
    assert Replicated(squeeze=True).to_json() == {"kind": "replicated", "squeeze": True}
    assert Replicated().to_json() == {"kind": "replicated"}


@pytest.mark.parametrize("found", [(2, 8), (1, 4), (8, 1)])
def test_only_leading_ones_are_squeezed(found: tuple[int, ...]) -> None:
    assert Replicated(squeeze=True).part((8,), None, None, Parallel(1, 0), found).expected == (8,)  # plan reports the mismatch
    assert Replicated().part((8,), None, None, Parallel(1, 0), (1, 8)).expected == (8,)


@pytest.fixture(scope="module")
def ernie(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from functional_load.testing.checkpoints import write_checkpoint

    return write_checkpoint("ernie4_5_moe", tmp_path_factory.mktemp("ernie") / "ckpt", kv_heads=2)


@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 1)])
def test_ernie_router_bias_loads_squeezed(ernie: Path, tp: int, rank: int) -> None:
    import functional_load as fl
    from functional_load.testing.checkpoints import read_checkpoint_tensors

    stored = read_checkpoint_tensors(ernie)["model.layers.1.mlp.moe_statics.e_score_correction_bias"]
    assert tuple(stored.shape) == (1, 8)
    state = fl.load(ernie, tp_size=tp, rank=rank)
    got = state["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert got.dtype == torch.float32 and tuple(got.shape) == (8,)
    assert torch.equal(got, stored[0].float())


def test_a_wrong_shape_is_still_refused(ernie: Path, tmp_path: Path) -> None:
    import shutil

    import functional_load as fl
    from functional_load.testing.checkpoints import read_checkpoint_tensors, write_shards

    bad = tmp_path / "bad"
    shutil.copytree(ernie, bad)
    tensors = read_checkpoint_tensors(bad)
    name = "model.layers.1.mlp.moe_statics.e_score_correction_bias"
    tensors[name] = tensors[name].repeat(2, 1)  # [2, 8]: not a squeezable [1, ..., 8]
    write_shards(bad, tensors)
    with pytest.raises(PlanError, match="e_score_correction_bias"):
        fl.plan(bad, tp_size=1, rank=0)
