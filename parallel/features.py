"""megatron-core's speed features in a run: the rules megatron-core 0.19.2 puts on combining
them (checked before compute, each message naming the fields), what a machine needs to run them
(checked only when a run starts there: a plan is made on a login node for a GPU cluster), and
the megatron config fields they become.

The fields live in :class:`parallel.config.ParallelConfig` under megatron's names; what each one
does, whether it runs on CPU ranks and how it is tested: ``docs/speed_features.md``.
"""

from __future__ import annotations

import importlib.util

DISPATCHERS = ("alltoall", "flex")
FLEX_BACKENDS = ("deepep", "hybridep")

#: ParallelConfig fields that are megatron TransformerConfig / ModelParallelConfig fields of the
#: same name and meaning
TRANSFORMER_FIELDS = (
    "moe_token_dispatcher_type", "moe_flex_dispatcher_backend", "moe_permute_fusion",
    "moe_router_fusion", "cross_entropy_loss_fusion", "apply_rope_fusion", "bias_activation_fusion",
    "gradient_accumulation_fusion", "overlap_moe_expert_parallel_comm", "delay_wgrad_compute",
    "high_priority_a2a_comm_stream", "tp_comm_overlap",
)
#: ... that are megatron DistributedDataParallelConfig fields
DDP_FIELDS = ("overlap_grad_reduce", "overlap_param_gather")


def check_features(par, model, dtype: str) -> list[str]:
    """Every combination of ``par``'s speed features with the ``model`` (a
    :class:`~model_providers.glm5.model.config.GLM5Config`: recompute mode, MTP steps, experts,
    RoPE, head dims) and the precision ``dtype`` that megatron-core 0.19.2 refuses or cannot run
    (every model here uses multi-latent attention)."""
    p = []
    if par.apply_rope_fusion:
        p += rope_fusion_problems(model)
    if par.tp_comm_overlap:
        # megatron.core.extensions.transformer_engine.TELinear.__init__: a userbuffer name other
        # than qkv / proj / fc1 / fc2 sets ``self.config.tp_comm_overlap = False`` -- on the config
        # every layer shares -- so from the first layer's linear_q_down_proj on, no layer overlaps
        p.append("parallel.tp_comm_overlap=true cannot run with multi-latent attention on "
                 "megatron-core 0.19.2: Transformer Engine has no userbuffers for MLA's projections "
                 "(q_down_proj, kv_down_proj, q_up_proj, kv_up_proj), and megatron's TE linear layer "
                 "then switches the overlap off in the config every later layer shares (it warns once "
                 "and runs the model without it)")
    if par.cross_entropy_loss_fusion and dtype != "bf16":
        p.append(f"parallel.cross_entropy_loss_fusion=true needs precision.dtype=bf16 (got {dtype}): "
                 "megatron's fused cross entropy rounds the logits' gradient to bf16")
    if par.moe_token_dispatcher_type not in DISPATCHERS:
        p.append(f"parallel.moe_token_dispatcher_type={par.moe_token_dispatcher_type!r} must be "
                 f"{' or '.join(DISPATCHERS)}")
    if par.moe_flex_dispatcher_backend not in FLEX_BACKENDS:
        p.append(f"parallel.moe_flex_dispatcher_backend={par.moe_flex_dispatcher_backend!r} must be "
                 f"{' or '.join(FLEX_BACKENDS)}")
    if par.moe_token_dispatcher_type == "flex" and par.ep * par.expert_tp == 1:
        p.append(f"parallel.moe_token_dispatcher_type=flex needs parallel.ep*etp > 1 (got ep={par.ep}, "
                 f"etp={par.expert_tp}): the flex dispatcher moves tokens between expert ranks")
    if par.overlap_param_gather and not par.distributed_optimizer:
        p.append("parallel.overlap_param_gather=true needs parallel.distributed_optimizer=true (it "
                 "overlaps the distributed optimizer's parameter all-gather)")
    if par.overlap_param_gather and not par.overlap_grad_reduce:
        p.append("parallel.overlap_param_gather=true needs parallel.overlap_grad_reduce=true "
                 "(megatron's bucketed, overlapped gradient buffers)")
    if par.delay_wgrad_compute and not par.overlap_moe_expert_parallel_comm:
        p.append("parallel.delay_wgrad_compute=true needs parallel.overlap_moe_expert_parallel_comm=true")
    if par.high_priority_a2a_comm_stream and not par.overlap_moe_expert_parallel_comm:
        # megatron reads it only where the combined 1F1B schedule makes its communication stream
        # (pipeline_parallel/combined_1f1b.py): elsewhere it would be accepted and do nothing
        p.append("parallel.high_priority_a2a_comm_stream=true needs parallel.overlap_moe_expert_parallel_comm=true "
                 "(it is the priority of that overlap's all-to-all stream; without it the flag does nothing)")
    if par.overlap_moe_expert_parallel_comm:
        p += _ep_overlap_problems(par, model, dtype)
    return p


def rope_fusion_problems(model) -> list[str]:
    """Why megatron-core 0.19.2's fused MLA RoPE (``apply_rope_fusion``) cannot run ``model``."""
    p = []
    if model.rope_type != "yarn":
        p.append(f"parallel.apply_rope_fusion=true needs model.rope_type=yarn (got {model.rope_type}): "
                 "megatron-core's fused MLA RoPE kernels exist for YaRN only")
    odd = {n: getattr(model, n) for n in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
           if getattr(model, n) & (getattr(model, n) - 1)}
    if odd:  # fused_mla_yarn_rope_apply.rotary_fwd_kv_kernel: tl.arange(0, k_dim), tl.arange(0, v_dim)
        p.append(f"parallel.apply_rope_fusion=true needs MLA head dims that are powers of 2 (got "
                 f"{', '.join(f'model.{n}={v}' for n, v in odd.items())}): megatron's fused MLA RoPE "
                 "kernels tile whole heads with tl.arange, which Triton allows for powers of 2 only")
    return p


def _ep_overlap_problems(par, model, dtype) -> list[str]:
    """megatron-core 0.19.2's conditions for hiding the EP all-to-all behind another
    micro-batch's compute (TransformerConfig.__post_init__)."""
    what = "parallel.overlap_moe_expert_parallel_comm=true"
    p = []
    if not model.num_experts or par.ep == 1:
        p.append(f"{what} needs expert parallelism: parallel.ep > 1 (got {par.ep})")
    if model.recompute == "full":
        p.append(f"{what} needs model.recompute other than full (got full; selective is allowed)")
    if model.recompute == "selective" and "moe" in model.recompute_modules:
        p.append(f"{what} cannot recompute the MoE layer: model.recompute_modules="
                 f"{list(model.recompute_modules)} must not hold moe (moe_act is allowed)")
    if dtype != "bf16":
        p.append(f"{what} needs precision.dtype=bf16 (got {dtype})")
    if par.pp > 1 and (par.vpp or 1) == 1:
        p.append(f"{what} with parallel.pp={par.pp} needs virtual pipeline stages: parallel.vpp > 1 "
                 f"(got {par.vpp})")
    return p


def _have(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def machine_problems(par, precision, optimizer, *, cuda: bool) -> list[str]:
    """What this machine lacks for the run's features: each enabled feature whose kernels are
    missing here, named with what it needs. Checked when a run starts, not when it is planned."""
    te, apex, deep_ep = _have("transformer_engine"), _have("apex"), _have("deep_ep")
    needs = {  # feature -> (needs CUDA, what else it needs, is it there)
        "moe_permute_fusion": ("Transformer Engine >= 2.1", te),
        "moe_router_fusion": ("Transformer Engine", te),
        "apply_rope_fusion": ("megatron's Triton MLA RoPE kernels", True),
        "gradient_accumulation_fusion": ("Transformer Engine or apex", te or apex),
        "tp_comm_overlap": ("Transformer Engine userbuffers", te),
        "delay_wgrad_compute": ("Transformer Engine grouped GEMM", te),
    }
    missing = []
    for name, (what, there) in needs.items():
        if getattr(par, name) and not (cuda and there):
            missing.append(f"parallel.{name}=true needs CUDA and {what}")
    if par.moe_token_dispatcher_type == "flex" and not (cuda and deep_ep):
        missing.append(f"parallel.moe_token_dispatcher_type=flex needs CUDA and the deep_ep package "
                       f"({par.moe_flex_dispatcher_backend} kernels)")
    if precision.fp8 is not None and not (cuda and te):
        missing.append(f"precision.fp8={precision.fp8} needs CUDA and Transformer Engine")
    bf16_moments = [f"optimizer.{n}=bf16" for n in ("exp_avg_dtype", "exp_avg_sq_dtype")
                    if getattr(optimizer, n) == "bf16"]
    if bf16_moments and not (cuda and te):
        missing.append(f"{' and '.join(bf16_moments)} (megatron's precision-aware optimizer) needs CUDA "
                       "and Transformer Engine's FusedAdam")
    return [m + ("" if cuda else " (this machine has no CUDA)") for m in missing]


def transformer_kwargs(par) -> dict:
    """megatron TransformerConfig fields of the layout's speed features and pipeline layout."""
    from parallel.config import layout_stages

    kw = {name: getattr(par, name) for name in TRANSFORMER_FIELDS}
    if par.pipeline_layout:
        kw["pipeline_model_parallel_layout"] = layout_stages(par.pipeline_layout)
    return kw


def ddp_kwargs(par) -> dict:
    """megatron DistributedDataParallelConfig fields of the layout's speed features."""
    return {name: getattr(par, name) for name in DDP_FIELDS}


def summary(par) -> str:
    """The features a run uses, for its banner."""
    on = [name for name in TRANSFORMER_FIELDS + DDP_FIELDS
          if name != "moe_token_dispatcher_type" and name != "moe_flex_dispatcher_backend" and getattr(par, name)]
    dispatcher = par.moe_token_dispatcher_type + (
        f" ({par.moe_flex_dispatcher_backend})" if par.moe_token_dispatcher_type == "flex" else "")
    return f"dispatcher {dispatcher}; " + (", ".join(on) if on else "no fusions or overlaps")
