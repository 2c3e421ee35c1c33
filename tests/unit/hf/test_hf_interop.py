"""Hugging Face interop against transformers' own ``GlmMoeDsaForCausalLM`` (tiny, random, fp32):
logits parity through import (dense and DSA-sparse top-k, plain RoPE and YaRN), the MTP module
against a reference built from transformers' modules, bit-identical import -> export, and a
missing MTP module."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.support import hf as hs
TOL = 1e-4  #: max |ours - HF| / max |HF| over all logits


@pytest.fixture(scope="module")
def one_rank():
    from megatron.core import parallel_state

    from model_providers.glm5.hf.convert import ensure_one_rank

    ensure_one_rank()
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _our_model(ckpt, mtp_num_steps=0, dsa_mode="sparse"):
    from checkpointing.dist_io import load_common
    from model_providers.glm5.hf.convert import config_from_common
    from model_providers.glm5.hf.evaluate import build_eval_model, load_weights
    from parallel.config import ParallelConfig

    cfg = config_from_common(load_common(ckpt))
    chunks, _ = build_eval_model(cfg, ParallelConfig(), dsa_mode, mtp_num_steps=mtp_num_steps)
    load_weights(ckpt, chunks)
    return cfg, chunks


def _rel_err(ours, ref) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


@pytest.fixture(scope="module")
def released(one_rank, tmp_path_factory):
    """A released-style HF dir (several shards + the MTP module as layer 4), index_topk=16 < 48,
    imported with 3 MTP steps."""
    from model_providers.glm5.hf.convert import import_hf

    root = tmp_path_factory.mktemp("hf")
    model = hs.make_model(index_topk=16)
    mods = hs.mtp_modules(model.config)
    hf_dir = hs.save_hf(model, str(root / "hf"), extra=hs.mtp_tensors(model, mods))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = import_hf(hf_dir, str(root / "ckpt"), mtp_num_steps=3)
    assert not summary["mtp_initialised"]
    assert not [w for w in caught if "MTP" in str(w.message)]
    return root, model, mods, hf_dir, str(root / "ckpt")


@pytest.mark.parametrize("index_topk", [64, 16])
def test_logits_match_transformers(released, index_topk, tmp_path):
    """index_topk 64 >= 48 tokens: every query sees all its keys; 16: DSA sparse attention for
    queries 16..47 (only their indexer top-16 keys)."""
    from model_providers.glm5.hf.convert import import_hf
    from model_providers.glm5.hf.evaluate import hf_logits, logits

    root, model, _, hf_dir, ckpt = released
    if index_topk != model.config.index_topk:
        model = hs.make_model(index_topk=index_topk)
        hf_dir = hs.save_hf(model, str(tmp_path / "hf"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import_hf(hf_dir, str(tmp_path / "ckpt"), mtp_num_steps=0)
        ckpt = str(tmp_path / "ckpt")
    tokens = hs.well_separated_tokens(model)
    _, chunks = _our_model(ckpt)
    from tests.support.dsa_probe import TopkProbe

    with TopkProbe(chunks[0]) as probe:
        ours = logits(chunks, tokens, hs.TINY["vocab_size"])
    ref = hf_logits(model, tokens)
    err = _rel_err(ours, ref)
    print(f"\nindex_topk={index_topk} seq={hs.SEQ}: max relative logits error {err:.2e}")
    assert err < TOL
    if index_topk >= hs.SEQ:  # the training default (dense attention, no indexer) agrees too
        _, dense_chunks = _our_model(ckpt, dsa_mode="dense")
        assert _rel_err(logits(dense_chunks, tokens, hs.TINY["vocab_size"]), ref) < TOL
    else:  # the sparse path must matter, or this comparison proves little
        dense = hf_logits(hs.make_model(index_topk=hs.SEQ), tokens)
        assert _rel_err(ref, dense) > 100 * TOL
        assert len(probe.latest) == hs.TINY["num_hidden_layers"]  # every layer selected top-k


YARN_SEQ = 96  #: past the original context of 64
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0}
YARN_CASES = {  # with qk_rope_head_dim 8 the ramp spans dims 0..2: kept, blended, interpolated x2
    "yarn": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.0},  # cos/sin x (0.1 ln 4 + 1)
    "yarn_deepseek_v3": {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0},  # softmax x (0.1 ln 4 + 1)^2
}


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_logits_match_transformers(one_rank, case, tmp_path):
    """A YaRN model (4x an original context of 64, 96 tokens, DSA top-16) imported from HF gives
    HF's logits: megatron's YarnRotaryEmbedding in MLA, the same frequencies and cos/sin scale in
    the indexer, megatron's softmax scale in DSA attention. Plain RoPE on the same weights gives
    other logits, so YaRN is really exercised; export writes the same config.json back."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_mscale

    from model_providers.glm5.model.dsa.attention import DSACoreAttention
    from model_providers.glm5.hf.convert import export_hf, import_hf
    from model_providers.glm5.hf.evaluate import hf_logits, logits

    rope = YARN_CASES[case]
    shape = dict(max_position_embeddings=256, num_nextn_predict_layers=0)
    model = hs.make_model(index_topk=16, rope_parameters=dict(rope), **shape)
    hf_dir = hs.save_hf(model, str(tmp_path / "hf"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import_hf(hf_dir, str(tmp_path / "ckpt"), mtp_num_steps=0)
    cfg, chunks = _our_model(str(tmp_path / "ckpt"))
    assert cfg.rope_type == "yarn" and cfg.yarn.mscale_all_dim == rope["mscale_all_dim"]
    scale = _yarn_get_mscale(4.0, rope["mscale_all_dim"]) ** 2 / (24 + 8) ** 0.5
    cores = [m for m in chunks[0].modules() if isinstance(m, DSACoreAttention)]
    assert len(cores) == 4 and all(c.softmax_scale == pytest.approx(scale, rel=1e-12) for c in cores)
    assert all(c.indexer.yarn == cfg.yarn for c in cores)
    tokens = hs.well_separated_tokens(model, batch=1, seq=YARN_SEQ)  # 2 x 96 rows: no clear top-k
    from tests.support.dsa_probe import TopkProbe

    with TopkProbe(chunks[0]) as probe:
        ours = logits(chunks, tokens, hs.TINY["vocab_size"])
    ref = hf_logits(model, tokens)
    err = _rel_err(ours, ref)
    print(f"\n{case} seq={YARN_SEQ}: max relative logits error {err:.2e}")
    assert err < TOL
    assert all(c in probe.latest for c in cores)  # queries 16..95 attended sparsely
    plain = hf_logits(hs.make_model(index_topk=16, **shape), tokens)
    assert _rel_err(plain, ref) > 100 * TOL
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "export"))
    with open(os.path.join(hf_dir, "config.json")) as f, \
            open(os.path.join(tmp_path, "export", "config.json")) as g:
        a, b = json.load(f), json.load(g)
    assert a["rope_parameters"] == rope
    assert {k: v for k, v in a.items() if k != "transformers_version"} == \
        {k: v for k, v in b.items() if k != "transformers_version"}


def test_mtp_matches_transformers_modules(released):
    """Depth-1 MTP logits of the imported MTP module equal a reference assembled from
    transformers' decoder layer and norms (checks enorm/hnorm/eh_proj order, the shared head
    norm and the MTP layer's own weights)."""
    _, model, mods, _, ckpt = released
    tokens = hs.well_separated_tokens(model, mods, batch=1)
    _, chunks = _our_model(ckpt, mtp_num_steps=1)
    captured = {}
    chunks[0].mtp.register_forward_hook(lambda m, a, out: captured.update(h=out))
    labels = torch.roll(tokens, -1, dims=1)
    with torch.no_grad():
        chunks[0](tokens, torch.arange(hs.SEQ)[None], None, labels=labels)
    depth1 = captured["h"][hs.SEQ:2 * hs.SEQ, 0]  # [s, h] after the MTP final norm
    ours = (depth1 @ chunks[0].output_layer.weight.T)[: hs.SEQ - 1, : hs.TINY["vocab_size"]]
    ref = hs.mtp_reference_logits(model, mods, tokens)[0]
    err = _rel_err(ours, ref)
    print(f"\nMTP depth-1 max relative logits error {err:.2e}")
    assert err < TOL


def test_import_export_round_trip_is_bit_identical(released, tmp_path):
    from model_providers.glm5.hf.convert import export_hf
    from model_providers.glm5.hf.evaluate import hf_logits, load_hf_model

    _, model, _, hf_dir, ckpt = released
    out = str(tmp_path / "export")
    summary = export_hf(ckpt, out, max_shard_bytes=400_000)
    assert summary["files"] > 1 and os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    src, dst = hs.read_hf_tensors(hf_dir), hs.read_hf_tensors(out)
    assert sorted(src) == sorted(dst)
    for name in src:
        assert src[name].dtype == dst[name].dtype and torch.equal(src[name], dst[name]), name
    with open(os.path.join(hf_dir, "config.json")) as f, open(os.path.join(out, "config.json")) as g:
        a, b = json.load(f), json.load(g)
    assert {k: v for k, v in a.items() if k != "transformers_version"} == \
        {k: v for k, v in b.items() if k != "transformers_version"}
    tokens = hs.tokens(batch=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported, original = load_hf_model(out), load_hf_model(hf_dir)
    assert torch.equal(hf_logits(exported, tokens), hf_logits(original, tokens))


def test_missing_mtp_is_initialised_with_a_warning(one_rank, tmp_path):
    """transformers drops the MTP module on save; import then initialises it and says so."""
    from checkpointing.dist_io import stored_dtypes
    from model_providers.glm5.hf.convert import import_hf

    model = hs.make_model(index_topk=16)
    hf_dir = hs.save_hf(model, str(tmp_path / "hf"))
    with pytest.warns(UserWarning, match=r"no MTP module \(model\.layers\.4\.\*.*initialising"):
        summary = import_hf(hf_dir, str(tmp_path / "ckpt"), mtp_num_steps=3)
    assert summary["mtp_initialised"]
    keys = stored_dtypes(str(tmp_path / "ckpt"))
    assert "mtp.layers.0.eh_proj.weight" in keys
    assert "mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1.weight" in keys
    _, chunks = _our_model(str(tmp_path / "ckpt"), mtp_num_steps=1)
    eh = chunks[0].mtp.layers[0].eh_proj.weight
    assert 0.5 * model.config.initializer_range < float(eh.std()) < 2 * model.config.initializer_range
    assert torch.equal(chunks[0].mtp.layers[0].enorm.weight, torch.ones_like(chunks[0].mtp.layers[0].enorm.weight))


def test_partial_or_foreign_weights_are_rejected(one_rank, tmp_path):
    from safetensors.torch import load_file, save_file

    from model_providers.glm5.hf.convert import MissingWeightsError, import_hf

    model = hs.make_model(index_topk=16)
    hf_dir = hs.save_hf(model, str(tmp_path / "hf"), shard_size="50MB")
    path = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(path)
    dropped = tensors.pop("model.layers.2.self_attn.indexer.wk.weight")
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(MissingWeightsError, match=r"model\.layers\.2\.self_attn\.indexer\.wk\.weight"):
        import_hf(hf_dir, str(tmp_path / "a"), mtp_num_steps=0)
    tensors["model.layers.2.self_attn.indexer.wk.weight"] = dropped
    tensors["model.layers.1.self_attn.q_proj.weight"] = dropped.clone()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(MissingWeightsError, match=r"no megatron counterpart.*q_proj"):
        import_hf(hf_dir, str(tmp_path / "b"), mtp_num_steps=0)


def test_import_keeps_bf16_and_fp32_router_dtypes(one_rank, tmp_path):
    """Released checkpoints are bf16 with fp32 router weights / expert bias: both are stored as
    they are (a round trip must not round them)."""
    from checkpointing.dist_io import stored_dtypes
    from model_providers.glm5.hf.convert import import_hf

    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaTopkRouter

    model = hs.make_model(index_topk=16).to(torch.bfloat16)
    for m in model.modules():
        if isinstance(m, GlmMoeDsaTopkRouter):
            m.float()
    hf_dir = hs.save_hf(model, str(tmp_path / "hf"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import_hf(hf_dir, str(tmp_path / "ckpt"), mtp_num_steps=0)
    dtypes = stored_dtypes(str(tmp_path / "ckpt"))
    assert dtypes["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"] == torch.bfloat16
    assert dtypes["decoder.layers.1.mlp.router.weight"] == torch.float32
    assert dtypes["decoder.layers.1.mlp.router.expert_bias"] == torch.float32
    _, chunks = _our_model(str(tmp_path / "ckpt"))  # the fp32 model loads the bf16 tensors exactly
    layer = chunks[0].decoder.layers[1]
    assert torch.equal(layer.mlp.experts.local_experts[3].linear_fc2.weight,
                       model.model.layers[1].mlp.experts.down_proj[3].float())
    assert torch.equal(layer.mlp.router.expert_bias, model.model.layers[1].mlp.gate.e_score_correction_bias)
