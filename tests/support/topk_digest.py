"""Which keys every DSA sparse selection picked, per training step and rank, recorded around the
training entry point (in a :mod:`.rank_pool` job: ``run_train(..., digest_dir=DIR)``).

The training code keeps no inspection state: :func:`install` wraps the ``select_topk`` that
``model_providers.glm5.model.dsa.attention`` calls and ``pretrain.step.train_step`` (for the step number);
inside :func:`recording` each rank writes ``DIR/rank<r>.json``: ``{step: [row digests]}``. A row
digest hashes the layer, the query's global position and the set of visible keys it selected; a
step's digests are a set, so the union over ranks is the same for any data, tensor, context or
pipeline layout that selected the same keys (TP ranks repeat their group's selections; DP and CP
ranks hold other rows). Selections made outside a training step (validation) are not recorded.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch

_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # an odd 64-bit constant, as a signed int64


def row_digests(idx: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor, layer: int) -> list[int]:
    """int64 digests of selection rows: idx/valid [b, s, k], positions [s] (global)."""
    keys = torch.where(valid, idx, torch.full_like(idx, -1)).sort(dim=-1).values.to(torch.int64)
    weights = torch.arange(1, keys.shape[-1] + 1, dtype=torch.int64) * _MIX  # wraps: a hash, not a sum
    h = (keys + 2) * weights
    h = h.sum(dim=-1) * 1_000_003 + positions.to(torch.int64).view(1, -1) * 7919 + layer
    return h.flatten().tolist()


_TARGET: dict = {"dir": None, "steps": {}}  #: where the current run records, and what it has


@contextlib.contextmanager
def recording(digest_dir):
    """Record the selections of the runs inside the block into ``digest_dir`` (None: nothing)."""
    if digest_dir is None:
        yield
        return
    install()
    os.makedirs(digest_dir, exist_ok=True)
    _TARGET.update(dir=str(digest_dir), steps={})
    try:
        yield
    finally:
        _TARGET.update(dir=None, steps={})


def install() -> None:
    """Wrap the selection and the training step, once per process."""
    import torch.distributed as dist

    from model_providers.glm5.model.dsa import attention
    from pretrain import step as one_step

    if getattr(attention.select_topk, "records_topk", False):
        return
    current = {"step": None, "layer": 0}
    select, forward, train_step = attention.select_topk, attention.DSACoreAttention.forward, one_step.train_step

    def recording_select(q, k, w, topk, chunk, dtype="fp32", first=0, layout=None, *args, **kwargs):
        idx, valid = select(q, k, w, topk, chunk, dtype, first, layout, *args, **kwargs)
        if current["step"] is not None:
            positions = (torch.arange(first, first + idx.shape[1]) if layout is None
                         else layout.q_pos[first:first + idx.shape[1]])
            _TARGET["steps"].setdefault(current["step"], set()).update(
                row_digests(idx.cpu(), valid.cpu(), positions.cpu(), current["layer"]))
        return idx, valid

    def forward_noting_layer(self, *args, **kwargs):
        current["layer"] = self.layer_number
        return forward(self, *args, **kwargs)

    def step_recorded(ddp_chunks, optimizer, scheduler, dataset, consumed_samples, trainer_cfg, *args, **kwargs):
        if _TARGET["dir"] is not None:
            current["step"] = consumed_samples // trainer_cfg.global_batch_size + 1
        try:
            return train_step(ddp_chunks, optimizer, scheduler, dataset, consumed_samples, trainer_cfg,
                              *args, **kwargs)
        finally:
            if current["step"] is not None:
                current["step"] = None
                rank = dist.get_rank() if dist.is_initialized() else 0
                path = os.path.join(_TARGET["dir"], f"rank{rank}.json")
                with open(path + ".tmp", "w") as f:
                    json.dump({s: sorted(d) for s, d in _TARGET["steps"].items()}, f)
                os.replace(path + ".tmp", path)

    recording_select.records_topk = True
    attention.select_topk = recording_select
    attention.DSACoreAttention.forward = forward_noting_layer
    one_step.train_step = step_recorded


def read(digest_dir) -> dict[int, frozenset]:
    """{step: the union of every rank's row digests}."""
    union: dict = {}
    for name in sorted(os.listdir(digest_dir)):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(digest_dir, name)) as f:
                for step, rows in json.load(f).items():
                    union.setdefault(int(step), set()).update(rows)
    return {s: frozenset(r) for s, r in union.items()}
