"""functional_load: plan-first, per-rank loading of LLM checkpoints with vLLM's semantics.

A load is a pipeline of pure stages over immutable values: config + spec -> layout, headers ->
checkpoint index, names -> routes, (layout, checkpoint) -> validated plan; only ``execute``
reads tensor bytes, and each rank reads only the bytes it keeps.
"""

from .api import layout as layout
from .api import load as load
from .api import plan as plan
from .execute import LoadedState as LoadedState
from .jax_load import load_jax as load_jax
from .sharded_state import save_sharded as save_sharded
from .quant.dequant import dequantize as dequantize
from .errors import CheckpointError as CheckpointError
from .errors import ConfigError as ConfigError
from .errors import LoadError as LoadError
from .errors import MissingFileError as MissingFileError
from .errors import PlanError as PlanError
from .errors import ShardingError as ShardingError
from .layout import Layout as Layout
from .layout import Parallel as Parallel
from .layout import ParamSpec as ParamSpec
from .mapping import MappingTable as MappingTable
from .mapping import Rule as Rule
from .plan import Copy as Copy
from .plan import ParamPlan as ParamPlan
from .plan import Plan as Plan
from .sharding import Replicated as Replicated
from .sharding import Segment as Segment
from .sharding import Split as Split
from .sharding import VocabSplit as VocabSplit

__all__ = [
    "CheckpointError",
    "ConfigError",
    "Copy",
    "Layout",
    "LoadedState",
    "LoadError",
    "MappingTable",
    "MissingFileError",
    "Parallel",
    "ParamPlan",
    "ParamSpec",
    "Plan",
    "PlanError",
    "Replicated",
    "Rule",
    "Segment",
    "ShardingError",
    "Split",
    "VocabSplit",
    "dequantize",
    "layout",
    "load",
    "load_jax",
    "save_sharded",
    "plan",
]
