"""``python -m tests.support.topk_digest --digest-dir=DIR [hydra overrides]``: the training entry
point, recording which keys every DSA sparse selection picked, per training step and rank.

The training code keeps no inspection state: this launcher wraps the ``select_topk`` that
``model_providers.glm5.model.dsa.attention`` calls and ``loop.train_step`` (for the step number),
and writes ``DIR/rank<r>.json``: ``{step: [row digests]}``. A row digest hashes the layer, the
query's global position and the set of visible keys it selected; a step's digests are a set, so
the union over ranks is the same for any data, tensor, context or pipeline layout that selected
the same keys (TP ranks repeat their group's selections; DP and CP ranks hold other rows).
Selections made outside a training step (validation) are not recorded.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

import torch

FLAG = "--digest-dir="
_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # an odd 64-bit constant, as a signed int64


def command(digest_dir: str, overrides: list[str]) -> list[str]:
    """The module arguments (after ``python`` or ``torchrun``) of a recorded run."""
    return ["-m", __name__, FLAG + str(digest_dir), *overrides]


def row_digests(idx: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor, layer: int) -> list[int]:
    """int64 digests of selection rows: idx/valid [b, s, k], positions [s] (global)."""
    keys = torch.where(valid, idx, torch.full_like(idx, -1)).sort(dim=-1).values.to(torch.int64)
    weights = torch.arange(1, keys.shape[-1] + 1, dtype=torch.int64) * _MIX  # wraps: a hash, not a sum
    h = (keys + 2) * weights
    h = h.sum(dim=-1) * 1_000_003 + positions.to(torch.int64).view(1, -1) * 7919 + layer
    return h.flatten().tolist()


def install(digest_dir: str) -> None:
    import torch.distributed as dist

    from model_providers.glm5.model.dsa import attention
    from pretrain import loop

    steps: dict = {}
    current = {"step": None, "layer": 0}
    select, forward, train_step = attention.select_topk, attention.DSACoreAttention.forward, loop.train_step

    def recording_select(q, k, w, topk, chunk, dtype="fp32", first=0, layout=None, *args, **kwargs):
        idx, valid = select(q, k, w, topk, chunk, dtype, first, layout, *args, **kwargs)
        if current["step"] is not None:
            positions = (torch.arange(first, first + idx.shape[1]) if layout is None
                         else layout.q_pos[first:first + idx.shape[1]])
            steps.setdefault(current["step"], set()).update(
                row_digests(idx.cpu(), valid.cpu(), positions.cpu(), current["layer"]))
        return idx, valid

    def forward_noting_layer(self, *args, **kwargs):
        current["layer"] = self.layer_number
        return forward(self, *args, **kwargs)

    def step_recorded(ddp_chunks, optimizer, scheduler, dataset, consumed_samples, trainer_cfg, *args, **kwargs):
        current["step"] = consumed_samples // trainer_cfg.global_batch_size + 1
        try:
            return train_step(ddp_chunks, optimizer, scheduler, dataset, consumed_samples, trainer_cfg,
                              *args, **kwargs)
        finally:
            current["step"] = None
            rank = dist.get_rank() if dist.is_initialized() else 0
            path = os.path.join(digest_dir, f"rank{rank}.json")
            with open(path + ".tmp", "w") as f:
                json.dump({s: sorted(d) for s, d in steps.items()}, f)
            os.replace(path + ".tmp", path)

    attention.select_topk = recording_select
    attention.DSACoreAttention.forward = forward_noting_layer
    loop.train_step = step_recorded


def read(digest_dir) -> dict[int, frozenset]:
    """{step: the union of every rank's row digests}."""
    union: dict = {}
    for name in sorted(os.listdir(digest_dir)):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(digest_dir, name)) as f:
                for step, rows in json.load(f).items():
                    union.setdefault(int(step), set()).update(rows)
    return {s: frozenset(r) for s, r in union.items()}


def main() -> None:
    if len(sys.argv) < 2 or not sys.argv[1].startswith(FLAG):
        raise SystemExit(f"usage: python -m {__name__} {FLAG}<dir> [hydra overrides]")
    digest_dir = sys.argv[1][len(FLAG):]
    del sys.argv[1]  # the rest is Hydra's
    os.makedirs(digest_dir, exist_ok=True)
    install(digest_dir)
    runpy.run_module("pretrain.train", run_name="__main__")


if __name__ == "__main__":
    main()
