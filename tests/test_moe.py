"""MoE loading: every rank's experts (and attention) put back together with vLLM's layout rules,
written out here independently of the planner, equal the checkpoint bit for bit; expert
parallelism reads no byte of another rank's experts; the local-expert tables of vLLM; errors.

Tiny models (``functional_load.testing.checkpoints``): hidden 64, 8 attention heads of head_dim 8,
vocab 1000 (padded to 1024), 8 routed experts of intermediate 32, bf16, 2 layers.
mixtral / qwen3_moe: both layers sparse, GQA with 2 KV heads. deepseek_v3: MLA attention,
layer 0 dense (intermediate 128), layer 1 sparse with one shared expert (intermediate 32).

Destination layout (vLLM fused MoE): ``experts.routed_experts.w13_weight [E_local, 2*I_local, H]`` holding
``[w1 (gate); w3 (up)]`` rows and ``experts.routed_experts.w2_weight [E_local, H, I_local]``. Without expert
parallelism every rank holds all experts with I split over tp; with it, ``ep = tp``, experts are
whole and spread by placement.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import assert_same_bits, unreplicate
from safetensors.torch import load_file, save_file

import functional_load as fl
from functional_load import Parallel, PlanError, ShardingError
from functional_load.io import Reader, ReadOptions, execute
from functional_load.layout.parallel import compute_local_expert_ids, local_expert_slots
from functional_load.testing.checkpoints import list_tensors, read_checkpoint_tensors

HEADS, HEAD_DIM, HIDDEN, VOCAB, PADDED_VOCAB = 8, 8, 64, 1000, 1024
EXPERTS, EXPERT_INTER = 8, 32
KV_HEADS = 2  # mixtral / qwen3_moe
# DeepSeek MLA sizes of the tiny config
Q_LORA, KV_LORA, ROPE, NOPE, V_HEAD = 32, 32, 8, 8, 8
DENSE_INTER, SHARED_INTER = 128, 32

MOE_ARCHS = ["mixtral", "qwen3_moe", "deepseek_v3"]
INDEX = "model.safetensors.index.json"

# checkpoint names of one expert's matrices: (prefix under the layer, gate, up, down)
PER_EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe.experts", "w1", "w3", "w2"),
    "qwen3_moe": ("mlp.experts", "gate_proj", "up_proj", "down_proj"),
    "deepseek_v3": ("mlp.experts", "gate_proj", "up_proj", "down_proj"),
}
MOE_LAYERS = {"mixtral": (0, 1), "qwen3_moe": (0, 1), "deepseek_v3": (1,)}

PER_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\..*\.experts\.(\d+)\.\w+\.weight$")
FUSED_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def checkpoint_options(arch: str, fused: bool) -> dict:
    options = {"fused_experts": fused}
    if arch != "deepseek_v3":  # MLA has no KV heads to group
        options["kv_heads"] = KV_HEADS
    return options


def load_all(path: Path, tp: int, **moe) -> list[dict[str, torch.Tensor]]:
    return [fl.load(path, tp_size=tp, rank=r, progress=False, **moe) for r in range(tp)]


# --- independent layout rules --------------------------------------------------------------------


def local_ids(num: int, ep: int, rank: int, placement: str) -> list[int]:
    """The experts (physical ids) ``rank`` holds, per vLLM 1.4 / 2.9, spelled out from sizes."""
    if ep == 1:
        return list(range(num))
    if placement == "linear":
        sizes = [num // ep + (1 if r < num % ep else 0) for r in range(ep)]
        start = sum(sizes[:rank])
        return list(range(start, start + sizes[rank]))
    assert placement == "round_robin"
    return [e for e in range(num) if e % ep == rank]


EXPERT_GROUPS = {"mixtral": 1, "qwen3_moe": 1, "deepseek_v3": 2}  # n_group of the tiny configs


def served(arch: str, ep: int, placement: str, redundant: int = 0) -> str:
    """The placement vLLM 0.32 serves (``determine_expert_placement_strategy``): round-robin only
    with expert parallelism over several ranks, more than one expert group and no redundant
    experts; linear otherwise."""
    if placement == "round_robin" and ep > 1 and EXPERT_GROUPS[arch] > 1 and redundant == 0:
        return "round_robin"
    return "linear"


def assert_shapes(ranks: list[torch.Tensor], shape: tuple[int, ...], what: str) -> None:
    for r, t in enumerate(ranks):
        assert tuple(t.shape) == shape, f"{what} on rank {r}: shape {list(t.shape)}, expected {list(shape)}"


def replicated(ranks: list[torch.Tensor], what: str) -> torch.Tensor:
    for r, t in enumerate(ranks):
        assert_same_bits(t, ranks[0], f"replicated {what} on rank {r}")
    return ranks[0]


def column(ranks: list[torch.Tensor], rows: int, cols: int, tp: int, what: str) -> torch.Tensor:
    assert_shapes(ranks, (rows // tp, cols), what)
    return torch.cat(ranks)


def row(ranks: list[torch.Tensor], rows: int, cols: int, tp: int, what: str) -> torch.Tensor:
    assert_shapes(ranks, (rows, cols // tp), what)
    return torch.cat(ranks, dim=1)


def gate_up(ranks: list[torch.Tensor], inter: int, tp: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A merged [gate_r; up_r] parameter -> the checkpoint's gate and up."""
    per = inter // tp
    assert_shapes(ranks, (2 * per, HIDDEN), what)
    return torch.cat([r[:per] for r in ranks]), torch.cat([r[per:] for r in ranks])


def rebuild_experts(
    w13: list[torch.Tensor], w2: list[torch.Tensor], tp: int, expert_parallel: bool, placement: str, what: str
) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """expert -> (gate [I, H], up [I, H], down [H, I]) from every rank's w13 / w2."""
    experts: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    if not expert_parallel:
        per = EXPERT_INTER // tp
        assert_shapes(w13, (EXPERTS, 2 * per, HIDDEN), what + ".w13_weight")
        assert_shapes(w2, (EXPERTS, HIDDEN, per), what + ".w2_weight")
        for e in range(EXPERTS):
            gate = torch.cat([r[e, :per] for r in w13])
            up = torch.cat([r[e, per:] for r in w13])
            down = torch.cat([r[e] for r in w2], dim=1)
            experts[e] = (gate, up, down)
        return experts
    for rank in range(tp):
        ids = local_ids(EXPERTS, tp, rank, placement)
        assert tuple(w13[rank].shape) == (len(ids), 2 * EXPERT_INTER, HIDDEN), f"{what}.w13_weight rank {rank}"
        assert tuple(w2[rank].shape) == (len(ids), HIDDEN, EXPERT_INTER), f"{what}.w2_weight rank {rank}"
        for slot, e in enumerate(ids):
            assert e not in experts, f"{what}: expert {e} on two ranks"
            experts[e] = (w13[rank][slot, :EXPERT_INTER], w13[rank][slot, EXPERT_INTER:], w2[rank][slot])
    assert sorted(experts) == list(range(EXPERTS)), f"{what}: experts held {sorted(experts)}"
    return experts


def reassemble(
    arch: str, fused: bool, tp: int, states: list[dict[str, torch.Tensor]], expert_parallel: bool, placement: str
) -> dict[str, torch.Tensor]:
    """Checkpoint name -> tensor rebuilt from the rank states."""
    out: dict[str, torch.Tensor] = {}
    names = list(states[0])
    for s in states:
        assert list(s) == names, "ranks disagree on the parameter names"
    done: set[str] = set()
    for name in names:
        if name in done:
            continue
        ranks = [s[name] for s in states]
        m = re.match(r"^(model\.layers\.(\d+))\.(.*)$", name)
        if m is None:
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                assert_shapes(ranks, (PADDED_VOCAB // tp, HIDDEN), name)
                full = torch.cat(ranks)
                assert torch.count_nonzero(full[VOCAB:].float()) == 0, f"{name}: padding rows are not zero"
                out[name] = full[:VOCAB]
            elif name == "model.norm.weight":
                out[name] = replicated(ranks, name)
            else:
                pytest.fail(f"unexpected parameter {name}")
            continue
        layer, index, rest = m[1], int(m[2]), m[3]
        if rest in ("block_sparse_moe.experts.routed_experts.w13_weight", "mlp.experts.routed_experts.w13_weight"):
            assert arch == "mixtral" or rest.startswith("mlp."), f"{arch} names its experts {rest}"
            assert (arch == "mixtral") == rest.startswith("block_sparse_moe."), f"{arch}: {name}"
            w2_name = name.replace("w13_weight", "w2_weight")
            done.add(w2_name)
            experts = rebuild_experts(ranks, [s[w2_name] for s in states], tp, expert_parallel, placement, name)
            if fused:
                base = f"{layer}.mlp.experts"
                out[f"{base}.gate_up_proj"] = torch.stack([torch.cat(experts[e][:2]) for e in range(EXPERTS)])
                out[f"{base}.down_proj"] = torch.stack([experts[e][2] for e in range(EXPERTS)])
            else:
                prefix, gate_n, up_n, down_n = PER_EXPERT_NAMES[arch]
                for e, (g, u, d) in experts.items():
                    out[f"{layer}.{prefix}.{e}.{gate_n}.weight"] = g
                    out[f"{layer}.{prefix}.{e}.{up_n}.weight"] = u
                    out[f"{layer}.{prefix}.{e}.{down_n}.weight"] = d
        elif rest.endswith("w2_weight"):
            pytest.fail(f"{name} before its w13_weight")
        elif rest == "self_attn.qkv_proj.weight":
            q_rows, kv_rows = HEADS // tp * HEAD_DIM, max(KV_HEADS // tp, 1) * HEAD_DIM
            assert_shapes(ranks, (q_rows + 2 * kv_rows, HIDDEN), name)
            out[f"{layer}.self_attn.q_proj.weight"] = torch.cat([r[:q_rows] for r in ranks])
            k = [r[q_rows : q_rows + kv_rows] for r in ranks]
            v = [r[q_rows + kv_rows :] for r in ranks]
            out[f"{layer}.self_attn.k_proj.weight"] = unreplicate(k, KV_HEADS, tp, name + " k")
            out[f"{layer}.self_attn.v_proj.weight"] = unreplicate(v, KV_HEADS, tp, name + " v")
        elif rest == "self_attn.o_proj.weight":
            v_dim = V_HEAD if arch == "deepseek_v3" else HEAD_DIM
            out[name] = row(ranks, HIDDEN, HEADS * v_dim, tp, name)
        elif rest == "self_attn.fused_qkv_a_proj.weight":  # replicated [q_a_proj; kv_a_proj_with_mqa]
            full = replicated(ranks, name)
            assert tuple(full.shape) == (Q_LORA + KV_LORA + ROPE, HIDDEN), name
            out[f"{layer}.self_attn.q_a_proj.weight"] = full[:Q_LORA]
            out[f"{layer}.self_attn.kv_a_proj_with_mqa.weight"] = full[Q_LORA:]
        elif rest == "self_attn.q_b_proj.weight":
            out[name] = column(ranks, HEADS * (NOPE + ROPE), Q_LORA, tp, name)
        elif rest == "self_attn.kv_b_proj.weight":
            out[name] = column(ranks, HEADS * (NOPE + V_HEAD), KV_LORA, tp, name)
        elif rest in ("mlp.gate_up_proj.weight", "mlp.shared_experts.gate_up_proj.weight"):
            inter = SHARED_INTER if "shared" in rest else DENSE_INTER
            assert arch == "deepseek_v3" and (index == 0) == (inter == DENSE_INTER), name
            g, u = gate_up(ranks, inter, tp, name)
            out[name.replace("gate_up_proj", "gate_proj")] = g
            out[name.replace("gate_up_proj", "up_proj")] = u
        elif rest in ("mlp.down_proj.weight", "mlp.shared_experts.down_proj.weight"):
            inter = SHARED_INTER if "shared" in rest else DENSE_INTER
            out[name] = row(ranks, HIDDEN, inter, tp, name)
        elif rest == "mlp.gate.e_score_correction_bias":
            full = replicated(ranks, name)
            assert full.dtype == torch.float32, f"{name} is {full.dtype}, vLLM keeps it float32"
            out[name] = full
        elif rest in ("block_sparse_moe.gate.weight", "mlp.gate.weight"):
            full = replicated(ranks, name)
            assert tuple(full.shape) == (EXPERTS, HIDDEN), name
            ck_name = name.replace(".block_sparse_moe.", ".mlp.") if fused else name  # transformers 5 rename
            out[ck_name] = full
        elif re.fullmatch(
            r"input_layernorm\.weight|post_attention_layernorm\.weight|self_attn\.(q_norm|k_norm|q_a_layernorm|kv_a_layernorm)\.weight",
            rest,
        ):
            out[name] = replicated(ranks, name)
        else:
            pytest.fail(f"unexpected parameter {name}")
    return out


def assert_matches_checkpoint(rebuilt: dict[str, torch.Tensor], checkpoint: dict[str, torch.Tensor]) -> None:
    assert sorted(rebuilt) == sorted(checkpoint)
    for name, tensor in checkpoint.items():
        if name.endswith("e_score_correction_bias"):  # stored bf16, loaded float32: an exact upcast
            assert_same_bits(rebuilt[name], tensor.float(), name)
        else:
            assert_same_bits(rebuilt[name], tensor, name)


# --- reassembly ----------------------------------------------------------------------------------

EP_MODES = [
    pytest.param(False, "linear", id="tp-experts"),
    pytest.param(True, "linear", id="ep-linear"),
    pytest.param(True, "round_robin", id="ep-round_robin"),
]


@pytest.mark.parametrize("expert_parallel,placement", EP_MODES)
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused-3d"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_ranks_reassemble_to_the_checkpoint(tiny_checkpoint, arch, fused, tp, expert_parallel, placement):
    path = tiny_checkpoint(arch, **checkpoint_options(arch, fused))
    checkpoint = read_checkpoint_tensors(path)
    assert any((FUSED_EXPERT_RE if fused else PER_EXPERT_RE).match(n) for n in checkpoint), "fixture layout"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a round-robin fallback warns (test_round_robin_falls_back_as_vllm_serves)
        states = load_all(path, tp, expert_parallel=expert_parallel, expert_placement=placement)
    placement = served(arch, tp if expert_parallel else 1, placement)
    for state in states:
        assert state.plan.parallel.expert_placement == placement

    rebuilt = reassemble(arch, fused, tp, states, expert_parallel, placement)

    assert_matches_checkpoint(rebuilt, checkpoint)


def expert_matrices(checkpoint: dict[str, torch.Tensor], arch: str, layer: int, e: int, fused: bool):
    """(gate, up, down) of expert ``e`` in ``layer``, read from the checkpoint tensors."""
    if fused:
        gu = checkpoint[f"model.layers.{layer}.mlp.experts.gate_up_proj"][e]
        return gu[:EXPERT_INTER], gu[EXPERT_INTER:], checkpoint[f"model.layers.{layer}.mlp.experts.down_proj"][e]
    prefix, g, u, d = PER_EXPERT_NAMES[arch]
    base = f"model.layers.{layer}.{prefix}.{e}"
    return tuple(checkpoint[f"{base}.{n}.weight"] for n in (g, u, d))


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused-3d"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_redundant_experts_repeat_logical_experts(tiny_checkpoint, arch, fused, placement):
    """tp=4 with EP and 4 redundant experts: 12 physical experts, 3 per rank; physical expert p
    holds logical expert p % 8 (vLLM phys2log)."""
    path = tiny_checkpoint(arch, **checkpoint_options(arch, fused))
    checkpoint = read_checkpoint_tensors(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        states = load_all(path, 4, expert_parallel=True, expert_placement=placement, num_redundant_experts=4)
    placement = served(arch, 4, placement, redundant=4)
    module = "block_sparse_moe" if arch == "mixtral" else "mlp"
    seen = Counter()
    for rank, state in enumerate(states):
        physical = local_ids(EXPERTS + 4, 4, rank, placement)
        assert len(physical) == 3
        for layer in MOE_LAYERS[arch]:
            w13 = state[f"model.layers.{layer}.{module}.experts.routed_experts.w13_weight"]
            w2 = state[f"model.layers.{layer}.{module}.experts.routed_experts.w2_weight"]
            assert tuple(w13.shape) == (3, 2 * EXPERT_INTER, HIDDEN)
            assert tuple(w2.shape) == (3, HIDDEN, EXPERT_INTER)
            for slot, p in enumerate(physical):
                gate, up, down = expert_matrices(checkpoint, arch, layer, p % EXPERTS, fused)
                what = f"rank {rank} layer {layer} slot {slot} (physical {p}, logical {p % EXPERTS})"
                assert_same_bits(w13[slot, :EXPERT_INTER], gate, what + " w1")
                assert_same_bits(w13[slot, EXPERT_INTER:], up, what + " w3")
                assert_same_bits(w2[slot], down, what + " w2")
                seen[p % EXPERTS] += 1
    layers = len(MOE_LAYERS[arch])
    assert seen == Counter({e: (2 if e < 4 else 1) * layers for e in range(EXPERTS)})


# --- bytes read ----------------------------------------------------------------------------------


class RecordingReader(Reader):
    """The reader of every load, also counting, per checkpoint tensor, the bytes it read."""

    def __init__(self) -> None:
        super().__init__(ReadOptions(strategy="pread", threads=1))
        self.by_tensor: Counter[str] = Counter()

    def read_into(self, info, box, out) -> None:
        before = self.bytes_read
        super().read_into(info, box, out)
        self.by_tensor[info.name] += self.bytes_read - before

    def read_run(self, run) -> None:  # abutting direct copies read at once: each view is its tensor's
        before = self.bytes_read
        super().read_run(run)
        assert self.bytes_read - before == sum(v.nbytes for v in run.views)
        for name, view in zip(run.tensors, run.views, strict=True):
            self.by_tensor[name] += view.nbytes


def dense_share(name: str, numel: int, tp: int, rank: int) -> int:
    """Elements of non-expert checkpoint tensor ``name`` that ``rank`` of ``tp`` keeps."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        per = PADDED_VOCAB // tp
        real_rows = max(0, min(VOCAB, (rank + 1) * per) - rank * per)
        return real_rows * HIDDEN
    if re.search(r"\.(k_proj|v_proj)\.weight$", name):  # one of the 2 KV heads (replicated if tp > 2)
        return numel // min(KV_HEADS, tp)
    if re.search(r"\.(q_proj|o_proj|q_b_proj|kv_b_proj|gate_proj|up_proj|down_proj)\.weight$", name):
        return numel // tp  # column / row parallel (dense MLP, shared experts, attention)
    if re.search(r"(layernorm|norm)\.weight$|\.gate\.weight$|e_score_correction_bias$|\.(q_a_proj|kv_a_proj_with_mqa)\.weight$", name):
        return numel  # replicated
    raise AssertionError(f"no rule for {name}")


def expert_of(name: str) -> tuple[int, int] | None:
    """(layer, expert) of a per-expert checkpoint tensor."""
    m = PER_EXPERT_RE.match(name)
    return (int(m[1]), int(m[2])) if m else None


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused-3d"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_expert_parallel_reads_only_local_experts(tiny_checkpoint, arch, fused, placement):
    tp = 4
    path = tiny_checkpoint(arch, **checkpoint_options(arch, fused))
    tensors = list_tensors(path)
    item = 2  # bf16
    nbytes = {n: torch.Size(shape).numel() * item for n, (shape, _) in tensors.items()}
    is_expert = {n: bool(expert_of(n) or FUSED_EXPERT_RE.match(n)) for n in tensors}
    total_expert_bytes = sum(b for n, b in nbytes.items() if is_expert[n])
    one_expert = 3 * EXPERT_INTER * HIDDEN * item  # gate + up + down
    assert total_expert_bytes == len(MOE_LAYERS[arch]) * EXPERTS * one_expert

    expert_bytes_all_ranks = 0
    # per expert tensor, how many planned copies (over all ranks) cover each element
    coverage = {n: torch.zeros(tensors[n][0], dtype=torch.int32) for n in tensors if is_expert[n]}
    for rank in range(tp):
        local = local_ids(EXPERTS, tp, rank, served(arch, tp, placement))
        assert len(local) == 2
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            the_plan = fl.plan(path, tp_size=tp, rank=rank, expert_parallel=True, expert_placement=placement)

        # no copy touches a non-local expert
        for param in the_plan.params:
            for copy in param.copies:
                if (le := expert_of(copy.tensor)) is not None:
                    assert le[1] in local, f"rank {rank} plans to read {copy.tensor} (local experts {local})"
                    coverage[copy.tensor][tuple(slice(a, b) for a, b in copy.src)] += 1
                elif FUSED_EXPERT_RE.match(copy.tensor):
                    lo, hi = copy.src[0]
                    covered = list(range(lo, hi))
                    assert set(covered) <= set(local), f"rank {rank} reads experts {covered} of {copy.tensor}"
                    # the slots in dst hold the same experts, in local order
                    assert [local[s] for s in range(*copy.dst[0])] == covered, f"{copy.tensor}: {copy.src} -> {copy.dst}"
                    coverage[copy.tensor][tuple(slice(a, b) for a, b in copy.src)] += 1
        if not fused:
            dropped = {t for t, _ in the_plan.dropped if expert_of(t)}
            assert dropped == {n for n in tensors if expert_of(n) and expert_of(n)[1] not in local}

        reader = RecordingReader()
        with reader:  # one thread: the per-tensor tally reads a shared counter
            execute(the_plan, ReadOptions(threads=1), reader=reader, progress=False)
        assert reader.bytes_read == the_plan.bytes_to_read

        expert_bytes = sum(b for n, b in reader.by_tensor.items() if is_expert[n])
        # exactly the local experts: 2 of 8 per MoE layer
        assert expert_bytes == len(MOE_LAYERS[arch]) * len(local) * one_expert
        assert expert_bytes * EXPERTS == total_expert_bytes * len(local)
        for n in tensors:
            if (le := expert_of(n)) is not None:
                assert reader.by_tensor[n] == (nbytes[n] if le[1] in local else 0), f"rank {rank}: {n}"
            elif FUSED_EXPERT_RE.match(n):
                assert reader.by_tensor[n] == nbytes[n] // EXPERTS * len(local), f"rank {rank}: {n}"
            else:  # attention, norms, router, embeddings, dense / shared MLP: the TP share
                share = dense_share(n, torch.Size(tensors[n][0]).numel(), tp, rank) * item
                assert reader.by_tensor[n] == share, f"rank {rank}: {n} read {reader.by_tensor[n]}, expected {share}"
        assert set(reader.by_tensor) <= set(tensors)
        expert_bytes_all_ranks += expert_bytes

    assert expert_bytes_all_ranks == total_expert_bytes  # each expert read once, by one rank
    for n, counts in coverage.items():  # every element of every expert planned exactly once
        assert torch.all(counts == 1), f"{n}: elements planned {sorted(set(counts.flatten().tolist()))} times"


# --- local expert tables (reference 2.9) ---------------------------------------------------------


@pytest.mark.parametrize(
    "num,ep,expected",
    [
        (10, 3, [(0, 1, 2, 3), (4, 5, 6), (7, 8, 9)]),
        (10, 4, [(0, 1, 2), (3, 4, 5), (6, 7), (8, 9)]),
        (8, 4, [(0, 1), (2, 3), (4, 5), (6, 7)]),
    ],
)
def test_linear_placement_tables(num, ep, expected):
    assert [compute_local_expert_ids(num, ep, r, "linear") for r in range(ep)] == expected
    assert [compute_local_expert_ids(num, ep, r) for r in range(ep)] == expected  # linear is the default


def test_linear_placement_64_experts_over_8():
    assert compute_local_expert_ids(64, 8, 0) == tuple(range(0, 8))
    assert compute_local_expert_ids(64, 8, 7) == tuple(range(56, 64))
    assert [compute_local_expert_ids(64, 8, r) for r in range(8)] == [tuple(range(8 * r, 8 * r + 8)) for r in range(8)]


@pytest.mark.parametrize("ep,per_rank", [(8, 48), (16, 24), (24, 16)])
def test_linear_placement_384_experts(ep, per_rank):
    ranks = [compute_local_expert_ids(384, ep, r) for r in range(ep)]
    assert ranks == [tuple(range(r * per_rank, (r + 1) * per_rank)) for r in range(ep)]


@pytest.mark.parametrize(
    "num,ep,expected",
    [
        (8, 2, [(0, 2, 4, 6), (1, 3, 5, 7)]),
        (10, 3, [(0, 3, 6, 9), (1, 4, 7), (2, 5, 8)]),
    ],
)
def test_round_robin_placement_tables(num, ep, expected):
    assert [compute_local_expert_ids(num, ep, r, "round_robin") for r in range(ep)] == expected


def test_redundant_experts_phys2log():
    """E=4, R=2: phys2log = [0, 1, 2, 3, 0, 1]; physical expert 5 loads from experts.1."""
    assert local_expert_slots(4, 1, 0, redundant=2) == (0, 1, 2, 3, 0, 1)
    # spread over ep=2 (6 physical experts, 3 each, linear): rank 1 holds physical 3, 4, 5
    assert local_expert_slots(4, 2, 0, "linear", redundant=2) == (0, 1, 2)
    assert local_expert_slots(4, 2, 1, "linear", redundant=2) == (3, 0, 1)
    assert local_expert_slots(4, 2, 1, "round_robin", redundant=2) == (1, 3, 1)
    assert Parallel(4, 3, expert_parallel=True, num_redundant_experts=4).expert_slots(8) == (1, 2, 3)


def test_unknown_placement_is_a_sharding_error():
    with pytest.raises(ShardingError, match="blocked"):
        compute_local_expert_ids(8, 2, 0, "blocked")
    with pytest.raises(ShardingError, match="blocked"):
        Parallel(2, 0, expert_parallel=True, expert_placement="blocked")


def test_fewer_experts_than_ep_ranks_in_the_table():
    """vLLM's determine_expert_map: ranks past the experts hold none."""
    for placement in ("linear", "round_robin"):
        assert [compute_local_expert_ids(2, 4, r, placement) for r in range(4)] == [(0,), (1,), (), ()]


# --- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch,override,module",
    [
        ("qwen3_moe", {"moe_intermediate_size": 36}, "model.layers.0.mlp.experts (and every layer like it)"),
        ("mixtral", {"intermediate_size": 36}, "model.layers.0.block_sparse_moe.experts (and every layer like it)"),
    ],
)
def test_expert_intermediate_that_does_not_divide_over_tp(tiny_checkpoint, arch, override, module):
    path = tiny_checkpoint(arch, kv_heads=KV_HEADS, **override)
    with pytest.raises(ShardingError) as info:
        fl.plan(path, tp_size=8, rank=3)
    message = str(info.value)
    assert "36" in message and "tp=8" in message, message
    assert module in message, message
    assert "expert_parallel=True" in message, message  # the way out is named
    # tp=4 divides 36; and under expert parallelism experts are whole, so tp=8 is fine too
    fl.plan(path, tp_size=4, rank=3)
    state = fl.load(path, tp_size=8, rank=3, expert_parallel=True, progress=False)
    moe = "block_sparse_moe" if arch == "mixtral" else "mlp"
    assert tuple(state[f"model.layers.1.{moe}.experts.routed_experts.w13_weight"].shape) == (1, 72, HIDDEN)
    assert tuple(state[f"model.layers.1.{moe}.experts.routed_experts.w2_weight"].shape) == (1, HIDDEN, 36)


def test_fewer_experts_than_ep_ranks(tiny_checkpoint):
    """Mixtral, 2 experts over 4 EP ranks: vLLM loads ranks 2 and 3 with zero local experts."""
    path = tiny_checkpoint("mixtral", kv_heads=KV_HEADS, num_local_experts=2)
    config = json.loads((path / "config.json").read_text())
    assert config["num_local_experts"] == 2
    inter = config["intermediate_size"]
    checkpoint = read_checkpoint_tensors(path)
    for rank in range(4):
        state = fl.load(path, tp_size=4, rank=rank, expert_parallel=True, progress=False)
        w13 = state["model.layers.1.block_sparse_moe.experts.routed_experts.w13_weight"]
        w2 = state["model.layers.1.block_sparse_moe.experts.routed_experts.w2_weight"]
        held = 1 if rank < 2 else 0
        assert tuple(w13.shape) == (held, 2 * inter, HIDDEN) and tuple(w2.shape) == (held, HIDDEN, inter)
        if held:
            gate, up, down = expert_matrices(checkpoint, "mixtral", 1, rank, False)
            assert_same_bits(w13[0], torch.cat([gate, up]), f"rank {rank} w13")
            assert_same_bits(w2[0], down, f"rank {rank} w2")
        else:  # reads no expert byte
            assert not [c.tensor for p in state.plan.params for c in p.copies if ".experts." in c.tensor]
    # without EP, every rank holds both experts, TP-sharded
    state = fl.load(path, tp_size=4, rank=1, progress=False)
    assert tuple(state["model.layers.1.block_sparse_moe.experts.routed_experts.w13_weight"].shape) == (2, 2 * inter // 4, HIDDEN)


@pytest.mark.parametrize("ep", [False, True])
def test_qwen_moe_refuses_more_ranks_than_experts(tiny_checkpoint, ep):
    """vLLM's Qwen-MoE block refuses tp > experts in its constructor, with or without expert
    parallelism ("Tensor parallel size 8 is greater than the number of experts 6"): so does the layout."""
    path = tiny_checkpoint("qwen3_moe", kv_heads=KV_HEADS, num_experts=2)
    with pytest.raises(ShardingError, match="Tensor parallel size 4 is greater than the number of experts 2"):
        fl.plan(path, tp_size=4, rank=0, expert_parallel=ep)
    fl.plan(path, tp_size=2, rank=0, expert_parallel=ep)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_round_robin_falls_back_as_vllm_serves(tiny_checkpoint, arch):
    """Round-robin is served only for models with more than one expert group (deepseek_v3's
    n_group 2 here); otherwise vLLM places linearly and warns, and so does the plan."""
    path = tiny_checkpoint(arch, **checkpoint_options(arch, False))
    expected = served(arch, 4, "round_robin")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = fl.plan(path, tp_size=4, rank=1, expert_parallel=True, expert_placement="round_robin")
    assert plan.parallel.expert_placement == expected
    fallback = [w for w in caught if "falls back to 'linear'" in str(w.message)]
    assert len(fallback) == (expected == "linear"), [str(w.message) for w in caught]
    assert plan.to_json()["expert_placement"] == expected
    if expected == "round_robin":  # with redundant experts, vLLM places linearly
        with pytest.warns(UserWarning, match="4 redundant experts"):
            plan = fl.plan(path, tp_size=4, rank=1, expert_parallel=True, expert_placement="round_robin", num_redundant_experts=4)
        assert plan.parallel.expert_placement == "linear"
    # tp 1: a single EP rank holds every expert, silently linear
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fl.plan(path, tp_size=1, expert_parallel=True, expert_placement="round_robin").parallel.expert_placement == "linear"


MISSING = "model.layers.1.mlp.experts.5.up_proj.weight"


@pytest.fixture(scope="module")
def missing_expert_dir(tmp_path_factory) -> Path:
    """A per-expert qwen3_moe checkpoint without layer 1's expert 5 up projection (shard + index)."""
    from functional_load.testing.checkpoints import write_checkpoint

    path = write_checkpoint("qwen3_moe", tmp_path_factory.mktemp("missing-expert") / "ckpt", kv_heads=KV_HEADS)
    index = json.loads((path / INDEX).read_text())
    shard = index["weight_map"].pop(MISSING)
    tensors = load_file(str(path / shard))
    del tensors[MISSING]
    save_file(tensors, str(path / shard), metadata={"format": "pt"})
    (path / INDEX).write_text(json.dumps(index, indent=2))
    assert MISSING not in read_checkpoint_tensors(path)
    return path


@pytest.mark.parametrize(
    "tp,moe",
    [
        pytest.param(1, {}, id="tp1"),
        pytest.param(2, {}, id="tp2"),
        pytest.param(4, {"expert_parallel": True, "expert_placement": "linear"}, id="ep4-linear"),
        pytest.param(4, {"expert_parallel": True, "expert_placement": "round_robin"}, id="ep4-round_robin"),
    ],
)
def test_missing_expert_is_named(missing_expert_dir, tp, moe):
    """Ranks that hold expert 5 fail naming the parameter, the expert and w3; the others load."""
    checkpoint = read_checkpoint_tensors(missing_expert_dir)
    if moe.get("expert_parallel"):
        owners = [r for r in range(tp) if 5 in local_ids(EXPERTS, tp, r, served("qwen3_moe", tp, moe["expert_placement"]))]
        assert len(owners) == 1
    else:  # every rank holds (a TP slice of) every expert
        owners = list(range(tp))
    for rank in range(tp):
        if rank in owners:
            with pytest.raises(PlanError) as info:
                fl.plan(missing_expert_dir, tp_size=tp, rank=rank, **moe)
            problems = [p for p in info.value.problems if "model.layers.1.mlp.experts.routed_experts.w13_weight" in p]
            assert len(problems) == 1, str(info.value)
            assert "expert 5" in problems[0] and "w3" in problems[0], problems[0]
            assert len(info.value.problems) == 1, str(info.value)  # nothing else is wrong
        else:  # this rank's plan never needs expert 5
            state = fl.load(missing_expert_dir, tp_size=tp, rank=rank, progress=False, **moe)
            local = local_ids(EXPERTS, tp, rank, served("qwen3_moe", tp, moe.get("expert_placement", "linear")) if moe else "linear")
            w13 = state["model.layers.1.mlp.experts.routed_experts.w13_weight"]
            for slot, e in enumerate(local):
                gate, up, _ = expert_matrices(checkpoint, "qwen3_moe", 1, e, False)
                assert_same_bits(w13[slot, :EXPERT_INTER], gate, f"rank {rank} expert {e} w1")
                assert_same_bits(w13[slot, EXPERT_INTER:], up, f"rank {rank} expert {e} w3")


# --- config spellings ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch,key,alias",
    [
        ("qwen3_moe", "num_local_experts", "num_experts"),
        ("mixtral", "num_local_experts", "num_experts"),
        ("deepseek_v3", "n_routed_experts", "num_experts"),
    ],
)
def test_expert_count_spellings_plan_identically(tiny_checkpoint, tmp_path, arch, key, alias):
    original = tiny_checkpoint(arch, **checkpoint_options(arch, False))
    renamed = tmp_path / "renamed"
    shutil.copytree(original, renamed)
    config = json.loads((renamed / "config.json").read_text())
    assert config[key] == EXPERTS and alias not in config
    config[alias] = config.pop(key)
    (renamed / "config.json").write_text(json.dumps(config, indent=2))

    for tp, rank, moe in [
        (1, 0, {}),
        (2, 1, {}),
        (4, 2, {"expert_parallel": True}),
        (4, 1, {"expert_parallel": True, "expert_placement": "round_robin"}),
    ]:
        a = fl.plan(original, tp_size=tp, rank=rank, **moe).to_json()
        b = fl.plan(renamed, tp_size=tp, rank=rank, **moe).to_json()
        assert a.pop("model_dir") != b.pop("model_dir")
        assert a == b, f"tp={tp} rank={rank} {moe}"
        experts = [p for p in a["params"] if p["name"].endswith("experts.routed_experts.w13_weight")]
        assert experts and all(p["global_shape"][0] == EXPERTS for p in experts)
