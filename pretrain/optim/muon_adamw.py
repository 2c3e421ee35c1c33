"""One torch optimizer holding Muon groups and AdamW groups, shaped to live inside megatron's
optimizer wrappers (FP32Optimizer, Float16OptimizerWithFloat16Params, DistributedOptimizer).

Why one optimizer: megatron's distributed optimizer shards each DDP grad buffer, which mixes
Muon and Adam parameters, and its checkpoint formats walk every parameter of the buffer; one
wrapper per buffer must therefore own all of them. Groups flagged ``muon`` are stepped here;
the rest by ``torch.optim.AdamW`` unchanged.

Muon state uses AdamW's state keys so megatron's checkpoint code (which saves ``param``,
``exp_avg``, ``exp_avg_sq`` per element and one common ``step``) stores and reshards it as is:
``exp_avg`` is the Muon momentum buffer, ``exp_avg_sq`` stays zero (4 bytes per Muon parameter
spent to keep every megatron checkpoint format working), ``step`` advances with Adam's.

The update per matrix, as ``torch.optim.Muon``: ``B <- mu B + (1 - mu) g``; Nesterov direction
``g + mu (B - g)``; orthogonalise (per block, see ``newton_schulz``); decoupled weight decay
``W <- W (1 - lr wd)``; ``W <- W - lr * rms_scale * O``.

Distributed optimizer: a rank owns a contiguous range of each bucket of the flattened buffer, so
it may hold only part of a matrix. Each rank packs its Muon direction shards (in buffer order)
into one fp32 segment, and one all-gather over the DP group brings every rank's segment
(:class:`DPAssembly`); a whole matrix is a view of the gathered buffer, or the concatenation of
its pieces where it straddles a rank boundary. Each rank then orthogonalises only the matrices it
owns a part of and keeps its range. Communication per step: one all-gather of the Muon
parameters' size (segments padded to the largest rank's); Newton-Schulz work is duplicated only
for matrices straddling a rank boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.optim.optimizer import _get_scalar_dtype

from pretrain.optim.matrices import MatrixSpec
from pretrain.optim.newton_schulz import orthogonalized_blocks


@dataclass(frozen=True)
class MuonHyper:
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_dtype: str = "fp32"
    scale: str = "match_rms_adamw"


@dataclass(frozen=True)
class ShardPlacement:
    """Where a distributed-optimizer shard sits: its matrix occupies [offset, offset + numel) of
    the DP assembly buffer; the shard is elements [start, end) of the flattened matrix."""

    offset: int
    numel: int
    start: int
    end: int


class DPAssembly:
    """Rebuilds whole matrices from the DP ranks' shards with one all-gather.

    ``segments`` lists, for every rank of ``group`` in order, the runs ``(start, length)`` of the
    Muon elements it owns (in any order), in the assembly layout (the wrapper's Muon matrices one
    after the other, in megatron's buffer order: the same on every rank); ``placements`` are this
    rank's shards.
    ``device`` is the parameters' (megatron's grad buffers'): the segments are gathered there (NCCL
    on GPUs) and Newton-Schulz runs on views of them; a rank that owns no Muon shard still sends
    its (padding) segment, so the device cannot be taken from its directions."""

    def __init__(self, group, rank: int, segments: list, placements: dict, device: torch.device):
        self.group, self.placements = group, placements
        self.device = torch.device(device)
        segments = [_merged(runs) for runs in segments]  # a rank packs its shards in assembly order
        self.width = max((sum(n for _, n in runs) for runs in segments), default=0)
        self.own = sorted(placements, key=lambda p: placements[p].offset + placements[p].start)
        owned = [(placements[p].offset + placements[p].start, placements[p].end - placements[p].start)
                 for p in self.own]
        if _merged(owned) != segments[rank]:
            raise ValueError(f"DP rank {rank}'s Muon shards {owned} are not its segment {segments[rank]}")
        self.padding = self.width - sum(n for _, n in owned)
        # where each run of every rank sits in the gathered buffer, by assembly position
        runs = sorted((start, r * self.width + at, n) for r, rank_runs in enumerate(segments)
                      for (start, n), at in zip(rank_runs, _positions(rank_runs)))
        self.pieces = {p: _pieces(runs, placements[p].offset, placements[p].numel) for p in placements}

    def gather(self, directions: dict) -> dict:
        """{shard: its whole matrix, flattened} for the shards in ``directions`` (one per Muon
        matrix this rank owns a part of; a shard without a direction sends zeros)."""
        sent = [directions[p] if p in directions else
                torch.zeros(self.placements[p].end - self.placements[p].start, device=self.device)
                for p in self.own]
        sent.append(torch.zeros(self.padding, dtype=torch.float32, device=self.device))
        segment = torch.cat([d.reshape(-1).float() for d in sent])
        gathered = torch.empty(self.width * dist.get_world_size(self.group), dtype=torch.float32,
                               device=self.device)
        dist.all_gather_single(gathered, segment, group=self.group)
        return {p: _joined(gathered, self.pieces[p]) for p in directions}


def _positions(runs: list) -> list:
    """Where each run starts in its rank's segment."""
    at, out = 0, []
    for _, n in runs:
        out.append(at)
        at += n
    return out


def _merged(runs: list) -> list:
    """The runs ``(start, length)`` with adjacent ones joined."""
    out: list = []
    for start, n in sorted(runs):
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + n)
        elif n:
            out.append((start, n))
    return out


def _pieces(runs: list, offset: int, numel: int) -> list:
    """The slices ``(at, length)`` of the gathered buffer that make up assembly elements
    [offset, offset + numel), in order; every element must have exactly one owner."""
    out, covered = [], offset
    for start, at, n in runs:
        lo, hi = max(start, offset), min(start + n, offset + numel)
        if lo < hi:
            if lo != covered:
                raise ValueError(f"assembly elements [{covered}, {lo}) have no owner or two")
            out.append((at + lo - start, hi - lo))
            covered = hi
    if covered != offset + numel:
        raise ValueError(f"assembly elements [{covered}, {offset + numel}) have no owner")
    return out


def _joined(gathered: torch.Tensor, pieces: list) -> torch.Tensor:
    if len(pieces) == 1:
        at, n = pieces[0]
        return gathered[at: at + n]
    return torch.cat([gathered[at: at + n] for at, n in pieces])


class MuonAdamW(torch.optim.AdamW):
    """AdamW for groups without ``muon``; Muon for groups with ``muon=True``.

    ``matrices`` maps each Muon parameter as this optimizer sees it (a model parameter, its fp32
    main copy, or a distributed-optimizer shard) to its ``MatrixSpec``; ``assembly`` is set when
    those parameters are distributed-optimizer shards.
    """

    def __init__(self, param_groups: list, *, matrices: dict, hyper: MuonHyper,
                 assembly: DPAssembly | None = None, **adamw_kwargs):
        # torch's add_param_group refuses non-leaf tensors, and megatron's distributed optimizer
        # steps views into its flat buffers: install the groups the way megatron does, by
        # assignment, after filling in AdamW's defaults.
        super().__init__([torch.zeros(0, requires_grad=True)], **adamw_kwargs)
        for group in param_groups:
            group["params"] = list(group["params"])
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        self.param_groups = list(param_groups)
        self.matrices, self.hyper, self.assembly = matrices, hyper, assembly
        for group in self.param_groups:
            for p in group["params"] if group.get("muon") else ():
                if p not in matrices:
                    raise ValueError(f"Muon group holds a parameter of shape {tuple(p.shape)} "
                                     "without a matrix spec")

    @torch.no_grad()
    def step(self, closure=None):
        groups = self.param_groups
        self.param_groups = [g for g in groups if not g.get("muon")]
        try:
            loss = super().step(closure)
        finally:
            self.param_groups = groups
        self._muon_step([g for g in groups if g.get("muon")])
        for g in groups:  # kept in the groups too, for megatron's checkpoint code under TE / Apex
            steps = [self.state[p]["step"] for p in g["params"] if "step" in self.state.get(p, {})]
            if steps:
                g["step"] = int(steps[0])
        return loss

    def __setstate__(self, state):
        """Per-parameter ``step`` from the group's ``step`` where a loaded state has none: megatron's
        distributed optimizer keeps the step in the param groups, not the state, when Transformer
        Engine or Apex is installed (it expects their FusedAdam)."""
        for group in state["param_groups"]:
            for p in group["params"]:
                p_state = state["state"].get(p)
                if p_state and "step" not in p_state:
                    p_state["step"] = torch.tensor(float(group.get("step", 0)), dtype=_get_scalar_dtype())
        super().__setstate__(state)

    def _direction(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state:
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        mu = self.hyper.momentum
        buf = state["exp_avg"]
        buf.lerp_(p.grad, 1 - mu)
        return p.grad.lerp(buf, mu) if self.hyper.nesterov else buf

    def _muon_step(self, groups) -> None:
        work = [(p, g) for g in groups for p in g["params"] if p.grad is not None]
        directions = {p: self._direction(p) for p, _ in work}
        if self.assembly is not None:
            flat = self.assembly.gather(directions)
        for p, group in work:
            spec: MatrixSpec = self.matrices[p]
            if self.assembly is None:
                full = directions[p].view(spec.shape)
            else:
                full = flat[p].view(spec.shape)
            self._apply(p, spec, full, group["lr"], group["weight_decay"])

    def _apply(self, p, spec: MatrixSpec, full, lr: float, wd: float) -> None:
        h = self.hyper
        if spec.tp_group is not None:
            full = _gather(full, spec.tp_group, spec.tp_dim)
        blocks = orthogonalized_blocks(full, spec.block_rows, h.ns_steps, h.ns_dtype, h.scale)
        p.mul_(1 - lr * wd)
        if spec.tp_group is None and self.assembly is None:
            for first, o, ratio in blocks:
                p[first: first + o.size(0)].add_(o, alpha=-lr * ratio)
            return
        update = torch.cat([o * ratio for _, o, ratio in blocks])
        if spec.tp_group is not None:
            rank = dist.get_rank(spec.tp_group)
            update = update.chunk(dist.get_world_size(spec.tp_group), dim=spec.tp_dim)[rank]
        if self.assembly is not None:
            at = self.assembly.placements[p]
            update = update.reshape(-1)[at.start: at.end]
        p.add_(update.reshape(p.shape), alpha=-lr)


def _gather(local: torch.Tensor, group, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=dim)
