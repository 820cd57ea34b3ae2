"""Name mapping tables (vLLM ``WeightsMapper`` semantics) and shard-id validation.

Sections refer to /work/shared/reference/vllm-loading-semantics.md: 1.5 (rule kinds), 2.8
(mapping-name examples), 1.7.4 / 1.7.5 (shard-id validation) and section 3,
tests/models/test_utils.py item 6 (``get_rename_mapper``).
"""

from __future__ import annotations

import re

import pytest

from functional_load.errors import ShardingError
from functional_load.layout.segments import Segment
from functional_load.layout.sharding import Split
from functional_load.model.mapping import ROTARY_CACHES, Mapped, MappingTable, Rule, map_name

# Llama's stacked_params_mapping as a table.
LLAMA_STACKED = MappingTable.from_dicts(
    stacked={
        ".q_proj": (".qkv_proj", "q"),
        ".k_proj": (".qkv_proj", "k"),
        ".v_proj": (".qkv_proj", "v"),
        ".gate_proj": (".gate_up_proj", 0),
        ".up_proj": (".gate_up_proj", 1),
    }
)

# Fp8Config's cache-scale suffix rules (1.11), written as test data.
CACHE_SCALES = MappingTable.from_dicts(
    suffix={
        ".k_proj.output_scale": ".attn.k_scale",
        ".v_proj.output_scale": ".attn.v_scale",
        ".q_proj.output_scale": ".attn.q_scale",
        ".self_attn.prob_output_scale": ".self_attn.attn.prob_scale",
    }
)

LLAMA = LLAMA_STACKED | ROTARY_CACHES


# --- Rule ------------------------------------------------------------------------------------------

RULE_APPLY = [
    # kind, pattern, replacement, name, matches, result
    ("rename", "a.b", "c.d", "a.b", True, "c.d"),
    ("rename", "a.b", "c.d", "a.b.c", False, None),
    ("regex", r"\.(\d+)\.", r".L\1.", "a.0.b.1.c", True, "a.L0.b.L1.c"),  # every occurrence
    ("regex", r"^x\.", "y.", "a.x.b", False, None),
    ("substr", "x", "y", "x.x.x", True, "y.x.x"),  # first occurrence
    ("prefix", "x.", "Q.", "x.y.x.z", True, "Q.y.x.z"),  # 2.8: first occurrence
    ("prefix", "x.", "Q.", "a.x.y", False, None),
    ("suffix", ".weight", ".w", "a.b.weight.weight", True, "a.b.weight.w"),  # 2.8: rsplit, last occurrence
    ("suffix", ".weight", ".w", "a.weight.b", False, None),
]


@pytest.mark.parametrize("kind, pattern, replacement, name, matches, result", RULE_APPLY)
def test_rule_match_and_apply(kind, pattern, replacement, name, matches, result):
    rule = Rule(kind, pattern, replacement)
    assert rule.matches(name) is matches
    if matches:
        assert rule.apply(name) == result
        assert MappingTable((rule,)).map(name) == Mapped(result)
    else:
        assert MappingTable((rule,)).map(name) == Mapped(name)


def test_stacked_rule_replaces_the_first_occurrence_and_tags_the_shard():
    table = MappingTable((Rule("stacked", "proj", "PROJ", ("q",)),))
    assert table.map("a.proj.proj") == Mapped("a.PROJ.proj", ("q",))


INVALID_RULES = [
    pytest.param(lambda: Rule("stacked", ".q_proj", None, ("q",)), "cannot drop", id="stacked-drop"),
    pytest.param(lambda: MappingTable.from_dicts(stacked={".q_proj": (None, "q")}), "cannot drop", id="stacked-drop-dict"),
    pytest.param(lambda: Rule("stacked", ".q_proj", ".qkv_proj"), "at least one shard id", id="stacked-no-id"),
    pytest.param(lambda: Rule("substr", "a", "b", ("q",)), "only stacked and expert rules", id="substr-with-id"),
    pytest.param(lambda: Rule("infix", "a", "b"), "unknown rule kind", id="unknown-kind"),
    pytest.param(lambda: MappingTable.from_dicts(infix={"a": "b"}), "unknown rule kinds", id="unknown-kind-dict"),
]


@pytest.mark.parametrize("make, message", INVALID_RULES)
def test_invalid_rules_raise_value_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_invalid_regex_is_rejected_when_the_rule_is_built():
    with pytest.raises(re.error):
        Rule("regex", "(unclosed", "x")


# --- order of kinds and rules ----------------------------------------------------------------------


def test_kinds_apply_in_fixed_order_whatever_the_table_order():
    # Each rule only matches the output of the kind before it: a -> b -> c -> d -> e -> f -> g.
    rules = (
        Rule("suffix", "f", "g"),
        Rule("prefix", "e", "f"),
        Rule("stacked", "d", "e", (0,)),
        Rule("substr", "c", "d"),
        Rule("regex", "^b$", "c"),
        Rule("rename", "a", "b"),
    )
    assert MappingTable(rules).map("a") == Mapped("g", (0,))


def test_every_matching_rule_of_a_kind_applies_in_table_order():
    chained = MappingTable.from_dicts(substr={"a": "b", "b": "c"})
    assert chained.map("a.x") == Mapped("c.x")
    # Reversed, the "b" rule is tried before "a" has become "b".
    reversed_order = MappingTable.from_dicts(substr={"b": "c", "a": "b"})
    assert reversed_order.map("a.x") == Mapped("b.x")


def test_the_last_matching_stacked_rule_sets_the_shard_id():
    table = MappingTable.from_dicts(stacked={"w1": ("w13", 0), "w13": ("w13", 1)})
    assert table.map("experts.w1.weight") == Mapped("experts.w13.weight", (1,))


def test_regex_runs_before_substr():
    # regex runs before substr: the regex is matched against the original name.
    table = MappingTable.from_dicts(substr={"old": "new"}, regex={r"^new\.": "seen."})
    assert table.map("old.x") == Mapped("new.x")


# --- drops -----------------------------------------------------------------------------------------

DROPS = [
    # kind, pattern, name
    ("regex", r"\.g_idx$", "model.layers.0.mlp.down_proj.g_idx"),
    ("substr", "rotary_emb.inv_freq", "model.layers.0.self_attn.rotary_emb.inv_freq"),
    ("prefix", "vision_tower.", "vision_tower.blocks.0.weight"),
    ("suffix", ".num_batches_tracked", "bn.num_batches_tracked"),
]


@pytest.mark.parametrize("kind, pattern, name", DROPS)
def test_none_replacement_drops_the_tensor(kind, pattern, name):
    table = MappingTable((Rule(kind, pattern, None),))
    assert table.map(name) is None
    assert map_name(table, name) is None
    assert table.map("model.norm.weight") == Mapped("model.norm.weight")


def test_a_drop_wins_over_renames_of_later_kinds():
    table = MappingTable.from_dicts(substr={"drop_me": None}, suffix={".weight": ".w"})
    assert table.map("a.drop_me.weight") is None
    assert table.map("a.keep.weight") == Mapped("a.keep.w")


def test_a_drop_applies_to_the_name_earlier_kinds_produced():
    table = MappingTable.from_dicts(regex={r"^legacy\.": "rotary_emb."}, substr={"rotary_emb.": None})
    assert table.map("legacy.inv_freq") is None


# --- stacked shard ids -----------------------------------------------------------------------------

STACKED = [
    # table, name, mapped name, shard ids
    (LLAMA_STACKED, "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.qkv_proj.weight", ("q",)),
    (LLAMA_STACKED, "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.qkv_proj.weight", ("k",)),
    (LLAMA_STACKED, "model.layers.0.self_attn.v_proj.bias", "model.layers.0.self_attn.qkv_proj.bias", ("v",)),
    (LLAMA_STACKED, "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.gate_up_proj.weight", (0,)),
    (LLAMA_STACKED, "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_up_proj.weight", (1,)),
    (
        MappingTable.from_dicts(stacked={".w13": (".w13", [0, 1])}),
        "experts.w13.weight",
        "experts.w13.weight",
        (0, 1),
    ),
    (
        MappingTable.from_dicts(stacked={".kv_proj": (".qkv_proj", ["k", "v"])}),
        "attn.kv_proj.weight",
        "attn.qkv_proj.weight",
        ("k", "v"),
    ),
]


@pytest.mark.parametrize("table, name, new_name, shard_ids", STACKED)
def test_stacked_rules_tag_shard_ids(table, name, new_name, shard_ids):
    assert table.map(name) == Mapped(new_name, shard_ids)


def test_from_dicts_stores_a_single_shard_id_as_a_one_tuple():
    (rule,) = MappingTable.from_dicts(stacked={".q_proj": (".qkv_proj", "q")}).rules
    assert rule == Rule("stacked", ".q_proj", ".qkv_proj", ("q",))
    (rule,) = MappingTable.from_dicts(stacked={".w13": (".w13", [0, 1])}).rules
    assert rule.shard_ids == (0, 1)


# --- | merge ---------------------------------------------------------------------------------------


def test_merge_overrides_same_kind_and_pattern_in_place_and_appends_new_rules():
    a = MappingTable.from_dicts(substr={"a": "A", "b": "B"}, suffix={".x": ".y"})
    b = MappingTable.from_dicts(substr={"a": "AA", "c": "C"}, prefix={"a": "P"})
    assert (a | b).rules == (
        Rule("substr", "a", "AA"),  # b's rule, in a's position
        Rule("substr", "b", "B"),
        Rule("suffix", ".x", ".y"),
        Rule("substr", "c", "C"),
        Rule("prefix", "a", "P"),  # same pattern, other kind: a new rule, not an override
    )
    # The operands are unchanged.
    assert a.rules[0] == Rule("substr", "a", "A")
    assert len(b.rules) == 3


def test_merge_can_turn_a_rename_into_a_drop_and_back():
    keep = MappingTable.from_dicts(substr={"lm_head.": "head."})
    drop = MappingTable.from_dicts(substr={"lm_head.": None})
    assert (keep | drop).map("lm_head.weight") is None
    assert (drop | keep).map("lm_head.weight") == Mapped("head.weight")


def test_merge_with_an_empty_table_is_identity():
    assert (LLAMA_STACKED | MappingTable()).rules == LLAMA_STACKED.rules
    assert (MappingTable() | LLAMA_STACKED).rules == LLAMA_STACKED.rules


# --- rename_only (vLLM tests/models/test_utils.py, get_rename_mapper) --------------------------------

FULL = MappingTable.from_dicts(
    regex={r"^drop_regex\.": None},
    substr={"drop_substr": None, "keep_substr": "kept"},
    stacked={".q_proj": (".qkv_proj", "q")},
    prefix={"drop_prefix.": None, "keep_prefix.": "kept."},
    suffix={".drop_suffix": None},
)


def test_rename_only_keeps_only_non_drop_non_stacked_rules():
    assert FULL.rename_only().rules == (
        Rule("substr", "keep_substr", "kept"),
        Rule("prefix", "keep_prefix.", "kept."),
    )


@pytest.mark.parametrize("name", ["drop_regex.w", "drop_substr.w", "drop_prefix.w", "w.drop_suffix"])
def test_rename_only_does_not_drop(name):
    assert FULL.map(name) is None
    assert FULL.rename_only().map(name) == Mapped(name)


@pytest.mark.parametrize(
    "name, full, renamed",
    [
        ("keep_substr.w", Mapped("kept.w"), Mapped("kept.w")),
        ("keep_prefix.w", Mapped("kept.w"), Mapped("kept.w")),
        ("layer.q_proj.w", Mapped("layer.qkv_proj.w", ("q",)), Mapped("layer.q_proj.w")),
    ],
)
def test_rename_only_still_renames(name, full, renamed):
    assert FULL.map(name) == full
    assert FULL.rename_only().map(name) == renamed


# --- 2.8 examples ----------------------------------------------------------------------------------

LLAMA_EXAMPLES = [
    # checkpoint name, destination (None: dropped), shard ids
    ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.qkv_proj.weight", ("q",)),
    ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_up_proj.weight", (1,)),
    ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.qkv_proj.weight", ()),  # Phi-3 fused
    ("model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.gate_up_proj.weight", ()),
    ("model.layers.0.self_attn.q_proj.weight_scale", "model.layers.0.self_attn.qkv_proj.weight_scale", ("q",)),
    ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.o_proj.weight", ()),
    ("model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight", ()),
    ("model.layers.0.self_attn.rotary_emb.inv_freq", None, None),
]


@pytest.mark.parametrize("name, new_name, shard_ids", LLAMA_EXAMPLES)
def test_llama_mapping_examples(name, new_name, shard_ids):
    expected = None if new_name is None else Mapped(new_name, shard_ids)
    assert LLAMA.map(name) == expected
    assert map_name(LLAMA, name) == expected


ROTARY = [
    "model.layers.3.self_attn.rotary_emb.inv_freq",
    "model.layers.3.self_attn.rotary_emb.cos_cached",
    "model.layers.3.self_attn.rotary_emb.sin_cached",
    "transformer.rotary_pos_emb.inv_freq",
]


@pytest.mark.parametrize("name", ROTARY)
def test_rotary_caches_are_dropped(name):
    assert ROTARY_CACHES.map(name) is None


def test_rotary_caches_keep_everything_else():
    assert len(ROTARY_CACHES.rules) == 4
    for name in ("model.layers.3.self_attn.rotary_emb.weight", "model.embed_tokens.weight"):
        assert ROTARY_CACHES.map(name) == Mapped(name)


# --- stages and the ordering hazard (2.8, 1.6 item 5) ------------------------------------------------

K_OUTPUT_SCALE = "model.layers.0.self_attn.k_proj.output_scale"


def test_single_merged_table_hits_the_ordering_hazard():
    # Stacked runs before suffix, so .k_proj becomes .qkv_proj and the cache-scale suffix never matches.
    merged = LLAMA_STACKED | CACHE_SCALES
    assert merged.map(K_OUTPUT_SCALE) == Mapped("model.layers.0.self_attn.qkv_proj.output_scale", ("k",))


def test_cache_scales_as_an_earlier_stage_avoid_the_hazard():
    assert map_name([CACHE_SCALES, LLAMA_STACKED], K_OUTPUT_SCALE) == Mapped("model.layers.0.self_attn.attn.k_scale")
    assert map_name([CACHE_SCALES, LLAMA_STACKED], "model.layers.0.self_attn.prob_output_scale") == Mapped(
        "model.layers.0.self_attn.attn.prob_scale"
    )
    # Other names still go through the stacked stage.
    assert map_name([CACHE_SCALES, LLAMA_STACKED], "model.layers.0.self_attn.v_proj.weight") == Mapped(
        "model.layers.0.self_attn.qkv_proj.weight", ("v",)
    )


def test_map_name_stages():
    tag = MappingTable.from_dicts(stacked={".w1": (".w13", 0)})
    rename = MappingTable.from_dicts(prefix={"model.": "m."})
    retag = MappingTable.from_dicts(stacked={".w13": (".w13", 1)})
    # A later stage without shard ids keeps the earlier ones; one with shard ids replaces them.
    assert map_name([tag, rename], "model.w1.weight") == Mapped("m.w13.weight", (0,))
    assert map_name([tag, retag], "model.w1.weight") == Mapped("model.w13.weight", (1,))
    # A drop in any stage drops the tensor; no stages leave the name alone.
    assert map_name([rename, ROTARY_CACHES], "model.rotary_emb.inv_freq") is None
    assert map_name([], "model.w1.weight") == Mapped("model.w1.weight")
    assert map_name(iter([rename]), "model.w1.weight") == Mapped("m.w1.weight")


# --- shard-id validation (Split.segment_ids; 1.7.4, 1.7.5, 2.3 errors) -------------------------------

MERGED_64_64 = Split(0, (Segment(0, 64), Segment(1, 64)))
QKV = Split(
    0,
    (
        Segment("q", 32, 128, label="attention heads"),
        Segment("k", 8, 128, replicate=True, label="KV heads"),
        Segment("v", 8, 128, replicate=True, label="KV heads"),
    ),
)


@pytest.mark.parametrize(
    "split, shard_id, ids",
    [
        (MERGED_64_64, None, [0, 1]),
        (MERGED_64_64, 0, [0]),
        (MERGED_64_64, 1, [1]),
        (QKV, None, ["q", "k", "v"]),
        (QKV, "k", ["k"]),
    ],
)
def test_valid_shard_ids(split, shard_id, ids):
    assert split.segment_ids(shard_id) == ids


@pytest.mark.parametrize(
    "split, shard_id, fragments",
    [
        (MERGED_64_64, 2, ["between 0 and 1", "Got shard id 2."]),
        (MERGED_64_64, -1, ["between 0 and 1", "Got shard id -1."]),
        (MERGED_64_64, "q", ["'q'", "[0, 1]"]),
        (MERGED_64_64, True, ["True"]),
        (QKV, "x", ["'q', 'k', or 'v'", "'x'"]),
        (QKV, 0, ["'q', 'k', or 'v'", "got shard id 0"]),
    ],
)
def test_invalid_shard_ids(split, shard_id, fragments):
    with pytest.raises(ShardingError) as excinfo:
        split.segment_ids(shard_id)
    for fragment in fragments:
        assert fragment in str(excinfo.value)
