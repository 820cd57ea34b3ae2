"""functional_load: plan-first, per-rank loading of LLM checkpoints with vLLM's semantics.

A load is a pipeline of pure stages over immutable values, one folder each: ``model`` (config,
spec, quantization config) -> ``layout`` (what a rank holds) -> ``checkpoint`` (headers only) ->
``plan`` (validated routing) -> ``io`` (the only stage that reads tensor bytes) -> ``transform``
-> ``output``. Each rank (or JAX device) reads only the bytes it keeps. Every entry point takes
one :class:`LoadOptions`.
"""

from .api import layout as layout
from .api import load as load
from .api import plan as plan
from .api import save_sharded as save_sharded
from .api_jax import load_jax as load_jax
from .errors import CheckpointError as CheckpointError
from .errors import ConfigError as ConfigError
from .errors import LoadError as LoadError
from .errors import MissingFileError as MissingFileError
from .errors import PlanError as PlanError
from .errors import ShardingError as ShardingError
from .io import ReadOptions as ReadOptions
from .layout.parallel import Parallel as Parallel
from .layout.sharding import Replicated as Replicated
from .layout.sharding import Split as Split
from .layout.sharding import VocabSplit as VocabSplit
from .model.targetmap import Drop as Drop
from .model.targetmap import Rule as Rule
from .model.targetmap import TargetMap as TargetMap
from .options import LoadOptions as LoadOptions
from .output.state import LoadedState as LoadedState
from .plan import Plan as Plan
from .transform.dequant import dequantize as dequantize
from .verify import verify_ranks as verify
from .vllm_target import VLLM_VERSION as VLLM_VERSION

__all__ = [
    "VLLM_VERSION",
    "CheckpointError",
    "ConfigError",
    "Drop",
    "LoadError",
    "LoadOptions",
    "LoadedState",
    "MissingFileError",
    "Parallel",
    "Plan",
    "PlanError",
    "ReadOptions",
    "Replicated",
    "Rule",
    "ShardingError",
    "Split",
    "TargetMap",
    "VocabSplit",
    "dequantize",
    "layout",
    "load",
    "load_jax",
    "plan",
    "save_sharded",
    "verify",
]
