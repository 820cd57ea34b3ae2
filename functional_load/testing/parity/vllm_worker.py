"""The vLLM side of the parity harness: real vLLM loads one rank at a time and saves it.

Runs inside the vLLM virtual environment (``python vllm_worker.py JOBS.json OUT_DIR``); it
imports vLLM, torch, safetensors and the standard library only, never functional_load.

For every job (a model directory, a tensor-parallel size and vLLM options) it builds vLLM's real
``VllmConfig`` with ``EngineArgs(...).create_engine_config()``, starts a real one-process world
(gloo), and for each rank ``r`` replaces ``vllm.distributed.parallel_state._TP`` with a proxy
over the real group that reports ``world_size=tp`` and ``rank_in_group=r``: every TP getter (and
the MoE expert-parallel config, which derives from it) reads it at call time; with expert
parallelism ``_EP`` gets the same proxy, for loaders that ask the EP group directly (gpt-oss). It then builds the
model as ``DefaultModelLoader`` does, fills every parameter with 0xFF bytes (NaN for floats, -1
for integers, so elements vLLM never writes stand out), runs vLLM's own ``load_weights`` on
vLLM's own safetensors iterator, and saves the rank's parameters. ``process_weights_after_loading``
is not run: it converts to CPU kernel formats. Kernels are made available where the CPU build
has none (``_kernels_available``: FP8 block, int4 MoE, NVFP4 / MXFP8 / MXFP4 linears through
vLLM's own Emulation kernels); no kernel runs, so the loaded layout is the scheme's. A job with ``load_format="dummy"`` runs vLLM's
``DummyModelLoader.load_weights`` instead, with the ROCm branch of its integer parameters (zeroed;
elsewhere vLLM leaves their ``torch.empty`` bytes, which no loader can reproduce).

Output per job: ``OUT_DIR/<id>/rank<r>.safetensors`` and ``OUT_DIR/<id>/result.json`` with, per
rank, ``status`` ("ok" or "refused"), vLLM's error (type and message) when refused, the
parameters that alias another one (``aliases``: name -> name, tied or shared modules), the
parameters vLLM's loader never writes (``initial``: saved with the value vLLM created them
with, e.g. the -1.0 of an absent KV-cache scale), the buffers (listed, not saved) and the
expert placement vLLM used per MoE layer.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import socket
import sys
import traceback
from pathlib import Path
from typing import Any


class _TPProxy:
    """A real (one-process) group, reporting another size and rank to vLLM's model code: the
    TP, EP and DP groups, and the PP group (whose first and last ranks decide which stage holds
    the embeddings and the head)."""

    def __init__(self, real: Any, world_size: int, rank: int) -> None:
        self._real = real
        self.world_size = world_size
        self.rank_in_group = rank
        self.is_first_rank = rank == 0
        self.is_last_rank = rank == world_size - 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def split_rank(job: dict[str, Any], flat: int) -> tuple[int, int, int]:
    """``(dp_rank, pp_rank, tp_rank)`` of a job's flat rank ``(dp * pp_size + pp) * tp_size + tp``."""
    tp, pp = job["tp"], job.get("pp", 1)
    return flat // (tp * pp), flat // tp % pp, flat % tp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _error(exc: BaseException) -> dict[str, str]:
    message = str(exc).strip() or repr(exc)
    frames = traceback.extract_tb(exc.__traceback__)
    where = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames) if "vllm" in f.filename), "")
    return {"type": type(exc).__name__, "message": message[:2000], "where": where}


class _Capture(logging.Handler):
    """Collects vLLM's warnings for the report."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _engine_config(job: dict[str, Any]) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    if job.get("pp_partition"):  # read by vLLM's get_pp_indices when the model is built
        os.environ["VLLM_PP_LAYER_PARTITION"] = job["pp_partition"]
    else:
        os.environ.pop("VLLM_PP_LAYER_PARTITION", None)

    kwargs: dict[str, Any] = {
        "model": job["model"],
        "tensor_parallel_size": job["tp"],
        "pipeline_parallel_size": job.get("pp", 1),
        "data_parallel_size": job.get("dp", 1),
        "enable_expert_parallel": bool(job.get("expert_parallel", False)),
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "dtype": job.get("dtype", "auto"),
        "load_format": job.get("load_format", "auto"),
        "use_tqdm_on_load": False,
    }
    if job.get("expert_placement"):
        kwargs["expert_placement_strategy"] = job["expert_placement"]
    if job.get("num_redundant_experts"):
        kwargs["enable_eplb"] = True
        kwargs["eplb_config"] = {"num_redundant_experts": job["num_redundant_experts"]}
    if job.get("quantization"):
        kwargs["quantization"] = job["quantization"]
    kwargs.update(job.get("engine_args", {}))
    return EngineArgs(**kwargs).create_engine_config()


def _persistent_buffers(model: Any) -> dict[str, Any]:
    """The model's buffers that are part of its state (a checkpoint may hold them: Gemma 4's
    ``layer_scalar``), by name; rotary caches and other non-persistent buffers are not."""
    saved = set(model.state_dict().keys())
    return {name: b for name, b in model.named_buffers(remove_duplicate=False) if name in saved and b.numel()}


def _fill(model: Any, byte: int) -> None:
    """``byte`` in every byte of every parameter and persistent buffer (0xFF: NaN in every float
    format, -1 in every integer)."""
    import torch

    with torch.no_grad():
        for tensor in [*model.parameters(), *_persistent_buffers(model).values()]:
            if tensor.numel():
                tensor.data.view(-1).view(torch.uint8).fill_(byte)


class _ZeroIntegers:
    """The platform as vLLM's ``initialize_single_dummy_weight`` sees it in a dummy job: ROCm, so
    that integer parameters are zeroed (the one deterministic branch) rather than left as created."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def is_rocm(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@contextlib.contextmanager
def _dummy_platform(dummy: bool) -> Any:
    import vllm.model_executor.model_loader.weight_utils as weight_utils

    real = weight_utils.current_platform
    if dummy:
        weight_utils.current_platform = _ZeroIntegers(real)
    try:
        yield
    finally:
        weight_utils.current_platform = real


def _build_and_load(cfg: Any, rank: tuple[int, int, int], byte: int | None) -> tuple[Any, dict[str, Any]]:
    """vLLM's model for ``rank`` (``(dp_rank, pp_rank, tp_rank)``), every parameter filled with
    ``byte`` (or left as created), then loaded by vLLM's own loader; also the parameters' values
    as vLLM created them."""
    import torch
    import vllm.distributed.parallel_state as ps
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.model_executor.models import utils as model_utils
    from vllm.utils.torch_utils import set_default_torch_dtype

    pc = cfg.parallel_config
    tp, pp, dp = pc.tensor_parallel_size, pc.pipeline_parallel_size, pc.data_parallel_size
    real = ps._TP, ps._EP, ps._PP, ps._DP
    ps._TP = _TPProxy(real[0], tp, rank[2])
    if pc.enable_expert_parallel:  # loaders that ask the EP group (gpt-oss) see the flattened DP x TP rank
        ps._EP = _TPProxy(real[1], dp * tp, rank[0] * tp + rank[2])
    ps._PP = _TPProxy(real[2], pp, rank[1])
    ps._DP = _TPProxy(real[3], dp, rank[0])
    try:
        cfg.compilation_config.static_forward_context.clear()
        # vLLM caches each model's pipeline-missing layer names by id(model) (models/utils.py), for the one
        # model of a worker process; here models come and go, and a new one may reuse a freed one's id
        model_utils._model_to_pp_missing_layer_names.clear()
        dummy = cfg.load_config.load_format == "dummy"
        loader = DummyModelLoader(cfg.load_config) if dummy else DefaultModelLoader(cfg.load_config)
        with set_default_torch_dtype(cfg.model_config.dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=cfg, model_config=cfg.model_config)
        created = {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}
        if byte is not None:
            _fill(model, byte)
        with _dummy_platform(dummy):
            loader.load_weights(model, cfg.model_config)
    finally:
        ps._TP, ps._EP, ps._PP, ps._DP = real
    return model, created


def _load_rank(cfg: Any, rank: tuple[int, int, int]) -> dict[str, Any]:
    """One rank as vLLM loads it, found with two loads of the rank (parameters, and the
    persistent buffers its loader writes: they hold checkpoint values too).

    The first leaves every parameter as vLLM creates it: its result is vLLM's state (some
    loaders read a parameter's created value: compressed-tensors MoE input scales are compared
    with their initial 1.0). The second fills every byte of every parameter with 0xFF first
    (NaN in every float format, -1 in every integer): an element that differs between the two
    was never written by vLLM's loader. A parameter never written at all keeps the value vLLM
    created it with and is listed under ``initial`` (e.g. the -1.0 of an absent KV-cache
    scale); unwritten elements of other parameters are saved as 0xFF, so a half-filled
    parameter shows up as a difference."""
    import torch

    model, _ = _build_and_load(cfg, rank, None)
    result = {**_collect(model), "model_class": type(model).__name__}
    try:
        filled, _ = _build_and_load(cfg, rank, 0xFF)
    except Exception:  # the fill changed what vLLM's loader decides: no element-level view
        return {**result, "initial": [], "sentinel": False}
    loaded, written = _persistent_buffers(model), _persistent_buffers(filled)
    owner: dict[tuple[int, int], str] = {}
    dummy = cfg.load_config.load_format == "dummy"  # its loader draws every buffer too: no checkpoint values
    for name, buffer in written.items() if not dummy else ():  # a buffer the loader wrote is state too (aliases named once)
        if not bool((buffer.view(-1).view(torch.uint8) == 0xFF).all()):
            key = (loaded[name].untyped_storage().data_ptr(), loaded[name].storage_offset())
            if key in owner:
                result["aliases"][name] = owner[key]
                continue
            owner[key] = name
            result["params"][name] = loaded[name].detach().clone().contiguous()
    second = {**dict(filled.named_parameters(remove_duplicate=False)), **written}
    initial = []
    for name, value in result["params"].items():
        other = second[name].detach().contiguous()
        if not value.numel():
            continue
        unwritten = value.view(-1).view(torch.uint8) != other.view(-1).view(torch.uint8)
        if bool(unwritten.all()):
            initial.append(name)
        elif bool(unwritten.any()):
            result["params"][name] = other.clone()
    return {**result, "initial": initial, "sentinel": True}


def _collect(model: Any) -> dict[str, Any]:
    """The parameters (each storage once; aliases named), buffers and expert placement of a model."""
    params: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    owner: dict[tuple[int, int, tuple[int, ...], str], str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        key = (param.untyped_storage().data_ptr(), param.storage_offset(), tuple(param.shape), str(param.dtype))
        if param.numel() and key in owner:
            aliases[name] = owner[key]
            continue
        owner.setdefault(key, name)
        params[name] = param.detach().clone().contiguous()
    return {
        "params": params,
        "aliases": aliases,
        "buffers": sorted(name for name, _ in model.named_buffers(remove_duplicate=False)),
        "experts": _placements(model),
    }


def _placements(model: Any) -> dict[str, Any]:
    """The expert placement vLLM used, per MoE layer: strategy and the global expert of each local slot."""
    import torch

    out = {}
    for name, module in model.named_modules():
        manager = getattr(module, "expert_map_manager", None)
        if manager is None or name.endswith("expert_map_manager"):
            continue
        expert_map = manager.expert_map
        if expert_map is None:
            local = list(range(manager.global_num_experts))
        else:
            ids = torch.nonzero(expert_map >= 0).flatten().tolist()
            local = sorted(ids, key=lambda g: int(expert_map[g]))
        out[name] = {"placement": manager.placement_strategy, "local_experts": local}
    return out


def _kernels_available() -> None:
    """Let vLLM pick its CPU kernels for layers this CPU has none for (FP8 block layers need AMX
    tiles; int4 MoE experts an Arm CPU or a GPU; NVFP4, MXFP8 and MXFP4 linears have no CPU entry
    in vLLM's kernel lists, whose Emulation kernels are plain torch and already the CUDA/ROCm
    fallback; the MXFP4 one asks only that amd-quark be importable, for its forward): only the
    layers' weights are created and loaded here, no kernel ever runs, and the loaded layout does
    not depend on the kernel (the parameters are the quantization scheme's)."""
    import torch
    import vllm._custom_ops as ops
    import vllm.model_executor.kernels.linear as kernels
    import vllm.model_executor.kernels.linear.mxfp4.emulation as mxfp4_emulation
    from vllm.platforms import PlatformEnum

    for table, kernel in (
        ("_POSSIBLE_NVFP4_KERNELS", kernels.EmulationNvFp4LinearKernel),
        ("_POSSIBLE_MXFP8_KERNELS", kernels.EmulationMxfp8LinearKernel),
        ("_POSSIBLE_MXFP4_KERNELS", kernels.EmulationMxfp4LinearKernel),
    ):
        entries = getattr(kernels, table).setdefault(PlatformEnum.CPU, [])
        if kernel not in entries:
            entries.append(kernel)
    mxfp4_emulation.has_quark = lambda: True
    import vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_wna16 as ct_wna16
    from vllm.model_executor.layers.fused_moe.experts.cpu_int4_moe import CPUExpertsInt4
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import WNA16MoEBackend

    torch.cpu._is_amx_tile_supported = lambda: True
    ops._supports_cpu_fp8_w8a16 = True
    CPUExpertsInt4.is_supported_config = classmethod(lambda cls, *args, **kwargs: (True, None))
    # compressed-tensors int4 experts: every backend allocates the same N-first layout
    # ([E, N, K/8] packed weights, [E, N, groups] scales); the CPU one is picked.
    ct_wna16.select_wna16_moe_backend = lambda *args, **kwargs: (WNA16MoEBackend.CPU, CPUExpertsInt4)


def run(jobs: list[dict[str, Any]], out_dir: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import destroy_model_parallel

    _kernels_available()
    capture = _Capture()
    logging.getLogger("vllm").addHandler(capture)
    initialized = False
    for job in jobs:
        job_dir = out_dir / job["id"]
        job_dir.mkdir(parents=True, exist_ok=True)
        result: dict[str, Any] = {"job": job, "ranks": {}}
        capture.messages.clear()
        try:
            cfg = _engine_config(job)
        except Exception as exc:  # vLLM refuses the configuration as a whole
            result["refused"] = _error(exc)
            (job_dir / "result.json").write_text(json.dumps(result, indent=1))
            print(f"{job['id']}: config refused: {result['refused']['message'][:200]}", flush=True)
            continue
        with set_current_vllm_config(cfg):
            dp = cfg.parallel_config.data_parallel_size  # one process: real groups of one, proxies report the sizes
            cfg.parallel_config.data_parallel_size = 1
            try:
                if not initialized:
                    init_distributed_environment(
                        world_size=1, rank=0, local_rank=0,
                        distributed_init_method=f"tcp://127.0.0.1:{_free_port()}", backend="gloo",
                    )
                    initialized = True
                destroy_model_parallel()  # the groups depend on the model (an EP group for MoE models)
                initialize_model_parallel(1, 1)
            finally:
                cfg.parallel_config.data_parallel_size = dp
            for rank in job.get("ranks") or range(job["tp"] * job.get("pp", 1) * job.get("dp", 1)):
                capture.messages.clear()
                entry: dict[str, Any] = {}
                try:
                    with torch.no_grad():
                        loaded = _load_rank(cfg, split_rank(job, rank))
                except Exception as exc:
                    entry = {"status": "refused", "error": _error(exc)}
                else:
                    save_file(loaded.pop("params"), str(job_dir / f"rank{rank}.safetensors"))
                    entry = {"status": "ok", **loaded}
                entry["warnings"] = sorted(set(capture.messages))
                result["ranks"][str(rank)] = entry
                print(f"{job['id']} rank {rank}: {entry['status']}", flush=True)
        (job_dir / "result.json").write_text(json.dumps(result, indent=1))


def main() -> None:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    out_dir = Path(sys.argv[2])
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # vLLM's own chatter goes to the log; the report reads result.json.
    with contextlib.redirect_stderr(io.StringIO()) if os.environ.get("PARITY_QUIET") else contextlib.nullcontext():
        run(jobs, out_dir)


if __name__ == "__main__":
    main()
