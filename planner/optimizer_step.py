"""Transient memory of the optimizer step (activations are gone by then; state is counted apart).

- Muon (``pretrain.optim.muon_adamw``): every Muon direction (fp32, the rank's own elements) lives
  at once; with the distributed optimizer each wrapper (megatron chains one for the dense buffers,
  one for the expert buffers, stepped one after the other) also packs its own shards into one fp32
  segment and all-gathers every rank's: a buffer of *all* its Muon matrices, unsharded, from which
  whole matrices are rebuilt. Newton-Schulz then
  works on one matrix at a time (TP-gathered when TP splits it other than per head): the matrix,
  its iterate, A = X X^T, B and B X, and the concatenated update.
- Adam: megatron uses Transformer Engine's (or apex's) fused Adam on GPUs: no temporaries. The
  Adam groups inside a Muon run are ``torch.optim.AdamW`` (foreach): one fp32 temporary per
  stepped element (the ``sqrt(v)`` list).
"""

from __future__ import annotations

FP32 = 4


def _muon_elements(rank, rc) -> dict:
    """{"dense"|"expert": Muon elements in that kind's buffers on this rank (unsharded)}, and the
    largest Muon matrix as Newton-Schulz sees it (rows, cols) after any TP gather."""
    from pretrain.optim.matrices import head_blocks, uses_adam

    tp, etp = rc.parallel.tp, rc.parallel.expert_tp
    totals, largest = {"dense": 0, "expert": 0}, (0, 0)
    for chunk in rank.chunks:
        for name, p in chunk.named_parameters():
            if not p.requires_grad or uses_adam(name, p):
                continue
            expert = not getattr(p, "allreduce", True)
            totals["expert" if expert else "dense"] += p.numel()
            rows, cols = p.shape
            per_head = head_blocks(name, (rows, cols), chunk.config, rc.optimizer.muon.split)
            split = 1 if per_head else (etp if expert else tp)
            if getattr(p, "tensor_model_parallel", False) and split > 1:
                if getattr(p, "partition_dim", 0) == 0:
                    rows *= split
                else:
                    cols *= split
            if per_head:
                rows = max(per_head)
            if rows * cols > largest[0] * largest[1]:
                largest = (rows, cols)
    return {**totals, "largest": largest}


def optimizer_step_bytes(rank, rc, state) -> int:
    """Peak transient bytes of one optimizer step on ``rank`` (a ``MetaRank``; ``state``: its
    :class:`~planner.memory.StateBytes`)."""
    if rc.optimizer.name != "muon":
        return 0
    m = _muon_elements(rank, rc)
    rows, cols = m["largest"]
    small = min(rows, cols)
    newton_schulz = FP32 * (4 * rows * cols + 2 * small * small)
    distributed = rc.parallel.distributed_optimizer
    step = 0
    for kind, group in (("dense", rank.dp), ("expert", rank.expert_dp)):
        own = m[kind] // group if distributed else m[kind]
        assembly = m[kind] + own if distributed else 0  # the gathered buffer and the packed segment
        step = max(step, FP32 * (own + assembly))
    adam_elements = state.optimizer // (2 * FP32) - state.muon_idle // FP32
    # MuonAdamW steps its Adam groups first, then the Muon matrices
    return max(step + newton_schulz, FP32 * max(adam_elements, 0))
