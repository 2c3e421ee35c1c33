"""GLM5Config <-> GlmMoeDsaConfig both ways, fields we cannot reproduce rejected by name, and the
HF tensor-name mapping (incl. fused expert tensors)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from omegaconf import OmegaConf

from model_providers.glm5.model.config import GLM5Config, YarnConfig
from model_providers.glm5.hf.config import HFConfigError, glm5_from_hf, hf_from_glm5
from model_providers.glm5.hf.mapping import HFReader, hf_names
from tests.support import hf as hs
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
#: GLM5Config fields with no HF counterpart (training choices), left at their defaults on import
TRAINING_ONLY = {"make_vocab_size_divisible_by", "recompute", "recompute_modules", "moe_bias_update_rate",
                 "moe_aux_loss", "moe_aux_loss_coeff", "mtp_num_steps", "mtp_loss_scale", "layer_backend"}
DSA_TRAINING_ONLY = {"mode", "kl_coeff", "indexer_dtype", "query_chunk"}


#: HF YaRN with only the required keys (HF's defaults for the rest)
YARN_HF = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 1024}


def _model_yaml(name: str) -> GLM5Config:
    raw = OmegaConf.load(os.path.join(REPO, "conf", "model", f"{name}.yaml"))
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(GLM5Config), raw))


def _architecture(cfg: GLM5Config) -> dict:
    d = dataclasses.asdict(cfg)
    dsa = {k: v for k, v in d.pop("dsa").items() if k not in DSA_TRAINING_ONLY}
    return {**{k: v for k, v in d.items() if k not in TRAINING_ONLY}, "dsa": dsa}


@pytest.mark.parametrize("name", ["glm5_744b", "glm5_tiny"])
def test_glm5_config_round_trips_through_hf(name):
    cfg = _model_yaml(name)
    hf = hf_from_glm5(cfg)
    back = glm5_from_hf(hf, mtp_num_steps=cfg.mtp_num_steps)
    assert _architecture(back) == _architecture(cfg)
    assert hf.num_nextn_predict_layers == 1 and hf.model_type == "glm_moe_dsa"


def test_dense_only_model_round_trips():
    tiny = _model_yaml("glm5_tiny")
    cfg = dataclasses.replace(tiny, num_experts=None, first_k_dense=tiny.num_layers)
    hf = hf_from_glm5(cfg)
    assert hf.mlp_layer_types == ["dense"] * cfg.num_layers
    assert _architecture(glm5_from_hf(hf, mtp_num_steps=cfg.mtp_num_steps)) == _architecture(cfg)


def test_glm5_744b_matches_the_released_hf_config():
    """Numbers from GLM-5's config.json (docs/model.md)."""
    hf = hf_from_glm5(_model_yaml("glm5_744b"))
    released = dict(vocab_size=154880, hidden_size=6144, intermediate_size=12288,
                    moe_intermediate_size=2048, num_hidden_layers=78, num_attention_heads=64,
                    n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1,
                    routed_scaling_factor=2.5, q_lora_rank=2048, kv_lora_rank=512,
                    qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
                    first_k_dense_replace=3, index_topk=2048, index_head_dim=128, index_n_heads=32,
                    max_position_embeddings=202752, rms_norm_eps=1e-5, n_group=1, topk_group=1,
                    norm_topk_prob=True, tie_word_embeddings=False)
    assert {k: getattr(hf, k) for k in released} == released
    assert hf.rope_parameters["rope_theta"] == 1e6 and hf.rope_parameters["rope_type"] == "default"


def test_hf_config_round_trips_through_glm5():
    hf = hs.hf_config(index_topk=16)
    again = hf_from_glm5(glm5_from_hf(hf, mtp_num_steps=3), dtype="float32")
    skip = {"transformers_version", "architectures", "dtype"}
    a = {k: v for k, v in hf.to_dict().items() if k not in skip}
    b = {k: v for k, v in again.to_dict().items() if k not in skip}
    assert a == b


@pytest.mark.parametrize("overrides, field", [
    (dict(indexer_types=["full", "shared", "full", "shared"]), "indexer_types"),
    (dict(index_topk_freq=2), "indexer_types"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}), "rope_type"),
    (dict(rope_parameters={**YARN_HF, "attention_factor": 1.2}), "attention_factor"),
    (dict(rope_parameters={**YARN_HF, "truncate": False}), "truncate"),
    (dict(rope_parameters={**YARN_HF, "partial_rotary_factor": 0.5}), "partial_rotary_factor"),
    (dict(rope_parameters={**YARN_HF, "mscale_all_dim": 1.0}), r"mscale=None with mscale_all_dim=1.0"),
    (dict(rope_parameters={**YARN_HF, "mscale": 0.707}), r"mscale=0.707 without mscale_all_dim"),
    (dict(rope_parameters={**YARN_HF, "factor": 1.0}), r"factor=1.0: YaRN needs factor > 1"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(norm_topk_prob=False), "norm_topk_prob"),
    (dict(n_group=2, topk_group=2), "n_group"),
    (dict(num_nextn_predict_layers=2), "num_nextn_predict_layers"),
    (dict(mlp_layer_types=["dense", "sparse", "dense", "sparse"]), "mlp_layer_types"),
    (dict(attention_dropout=0.1), "attention_dropout"),
])
def test_unsupported_hf_fields_are_rejected_by_name(overrides, field):
    hf = hs.hf_config(index_topk=16, **overrides)
    with pytest.raises(HFConfigError, match=field):
        glm5_from_hf(hf)


YARN_VARIANTS = [  # as HF configs carry them
    YARN_HF,  # cos/sin x (0.1 ln 4 + 1), softmax unscaled
    {**YARN_HF, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},  # DeepSeek-V3
    {**YARN_HF, "mscale": 0.707, "mscale_all_dim": 0.707, "truncate": True},  # DeepSeek-V2
    {**YARN_HF, "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16.0, "beta_slow": 2.0},
]


@pytest.mark.parametrize("params", YARN_VARIANTS)
def test_hf_yarn_imports_and_exports_to_the_same_rope(params):
    """HF -> GLM5Config -> HF keeps what HF computes from the YaRN settings exactly: frequencies,
    cos/sin scale (``_compute_yarn_parameters``) and softmax scale (``yarn_apply_mscale``); our
    config maps it onto megatron's (same cos/sin scale and softmax scale formulas)."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor, _yarn_get_mscale)
    from transformers.modeling_rope_utils import _compute_yarn_parameters
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import yarn_apply_mscale

    hf = hs.hf_config(index_topk=16, rope_parameters=dict(params))
    cfg = glm5_from_hf(hf, mtp_num_steps=3)
    y = cfg.yarn
    assert cfg.rope_type == "yarn" and (y.factor, y.original_max_position_embeddings) == (4.0, 1024)
    again = hf_from_glm5(cfg)
    inv_a, scale_a = _compute_yarn_parameters(hf)
    inv_b, scale_b = _compute_yarn_parameters(again)
    assert torch.equal(inv_a, inv_b) and scale_a == scale_b
    assert scale_a == _yarn_get_concentration_factor(y.factor, y.mscale, y.mscale_all_dim)
    softmax = yarn_apply_mscale(hf.rope_parameters, 1.0)
    assert softmax == yarn_apply_mscale(again.rope_parameters, 1.0)
    assert softmax == _yarn_get_mscale(y.factor, y.mscale_all_dim) ** 2
    assert _architecture(glm5_from_hf(again, mtp_num_steps=3)) == _architecture(cfg)
    if set(params) >= {"mscale", "mscale_all_dim", "beta_fast", "beta_slow"}:  # nothing left to default
        skip = {"transformers_version", "architectures", "dtype"}
        src = {k: v for k, v in hf.to_dict().items() if k not in skip}
        src["rope_parameters"] = {k: v for k, v in src["rope_parameters"].items() if k != "truncate"}
        assert src == {k: v for k, v in again.to_dict().items() if k not in skip}


def test_hf_yarn_defaults():
    cfg = glm5_from_hf(hs.hf_config(index_topk=16, rope_parameters=dict(YARN_HF)))
    assert cfg.yarn == YarnConfig(factor=4.0, original_max_position_embeddings=1024, beta_fast=32.0,
                                  beta_slow=1.0, mscale=1.0, mscale_all_dim=0.0)
    # original_max_position_embeddings absent: HF takes max_position_embeddings
    cfg = glm5_from_hf(hs.hf_config(index_topk=16, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4,
                                                                    "factor": 2.0}))
    assert cfg.yarn.original_max_position_embeddings == hs.TINY["max_position_embeddings"]


@pytest.mark.parametrize("name", ["glm5_744b", "glm5_tiny"])
def test_glm5_yarn_config_round_trips_through_hf(name):
    cfg = dataclasses.replace(_model_yaml(name), rope_type="yarn", yarn=YarnConfig(
        factor=8.0, original_max_position_embeddings=2048, beta_fast=24.0, beta_slow=0.5, mscale=0.9,
        mscale_all_dim=0.8))
    hf = hf_from_glm5(cfg)
    assert hf.rope_parameters == {"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0,
                                  "original_max_position_embeddings": 2048, "beta_fast": 24.0,
                                  "beta_slow": 0.5, "mscale": 0.9, "mscale_all_dim": 0.8}
    assert _architecture(glm5_from_hf(hf, mtp_num_steps=cfg.mtp_num_steps)) == _architecture(cfg)


@pytest.mark.parametrize("yarn, field", [
    (YarnConfig(factor=4.0, mscale=0.707), "model.yarn.mscale=0.707 with mscale_all_dim=0"),
    (YarnConfig(factor=4.0, mscale=0.0, mscale_all_dim=1.0), "model.yarn.mscale=0 with mscale_all_dim=1.0"),
])
def test_export_rejects_yarn_hf_reads_differently(yarn, field):
    cfg = dataclasses.replace(_model_yaml("glm5_tiny"), rope_type="yarn", yarn=yarn)
    with pytest.raises(HFConfigError, match=field):
        hf_from_glm5(cfg)


@pytest.mark.parametrize("dsa, field", [({"hadamard": True}, "hadamard"),
                                        ({"rope_interleaved": False}, "rope_interleaved")])
def test_export_rejects_what_hf_cannot_run(dsa, field):
    cfg = _model_yaml("glm5_tiny")
    cfg = dataclasses.replace(cfg, dsa=dataclasses.replace(cfg.dsa, **dsa))
    with pytest.raises(HFConfigError, match=field):
        hf_from_glm5(cfg)


def test_tensor_names():
    assert hf_names("decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight", 4) == (
        "model.layers.2.mlp.experts.5.gate_proj.weight", "model.layers.2.mlp.experts.5.up_proj.weight")
    assert hf_names("decoder.layers.0.self_attention.linear_kv_up_proj.weight", 4) == (
        "model.layers.0.self_attn.kv_b_proj.weight",)
    assert hf_names("mtp.layers.0.final_layernorm.weight", 78) == ("model.layers.78.shared_head.norm.weight",)
    assert hf_names("mtp.layers.0.transformer_layer.mlp.router.expert_bias", 78) == (
        "model.layers.78.mlp.gate.e_score_correction_bias",)
    with pytest.raises(KeyError, match="no Hugging Face mapping"):
        hf_names("decoder.layers.0.self_attention.linear_qkv.weight", 4)


def test_reader_answers_per_expert_names_from_fused_tensors(tmp_path):
    from safetensors.torch import save_file

    gate_up, down = torch.randn(4, 6, 5), torch.randn(4, 5, 3)
    save_file({"model.layers.1.mlp.experts.gate_up_proj": gate_up,
               "model.layers.1.mlp.experts.down_proj": down}, str(tmp_path / "model.safetensors"))
    r = HFReader(str(tmp_path))
    assert torch.equal(r.get("model.layers.1.mlp.experts.2.gate_proj.weight"), gate_up[2, :3])
    assert torch.equal(r.get("model.layers.1.mlp.experts.2.up_proj.weight"), gate_up[2, 3:])
    assert torch.equal(r.get("model.layers.1.mlp.experts.3.down_proj.weight"), down[3])
    assert r.dtype("model.layers.1.mlp.experts.0.up_proj.weight") == torch.float32
    assert not r.has("model.layers.2.mlp.experts.0.up_proj.weight")
