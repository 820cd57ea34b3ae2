"""The vLLM model loader of the ``functional_load`` load format (imports vLLM; see :mod:`.vllm`)."""

from __future__ import annotations

import dataclasses
import logging
import time

from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from ..api import plan, resolve_model_dir
from ..checkpoint.discover import checkpoint_format
from ..errors import ConfigError
from ..model.config import read_config
from .vllm_model import LOAD_FORMAT, ExtraConfig, MoePlacement, check_supported, fill_model, live_tensors, write_report

logger = logging.getLogger("vllm.functional_load")  # under vLLM's logger: its handlers print it


class FunctionalLoadLoader(BaseModelLoader):
    """vLLM's ``load_format="functional_load"``: plan this worker's rank, read only its bytes."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        self.extra = ExtraConfig.parse(load_config.model_loader_extra_config)
        self._vllm_config: VllmConfig | None = None

    def download_model(self, model_config: ModelConfig) -> None:
        resolve_model_dir(self.extra.weights or model_config.model, model_config.revision, self.extra.options.load_format,
                          self.extra.options.allow_pickle)

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        self._vllm_config = vllm_config  # the parallel settings the plan needs
        return super().load_model(vllm_config, model_config, prefix)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        from vllm.config import get_current_vllm_config_or_none
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        start = time.perf_counter()
        config = self._vllm_config or get_current_vllm_config_or_none()
        if config is None:
            raise RuntimeError(f"load_format={LOAD_FORMAT!r} needs vLLM's config; call it through vLLM's load_model")
        par = config.parallel_config
        placement = self.extra.expert_placement or par.expert_placement_strategy
        if placement != par.expert_placement_strategy:
            raise ConfigError(
                f"model_loader_extra_config expert_placement={placement!r}, but vLLM places experts "
                f"{par.expert_placement_strategy!r}; set vLLM's --expert-placement-strategy instead"
            )
        ep = bool(par.enable_expert_parallel)
        options = self.extra.options.replace(  # the one options value, with what vLLM decided
            dtype=model_config.dtype, expert_parallel=ep, expert_placement=placement,
            num_redundant_experts=int(getattr(par.eplb_config, "num_redundant_experts", 0) or 0) if ep else 0,
            pp_size=par.pipeline_parallel_size, pp_rank=get_pp_group().rank_in_group,
            dp_size=par.data_parallel_size, dp_rank=par.data_parallel_rank,
        )
        parallel = options.parallel(get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank())
        directory = resolve_model_dir(self.extra.weights or model_config.model, model_config.revision, options.load_format,
                                      options.allow_pickle)
        declared = read_config(directory, checkpoint_format(directory, options.load_format)).get("quantization_config")
        online = model_config.quantization if model_config.quantization and not declared else None
        check_supported(online)
        the_plan = plan(directory, tp_size=parallel.tp_size, rank=parallel.rank, options=options)
        planned = time.perf_counter()
        params = live_tensors(model, the_plan)
        stats = dataclasses.replace(fill_model(the_plan, params, options, _placements(model)), plan_seconds=planned - start)
        seconds = time.perf_counter() - start
        write_report(self.extra.report_dir, the_plan, stats, seconds)
        logger.info("functional_load: tensor %s loaded in %.2f s: %s", parallel.describe(), seconds, stats.summary())


def _placements(model: nn.Module) -> dict[str, MoePlacement]:
    """How vLLM placed each fused-MoE layer's experts on this rank."""
    import torch

    out = {}
    for name, module in model.named_modules():
        manager = getattr(module, "expert_map_manager", None)
        if manager is None or name.endswith("expert_map_manager"):
            continue
        expert_map = manager.expert_map
        if expert_map is None:
            local = tuple(range(manager.global_num_experts))
        else:
            ids = torch.nonzero(expert_map >= 0).flatten().tolist()
            local = tuple(sorted(ids, key=lambda g: int(expert_map[g])))
        out[name] = MoePlacement(str(manager.placement_strategy), int(manager.global_num_experts), local)
    return out


def register() -> None:
    """The ``vllm.general_plugins`` entry point, called by vLLM in every process: add the
    ``functional_load`` load format to vLLM's model-loader registry (once per process)."""
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    if _LOAD_FORMAT_TO_MODEL_LOADER.get(LOAD_FORMAT) is not FunctionalLoadLoader:
        register_model_loader(LOAD_FORMAT)(FunctionalLoadLoader)
