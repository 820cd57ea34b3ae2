"""The rank value over every parallel axis: vLLM's fused-MoE groups from (tp, dp, ep), checked
against the worked examples of vLLM 0.32's ``FusedMoEParallelConfig.make`` docstring; today's
``Parallel(tp_size, rank)`` calls unchanged; vLLM's sequence-parallel MoE under DP x TP with EP."""

from __future__ import annotations

import pytest

from functional_load.errors import ShardingError
from functional_load.layout.parallel import Parallel

# (tp, dp, enable_expert_parallel) -> per device (dp-major): (MoE TP size, rank), (EP size, rank)
VLLM_EXAMPLES = {
    (2, 1, False): [((2, 0), (1, 0)), ((2, 1), (1, 0))],
    (1, 2, False): [((2, 0), (1, 0)), ((2, 1), (1, 0))],
    (2, 2, False): [((4, 0), (1, 0)), ((4, 1), (1, 0)), ((4, 2), (1, 0)), ((4, 3), (1, 0))],
    (2, 1, True): [((1, 0), (2, 0)), ((1, 0), (2, 1))],
    (1, 2, True): [((1, 0), (2, 0)), ((1, 0), (2, 1))],
    (2, 2, True): [((1, 0), (4, 0)), ((1, 0), (4, 1)), ((1, 0), (4, 2)), ((1, 0), (4, 3))],
}


@pytest.mark.parametrize(("tp", "dp", "ep"), list(VLLM_EXAMPLES))
def test_moe_groups_are_vllms(tp: int, dp: int, ep: bool) -> None:
    for device, (moe_tp, ep_group) in enumerate(VLLM_EXAMPLES[(tp, dp, ep)]):
        p = Parallel(tp, device % tp, ep, dp_size=dp, dp_rank=device // tp)
        assert (p.expert_tp.tp_size, p.expert_tp.rank) == moe_tp, (device, p)
        assert (p.ep_size, p.ep_rank) == ep_group, (device, p)


def test_whole_experts_spread_over_the_dp_x_tp_group() -> None:
    held = [Parallel(2, r % 2, True, dp_size=2, dp_rank=r // 2).expert_slots(8) for r in range(4)]
    assert held == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert Parallel(2, 1, True, "round_robin", dp_size=2, dp_rank=1).expert_slots(8) == (3, 7)


def test_todays_calls_and_json_are_unchanged() -> None:
    assert Parallel(4, 3) == Parallel(tp_size=4, rank=3, pp_size=1, pp_rank=0, dp_size=1, dp_rank=0)
    assert Parallel(4, 3, True).to_json() == {"tp_size": 4, "rank": 3, "expert_parallel": True,
                                              "expert_placement": "linear", "num_redundant_experts": 0}
    assert Parallel(2, 1, dp_size=2, dp_rank=1).to_json()["dp_rank"] == 1


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"pp_size": 2, "pp_rank": 2}, r"pp_rank must be in \[0, 2\) for pp_size=2, got 2"),
    ({"dp_size": 0}, "dp_size must be a positive integer, got 0"),
    ({"dp_size": 2, "dp_rank": True}, "dp_rank must be in"),
])
def test_axes_are_checked(kwargs: dict, message: str) -> None:
    with pytest.raises(ShardingError, match=message):
        Parallel(2, 0, **kwargs)


@pytest.mark.parametrize(("tp", "dp", "ep", "replicated"), [
    (2, 2, True, True),  # vLLM's sequence-parallel MoE: the shared expert whole on every rank
    (2, 2, False, False), (2, 1, True, False), (1, 4, True, False),  # split as usual (tp 1: nothing to split)
])
def test_sequence_parallel_moe_replicates_the_shared_expert(tiny_checkpoint, tp: int, dp: int, ep: bool, replicated: bool) -> None:
    """DP x TP > 1 with expert parallelism: vLLM runs the MoE layers sequence-parallel
    (``use_sequence_parallel_moe``) and DeepSeek's shared experts are ReplicatedLinear there
    (``disable_tp=is_sequence_parallel``); everything else keeps its tensor-parallel split
    (judged for every MoE family by the parity harness's -dp cases)."""
    from functional_load.layout.build import build_layout
    from functional_load.model.config import read_config
    from functional_load.model.spec import spec_for_config

    config = read_config(tiny_checkpoint("deepseek_v3"))
    for rank in range(tp * dp):
        parallel = Parallel(tp, rank % tp, ep, dp_size=dp, dp_rank=rank // tp)
        assert parallel.sequence_parallel_moe is replicated
        layout = build_layout(config, spec_for_config(config), parallel, "bfloat16")
        shared = [p for n, p in layout.params.items() if ".shared_experts." in n]
        attention = [p for n, p in layout.params.items() if n.endswith("o_proj.weight")]
        assert shared and attention
        assert all((p.local_shape == p.shape) is (replicated or tp == 1) for p in shared), (rank, parallel)
        assert all((p.local_shape == p.shape) is (tp == 1) for p in attention), (rank, parallel)
