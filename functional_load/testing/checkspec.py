"""``functional-load check-spec SPEC_OR_ARCH``: prove a spec against real vLLM and transformers.

1. The spec: a ``.toml`` file (an out-of-tree one is put first on the spec search path for the
   check), a spec name, or an architecture class name (``Qwen3ForCausalLM``).
2. A tiny random checkpoint of that architecture, written by transformers from the tiny config
   of :data:`functional_load.testing.archs.ARCHS` whose architecture the spec lists.
3. (a) When the vLLM parity environment exists (:func:`.parity.env.venv_dir`, built by
   ``python -m functional_load.testing.parity.env``), real vLLM loads every rank of every tp size
   and each rank state must be bit-identical to functional_load's (or refused by both); MoE models
   with and without expert parallelism.
   (b) Independent of vLLM, for the families :mod:`.tp_forward` knows: a tensor-parallel forward
   over the loaded ranks (a checkpoint rescaled so every block moves the logits) must give
   transformers' logits.

Exit status 0 when every check that ran passed, 1 otherwise; the report says what ran.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import functional_load as fl

from ..layout.parallel import Parallel
from ..model.spec import SPEC_PATH_ENV, ArchSpec, find_spec, load_spec, spec_for_config
from .archs import ARCHS
from .archspec import ArchSpec as TinyArch
from .checkpoints import quiet_transformers
from .forward import write_unit_scale_checkpoint
from .parity import env
from .parity.case import check_case
from .parity.record import Live, Oracle
from .parity.run import ACCEPTED, run_parity, summary
from .tp_forward import FAMILIES, tp_logits

FORWARD_TOLERANCE = 1e-5  # of the largest logit: float32 rounding (2e-6 of it measured here); a wrong block moves them by O(1)


@dataclass(frozen=True)
class Check:
    """One check's outcome: ``status`` "ok", "FAIL" or "skipped" (it could not run here: why)."""

    what: str
    status: str
    detail: str


def resolve(target: str) -> tuple[ArchSpec, Path | None]:
    """The spec ``target`` names, and its file when it is one (``.toml``)."""
    if target.endswith(".toml"):
        return load_spec(target), Path(target).resolve()
    if target[:1].isupper():  # an architecture class name
        return spec_for_config({"architectures": [target]}), None
    return find_spec(target), None


def tiny_arch(spec: ArchSpec) -> str:
    """The key of the tiny architecture that writes a checkpoint this spec serves."""
    for key, arch in ARCHS.items():
        if _architecture(arch) in spec.architectures:
            return key
    raise SystemExit(
        f"check-spec: no tiny transformers config writes {' or '.join(spec.architectures)}; add one to a table of "
        f"functional_load/testing/archs_*.py (transformers config and model class, tiny sizes; see "
        f"docs/adding-an-architecture.md), or check an existing checkpoint with `functional-load verify`"
    )


def _architecture(arch: TinyArch) -> str:
    names = arch.config_json.get("architectures")
    return str(names[0]) if names else arch.model_class


def check_spec(
    target: str,
    *,
    tps: Sequence[int] = (1, 2, 4, 8),
    kv_heads: int = 2,
    work: Path | None = None,
    vllm: bool = True,
    oracle: Oracle | None = None,
) -> list[Check]:
    spec, file = resolve(target)
    key = tiny_arch(spec)
    previous = os.environ.get(SPEC_PATH_ENV)
    if file is not None:  # the file first on the search path: it serves its architectures here
        os.environ[SPEC_PATH_ENV] = os.pathsep.join([str(file.parent)] + ([previous] if previous else []))
    try:
        with tempfile.TemporaryDirectory(prefix="fl-check-spec-") as tmp:
            root = work or Path(tmp)
            checks = _with_vllm(key, tps, kv_heads, root, oracle) if vllm else []
            checks += _forward(key, tps, kv_heads, root)
        return checks
    finally:
        if file is not None:
            if previous is None:
                os.environ.pop(SPEC_PATH_ENV, None)
            else:
                os.environ[SPEC_PATH_ENV] = previous


def _build(key: str, kv_heads: int) -> dict[str, int]:
    return {"kv_heads": kv_heads} if ARCHS[key].kv_heads_key else {}


def _with_vllm(key: str, tps: Sequence[int], kv_heads: int, root: Path, oracle: Oracle | None) -> list[Check]:
    """Real vLLM's rank states (``oracle``: live when None and its environment exists; the
    test suite replays recorded ones)."""
    if oracle is None:
        if not env.ready():
            why = f"no parity environment at {env.venv_dir()} (python -m functional_load.testing.parity.env builds it)"
            return [Check("vLLM", "skipped", why)]
        oracle = Live(env.python(), workers=1)
    rows = run_parity([check_case(key, tuple(tps), kv_heads)], root / "parity", oracle=oracle, progress=False)
    bad = [r.line() for r in rows if r.outcome not in ACCEPTED]
    return [Check("vLLM", "FAIL" if bad else "ok", summary(rows) + ("".join(f"\n    {line}" for line in bad[:20])))]


def _forward(key: str, tps: Sequence[int], kv_heads: int, root: Path) -> list[Check]:
    import torch
    from transformers import AutoModelForCausalLM

    family = ARCHS[key].model_class
    if family not in FAMILIES:
        return [Check("forward", "skipped", f"no reference tensor-parallel forward for {family} (known: {', '.join(FAMILIES)})")]
    with quiet_transformers():
        path = write_unit_scale_checkpoint(key, root / "unit-scale", dtype="float32", **_build(key, kv_heads))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = model.config.to_dict()
    ids = torch.arange(0, 2 * config["vocab_size"], 37)[:24] % config["vocab_size"]
    with torch.no_grad():
        reference = model(ids[None]).logits[0].float()
    checks = []
    eps = (False, True) if ARCHS[key].moe else (False,)
    for tp in tps:
        for ep in eps:
            parallels = [Parallel(tp, r, ep) for r in range(tp)]
            try:
                states = [fl.load(path, tp_size=tp, rank=r, expert_parallel=ep, dtype="float32") for r in range(tp)]
            except fl.LoadError as exc:
                checks.append(Check(f"forward tp {tp}{' ep' if ep else ''}", "skipped", f"functional_load refuses it: {str(exc)[:160]}"))
                continue
            with torch.no_grad():
                logits = tp_logits(family, states, parallels, config, ids)
            err = float((logits - reference).abs().max())
            bound = FORWARD_TOLERANCE * float(reference.abs().max())
            detail = f"max |logits - transformers'| {err:.2e} (bound {bound:.2e})"
            checks.append(Check(f"forward tp {tp}{' ep' if ep else ''}", "ok" if err <= bound else "FAIL", detail))
    return checks


def report(checks: Sequence[Check]) -> str:
    return "\n".join(f"{c.status:7s} {c.what}: {c.detail}" for c in checks)
