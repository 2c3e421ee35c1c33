"""Static memory of one rank: weights, gradient buffers, fp32 main params, optimizer state.

Counted on the rank's meta build (:mod:`planner.meta_build`: the real chunks, trainable
set and megatron DDP buffers), following what training keeps:

- weights: every parameter in its dtype; with the distributed optimizer the trainable ones live
  in megatron's param buffers, whose padding counts (each parameter 64-aligned, each bucket a
  multiple of lcm(DP, 128) elements).
- grads: megatron's gradient buffers, fp32 (``grad_reduce_in_fp32``, :func:`pretrain.stage_build.wrap_ddp`),
  padded likewise; frozen parameters have none.
- main params: an fp32 copy of each bf16 trainable parameter (megatron's mixed-precision
  wrappers); fp32 parameters are stepped in place.
- optimizer: two fp32 tensors per stepped element (bf16 each with megatron's precision-aware
  optimizer: ``optimizer.exp_avg_dtype`` / ``exp_avg_sq_dtype``). Adam: ``exp_avg``, ``exp_avg_sq``. Muon
  (``pretrain.optim``): its momentum in ``exp_avg`` and a zero ``exp_avg_sq`` kept so megatron's
  checkpoint formats work (:attr:`StateBytes.muon_idle`); the parameters Adam keeps in a Muon run
  (``pretrain.optim.matrices.uses_adam``) have Adam's two.

With the distributed optimizer each DDP bucket is split into equal contiguous shards, one per
rank of its data-parallel group (dense parameters: DP x CP ranks; expert parameters: the
expert-DP group, world / (EP x ETP x PP)), and a rank keeps main params and optimizer state only
for the parameter elements inside its shard: padding is nobody's, so ranks differ by it.
Optimizer ``step`` counters (one scalar per parameter, on the host) are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

FP32 = 4  #: bytes of an fp32 element (main params, Adam/Muon state)
STATE_TENSORS = 2  #: exp_avg, exp_avg_sq per stepped element (Adam and this project's Muon)


@dataclass(frozen=True)
class StateBytes:
    """Bytes one rank holds outside activations (see the module docstring)."""

    params: int  #: parameters on this rank (every chunk; frozen ones included)
    weights: int
    grads: int
    main_params: int
    optimizer: int
    trainable: int = 0  #: of ``params``, those the stage trains
    expert_params: int = 0  #: of ``params``, routed-expert ones (megatron ``allreduce=False``)
    muon_idle: int = 0  #: of ``optimizer``, Muon parameters' all-zero ``exp_avg_sq``
    dp_rank: Optional[int] = None  #: the dense DP x CP rank counted (None: no distributed optimizer)
    expert_dp_rank: Optional[int] = None  #: the expert-DP rank counted

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.main_params + self.optimizer


def state_bytes(rc, layout, pp_rank: int, *, trainable: Sequence[str] = (),
                dp_rank: Optional[int] = None, expert_dp_rank: Optional[int] = None) -> StateBytes:
    """What a rank of pipeline rank ``pp_rank`` holds for ``rc`` (one stage's resolved run config)
    at ``layout``; ``trainable``: the stage's ``trainable`` patterns (``Stage.trainable``).

    With the distributed optimizer, ``dp_rank`` / ``expert_dp_rank`` name the rank in the dense
    (DP x CP) and expert-DP groups; None takes the one holding the most state in each group.
    Results are remembered per model, layout, precision and optimizer (a layout search asks for
    the same rank many times; batch and sequence length do not change them)."""
    from planner.meta_build import build_rank

    key = (repr(rc.model), repr(rc.parallel), rc.precision.dtype, rc.optimizer.name,
           moment_bytes(rc.optimizer), layout, pp_rank,
           tuple(trainable or ()), dp_rank, expert_dp_rank)
    if key not in _REMEMBERED:
        if len(_REMEMBERED) >= 4096:
            _REMEMBERED.clear()
        _REMEMBERED[key] = count_rank(build_rank(rc, layout, pp_rank, trainable), rc, dp_rank,
                                      expert_dp_rank)
    return _REMEMBERED[key]


_REMEMBERED: dict = {}  #: state_bytes results by what decides them


def count_rank(rank, rc, dp_rank: Optional[int] = None, expert_dp_rank: Optional[int] = None) -> StateBytes:
    """:func:`state_bytes` of an already built :class:`~planner.meta_build.MetaRank`."""
    from pretrain.optim.matrices import uses_adam

    distributed = rc.parallel.distributed_optimizer
    muon = rc.optimizer.name == "muon"
    params = [p for c in rank.chunks for p in c.parameters()]
    buffered, weights, grads = set(), 0, 0
    shards = {"dense": [], "expert": []}
    for d in rank.ddp:
        for kind, buffers in (("dense", d.buffers), ("expert", d.expert_parallel_buffers)):
            for b in buffers:
                grads += b.grad_data.numel() * b.grad_data.element_size()
                if b.param_data is not None:
                    weights += b.param_data.numel() * b.param_data.element_size()
                    buffered.update(b.param_index_map)
                shards[kind].append(b)
    weights += sum(p.numel() * p.element_size() for p in params if p not in buffered)

    def flags(p) -> tuple[int, int]:
        half = p.dtype in (torch.float16, torch.bfloat16)
        return int(half), int(muon and not uses_adam(rank.names[p], p))

    per_kind, chosen = {}, {}
    for kind, want in (("dense", dp_rank), ("expert", expert_dp_rank)):
        group = rank.dp if kind == "dense" else rank.expert_dp
        if want is not None and not 0 <= want < group:
            raise ValueError(f"{kind} data-parallel rank {want} is not in [0, {group})")
        owned = _owned_elements(shards[kind], group if distributed else 1, flags)  # [ranks, 3]
        if not distributed:
            want = 0
        r = want if want is not None else int((owned[:, 0] * STATE_TENSORS + owned[:, 1]).argmax())
        per_kind[kind], chosen[kind] = owned[r], r
    stepped = sum(int(v[0]) for v in per_kind.values())
    half = sum(int(v[1]) for v in per_kind.values())
    muon_elements = sum(int(v[2]) for v in per_kind.values())
    moments = moment_bytes(rc.optimizer)
    return StateBytes(
        params=sum(p.numel() for p in params),
        weights=weights,
        grads=grads,
        main_params=FP32 * half,
        optimizer=moments * stepped,
        trainable=sum(p.numel() for p in params if p.requires_grad),
        expert_params=sum(p.numel() for p in params if not getattr(p, "allreduce", True)),
        muon_idle=FP32 * muon_elements,
        dp_rank=chosen["dense"] if distributed else None,
        expert_dp_rank=chosen["expert"] if distributed else None,
    )


def _owned_elements(buffers: list, size: int, flags) -> torch.Tensor:
    """int64 [size, 3]: per rank of the buffers' data-parallel group (``size`` ranks; 1: no
    distributed optimizer, every rank steps everything), the parameter elements it steps (all,
    of bf16/fp16 parameters, of Muon matrices)."""
    out = torch.zeros(size, 3, dtype=torch.int64)
    for b in buffers:
        index = list(b.param_index_map.items())  # param -> (start, end, bucket) in the buffer
        if not index:
            continue
        start = torch.tensor([s for _, (s, _, _) in index], dtype=torch.int64)
        end = torch.tensor([e for _, (_, e, _) in index], dtype=torch.int64)
        weight = torch.tensor([(1, *flags(p)) for p, _ in index], dtype=torch.int64)  # [P, 3]
        if size == 1:
            out[0] += ((end - start)[:, None] * weight).sum(0)
            continue
        if b.data_parallel_group.size() != size:
            raise RuntimeError(f"a DDP buffer is sharded over {b.data_parallel_group.size()} ranks, "
                               f"the layout says {size}")
        ranks = torch.arange(size, dtype=torch.int64)[:, None]
        for bucket in b.buckets:
            shard = bucket.grad_data.numel() // size
            lo = bucket.offset + ranks * shard  # [ranks, 1]
            overlap = (torch.minimum(end, lo + shard) - torch.maximum(start, lo)).clamp(min=0)
            out += overlap @ weight
    return out


def moment_bytes(opt) -> int:
    """Bytes of the two optimizer state tensors per stepped element: fp32 each, or bf16 for a
    moment megatron's precision-aware optimizer keeps in bf16 (``optimizer.exp_avg_dtype`` /
    ``exp_avg_sq_dtype``; Adam only, checked by :func:`pretrain.optim.schedule.check_moments`)."""
    return sum(2 if getattr(opt, name, "fp32") == "bf16" else FP32 for name in ("exp_avg_dtype", "exp_avg_sq_dtype"))


def compare_with_run(run_dir: str) -> list[dict]:
    """The prediction next to what a run measured (``<run_dir>/memory/rank<N>.json``, written by
    :mod:`pretrain.reporting.memory_report`): one row per rank and stage, ``{"rank", "stage", "field",
    "predicted", "measured"}`` for ``params`` and every byte field, each rank predicted at its own
    pipeline and data-parallel ranks from the run's resolved ``config.yaml``."""
    import os

    from omegaconf import OmegaConf

    from pretrain.reporting import memory_report
    from pretrain.config.schema import to_run_config
    from pretrain.curriculum import plan
    from pretrain.config.validation import check_run

    rc = to_run_config(OmegaConf.load(os.path.join(run_dir, "config.yaml")))
    stages = {st.name: st for st in plan(rc)[0]}
    measured = memory_report.read(run_dir)
    if sorted(measured) != list(range(len(measured))) or not measured:
        raise ValueError(f"{run_dir}/memory: rank files {sorted(measured)}, expected ranks 0..N-1")
    rows = []
    for rank, by_stage in sorted(measured.items()):
        for name, rec in by_stage.items():
            if name not in stages:
                raise ValueError(f"{run_dir}/memory/rank{rank}.json: stage {name!r} is not a stage of the "
                                 f"run's config.yaml ({', '.join(stages)})")
            st = stages[name]
            layout, problems = check_run(st.rc, len(measured), check_paths=False)
            if problems:
                raise ValueError(f"{run_dir}: stage {name!r} does not validate at {len(measured)} "
                                 f"ranks: {problems}")
            want = state_bytes(st.rc, layout, rec["pp_rank"], trainable=st.trainable,
                               dp_rank=rec["dp_rank"], expert_dp_rank=rec["expert_dp_rank"])
            for field in ("params", *memory_report.FIELDS):
                rows.append({"rank": rank, "stage": name, "field": field,
                             "predicted": getattr(want, field), "measured": rec[field]})
    return rows
