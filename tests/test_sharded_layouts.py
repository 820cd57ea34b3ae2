"""Pre-sharded saves of multi-node layouts: every (stage, replica, tensor) rank, each tensor box once.

* A save at PP 2 x TP 4, DP x TP or wide EP writes one file per global rank
  ``(dp_rank * pp_size + pp_rank) * tp_size + rank`` and records each rank's coordinates; every
  rank reloads at that layout from the files its manifest entries name, as they are (no virtual
  original tensors), bit for bit equal to loading the original checkpoint, reading exactly the
  plan's bytes.
* Data-parallel replicas and stages that repeat a tensor store it once: a DP 2 x TP 2 save holds
  the data bytes of a TP 2 save, its replica files hold only experts (nothing for a dense model).
* The manifest describes the virtual original checkpoint, so a save reshards to any layout:
  PP 2 x TP 4 <-> TP 8, EP 8 (TP 8 or DP 8) <-> EP 16 (DP 16), linear <-> round-robin expert
  placement, each rank equal to loading the original at the target layout.
* A save written before these layouts (manifest version 1 without rank coordinates) still loads;
  a corrupt rank coordinate, a missing rank and a stage or replica asked of a save are refused.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from helpers import assert_same_state, hook_opens
from safetensors import safe_open

import functional_load as fl
from functional_load.checkpoint import FileSpan
from functional_load.checkpoint.sharded import MANIFEST, read_manifest
from functional_load.errors import FormatError
from functional_load.layout.parallel import Parallel

EP8_TP = {"tp_size": 8, "expert_parallel": True}
EP8_DP = {"tp_size": 1, "dp_size": 8, "expert_parallel": True}
EP16_DP = {"tp_size": 1, "dp_size": 16, "expert_parallel": True}
PP2_TP4 = {"tp_size": 4, "pp_size": 2}
TP8 = {"tp_size": 8}


BUILDS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {"num_layers": 4}),  # 8 KV heads
    "llama-tied": ("llama", {"num_layers": 4, "tie_word_embeddings": True}),
    "moe": ("qwen3_moe", {"num_experts": 16}),
    "deepseek": ("deepseek_v3", {}),  # 2 expert groups: round-robin placement is served
}


class Sources(dict):
    """Tiny checkpoints by name (``BUILDS``), written on first use."""

    def __init__(self, tiny_checkpoint: Any) -> None:
        super().__init__()
        self.make = tiny_checkpoint

    def __missing__(self, name: str) -> Path:
        arch, build = BUILDS[name]
        self[name] = self.make(arch, **build)
        return self[name]


@pytest.fixture(scope="module")
def sources(tiny_checkpoint: Any) -> Sources:
    return Sources(tiny_checkpoint)


_SAVES: dict[tuple[str, str], Path] = {}


def save(sources: Sources, tmp_path_factory: pytest.TempPathFactory, model: str, layout: dict[str, Any]) -> Path:
    """``save_sharded`` of ``model`` at ``layout``, once per module."""
    key = (model, json.dumps(layout, sort_keys=True))
    if key not in _SAVES:
        sizes = {k: v for k, v in layout.items() if k != "tp_size"}
        _SAVES[key] = fl.save_sharded(sources[model], tmp_path_factory.mktemp(model) / "save", layout["tp_size"], **sizes)
    return _SAVES[key]


def ranks(layout: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank of ``layout`` as load keywords, in global-rank order."""
    tp, pp, dp = layout["tp_size"], layout.get("pp_size", 1), layout.get("dp_size", 1)
    extra = {k: v for k, v in layout.items() if k not in ("tp_size", "pp_size", "dp_size")}
    axes = {"pp_size": pp} if pp > 1 else {}
    axes |= {"dp_size": dp} if dp > 1 else {}
    return [
        {"tp_size": tp, "rank": r, **axes, **({"pp_rank": p} if pp > 1 else {}), **({"dp_rank": d} if dp > 1 else {}), **extra}
        for d in range(dp) for p in range(pp) for r in range(tp)
    ]


def parallel(kw: dict[str, Any]) -> Parallel:
    return Parallel(kw["tp_size"], kw["rank"], kw.get("expert_parallel", False), pp_size=kw.get("pp_size", 1),
                    pp_rank=kw.get("pp_rank", 0), dp_size=kw.get("dp_size", 1), dp_rank=kw.get("dp_rank", 0))


def data_bytes(path: Path) -> int:
    """Bytes of tensor data in a safetensors file (everything after the header)."""
    blob = path.read_bytes()
    return len(blob) - 8 - int.from_bytes(blob[:8], "little")


def save_data_bytes(saved: Path) -> int:
    return sum(data_bytes(saved / name) for name in read_manifest(saved)["files"])


# --- reload at the saved layout ------------------------------------------------------------------


@pytest.mark.parametrize(("model", "layout"), [("llama", PP2_TP4), ("moe", EP8_DP), ("moe", {"tp_size": 2, "dp_size": 2})],
                         ids=["llama-pp2-tp4", "moe-ep8-dp8", "moe-dp2-tp2"])
def test_reload_at_the_saved_layout_reads_the_rank_files_as_they_are(sources, tmp_path_factory, monkeypatch, model, layout):
    saved = save(sources, tmp_path_factory, model, layout)
    manifest = read_manifest(saved)
    world = len(ranks(layout))
    assert manifest["version"] == 2 and len(manifest["files"]) == world
    for g, kw in enumerate(ranks(layout)):
        entry = manifest["ranks"][str(g)]
        assert entry["file"].startswith(f"model-rank-{g}-of-{world}-") and manifest["files"][entry["file"]]["rank"] == g
        assert entry["parallel"] == parallel(kw).to_json()
        named = {str((saved / r.get("file", entry["file"])).resolve()) for r in entry["params"].values() if r["sources"]}
        opened: list[str] = []
        hook_opens(monkeypatch, lambda f, seen=opened: isinstance(f, (str, os.PathLike)) and seen.append(os.path.realpath(os.fsdecode(f))))
        state = fl.load(saved, progress=False, **kw)
        monkeypatch.undo()
        assert_same_state(state, fl.load(sources[model], progress=False, **kw), f"{model} {kw}")
        assert all(isinstance(info.location, FileSpan) for info in state.plan.tensors.values()), "resharded, not read as saved"
        rank_files = {str((saved / f).resolve()) for f in manifest["files"]}
        assert {p for p in opened if p in rank_files} == named, f"{kw}: opened {sorted(set(opened) & rank_files)}"
        assert state.stats.bytes_read == state.plan.bytes_to_read == sum(info.nbytes for info in state.plan.tensors.values())


# --- each box once ---------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["llama", "moe"])
def test_data_parallel_replicas_store_shared_tensors_once(sources, tmp_path_factory, model):
    """DP 2 x TP 2 holds the data bytes of TP 2: replica 1 points its attention (and dense layers)
    at replica 0's files and stores only its share of the experts (a dense model: nothing)."""
    dp_save = save(sources, tmp_path_factory, model, {"tp_size": 2, "dp_size": 2})
    tp_save = save(sources, tmp_path_factory, model, {"tp_size": 2})
    assert save_data_bytes(dp_save) == save_data_bytes(tp_save)
    manifest = read_manifest(dp_save)
    for r in range(2):
        replica, first = manifest["ranks"][str(2 + r)], manifest["ranks"][str(r)]
        for name, record in replica["params"].items():
            expert = ".experts." in name
            assert record["file"] == (replica["file"] if expert else first["file"]), f"rank {2 + r} {name}"
        stored = data_bytes(dp_save / replica["file"])
        assert (stored > 0) == (model == "moe")
    assert read_manifest(tp_save)["version"] == 1  # a single-stage, single-replica save is written as before
    if model == "llama":  # a replica that reshards at its own coordinates (quantized while loading: scales the save
        # does not hold) prefers its own rank's boxes, and reads the shared ones from the file storing them
        kw = {"tp_size": 2, "rank": 1, "dp_size": 2, "dp_rank": 1, "quantization": "fp8"}
        assert_same_state(fl.load(dp_save, progress=False, **kw), fl.load(sources[model], progress=False, **kw), str(kw))


def test_a_tied_head_on_the_last_stage_is_stored_once(sources, tmp_path_factory):
    """Tied embeddings: the last stage holds the embedding too (as the head); it is stage 0's box."""
    layout = {"tp_size": 2, "pp_size": 2}
    saved = save(sources, tmp_path_factory, "llama-tied", layout)
    manifest = read_manifest(saved)
    for r in range(2):
        first, last = manifest["ranks"][str(r)], manifest["ranks"][str(2 + r)]
        assert last["params"]["model.embed_tokens.weight"]["file"] == first["file"]
        with safe_open(str(saved / last["file"]), "pt") as f:
            assert "model.embed_tokens.weight" not in set(f.keys()) and "lm_head.weight" not in set(f.keys())
    for kw in ranks(layout) + ranks({"tp_size": 4}):
        assert_same_state(fl.load(saved, progress=False, **kw), fl.load(sources["llama-tied"], progress=False, **kw), str(kw))


def test_online_quantized_replicas_store_weights_and_scales_once(sources, tmp_path):
    """FP8 quantized while loading: a replica's weights and the scales derived from them are
    replica 0's; the save reloads at its layout only."""
    saved = fl.save_sharded(sources["llama"], tmp_path / "save", 2, dp_size=2, quantization="fp8")
    manifest = read_manifest(saved)
    assert all(data_bytes(saved / manifest["ranks"][str(g)]["file"]) == 0 for g in (2, 3))
    for kw in ranks({"tp_size": 2, "dp_size": 2}):
        assert_same_state(fl.load(saved, progress=False, **kw), fl.load(sources["llama"], quantization="fp8", progress=False, **kw))
    with pytest.raises(fl.ConfigError, match="quantized while loading"):
        fl.load(saved, tp_size=2, progress=False)


# --- reshard -----------------------------------------------------------------------------------------

RR4 = {"tp_size": 4, "expert_parallel": True, "expert_placement": "round_robin"}
RESHARDS = [
    pytest.param("llama", PP2_TP4, TP8, id="llama-pp2xtp4-to-tp8"),
    pytest.param("llama", TP8, PP2_TP4, id="llama-tp8-to-pp2xtp4"),
    pytest.param("moe", EP8_TP, EP16_DP, id="moe-ep8(tp8)-to-ep16(dp16)"),
    pytest.param("moe", EP8_DP, EP16_DP, id="moe-ep8(dp8)-to-ep16(dp16)"),
    pytest.param("moe", EP16_DP, EP8_TP, id="moe-ep16(dp16)-to-ep8(tp8)"),
    pytest.param("moe", EP16_DP, EP8_DP, id="moe-ep16(dp16)-to-ep8(dp8)"),
    # the same ranks and shapes, other experts: only the recorded coordinates tell them apart
    pytest.param("deepseek", {"tp_size": 4, "expert_parallel": True}, RR4, id="deepseek-ep4-linear-to-round_robin"),
]


@pytest.mark.parametrize(("model", "saved_at", "load_at"), RESHARDS)
def test_a_save_reshards_to_another_layout(sources, tmp_path_factory, model, saved_at, load_at):
    saved = save(sources, tmp_path_factory, model, saved_at)
    for kw in ranks(load_at):
        state = fl.load(saved, progress=False, **kw)
        assert_same_state(state, fl.load(sources[model], progress=False, **kw), f"{model} saved at {saved_at}, loaded at {kw}")
        assert state.stats.bytes_read == state.plan.bytes_to_read


# --- compatibility and refusals ----------------------------------------------------------------------


def test_a_save_without_rank_coordinates_still_loads(sources, tmp_path_factory, tmp_path):
    """Saves written before these layouts: version 1, no ``pp_size``/``dp_size``, no rank coordinates."""
    saved = tmp_path / "old"
    shutil.copytree(save(sources, tmp_path_factory, "moe", EP8_TP), saved)
    manifest = json.loads((saved / MANIFEST).read_text())
    del manifest["parallel"]["pp_size"], manifest["parallel"]["dp_size"]
    for entry in manifest["ranks"].values():
        del entry["parallel"]
    (saved / MANIFEST).write_text(json.dumps(manifest))
    for kw in ranks(EP8_TP)[:2] + ranks(EP16_DP)[:2]:
        state = fl.load(saved, progress=False, **kw)
        assert_same_state(state, fl.load(sources["moe"], progress=False, **kw), str(kw))
        assert all(isinstance(i.location, FileSpan) for i in state.plan.tensors.values()) == (kw["tp_size"] == 8)


def test_corrupt_rank_coordinates_are_refused(sources, tmp_path_factory, tmp_path):
    saved = tmp_path / "save"
    shutil.copytree(save(sources, tmp_path_factory, "llama", PP2_TP4), saved)
    manifest = json.loads((saved / MANIFEST).read_text())
    manifest["ranks"]["5"]["parallel"]["pp_rank"] = 0  # global rank 5 is stage 1, tensor rank 1
    (saved / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(fl.LoadError, match=r"ranks\['5'\]\.parallel .* is not global rank 5 of the saved layout \(tp_size 4, pp_size 2"):
        fl.load(saved, tp_size=4, rank=1, pp_size=2, pp_rank=1, progress=False)
    manifest["ranks"]["5"]["parallel"]["pp_rank"] = 1
    manifest["ranks"]["5"]["params"]["model.norm.weight"]["file"] = "elsewhere.safetensors"
    (saved / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match=r"ranks\['5'\]\.params\['model\.norm\.weight'\]\.file is malformed"):
        fl.load(saved, tp_size=8, rank=0, progress=False)
    manifest["version"] = 3
    (saved / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match=r"manifest version 3; this loader reads versions \[1, 2\]"):
        fl.load(saved, tp_size=8, rank=0, progress=False)


def test_a_save_needs_every_rank_of_one_layout(sources, tmp_path):
    llama = sources["llama"]
    with pytest.raises(fl.ConfigError, match="pp_rank/dp_rank pick one rank: leave them out"):
        fl.save_sharded(llama, tmp_path / "out", 2, pp_size=2, pp_rank=1)
    stage0 = [fl.load(llama, progress=False, **kw) for kw in ranks({"tp_size": 2, "pp_size": 2})[:2]]
    with pytest.raises(fl.ConfigError, match=r"got 2 rank states for tp_size=2, pp_size=2, dp_size=1 \(4 ranks\); global ranks \[2, 3\]"):
        fl.save_sharded(stage0, tmp_path / "out")
    other = fl.load(llama, tp_size=2, rank=1, progress=False)
    with pytest.raises(fl.ConfigError, match="rank states are of different models or layouts"):
        fl.save_sharded([stage0[0], other], tmp_path / "out")
    with pytest.raises(fl.ConfigError, match=r"two rank states are rank 0/2 \(pipeline stage 0 of 2\)"):
        fl.save_sharded([stage0[0], stage0[0]], tmp_path / "out")
    assert not (tmp_path / "out").exists()
