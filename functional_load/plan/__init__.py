"""4. Planning: route checkpoint tensors to parameter slices (:func:`.make.make_plan`) into a
validated :class:`.plan.Plan`."""

from .make import make_plan
from .plan import Copy, ParamPlan, Plan

__all__ = ["Copy", "ParamPlan", "Plan", "make_plan"]
