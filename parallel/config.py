"""Typed parallel layout and its validation.

The layout is checked against the model and the world size before any process group, model or
data exists, so a bad launch fails in a second with a message naming the fields and values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional


@dataclass
class ParallelConfig:
    """How ranks split the work. Data parallelism is what is left: world / (tp * pp * cp)."""

    tp: int = 1  #: tensor parallel size (megatron: tensor_model_parallel_size)
    pp: int = 1  #: pipeline stages
    vpp: Optional[int] = None  #: virtual stages (model chunks) per pipeline rank; None = 1
    ep: int = 1  #: expert parallel size
    etp: Optional[int] = None  #: expert tensor parallel size; None = same as tp
    cp: int = 1  #: context parallel size
    sequence_parallel: bool = False  #: shard activations along the sequence inside TP regions
    first_stage_layers: Optional[int] = None  #: uneven pipeline: layers on the first stage
    last_stage_layers: Optional[int] = None  #: uneven pipeline: layers on the last stage
    distributed_optimizer: bool = False  #: shard optimizer state across data-parallel ranks
    #: megatron's ``pipeline_model_parallel_layout``: which model pieces each (pp rank, virtual
    #: stage) holds, e.g. ``Et|(tt|)*30mL`` (E embedding, t decoder layer, m MTP, L loss and
    #: output heads; ``|`` ends a stage; stages in model order). Replaces first/last_stage_layers.
    pipeline_layout: Optional[str] = None
    # Speed features. Names are megatron-core 0.19.2's (ModelParallelConfig / TransformerConfig /
    # DistributedDataParallelConfig); all off by default (the CPU runs), the GPU cluster presets
    # (conf/parallel/*gpu.yaml) turn on what Megatron's own recipes do. What this machine lacks
    # (CUDA, Transformer Engine, DeepEP) is refused at run time, never when planning.
    moe_token_dispatcher_type: str = "alltoall"  #: alltoall | flex (DeepEP / HybridEP kernels)
    moe_flex_dispatcher_backend: str = "deepep"  #: deepep | hybridep (with flex)
    moe_permute_fusion: bool = False  #: fused token permute / unpermute (TE)
    moe_router_fusion: bool = False  #: fused router top-k + scores (TE)
    cross_entropy_loss_fusion: bool = False  #: fused vocab-parallel cross entropy
    apply_rope_fusion: bool = False  #: fused RoPE (TE / apex)
    bias_activation_fusion: bool = False  #: SwiGLU (and the MoE probs) in one fused op each way
    gradient_accumulation_fusion: bool = False  #: wgrad GEMM accumulates into main_grad (TE / apex)
    overlap_grad_reduce: bool = False  #: DDP: bucketed grad reduce(-scatter) during backward
    overlap_param_gather: bool = False  #: distributed optimizer: param all-gather during forward
    overlap_moe_expert_parallel_comm: bool = False  #: EP all-to-all hidden behind another micro-batch
    delay_wgrad_compute: bool = False  #: with the above: expert wgrad after the dispatch backward
    high_priority_a2a_comm_stream: bool = False  #: with the above: its all-to-all stream at CUDA high priority
    tp_comm_overlap: bool = False  #: TE userbuffers: TP all-gather / reduce-scatter overlapped with GEMMs
    #: without CUDA: ``plain`` maps CUDA to the CPU; ``strict`` also tracks which tensors would
    #: live on the GPU and fails where CUDA would (host tensor mixed in, host tensor handed to an
    #: NCCL collective), counting host syncs per step (``host_syncs`` in the metrics)
    cpu_emulation: str = "plain"
    #: how long a collective (and ``init_process_group`` itself: ranks that start first wait there
    #: for the others) may wait before the run fails, in minutes. 30, as large Megatron-LM jobs
    #: set ``--distributed-timeout-minutes``: at hundreds of ranks a checkpoint load at a stage
    #: change or a slow node's start sits inside a collective for minutes (torch's NCCL default,
    #: 10, is what such jobs raise); a real hang still ends well within a job's time limit
    timeout_minutes: float = 30.0
    #: layouts of a curriculum's stages on this cluster, by stage name: ``{stage: {field: value}}``
    #: over the stage's own ``parallel`` fields (and ``recompute``: none | selective | full,
    #: ``recompute_modules``, ``micro_batch_size``: the memory knobs that go with a layout; see
    #: ``pretrain.curriculum.PRESET_STAGE_KEYS``); ``pretrain`` is curriculum=none's one stage.
    #: A cluster preset knows which layout each stage of a recipe needs there
    #: (``python -m planner --search`` finds them); the recipe does not.
    stages: Dict[str, Dict[str, Any]] = field(default_factory=dict)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def virtual_stages(self) -> int:
        return self.vpp or 1


@dataclass(frozen=True)
class Layout:
    """A validated layout with its derived sizes."""

    world_size: int
    dp: int
    expert_dp: int
    layers_per_stage: tuple  #: decoder layers on each (pp rank, virtual stage), in model order
    #: model chunks (model order; chunk c is on pipeline rank c % pp) holding the embedding, the
    #: MTP module and the loss with the output heads; -1: the last chunk
    embedding_chunk: int = 0
    mtp_chunk: int = -1
    loss_chunk: int = -1


def layout_stages(layout: str) -> list[list[str]]:
    """megatron's parse of a ``pipeline_model_parallel_layout`` string: per stage in model order,
    its pieces as megatron's layer-type names (embedding, decoder, mtp, loss). Raises ValueError."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    try:
        return [[t.name for t in stage] for stage in PipelineParallelLayerLayout.parse_str_to_list(layout)]
    except (AssertionError, KeyError, ValueError) as e:
        raise ValueError(str(e)) from None


def _pipeline_layout_problems(par: "ParallelConfig", num_layers: int, mtp_num_steps: int):
    """``(stages, problems)`` of ``parallel.pipeline_layout``: megatron's own checks of the
    string against pp, vpp, the layer count and the MTP module."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    where = f"parallel.pipeline_layout={par.pipeline_layout!r}"
    if par.first_stage_layers is not None or par.last_stage_layers is not None:
        return None, [f"{where} replaces parallel.first_stage_layers={par.first_stage_layers} and "
                      f"last_stage_layers={par.last_stage_layers}: set those to null"]
    try:
        stages = layout_stages(par.pipeline_layout)
    except ValueError as e:
        return None, [f"{where}: {e}"]
    if len(stages) != par.pp * par.virtual_stages:
        return None, [f"{where} has {len(stages)} stages, but parallel.pp={par.pp} x vpp={par.vpp} = "
                      f"{par.pp * par.virtual_stages} model chunks"]
    try:
        PipelineParallelLayerLayout(stages, par.pp) \
            .validate_layer_layout(num_layers=num_layers, mtp_num_layers=1 if mtp_num_steps else None)
    except (AssertionError, NotImplementedError) as e:
        return None, [f"{where} (model.num_layers={num_layers}, one m for the MTP module "
                      f"{'applied ' + str(mtp_num_steps) + ' times' if mtp_num_steps else '(none: mtp_num_steps=0)'}): {e}"]
    return stages, []


def rank_layer_counts(num_layers: int, par: ParallelConfig) -> list[int]:
    """Decoder layers per pipeline rank (all its virtual stages together)."""
    first = par.first_stage_layers
    last = par.last_stage_layers
    middle_layers = num_layers - (first or 0) - (last or 0)
    middle_stages = par.pp - (first is not None) - (last is not None)
    per_rank = middle_layers // middle_stages if middle_stages else 0
    ranks = []
    for r in range(par.pp):
        if r == 0 and first is not None:
            ranks.append(first)
        elif r == par.pp - 1 and last is not None:
            ranks.append(last)
        else:
            ranks.append(per_rank)
    return ranks


def stage_layer_counts(num_layers: int, par: ParallelConfig) -> list[int]:
    """Decoder layers per model chunk in model order (pp ranks x virtual stages), as
    megatron-core assigns them (uneven first/last stages, the rest split evenly)."""
    v = par.virtual_stages
    chunks = [[n // v] * v for n in rank_layer_counts(num_layers, par)]
    return [chunks[r][s] for s in range(v) for r in range(par.pp)]


def check_layout(
    par: ParallelConfig,
    *,
    world_size: int,
    num_layers: int,
    num_attention_heads: int,
    num_experts: Optional[int],
    seq_length: int,
    micro_batch_size: int,
    global_batch_size: int,
    mtp_num_steps: int = 0,
) -> tuple[Optional[Layout], list[str]]:
    """Check ``par`` against the model and world: the derived layout (None when it cannot
    work) and every problem found. Later checks need the earlier ones to hold, so a layout
    reports the problems of the first failing group."""
    p: list[str] = []
    if world_size < 1:
        p.append(f"world size {world_size} must be >= 1")
    for name in ("tp", "pp", "ep", "cp"):
        if getattr(par, name) < 1:
            p.append(f"parallel.{name}={getattr(par, name)} must be >= 1")
    if par.vpp is not None and par.vpp < 1:
        p.append(f"parallel.vpp={par.vpp} must be >= 1 or null")
    if par.etp is not None and par.etp < 1:
        p.append(f"parallel.etp={par.etp} must be >= 1 or null")
    if par.cpu_emulation not in ("plain", "strict"):
        p.append(f"parallel.cpu_emulation={par.cpu_emulation!r} must be plain or strict")
    if not par.timeout_minutes > 0 or par.timeout_minutes == float("inf"):  # NaN fails the first
        p.append(f"parallel.timeout_minutes={par.timeout_minutes} must be a finite number of minutes > 0")
    if p:
        return None, p

    model_parallel = par.tp * par.pp * par.cp
    if world_size % model_parallel:
        p.append(
            f"world size {world_size} is not divisible by parallel.tp*pp*cp = "
            f"{par.tp}*{par.pp}*{par.cp} = {model_parallel}"
        )
    expert_parallel = par.ep * par.expert_tp * par.pp
    if world_size % expert_parallel:
        p.append(
            f"world size {world_size} is not divisible by parallel.ep*etp*pp = "
            f"{par.ep}*{par.expert_tp}*{par.pp} = {expert_parallel}"
        )
    if num_attention_heads % par.tp:
        p.append(f"model.num_attention_heads={num_attention_heads} is not divisible by parallel.tp={par.tp}")
    if num_experts is None:
        if par.ep > 1:
            p.append(f"parallel.ep={par.ep} needs a MoE model (model.num_experts is unset)")
    elif num_experts % par.ep:
        p.append(f"model.num_experts={num_experts} is not divisible by parallel.ep={par.ep}")
    if par.sequence_parallel and par.tp == 1:
        p.append("parallel.sequence_parallel=true needs parallel.tp > 1")
    if par.tp > 1 and not par.sequence_parallel:
        p.append(
            f"parallel.tp={par.tp} needs parallel.sequence_parallel=true (megatron-core's MoE "
            "layer refuses TP without it, and MLA's replicated down-projections and q/kv norms "
            "reduce their gradients over the TP group only under SP)"
        )
    if par.sequence_parallel and seq_length % par.tp:
        p.append(f"seq_length={seq_length} is not divisible by parallel.tp={par.tp} (sequence parallel)")
    if par.cp > 1 and seq_length % (2 * par.cp):
        p.append(f"seq_length={seq_length} is not divisible by 2*parallel.cp={2 * par.cp}")
    elif par.cp > 1 and par.sequence_parallel and (seq_length // par.cp) % par.tp:
        p.append(
            f"seq_length={seq_length} / parallel.cp={par.cp} = {seq_length // par.cp} tokens per CP "
            f"rank is not divisible by parallel.tp={par.tp} (sequence parallel)"
        )
    if par.vpp is not None and par.vpp > 1 and par.pp == 1:
        p.append(f"parallel.vpp={par.vpp} needs parallel.pp > 1")
    for name in ("first_stage_layers", "last_stage_layers"):
        val = getattr(par, name)
        if val is not None and (par.pp == 1 or val < 1):
            p.append(f"parallel.{name}={val} needs parallel.pp > 1 and a value >= 1")
    if p:
        return None, p
    chunks = None
    if par.pipeline_layout:
        stages, p = _pipeline_layout_problems(par, num_layers, mtp_num_steps)
        if p:
            return None, p
        chunks = dict(layers_per_stage=tuple(st.count("decoder") for st in stages),
                      **{f"{piece}_chunk": next(c for c, st in enumerate(stages) if kind in st)
                         for piece, kind in (("embedding", "embedding"), ("loss", "loss"))},
                      mtp_chunk=next((c for c, st in enumerate(stages) if "mtp" in st), -1))

    uneven = (par.first_stage_layers or 0) + (par.last_stage_layers or 0)
    middle_stages = par.pp - (par.first_stage_layers is not None) - (par.last_stage_layers is not None)
    middle_layers = num_layers - uneven
    if chunks is not None:
        pass  # megatron checked the layout string
    elif middle_layers < 0 or (middle_stages == 0 and middle_layers != 0):
        p.append(
            f"parallel.first_stage_layers={par.first_stage_layers} + last_stage_layers="
            f"{par.last_stage_layers} do not add up to model.num_layers={num_layers} over pp={par.pp}"
        )
    elif middle_stages and middle_layers % middle_stages:
        p.append(
            f"model.num_layers={num_layers} (minus uneven first/last stages: {uneven}) is not "
            f"divisible by the remaining {middle_stages} pipeline stages (parallel.pp={par.pp})"
        )
    else:
        for r, n in enumerate(rank_layer_counts(num_layers, par)):
            if n % par.virtual_stages:
                p.append(
                    f"pipeline rank {r} holds {n} layers, not divisible by parallel.vpp={par.vpp}"
                )
            elif n // par.virtual_stages < 1:
                p.append(
                    f"pipeline rank {r} would hold {n} layers for parallel.vpp={par.vpp}: every "
                    "model chunk needs at least one layer"
                )
    if p:
        return None, p

    dp = world_size // model_parallel
    if micro_batch_size < 1 or global_batch_size < 1:
        p.append(
            f"trainer.micro_batch_size={micro_batch_size} and trainer.global_batch_size="
            f"{global_batch_size} must be >= 1"
        )
    elif global_batch_size % (micro_batch_size * dp):
        p.append(
            f"trainer.global_batch_size={global_batch_size} is not divisible by "
            f"trainer.micro_batch_size*dp = {micro_batch_size}*{dp}"
        )
    elif par.vpp and par.vpp > 1 and (global_batch_size // (micro_batch_size * dp)) % par.pp:
        p.append(
            f"interleaved pipeline: micro-batches per step "
            f"({global_batch_size // (micro_batch_size * dp)}) must be a multiple of parallel.pp={par.pp}"
        )
    if p:
        return None, p
    return Layout(
        world_size=world_size,
        dp=dp,
        expert_dp=world_size // expert_parallel,
        **(chunks or dict(layers_per_stage=tuple(stage_layer_counts(num_layers, par)))),
    ), []
