"""GLM-5 architecture <-> Hugging Face ``GlmMoeDsaConfig`` (model_type ``glm_moe_dsa``).

Only architecture fields cross over; training-only fields (DSA mode, MTP depths, aux-loss
settings, ...) keep :class:`GLM5Config`'s defaults on import unless the caller sets them. A field
whose HF value our model cannot reproduce exactly is rejected with an error naming it.
"""

from __future__ import annotations

import dataclasses

from model_providers.glm5.model.config import DSAConfig, GLM5Config, YarnConfig

MODEL_TYPE = "glm_moe_dsa"
#: HF fields carried through a round trip untouched (not part of the architecture)
PASSTHROUGH = ("bos_token_id", "eos_token_id", "pad_token_id", "use_cache")


class HFConfigError(ValueError):
    """An HF config (or a GLM5Config for export) the conversion cannot represent exactly."""


def _fail(problems: list[str], what: str) -> None:
    if problems:
        raise HFConfigError(f"unsupported {what}:\n  - " + "\n  - ".join(problems))


def _rope(hf) -> dict:
    """HF's RoPE settings as one dict with ``rope_type`` (legacy ``rope_scaling`` / ``type`` too)."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    legacy = getattr(hf, "rope_scaling", None) or {}
    if legacy.get("rope_type", legacy.get("type", "default")) != "default":
        params.update(legacy)
        params["rope_type"] = legacy.get("rope_type", legacy.get("type"))
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(hf, "rope_theta", None))
    return params


def _yarn_from_hf(hf, params: dict) -> YarnConfig:
    """Our YaRN fields for HF's, with HF's defaults where a key is absent
    (``modeling_rope_utils._compute_yarn_parameters``: factor = max_position_embeddings /
    original_max_position_embeddings, beta_fast 32, beta_slow 1)."""
    original = params.get("original_max_position_embeddings") or hf.max_position_embeddings
    factor = params.get("factor")
    return YarnConfig(
        factor=float(factor if factor is not None else hf.max_position_embeddings / original),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params["mscale"]) if params.get("mscale") is not None else 1.0,
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
    )


def _yarn_problems(params: dict) -> list[str]:
    """HF YaRN variants megatron's ``YarnRotaryEmbedding`` / MLA softmax scale cannot reproduce.

    HF scales cos/sin by ``attention_factor`` if given, else by mscale(factor, mscale) /
    mscale(factor, mscale_all_dim) only when both are non-zero, else by mscale(factor, 1);
    megatron always uses the ratio. Megatron always rounds the correction range (HF's
    ``truncate: true``)."""
    p = []
    if params.get("attention_factor") is not None:
        p.append(f"rope_parameters.attention_factor={params['attention_factor']}: megatron derives "
                 "the cos/sin scale from factor, mscale and mscale_all_dim")
    if params.get("truncate", True) is not True:
        p.append(f"rope_parameters.truncate={params['truncate']}: megatron always rounds the YaRN "
                 "correction range to whole dims (truncate: true)")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        p.append(f"rope_parameters.partial_rotary_factor={params['partial_rotary_factor']}: the "
                 "whole qk_rope_head_dim is rotated")
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if all_dim and not mscale:
        p.append(f"rope_parameters.mscale={mscale} with mscale_all_dim={all_dim}: HF then scales "
                 "cos/sin by 0.1*ln(factor)+1, megatron by the mscale / mscale_all_dim ratio")
    if not all_dim and mscale is not None and float(mscale) != 1.0:
        p.append(f"rope_parameters.mscale={mscale} without mscale_all_dim: HF then ignores mscale, "
                 "megatron applies it")
    factor = params.get("factor")
    if factor is not None and not float(factor) > 1:
        p.append(f"rope_parameters.factor={factor}: YaRN needs factor > 1 (factor 1 is plain RoPE, "
                 "rope_type default)")
    return p


def check_hf(hf) -> None:
    """Reject every HF setting the GLM-5 provider does not implement identically."""
    p = []
    if getattr(hf, "model_type", None) != MODEL_TYPE:
        p.append(f"model_type={getattr(hf, 'model_type', None)!r} (expected {MODEL_TYPE!r})")
    rope = _rope(hf)
    if rope["rope_type"] not in ("default", "yarn"):
        p.append(f"rope_parameters.rope_type={rope['rope_type']!r}: only default (plain RoPE) and "
                 "yarn are implemented")
    elif rope["rope_type"] == "yarn":
        p += _yarn_problems(rope)
    if rope["rope_theta"] is None:
        p.append("rope_parameters.rope_theta is missing")
    types = list(getattr(hf, "indexer_types", None) or [])
    if any(t != "full" for t in types):
        shared = [i for i, t in enumerate(types) if t != "full"]
        p.append(f"indexer_types has non-'full' layers {shared[:8]}: cross-layer top-k sharing "
                 "('shared') is not implemented; every layer runs its own indexer")
    for name in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
        if getattr(hf, name, False):
            p.append(f"{name}=True (GLM-5 has none)")
    if getattr(hf, "hidden_act", "silu") != "silu":
        p.append(f"hidden_act={hf.hidden_act!r} (SwiGLU needs silu)")
    if float(getattr(hf, "attention_dropout", 0.0) or 0.0) != 0.0:
        p.append(f"attention_dropout={hf.attention_dropout} (not implemented)")
    if hf.num_key_value_heads != hf.num_attention_heads:
        p.append(f"num_key_value_heads={hf.num_key_value_heads} != num_attention_heads="
                 f"{hf.num_attention_heads} (MLA has one K/V per head)")
    if hf.q_lora_rank is None:
        p.append("q_lora_rank=None (the indexer needs the q latent)")
    if hf.qk_rope_head_dim > hf.index_head_dim:
        p.append(f"qk_rope_head_dim={hf.qk_rope_head_dim} > index_head_dim={hf.index_head_dim}")
    k = hf.first_k_dense_replace
    pattern = ["dense"] * min(k, hf.num_hidden_layers) + ["sparse"] * max(0, hf.num_hidden_layers - k)
    if list(getattr(hf, "mlp_layer_types", None) or pattern) != pattern:
        p.append(f"mlp_layer_types={hf.mlp_layer_types} is not {k} dense layers then MoE "
                 f"(first_k_dense_replace={k})")
    if any(t != "indexed_attention" for t in (getattr(hf, "layer_types", None) or [])):
        p.append(f"layer_types={hf.layer_types} (every layer must be indexed_attention)")
    topk = hf.num_experts_per_tok
    if hf.norm_topk_prob != (topk > 1):
        p.append(f"norm_topk_prob={hf.norm_topk_prob} with num_experts_per_tok={topk}: megatron "
                 "normalises the top-k sigmoid scores exactly when top-k > 1")
    if hf.n_group > 1 and topk // hf.topk_group != 2:
        p.append(f"n_group={hf.n_group}, topk_group={hf.topk_group}: megatron scores a group by "
                 f"its top num_experts_per_tok/topk_group={topk // hf.topk_group} experts, HF by 2")
    if getattr(hf, "num_nextn_predict_layers", 0) > 1:
        p.append(f"num_nextn_predict_layers={hf.num_nextn_predict_layers}: GLM-5 shares one MTP module")
    _fail(p, f"Hugging Face config for {MODEL_TYPE}")


def glm5_from_hf(hf, **training_fields) -> GLM5Config:
    """GLM5Config for an HF config (``GlmMoeDsaConfig`` or anything with its attributes).
    ``training_fields`` set GLM5Config fields HF does not have (e.g. ``mtp_num_steps``); DSA
    fields go in as ``dsa={...}``."""
    check_hf(hf)
    dsa_extra = training_fields.pop("dsa", {}) or {}
    rope = _rope(hf)
    yarn = _yarn_from_hf(hf, rope) if rope["rope_type"] == "yarn" else YarnConfig()
    dense_only = hf.first_k_dense_replace >= hf.num_hidden_layers
    dsa = dataclasses.replace(
        DSAConfig(), index_heads=hf.index_n_heads, index_head_dim=hf.index_head_dim,
        topk=hf.index_topk, rope_interleaved=True, hadamard=False, **dsa_extra)
    return dataclasses.replace(
        GLM5Config(),
        num_layers=hf.num_hidden_layers,
        first_k_dense=min(hf.first_k_dense_replace, hf.num_hidden_layers),
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=hf.num_attention_heads,
        q_lora_rank=hf.q_lora_rank,
        kv_lora_rank=hf.kv_lora_rank,
        qk_nope_head_dim=hf.qk_nope_head_dim,
        qk_rope_head_dim=hf.qk_rope_head_dim,
        v_head_dim=hf.v_head_dim,
        vocab_size=hf.vocab_size,
        max_position_embeddings=hf.max_position_embeddings,
        rope_theta=float(rope["rope_theta"]),
        rope_type="yarn" if rope["rope_type"] == "yarn" else "rope",
        yarn=yarn,
        norm_eps=hf.rms_norm_eps,
        init_std=hf.initializer_range,
        num_experts=None if dense_only else hf.n_routed_experts,
        moe_topk=hf.num_experts_per_tok,
        moe_ffn_hidden_size=hf.moe_intermediate_size,
        num_shared_experts=hf.n_shared_experts,
        moe_routed_scaling_factor=hf.routed_scaling_factor,
        moe_router_groups=hf.n_group,
        moe_router_group_topk=hf.topk_group,
        dsa=dsa,
        **training_fields,
    )


def check_exportable(cfg: GLM5Config) -> None:
    p = []
    if cfg.dsa.mode == "none":
        p.append("model.dsa.mode=none: the model has no DSA indexer, which GlmMoeDsaForCausalLM "
                 "always builds (a DeepSeek-V3 export, DeepseekV3ForCausalLM, is not implemented)")
    if not cfg.dsa.rope_interleaved:
        p.append("model.dsa.rope_interleaved=false: HF's GlmMoeDsaIndexer rotates interleaved pairs")
    if cfg.dsa.hadamard:
        p.append("model.dsa.hadamard=true: HF's GlmMoeDsaIndexer applies no Hadamard rotation")
    y = cfg.yarn
    if cfg.rope_type == "yarn" and not y.mscale_all_dim and y.mscale != 1:
        p.append(f"model.yarn.mscale={y.mscale} with mscale_all_dim=0: HF then ignores mscale")
    if cfg.rope_type == "yarn" and y.mscale_all_dim and not y.mscale:
        p.append(f"model.yarn.mscale=0 with mscale_all_dim={y.mscale_all_dim}: HF then scales cos/sin "
                 "by 0.1*ln(factor)+1")
    if cfg.num_experts and cfg.num_shared_experts < 1:
        p.append("model.num_shared_experts=0: GlmMoeDsaMoE always has a shared expert")
    _fail(p, "GLM5Config for a Hugging Face export")


def _rope_parameters(cfg: GLM5Config) -> dict:
    if cfg.rope_type != "yarn":
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {"rope_type": "yarn", "rope_theta": cfg.rope_theta, **dataclasses.asdict(cfg.yarn)}


def hf_from_glm5(cfg: GLM5Config, passthrough: dict | None = None, dtype: str | None = None):
    """``GlmMoeDsaConfig`` describing ``cfg`` (one MTP module when ``cfg.mtp_num_steps > 0``)."""
    from transformers import GlmMoeDsaConfig

    check_exportable(cfg)
    dense_only = not cfg.num_experts
    extra = {k: v for k, v in (passthrough or {}).items() if k in PASSTHROUGH}
    if dtype:
        extra["dtype"] = dtype
    return GlmMoeDsaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        moe_intermediate_size=cfg.moe_ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads,
        n_shared_experts=cfg.num_shared_experts,
        n_routed_experts=cfg.num_experts or 1,
        routed_scaling_factor=cfg.moe_routed_scaling_factor,
        kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        n_group=cfg.moe_router_groups,
        topk_group=cfg.moe_router_group_topk,
        num_experts_per_tok=cfg.moe_topk,
        norm_topk_prob=cfg.moe_topk > 1,
        max_position_embeddings=cfg.max_position_embeddings,
        initializer_range=cfg.init_std,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=False,
        rope_parameters=_rope_parameters(cfg),
        index_topk=cfg.dsa.topk,
        index_head_dim=cfg.dsa.index_head_dim,
        index_n_heads=cfg.dsa.index_heads,
        first_k_dense_replace=cfg.num_layers if dense_only else cfg.first_k_dense,
        indexer_types=["full"] * cfg.num_layers,
        num_nextn_predict_layers=1 if cfg.mtp_num_steps else 0,
        architectures=["GlmMoeDsaForCausalLM"],
        **extra,
    )
