"""Pipeline stages (``layout/pipeline.py``) against vLLM's ``get_pp_indices`` worked examples,
its partition checks, and which stage holds the modules outside the decoder layers.

The layouts themselves are judged by real vLLM in the parity harness (the ``-pp`` and ``-dp``
cases); here the index maths and the options.
"""

from __future__ import annotations

import pytest

import functional_load as fl
from functional_load.layout.parallel import Parallel
from functional_load.layout.pipeline import pp_partition, stage_layers


@pytest.mark.parametrize(
    ("layers", "pp", "want"),
    [
        (32, 3, (11, 11, 10)),  # vLLM's docstring: the remainder to partitions [-2], [-3], ...
        (30, 4, (7, 8, 8, 7)),  # the first and last stages hold the embeddings and the head
        (5, 2, (3, 2)),
        (5, 4, (1, 1, 2, 1)),
        (2, 3, (1, 1, 0)),  # fewer layers than stages: the last holds none
        (8, 1, (8,)),
    ],
)
def test_vllm_splits(layers: int, pp: int, want: tuple[int, ...]) -> None:
    assert pp_partition(layers, pp) == want
    starts = [stage_layers(layers, Parallel(pp_size=pp, pp_rank=r)) for r in range(pp)]
    assert [b - a for a, b in starts] == list(want)
    assert starts[0][0] == 0 and starts[-1][1] == layers and all(a[1] == b[0] for a, b in zip(starts, starts[1:]))


def test_a_given_partition_is_checked_as_vllm_checks_it() -> None:
    assert stage_layers(5, Parallel(pp_size=3, pp_rank=2, pp_partition=(1, 1, 3))) == (2, 5)
    with pytest.raises(fl.ShardingError, match=r"len\(partitions\)=2 does not match pp_size=3"):
        pp_partition(5, 3, (2, 3))
    with pytest.raises(fl.ShardingError, match=r"sum\(partitions\)=4 does not match num_hidden_layers=5"):
        pp_partition(5, 2, (2, 2))
    with pytest.raises(fl.ShardingError, match="pp_partition must be a tuple of layer counts"):
        Parallel(pp_size=2, pp_partition=(2, -1))


def test_the_partition_option_and_vllms_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    options = fl.LoadOptions(pp_size=3, pp_rank=1)
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    assert options.parallel(1, 0).pp_partition == ()
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,1,3")
    assert options.parallel(1, 0).pp_partition == (1, 1, 3)
    assert options.replace(pp_layer_partition="2,2,1").parallel(1, 0).pp_partition == (2, 2, 1), "the option wins"
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1;1;3")
    with pytest.raises(fl.ConfigError, match="Invalid partition string: 1;1;3"):
        options.parallel(1, 0)


def test_stages_hold_their_layers_and_llamas_outer_modules(tiny_checkpoint) -> None:
    """Llama (vLLM's llama.py): the embedding on the first stage, the final norm and the head on
    the last; tied, the last stage holds the embedding too, as its head."""
    path = tiny_checkpoint("llama", kv_heads=2)
    first, last = (fl.layout(path, pp_size=2, pp_rank=r) for r in (0, 1))
    outer = lambda layout: sorted(n for n in layout.params if ".layers." not in n)
    assert outer(first) == ["model.embed_tokens.weight"] and outer(last) == ["lm_head.weight", "model.norm.weight"]
    assert {n.split(".")[2] for n in first.params if ".layers." in n} == {"0"}
    assert {n.split(".")[2] for n in last.params if ".layers." in n} == {"1"}
    tied = tiny_checkpoint("llama", kv_heads=1, tie_word_embeddings=True)
    stages = [fl.layout(tied, pp_size=3, pp_rank=r) for r in range(3)]
    assert [outer(s) for s in stages] == [["model.embed_tokens.weight"], [], ["model.embed_tokens.weight", "model.norm.weight"]]
    assert [dict(s.aliases) for s in stages] == [{}, {}, {"lm_head.weight": "model.embed_tokens.weight"}]


def test_models_vllm_cannot_pipeline_are_refused_in_its_words(tiny_checkpoint) -> None:
    path = tiny_checkpoint("mamba2")
    with pytest.raises(fl.ShardingError, match="Pipeline parallelism is not supported for this model"):
        fl.layout(path, pp_size=2, pp_rank=0)
    assert fl.layout(path).params, "pp_size=1 loads"


def test_a_pipeline_table_names_modules_of_its_spec() -> None:
    from functional_load.model.spec import find_spec, parse_spec

    data = {"name": "x", "layers": "num_hidden_layers", "modules": {"model.norm": {"kind": "replicated", "params": {"weight": ["8"]}}},
            "pipeline": {"first": ["model.embed_token"], "last": ["model.norm"]}}
    with pytest.raises(fl.ConfigError, match=r"\[pipeline\] names modules the spec does not have: \['model.embed_token'\]"):
        parse_spec(data, "x.toml")
    assert find_spec("gpt_neox").pipeline.first == ("model.embed_in",)


def test_a_stage_is_neither_saved_nor_a_target_tree_option(tiny_checkpoint, tmp_path) -> None:
    """A pre-sharded save holds a whole layout (every stage: tests/test_sharded_layouts.py), and a
    target tree has no pipeline axis yet: both refuse a stage (or replica) rather than save or
    plan a part of the model as if it were all."""
    path = tiny_checkpoint("llama", kv_heads=2)
    with pytest.raises(fl.ConfigError, match=r"save_sharded saves every rank of the layout .* pp_rank/dp_rank pick one rank"):
        fl.save_sharded(path, tmp_path / "out", 1, pp_size=2, pp_rank=0)
    assert not (tmp_path / "out").exists()
    with pytest.raises(fl.ConfigError, match=r"\['pp_size'\] do not apply to load_jax\(target=...\)"):
        fl.load_jax(path, target={}, mapping={}, pp_size=2)
    with pytest.raises(fl.ConfigError, match="did you mean pp_size"):
        fl.load(path, pipeline_parallel_size=2)
