"""GLM-5 architecture config and its mapping onto megatron-core's ``MLATransformerConfig``."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.nn.functional as F

from parallel.config import ParallelConfig


@dataclass
class DSAConfig:
    """DeepSeek Sparse Attention fields (the indexer and sparse attention use them).

    Defaults are the tiny model's (conf/model/glm5_tiny.yaml), like :class:`GLM5Config`'s."""

    mode: str = "dense"  #: none (no indexer built: DeepSeek-V3) | dense | warmup | sparse
    index_heads: int = 4  #: lightning-indexer heads (GLM-5: 32)
    index_head_dim: int = 32  #: indexer head dim (GLM-5: 128)
    topk: int = 32  #: keys each query attends to in sparse mode (GLM-5 ``index_topk``: 2048)
    rope_interleaved: bool = True  #: GLM-5 interleaved; DeepSeek-V3.2 not
    hadamard: bool = False  #: Walsh-Hadamard-rotate indexer q and k (DeepSeek-V3.2: yes; GLM-5 HF: no)
    kl_coeff: float = 1.0  #: weight of the indexer KL loss
    indexer_dtype: str = "fp32"  #: fp8 | bf16 | fp32
    query_chunk: int = 64  #: queries scored at once (memory O(chunk * L)); GLM-5 run: 1024
    #: sparse attention and indexer kernels: auto (Triton on CUDA when triton imports; on CPU the
    #: fused C++ sparse MLA where it builds; else torch) | torch (op by op, the reference) |
    #: triton (CUDA, or CPU tensors under TRITON_INTERPRET=1, for tests)
    kernels: str = "auto"


@dataclass
class YarnConfig:
    """YaRN RoPE scaling, used when ``model.rope_type: yarn`` (GLM-5 itself uses none). Names are
    HF's ``rope_parameters`` keys and megatron's ``MLATransformerConfig`` fields; megatron builds
    ``YarnRotaryEmbedding`` from them and the DSA indexer uses the same frequencies and scale.

    ``yarn_mscale(f, m) = 0.1 * m * ln(f) + 1``: cos/sin are multiplied by
    ``yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)`` and the attention
    softmax scale by ``yarn_mscale(factor, mscale_all_dim) ** 2``."""

    factor: float = 1.0  #: context extension factor, > 1 (megatron ``rotary_scaling_factor``)
    original_max_position_embeddings: int = 4096  #: context the un-scaled RoPE was trained at
    beta_fast: float = 32.0  #: frequencies with more rotations than this (over the original context) are kept
    beta_slow: float = 1.0  #: ... with fewer than this are divided by ``factor``; a linear ramp between
    mscale: float = 1.0  #: cos/sin scale numerator (see above)
    mscale_all_dim: float = 0.0  #: cos/sin scale denominator and softmax scale (DeepSeek-V3: 1.0)


@dataclass
class GLM5Config:
    """The GLM-5 network. Names follow the HF ``GlmMoeDsaConfig`` where one exists.

    MLA's RoPE is always the interleaved layout GLM-5 uses: megatron-core's MLA de-interleaves
    the rope dims before rotating (HF ``rope_interleave``), so there is no switch for it.
    """

    num_layers: int = 4
    first_k_dense: int = 1  #: leading dense-FFN layers (HF ``first_k_dense_replace``)
    hidden_size: int = 128
    ffn_hidden_size: int = 256  #: dense-layer SwiGLU width
    num_attention_heads: int = 4
    q_lora_rank: int = 64
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 24
    qk_rope_head_dim: int = 8
    v_head_dim: int = 32
    vocab_size: int = 512
    make_vocab_size_divisible_by: int = 128  #: padded vocab is a multiple of this * tp
    max_position_embeddings: int = 4096
    rope_theta: float = 1_000_000.0
    rope_type: str = "rope"  #: rope (plain, GLM-5) | yarn (scaled by ``yarn``)
    yarn: YarnConfig = field(default_factory=YarnConfig)
    norm_eps: float = 1e-5
    init_std: float = 0.02
    num_experts: Optional[int] = 8
    moe_topk: int = 2
    moe_ffn_hidden_size: int = 64
    num_shared_experts: int = 1
    moe_routed_scaling_factor: float = 2.5
    moe_bias_update_rate: float = 1e-3  #: aux-loss-free expert-bias step
    moe_aux_loss: str = "seq_aux_loss"  #: megatron load-balancing type: seq_aux_loss | aux_loss | none
    moe_aux_loss_coeff: float = 1e-4
    moe_router_groups: int = 1  #: HF ``n_group``
    moe_router_group_topk: int = 1  #: HF ``topk_group``
    mtp_num_steps: int = 3  #: one shared MTP module applied this many times
    mtp_loss_scale: float = 0.3  #: total MTP loss weight (split evenly over steps)
    layer_backend: str = "auto"  #: auto (te with CUDA + Transformer Engine, else local) | te | local
    recompute: Optional[str] = None  #: activation recomputation: null | selective | full (every layer)
    recompute_modules: List[str] = field(default_factory=lambda: ["mla_up_proj", "moe"])  #: selective: megatron's recompute_modules
    dsa: DSAConfig = field(default_factory=DSAConfig)

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense if self.num_experts else 0

    def padded_vocab_size(self, tp: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple


@dataclass
class PrecisionConfig:
    """Numerics. fp32 is the CPU default and what the parity tests use."""

    dtype: str = "fp32"  #: fp32 | bf16
    fp8: Optional[str] = None  #: null | delayed | blockwise (Hopper) | mxfp8 (Blackwell); Transformer Engine, GPUs only


#: megatron-core 0.19.2's selective recompute choices (but gdn_norm_out: Gated DeltaNet layers only)
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")


def check_model(cfg: GLM5Config, precision: PrecisionConfig, seq_length: int) -> list[str]:
    """Every problem of the architecture and precision (empty when it can be built)."""
    p = []
    if not 0 <= cfg.first_k_dense <= cfg.num_layers:
        p.append(f"model.first_k_dense={cfg.first_k_dense} must be in [0, model.num_layers={cfg.num_layers}]")
    if cfg.num_experts is not None:
        if not 1 <= cfg.moe_topk <= cfg.num_experts:
            p.append(f"model.moe_topk={cfg.moe_topk} must be in [1, model.num_experts={cfg.num_experts}]")
        if cfg.num_experts % cfg.moe_router_groups:
            p.append(
                f"model.num_experts={cfg.num_experts} is not divisible by "
                f"model.moe_router_groups={cfg.moe_router_groups}"
            )
    if cfg.moe_aux_loss not in ("seq_aux_loss", "aux_loss", "none"):
        p.append(f"model.moe_aux_loss={cfg.moe_aux_loss!r} must be seq_aux_loss, aux_loss or none")
    if cfg.recompute not in (None, "selective", "full"):
        p.append(f"model.recompute={cfg.recompute!r} must be null, selective or full")
    unknown = sorted(set(cfg.recompute_modules) - set(RECOMPUTE_MODULES))
    if cfg.recompute == "selective" and (unknown or not cfg.recompute_modules):
        p.append(f"model.recompute_modules={list(cfg.recompute_modules)}: must be a non-empty subset of "
                 f"{list(RECOMPUTE_MODULES)}")
    if cfg.mtp_num_steps < 0:
        p.append(f"model.mtp_num_steps={cfg.mtp_num_steps} must be >= 0")
    if seq_length > cfg.max_position_embeddings:
        p.append(
            f"trainer.seq_length={seq_length} exceeds model.max_position_embeddings="
            f"{cfg.max_position_embeddings}"
        )
    if cfg.qk_rope_head_dim % 2:
        p.append(f"model.qk_rope_head_dim={cfg.qk_rope_head_dim} must be even")
    p += _rope_problems(cfg)
    if cfg.dsa.mode not in ("none", "dense", "warmup", "sparse"):
        p.append(f"model.dsa.mode={cfg.dsa.mode!r} must be none, dense, warmup or sparse")
    if cfg.dsa.indexer_dtype not in ("fp8", "bf16", "fp32"):
        p.append(f"model.dsa.indexer_dtype={cfg.dsa.indexer_dtype!r} must be fp8, bf16 or fp32")
    if cfg.dsa.indexer_dtype == "fp8" and cfg.dsa.index_head_dim % 128:
        p.append(
            f"model.dsa.indexer_dtype=fp8 needs model.dsa.index_head_dim divisible by 128 "
            f"(one scale per 128 values), got {cfg.dsa.index_head_dim}"
        )
    if cfg.dsa.kernels not in ("auto", "torch", "triton"):
        p.append(f"model.dsa.kernels={cfg.dsa.kernels!r} must be auto, torch or triton")
    elif cfg.dsa.kernels == "triton" and not (importlib.util.find_spec("triton") and (
            torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")):
        p.append("model.dsa.kernels=triton needs triton and CUDA (or TRITON_INTERPRET=1 for the "
                 "CPU interpreter); use auto or torch here")
    if cfg.dsa.topk < 1 or cfg.dsa.index_heads < 1 or cfg.dsa.query_chunk < 1:
        p.append(
            f"model.dsa.topk={cfg.dsa.topk}, index_heads={cfg.dsa.index_heads} and "
            f"query_chunk={cfg.dsa.query_chunk} must be >= 1"
        )
    if precision.dtype not in ("fp32", "bf16"):
        p.append(f"precision.dtype={precision.dtype!r} must be fp32 or bf16")
    if precision.fp8 not in (None, "delayed", "blockwise", "mxfp8"):
        p.append(f"precision.fp8={precision.fp8!r} must be null, delayed, blockwise or mxfp8")
    if precision.fp8 is not None and cfg.layer_backend == "local":
        p.append(f"precision.fp8={precision.fp8} needs Transformer Engine layers, but "
                 "model.layer_backend='local' gives the local spec: megatron's FP8 context would "
                 "do nothing and the run would train in bf16 (CUDA and Transformer Engine are "
                 "checked when the run starts: parallel.features.machine_problems)")
    if precision.fp8 is not None and precision.dtype != "bf16":
        p.append(f"precision.fp8={precision.fp8} needs precision.dtype=bf16, got {precision.dtype}")
    return p


def _rope_problems(cfg: GLM5Config) -> list:
    if cfg.rope_type not in ("rope", "yarn"):
        return [f"model.rope_type={cfg.rope_type!r} must be rope or yarn"]
    if cfg.rope_type == "rope":
        return []
    y, p = cfg.yarn, []
    if not y.factor > 1:
        p.append(f"model.yarn.factor={y.factor} must be > 1 with model.rope_type=yarn "
                 "(factor 1 is plain RoPE: model.rope_type=rope)")
    if y.original_max_position_embeddings <= 0:
        p.append(f"model.yarn.original_max_position_embeddings={y.original_max_position_embeddings} "
                 "must be > 0")
    if not y.beta_fast > y.beta_slow > 0:
        p.append(f"model.yarn.beta_fast={y.beta_fast} and beta_slow={y.beta_slow} must satisfy "
                 "beta_fast > beta_slow > 0")
    if y.mscale < 0 or y.mscale_all_dim < 0:
        p.append(f"model.yarn.mscale={y.mscale} and mscale_all_dim={y.mscale_all_dim} must be >= 0")
    return p


def _rope(cfg: GLM5Config) -> dict:
    """megatron's RoPE fields. Plain RoPE keeps ``rotary_scaling_factor`` 1: megatron's MLA
    multiplies its softmax scale by yarn_mscale(rotary_scaling_factor, mscale_all_dim)^2 whatever
    the rope_type."""
    if cfg.rope_type != "yarn":
        return dict(rope_type="rope", rotary_base=cfg.rope_theta, rotary_scaling_factor=1.0)
    y = cfg.yarn
    return dict(rope_type="yarn", rotary_base=cfg.rope_theta, rotary_scaling_factor=y.factor,
                original_max_position_embeddings=y.original_max_position_embeddings,
                beta_fast=y.beta_fast, beta_slow=y.beta_slow, mscale=y.mscale,
                mscale_all_dim=y.mscale_all_dim)


def _recompute(cfg: GLM5Config, grouped_experts: bool) -> dict:
    """megatron's activation recomputation: selective (the listed submodules of every layer) or
    full (each whole layer, one at a time). ``moe_act`` recomputes the grouped-GEMM experts'
    activation; megatron 0.19 refuses it without them (``SequentialMLP``, CPU builds), where it
    has nothing to recompute: it is dropped there."""
    if cfg.recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if cfg.recompute == "selective":
        modules = [m for m in cfg.recompute_modules if grouped_experts or m != "moe_act"]
        return dict(recompute_granularity="selective", recompute_modules=modules) if modules else {}
    return {}


def to_transformer_config(cfg: GLM5Config, par: ParallelConfig, precision: PrecisionConfig):
    """Build megatron's ``MLATransformerConfig`` for this model, layout and precision."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from parallel.features import transformer_kwargs

    on_cpu = not torch.cuda.is_available()
    dtype = torch.bfloat16 if precision.dtype == "bf16" else torch.float32
    moe = {}
    if cfg.num_experts:
        moe = dict(
            num_moe_experts=cfg.num_experts,
            moe_layer_freq=[0] * cfg.first_k_dense + [1] * (cfg.num_layers - cfg.first_k_dense),
            moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
            moe_router_topk=cfg.moe_topk,
            moe_shared_expert_intermediate_size=(
                cfg.num_shared_experts * cfg.moe_ffn_hidden_size if cfg.num_shared_experts else None
            ),
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=cfg.moe_bias_update_rate,
            moe_router_topk_scaling_factor=cfg.moe_routed_scaling_factor,
            moe_router_num_groups=cfg.moe_router_groups if cfg.moe_router_groups > 1 else None,
            moe_router_group_topk=cfg.moe_router_group_topk if cfg.moe_router_groups > 1 else None,
            moe_router_load_balancing_type=cfg.moe_aux_loss,
            moe_aux_loss_coeff=cfg.moe_aux_loss_coeff if cfg.moe_aux_loss != "none" else 0.0,
            moe_router_dtype="fp32",
            moe_grouped_gemm=not on_cpu,
        )
    fp8 = {}
    if precision.fp8 == "delayed":
        fp8 = dict(fp8="hybrid", fp8_recipe="delayed")
    elif precision.fp8 in ("blockwise", "mxfp8"):
        fp8 = dict(fp8="e4m3", fp8_recipe=precision.fp8)
    return MLATransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_head_dim=cfg.qk_nope_head_dim,
        qk_pos_emb_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        **_recompute(cfg, grouped_experts=not on_cpu),
        **_rope(cfg),
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_eps,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_std,
        mtp_num_layers=1 if cfg.mtp_num_steps else None,  # one layer, applied mtp_num_steps times
        mtp_loss_scaling_factor=cfg.mtp_loss_scale,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp if par.vpp and par.vpp > 1 else None,
        context_parallel_size=par.cp,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.expert_tp,
        sequence_parallel=par.sequence_parallel,
        num_layers_in_first_pipeline_stage=par.first_stage_layers,
        num_layers_in_last_pipeline_stage=par.last_stage_layers,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=precision.dtype == "bf16",
        use_cpu_initialization=on_cpu,
        **moe,
        **fp8,
        **transformer_kwargs(par),
    )
