"""GLM-5 architecture <-> Hugging Face ``GlmMoeDsaConfig`` (model_type ``glm_moe_dsa``).

Only architecture fields cross over; training-only fields (DSA mode, MTP depths, aux-loss
settings, ...) keep :class:`GLM5Config`'s defaults on import unless the caller sets them. A field
whose HF value our model cannot reproduce exactly is rejected with an error naming it.
"""

from __future__ import annotations

import dataclasses

from model_providers.glm5.config import DSAConfig, GLM5Config

MODEL_TYPE = "glm_moe_dsa"
#: HF fields carried through a round trip untouched (not part of the architecture)
PASSTHROUGH = ("bos_token_id", "eos_token_id", "pad_token_id", "use_cache")


class HFConfigError(ValueError):
    """An HF config (or a GLM5Config for export) the conversion cannot represent exactly."""


def _fail(problems: list[str], what: str) -> None:
    if problems:
        raise HFConfigError(f"unsupported {what}:\n  - " + "\n  - ".join(problems))


def _rope(hf) -> tuple[str, float]:
    params = getattr(hf, "rope_parameters", None) or {}
    legacy = getattr(hf, "rope_scaling", None)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if legacy and legacy.get("rope_type", legacy.get("type", "default")) != "default":
        rope_type = legacy.get("rope_type", legacy.get("type"))
    theta = params.get("rope_theta", getattr(hf, "rope_theta", None))
    return rope_type, theta


def check_hf(hf) -> None:
    """Reject every HF setting the GLM-5 provider does not implement identically."""
    p = []
    if getattr(hf, "model_type", None) != MODEL_TYPE:
        p.append(f"model_type={getattr(hf, 'model_type', None)!r} (expected {MODEL_TYPE!r})")
    rope_type, theta = _rope(hf)
    if rope_type != "default":
        p.append(f"rope_parameters.rope_type={rope_type!r} (YaRN / rope_scaling): GLM-5 uses plain RoPE")
    if theta is None:
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
    _, theta = _rope(hf)
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
        rope_theta=float(theta),
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
    if not cfg.dsa.rope_interleaved:
        p.append("model.dsa.rope_interleaved=false: HF's GlmMoeDsaIndexer rotates interleaved pairs")
    if cfg.dsa.hadamard:
        p.append("model.dsa.hadamard=true: HF's GlmMoeDsaIndexer applies no Hadamard rotation")
    if cfg.num_experts and cfg.num_shared_experts < 1:
        p.append("model.num_shared_experts=0: GlmMoeDsaMoE always has a shared expert")
    _fail(p, "GLM5Config for a Hugging Face export")


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
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        index_topk=cfg.dsa.topk,
        index_head_dim=cfg.dsa.index_head_dim,
        index_n_heads=cfg.dsa.index_heads,
        first_k_dense_replace=cfg.num_layers if dense_only else cfg.first_k_dense,
        indexer_types=["full"] * cfg.num_layers,
        num_nextn_predict_layers=1 if cfg.mtp_num_steps else 0,
        architectures=["GlmMoeDsaForCausalLM"],
        **extra,
    )
