"""The JAX-stack cases: which model, mesh and options each stack is asked about, and how.

Each case is one question to a real stack (its own code, in its own environment, see
:mod:`.oracle`): its abstract parameter tree, its own loader's arrays and its own forward's logits.
The answers are recorded (:mod:`.record`) and replayed against functional_load's ``load_jax``
(:mod:`.replay`): every leaf must equal the own loader's bit for bit, the logits must be
transformers' float32 logits within :data:`TOLERANCE`, the bytes read at most 1.1 x the shards'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TOLERANCE = 1e-5  # transformers' float32 logits (they reach |6|: about 1e-6 relative)
READ_BOUND = 1.1  # bytes read / bytes of this process's distinct shards
MAPS = {
    ("tpu-inference", "llama"): "tpu-inference.llama3",
    ("tpu-inference", "qwen3"): "tpu-inference.qwen3",
    ("maxtext", "llama"): "maxtext.llama3.1",
    ("maxtext", "qwen3"): "maxtext.qwen3",
}
WORKERS = {"tpu-inference": "tpu_inference_stack", "maxtext": "maxtext_stack"}


@dataclass(frozen=True)
class Case:
    arch: str
    mesh: dict[str, int]
    head_dim: int = 16
    options: dict[str, Any] = field(default_factory=dict)
    own: bool = True  # the stack's own loader can load it (compared bit for bit)
    reference: bool = True  # transformers' float32 logits apply (not to a bfloat16 model)

    @property
    def name(self) -> str:
        mesh = "x".join(f"{k}{v}" for k, v in self.mesh.items())
        extra = ",".join(f"{k}={v}" for k, v in self.options.items() if k != "model_name")
        return f"{self.arch}/hd{self.head_dim}/{mesh}" + (f"/{extra}" if extra else "")

    @property
    def checkpoint(self) -> str:
        """The tiny checkpoint's directory name (cases with the same one share it)."""
        return f"{self.arch}-hd{self.head_dim}"


CASES: dict[str, list[Case]] = {
    "tpu-inference": [
        Case("llama", {"data": 2, "model": 4}),  # KV heads repeated to the model axis, head_dim padded to 128
        Case("llama", {"data": 4, "model": 2}),
        Case("llama", {"data": 2, "model": 4}, options={"dtype": "bfloat16"}, reference=False),  # cast from float32
        Case("qwen3", {"data": 4, "model": 2}, head_dim=128),
        Case("qwen3", {"data": 2, "model": 4}, head_dim=64, own=False),  # its own loader repeats no KV head
    ],
    "maxtext": [
        Case("llama", {"fsdp": 4, "tensor": 2}, options={"scan_layers": True}),
        Case("llama", {"fsdp": 4, "tensor": 2}, options={"scan_layers": False}),
        Case("qwen3", {"fsdp": 4, "tensor": 2}, options={"scan_layers": True}),
        Case("qwen3", {"fsdp": 4, "tensor": 2}, options={"scan_layers": False}),
    ],
}


def case_id(stack: str, case: Case) -> str:
    return f"{stack} {case.name}"


def all_cases() -> dict[str, tuple[str, Case]]:
    """``{case id: (stack, case)}`` in :data:`CASES` order."""
    return {case_id(stack, case): (stack, case) for stack, cases in CASES.items() for case in cases}


def definition(stack: str, case: Case) -> dict[str, Any]:
    """Everything of a case that decides the oracle's answer (the mesh as ordered pairs: the
    order is the mesh's axis order)."""
    return {
        "stack": stack,
        "arch": case.arch,
        "mesh": [[k, v] for k, v in case.mesh.items()],
        "head_dim": case.head_dim,
        "options": case.options,
        "own": case.own,
        "reference": case.reference,
    }
