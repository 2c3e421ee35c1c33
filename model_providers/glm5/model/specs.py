"""GLM-5 layer specs for two backends: Transformer Engine (CUDA + TE) and local torch layers.

Both give the same structure: MLA with q/kv LoRA and q_a/kv_a RMSNorms, SwiGLU dense FFN for the
first ``first_k_dense`` layers, MoE (routed experts + shared expert) after, and one MTP layer whose
inner transformer layer is a MoE layer like the last decoder layer.
"""

from __future__ import annotations

import importlib.util

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.post_training.modelopt.layers import Linear as DuplicatedLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlockSubmodules,
    get_mtp_layer_spec_for_backend,
    get_mtp_num_layers_to_build,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from model_providers.glm5.model.dsa.attention import DSACoreAttention, GLM5MLASelfAttention
from model_providers.glm5.model.kv_up_projection import kv_up_projection
from model_providers.glm5.model.layers import RMSNorm


class LocalBackend(LocalSpecProvider):
    """megatron's local provider with GLM-5's RMSNorm (SP-aware)."""

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        return RMSNorm


def resolve_backend(name: str) -> str:
    """``auto`` -> ``te`` when CUDA and Transformer Engine are importable, else ``local``."""
    have_te = torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None
    if name == "auto":
        return "te" if have_te else "local"
    if name == "te" and not have_te:
        raise ValueError("model.layer_backend=te needs CUDA and transformer_engine (not found)")
    if name not in ("te", "local"):
        raise ValueError(f"model.layer_backend={name!r} must be auto, te or local")
    return name


def _backend_provider(backend: str):
    if backend == "te":
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        return TESpecProvider()
    return LocalBackend()


def _dsa_core_attention(dsa) -> ModuleSpec:
    return ModuleSpec(module=DSACoreAttention, params={"dsa": dsa})


def local_layer_spec(num_experts, dsa) -> ModuleSpec:
    """One decoder layer on megatron's local (torch) layers: dense FFN when ``num_experts`` is
    None, MoE otherwise."""
    backend = LocalBackend()
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm,
            self_attention=ModuleSpec(
                module=GLM5MLASelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=MLASelfAttentionSubmodules(
                    linear_q_proj=backend.column_parallel_linear(),
                    # Down-projections replicated across TP (as TE's "duplicated" TELinear):
                    # with column-parallel ones, megatron's MLA loses the other ranks' share of
                    # the k_rope gradient (it gathers k_rope along the hidden dim, whose
                    # backward is a split, not a sum).
                    linear_q_down_proj=DuplicatedLinear,
                    linear_q_up_proj=backend.column_parallel_linear(),
                    linear_kv_down_proj=DuplicatedLinear,
                    linear_kv_up_proj=kv_up_projection(backend.column_parallel_linear()),
                    core_attention=_dsa_core_attention(dsa),
                    linear_proj=backend.row_parallel_linear(),
                    q_layernorm=RMSNorm,
                    kv_layernorm=RMSNorm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=RMSNorm,
            mlp=get_mlp_module_spec_for_backend(backend=backend, num_experts=num_experts),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def layer_spec(backend: str, num_experts, dsa) -> ModuleSpec:
    """One decoder layer: dense FFN when ``num_experts`` is None, MoE otherwise; attention is
    MLA with DeepSeek Sparse Attention as its core (``dsa.mode`` picks dense/warmup/sparse)."""
    if backend == "te":
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts,
            moe_grouped_gemm=num_experts is not None,
            qk_layernorm=True,
            multi_latent_attention=True,
        )
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm

        attention = spec.submodules.self_attention
        attention.module = GLM5MLASelfAttention
        sub = attention.submodules
        sub.core_attention = _dsa_core_attention(dsa)
        # TE's MLA spec fuses q_a/kv_a layernorm into the up-projections, so the latents MLA hands
        # on would be pre-norm; the indexer reads the normalised q latent and the absorbed sparse
        # attention and CP use the normalised kv latent: keep the norms separate, as the local spec
        # does (also gives both backends the same checkpoint keys for these norms).
        sub.linear_q_up_proj = TEColumnParallelLinear
        sub.linear_kv_up_proj = kv_up_projection(TEColumnParallelLinear)
        sub.q_layernorm = sub.kv_layernorm = TENorm
        return spec
    return local_layer_spec(num_experts, dsa)


def all_layer_specs(tcfg, backend: str, dsa) -> list[ModuleSpec]:
    dense = layer_spec(backend, None, dsa)
    moe = layer_spec(backend, tcfg.num_moe_experts, dsa) if tcfg.num_moe_experts else dense
    pattern = tcfg.moe_layer_freq if tcfg.num_moe_experts else [0] * tcfg.num_layers
    return [moe if is_moe else dense for is_moe in pattern]


def decoder_block_spec(tcfg, backend: str, dsa, vp_stage=None) -> TransformerBlockSubmodules:
    """The decoder layers this rank builds for model chunk ``vp_stage``."""
    specs = all_layer_specs(tcfg, backend, dsa)
    offset = get_transformer_layer_offset(tcfg, vp_stage=vp_stage)
    count = get_num_layers_to_build(tcfg, vp_stage=vp_stage)
    norm = _backend_provider(backend).layer_norm(rms_norm=True) if backend == "te" else RMSNorm
    return TransformerBlockSubmodules(layer_specs=specs[offset : offset + count], layer_norm=norm)


def mtp_block_spec(tcfg, backend: str, dsa, vp_stage=None):
    """ONE MTP layer (applied ``mtp_num_layers`` times by the shared block), or None when this
    model chunk holds no MTP."""
    if not tcfg.mtp_num_layers or get_mtp_num_layers_to_build(tcfg, vp_stage=vp_stage) == 0:
        return None
    last_layer = all_layer_specs(tcfg, backend, dsa)[-1]
    mtp_layer = get_mtp_layer_spec_for_backend(last_layer, _backend_provider(backend))
    return MultiTokenPredictionBlockSubmodules(layer_specs=[mtp_layer])
