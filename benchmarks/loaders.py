"""The measured loaders of the load benchmark other than the peers (benchmarks/peers.py):
functional_load, the vLLM-style loader, ``safetensors.torch.load_file`` + clone and the
machine's limits, plus the vLLM layout step (``VllmLayout``) that the peers reuse.

Each ``run_*`` takes the worker's job and returns ``{"out_bytes", "get"?, ...}`` (see
``measure.run_worker``); ``KINDS`` maps a job kind to (modules imported before the timer, fn).
"""

from __future__ import annotations

import os
import threading

BLOCK = 16 << 20


def shard_rule(name: str) -> str:
    """How vLLM shards a Llama checkpoint tensor: 'col' (dim 0), 'row' (dim 1), 'vocab', 'rep'."""
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")):
        return "col"
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return "row"
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return "vocab"
    return "rep"


def fused_slot(name: str, cfg: dict, tp: int, rank: int) -> tuple[str, int, int, int] | None:
    """For a q/k/v/gate/up tensor: (fused param name, offset in the param, source start, rows)."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or hidden // heads
    inter = cfg["intermediate_size"]
    q_rows = heads // tp * head_dim
    kv_local = max(1, kv_heads // tp)
    kv_rows = kv_local * head_dim
    kv_start = (rank // max(1, tp // kv_heads)) * kv_rows
    i_rows = inter // tp
    table = {
        "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0, rank * q_rows, q_rows),
        "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", q_rows, kv_start, kv_rows),
        "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", q_rows + kv_rows, kv_start, kv_rows),
        "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0, rank * i_rows, i_rows),
        "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", i_rows, rank * i_rows, i_rows),
    }
    for suffix, (param, offset, start, rows) in table.items():
        if name.endswith(suffix):
            return name[: -len(suffix)] + param, offset, start, rows
    return None


def rank_slice(name: str, t, job: dict):
    """The view of checkpoint tensor ``t`` that ``job``'s rank keeps (unpadded, unfused)."""
    tp, rank, cfg = job["tp"], job["rank"], job["config"]
    slot = fused_slot(name, cfg, tp, rank)
    if slot is not None:
        return t.narrow(0, slot[2], slot[3])
    rule = shard_rule(name)
    if rule == "row":
        cols = t.shape[1] // tp
        return t.narrow(1, rank * cols, cols)
    if rule == "vocab":
        per = job["shapes"][name][0]
        start = rank * per
        return t.narrow(0, start, max(0, min(per, t.shape[0] - start)))
    return t


def checkpoint_get(tensors: dict, job: dict, sliced: bool):
    """``get(vllm_name)`` over tensors with checkpoint names: whole (``sliced=False``, sliced
    here) or already the rank's slices; fuses qkv/gate_up and pads the vocabulary (untimed)."""
    import torch

    def piece(name: str):
        return tensors[name] if sliced else rank_slice(name, tensors[name], job)

    def get(name: str):
        if name.endswith("qkv_proj.weight"):
            base = name[: -len("qkv_proj.weight")]
            return torch.cat([piece(base + s) for s in ("q_proj.weight", "k_proj.weight", "v_proj.weight")])
        if name.endswith("gate_up_proj.weight"):
            base = name[: -len("gate_up_proj.weight")]
            return torch.cat([piece(base + "gate_proj.weight"), piece(base + "up_proj.weight")])
        t = piece(name)
        rows = job["shapes"][name][0] if t.dim() == 2 and shard_rule(name) == "vocab" else None
        if rows is not None and t.shape[0] < rows:
            t = torch.cat([t, t.new_zeros(rows - t.shape[0], t.shape[1])])
        return t

    return get


class VllmLayout:
    """vLLM's parameters of one rank (``torch.empty`` at rank-local shapes, fused qkv/gate_up)
    and its weight loaders: ``feed(name, tensor)`` narrows a checkpoint tensor on its shard dim
    and ``copy_``s it into the parameter slot (vocab padding zeroed)."""

    def __init__(self, job: dict):
        import torch

        self.tp, self.rank, self.cfg = job["tp"], job["rank"], job["config"]
        self.vocab = self.cfg["vocab_size"]
        self.params = {name: torch.empty(shape, dtype=torch.bfloat16) for name, shape in job["shapes"].items()}

    def feed(self, name: str, w) -> None:
        slot = fused_slot(name, self.cfg, self.tp, self.rank)
        if slot is not None:
            param, offset, start, rows = slot
            self.params[param].narrow(0, offset, rows).copy_(w.narrow(0, start, rows))
            return
        p = self.params.get(name)
        if p is None:
            return  # e.g. rotary inv_freq
        rule = shard_rule(name)
        if rule == "row":
            cols = p.shape[1]
            p.copy_(w.narrow(1, self.rank * cols, cols))
        elif rule == "vocab":
            per = p.shape[0]
            start = self.rank * per
            n = max(0, min(per, self.vocab - start))
            p[:n].copy_(w.narrow(0, start, n))
            p[n:].zero_()
        else:
            p.copy_(w)

    def result(self) -> dict:
        out_bytes = sum(t.numel() * t.element_size() for t in self.params.values())
        return {"state": self.params, "out_bytes": out_bytes, "get": self.params.__getitem__}


def run_fl(job: dict) -> dict:
    import functional_load

    options = dict(job["options"])
    if options.get("max_over_read") == "tp":
        options["max_over_read"] = float(job["tp"])
    read = functional_load.ReadOptions(**options)
    source = job.get("source") or job["model_dir"]
    state = functional_load.load(source, tp_size=job["tp"], rank=job["rank"], progress=False, read=read)
    return {"state": state, "out_bytes": state.stats.bytes_out, "logical_read": state.stats.bytes_read,
            "get": state.__getitem__}


def run_vllm(job: dict) -> dict:
    """vLLM's default path: preallocated params, safe_open(pt) mmap views, narrow, copy_."""
    from safetensors import safe_open

    layout = VllmLayout(job)
    for path in job["files"]:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                layout.feed(name, f.get_tensor(name))
    return layout.result()


def run_load_file(job: dict) -> dict:
    """safetensors.torch.load_file per shard, then narrow + clone into owned tensors
    (checkpoint names, unfused; fused only afterwards for the checksum)."""
    import torch
    from safetensors.torch import load_file

    out = {}
    for path in job["files"]:
        sd = load_file(path)
        for name, t in sd.items():
            out[name] = rank_slice(name, t, job).clone(memory_format=torch.contiguous_format)
        del sd
    out_bytes = sum(t.numel() * t.element_size() for t in out.values())
    return {"state": out, "out_bytes": out_bytes, "get": checkpoint_get(out, job, sliced=True)}


def run_limit_cold(job: dict) -> dict:
    """Four threads pull 16 MiB blocks in file order and pread them into per-thread,
    pre-faulted buffers: the storage's sequential-read ceiling for these byte ranges."""
    ranges = job["ranges"]  # [path, start, stop]
    blocks = [(p, off, min(BLOCK, stop - off)) for p, start, stop in ranges for off in range(start, stop, BLOCK)]
    lock = threading.Lock()
    position = [0]
    fds = {p: os.open(p, os.O_RDONLY) for p, _, _ in ranges}
    total = [0]

    def worker() -> None:
        view = memoryview(bytearray(BLOCK))
        got_here = 0
        while True:
            with lock:
                i = position[0]
                position[0] += 1
            if i >= len(blocks):
                break
            path, off, n = blocks[i]
            done = 0
            while done < n:
                k = os.preadv(fds[path], [view[done:n]], off + done)
                if k <= 0:
                    break
                done += k
            got_here += done
        with lock:
            total[0] += got_here

    threads = [threading.Thread(target=worker) for _ in range(job.get("threads", 4))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for fd in fds.values():
        os.close(fd)
    return {"state": None, "out_bytes": total[0]}


def _limit_cold_setup(job: dict) -> None:
    for p, _, _ in job["ranges"]:  # files' metadata outside the timer
        os.stat(p)


def _copy_setup(job: dict):
    import torch

    n = job["out_bytes"]
    src = torch.empty(n, dtype=torch.uint8)
    src.fill_(1)  # the pre-loaded source, resident
    dst = None
    if job["kind"] == "limit_prefaulted":
        dst = torch.empty(n, dtype=torch.uint8)
        dst.fill_(0)
    return src, dst


def run_limit_hot(job: dict) -> dict:
    """``torch.empty`` + ``copy_`` of the output bytes from a resident source (page faults included)."""
    import torch

    src, _ = job["_pre"]
    dst = torch.empty(job["out_bytes"], dtype=torch.uint8)
    dst.copy_(src)
    return {"state": dst, "out_bytes": dst.numel()}


def run_limit_prefaulted(job: dict) -> dict:
    src, dst = job["_pre"]
    dst.copy_(src)
    return {"state": dst, "out_bytes": dst.numel()}


run_limit_cold.setup = _limit_cold_setup  # type: ignore[attr-defined]
run_limit_hot.setup = _copy_setup  # type: ignore[attr-defined]
run_limit_prefaulted.setup = _copy_setup  # type: ignore[attr-defined]

# Imports are excluded from the timing. For functional_load that includes the output targets and
# the jitted kernels (and with them jax), as in every earlier run of this benchmark (a
# default-target load no longer imports jax itself).
FL_IMPORTS = ("functional_load", "functional_load.quant.fp8_kernels", "functional_load.transform.targets")
KINDS = {
    "fl": (FL_IMPORTS, run_fl),
    "vllm": (("safetensors",), run_vllm),
    "load_file": (("safetensors.torch",), run_load_file),
    "limit_cold": ((), run_limit_cold),
    "limit_hot": ((), run_limit_hot),
    "limit_prefaulted": ((), run_limit_prefaulted),
}
