"""What a live rank holds: bytes of its weights, gradient buffers, fp32 main params and optimizer
state, measured once per stage after its first optimizer step, written to
``<run_dir>/memory/rank<N>.json``.

Measured from the tensors themselves: each tensor's whole storage counts once (megatron's DDP
buffers back many parameters and gradients with one allocation, padding included), in the first
of these that reaches it: model parameters (weights), their ``main_grad`` / ``grad`` (grads), the
parameters the inner optimizers step (main params: the fp32 copies; fp32 parameters stepped in
place are already weights), the optimizer's state tensors (its per-parameter ``step`` counters
are host scalars and are left out). Reading storage sizes and pointers does not touch the device:
no synchronisation. ``planner.memory.state_bytes`` predicts the same numbers before launch.
"""

from __future__ import annotations

import json
import os

import torch

FIELDS = ("weights", "grads", "main_params", "optimizer")


class _Storages:
    """Bytes of storages not counted yet."""

    def __init__(self):
        self.seen = set()

    def take(self, t) -> int:
        if t is None or not torch.is_tensor(t):
            return 0
        s = t.untyped_storage()
        key = (str(s.device), s.data_ptr())
        if key in self.seen:
            return 0
        self.seen.add(key)
        return s.nbytes()


def inner_optimizers(optimizer) -> list:
    """The torch optimizers inside megatron's (chained) optimizer wrappers."""
    wrappers = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [w.optimizer for w in wrappers if getattr(w, "optimizer", None) is not None]


def measure(model_chunks, optimizer) -> dict:
    """``{"params", "weights", "grads", "main_params", "optimizer"}`` of this rank: parameter
    count and bytes (see the module docstring). ``model_chunks``: the DDP-wrapped chunks."""
    seen = _Storages()
    params = [p for chunk in model_chunks for p in chunk.parameters()]
    out = {"params": sum(p.numel() for p in params)}
    out["weights"] = sum(seen.take(p) for p in params)
    out["grads"] = sum(seen.take(getattr(p, "main_grad", None)) + seen.take(p.grad) for p in params)
    inner = inner_optimizers(optimizer)
    out["main_params"] = sum(seen.take(q) for opt in inner for g in opt.param_groups for q in g["params"])
    out["optimizer"] = sum(seen.take(v) for opt in inner for state in opt.state.values()
                           for k, v in state.items() if k != "step")
    return out


def rank_position() -> dict:
    """This rank's place in megatron's groups (what the planner needs to predict its numbers)."""
    from megatron.core import parallel_state as ps

    return {
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "dp_rank": ps.get_data_parallel_rank(with_context_parallel=True),
        "expert_dp_rank": ps.get_expert_data_parallel_rank(),
    }


def report_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, "memory", f"rank{rank}.json")


def write(run_dir: str, rank: int, stage: str, step: int, model_chunks, optimizer) -> bool:
    """Measure and record this stage's entry in this rank's file (other stages' entries are
    kept); written to a temporary file and renamed, so a reader never sees half of it."""
    record = {"step": step, **rank_position(), **measure(model_chunks, optimizer)}
    if torch.cuda.is_available():
        record["cuda_allocated"] = torch.cuda.memory_allocated()
    path = report_path(run_dir, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    previous = {}
    if os.path.exists(path):
        with open(path) as f:
            previous = json.load(f).get("stages", {})
    doc = {"rank": rank, "stages": {**previous, stage: record}}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return True


def read(run_dir: str) -> dict:
    """``{rank: {stage: record}}`` of every rank file under ``<run_dir>/memory``."""
    folder = os.path.join(run_dir, "memory")
    out = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                doc = json.load(f)
            out[doc["rank"]] = doc["stages"]
    return out
