"""The GLM-5 network as megatron-core builds it, checked against the published GLM-5 numbers
(docs/model.md) and, for the tiny model, against megatron-core's own MTP block.

One process, a 1-rank gloo group and megatron's model-parallel groups (TP = PP = EP = 1). The
744B model is built on the meta device: shapes and counts are real, no weight memory is used.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf

from model_providers.glm5.model.config import GLM5Config, PrecisionConfig, to_transformer_config
from model_providers.glm5.model.provider import build_model_chunks
from parallel.config import ParallelConfig
from parallel.initialize import DistEnv, initialize

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="builds on CPU ranks (gloo + CPU emulation of megatron-core)"
)

CONF = os.path.join(os.path.dirname(__file__), "..", "..", "..", "conf")

HF_STORED_PARAMS = 753_864_139_008  #: GLM-5 HF weight dump (docs/model.md)

#: HF tensor shapes of one GLM-5 layer (docs/model.md), [out, in].
HF = {
    "q_a_proj": (2048, 6144),
    "q_b_proj": (16384, 2048),
    "kv_a_proj_with_mqa": (576, 6144),
    "kv_b_proj": (28672, 512),
    "o_proj": (6144, 16384),
    "expert.gate_proj": (2048, 6144),
    "expert.up_proj": (2048, 6144),
    "expert.down_proj": (6144, 2048),
    "router": (256, 6144),
    "dense.gate_proj": (12288, 6144),
    "dense.up_proj": (12288, 6144),
    "dense.down_proj": (6144, 12288),
    "mtp.eh_proj": (6144, 12288),
    "embed_tokens": (154880, 6144),
    "lm_head": (154880, 6144),
}


def _load_model_yaml(name: str) -> GLM5Config:
    schema = OmegaConf.structured(GLM5Config)
    return OmegaConf.to_object(OmegaConf.merge(schema, OmegaConf.load(os.path.join(CONF, "model", f"{name}.yaml"))))


def _meta_model(name: str):
    """``conf/model/<name>.yaml`` built on ``meta`` (one rank, local layers): (config, megatron's
    config, the chunk). ``use_cpu_initialization`` makes every weight a plain ``torch.empty`` that
    follows the meta device; no init kernels."""
    cfg = _load_model_yaml(name)
    tcfg = to_transformer_config(cfg, ParallelConfig(), PrecisionConfig())
    tcfg.use_cpu_initialization = True
    tcfg.perform_initialization = False
    with torch.device("meta"):
        (model,) = build_model_chunks(cfg, tcfg, "local")
    return cfg, tcfg, model


@pytest.fixture(scope="module", autouse=True)
def megatron_groups():
    """A 1-rank gloo group and megatron's model-parallel groups, torn down after the module so
    later tests in the same session start without a process group."""
    from megatron.core import parallel_state

    initialize(ParallelConfig(), seed=1, env=DistEnv.one_process())
    yield
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _attention_shapes(prefix: str, hf=HF) -> dict:
    """megatron MLA parameter -> HF shape (megatron names: the local layer spec)."""
    a = prefix + "self_attention."
    return {
        prefix + "input_layernorm.weight": (6144,),
        a + "linear_q_down_proj.weight": hf["q_a_proj"],
        a + "q_layernorm.weight": (2048,),  # HF q_a_layernorm
        a + "linear_q_up_proj.weight": hf["q_b_proj"],
        a + "linear_kv_down_proj.weight": hf["kv_a_proj_with_mqa"],
        a + "kv_layernorm.weight": (512,),  # HF kv_a_layernorm
        a + "linear_kv_up_proj.weight": hf["kv_b_proj"],
        a + "linear_proj.weight": hf["o_proj"],
        prefix + "pre_mlp_layernorm.weight": (6144,),  # HF post_attention_layernorm
        # DSA lightning indexer (HF self_attn.indexer.*)
        a + "core_attention.indexer.wq_b.weight": (4096, 2048),
        a + "core_attention.indexer.wk.weight": (128, 6144),
        a + "core_attention.indexer.k_norm.weight": (128,),
        a + "core_attention.indexer.k_norm.bias": (128,),
        a + "core_attention.indexer.weights_proj.weight": (32, 6144),
    }


def _fused_gate_up(gate, up):
    """megatron's linear_fc1 stacks SwiGLU's gate and up projections along the output dim."""
    assert gate[1] == up[1]
    return (gate[0] + up[0], gate[1])


def _dense_layer_shapes(prefix: str) -> dict:
    shapes = _attention_shapes(prefix)
    shapes[prefix + "mlp.linear_fc1.weight"] = _fused_gate_up(HF["dense.gate_proj"], HF["dense.up_proj"])
    shapes[prefix + "mlp.linear_fc2.weight"] = HF["dense.down_proj"]
    return shapes


def _moe_layer_shapes(prefix: str, num_experts: int = 256) -> dict:
    shapes = _attention_shapes(prefix)
    m = prefix + "mlp."
    shapes[m + "router.weight"] = HF["router"]
    fc1 = _fused_gate_up(HF["expert.gate_proj"], HF["expert.up_proj"])
    for e in range(num_experts):
        shapes[m + f"experts.local_experts.{e}.linear_fc1.weight"] = fc1
        shapes[m + f"experts.local_experts.{e}.linear_fc2.weight"] = HF["expert.down_proj"]
    shapes[m + "shared_experts.linear_fc1.weight"] = fc1  # 1 shared expert x 2048
    shapes[m + "shared_experts.linear_fc2.weight"] = HF["expert.down_proj"]
    return shapes


def _indexer_params_per_layer(cfg: GLM5Config) -> int:
    """HF DSA indexer of one layer: wq_b [heads*dim, q_lora_rank], wk [dim, hidden],
    k_norm weight + bias [dim] each, weights_proj [heads, hidden]."""
    d = cfg.dsa
    wq_b = d.index_heads * d.index_head_dim * cfg.q_lora_rank
    wk = d.index_head_dim * cfg.hidden_size
    k_norm = 2 * d.index_head_dim
    weights_proj = d.index_heads * cfg.hidden_size
    return wq_b + wk + k_norm + weights_proj


# --- glm5_744b on the meta device --------------------------------------------------------------


@pytest.mark.heavy  # builds the 744B model on meta (~10 s)
class TestGLM5_744B:
    @pytest.fixture(scope="class")
    def built(self):
        """The full 744B model at TP=PP=EP=1 on the meta device.

        ``to_transformer_config`` keeps ``use_cpu_initialization=True`` on CPU; that path allocates
        every weight with a plain ``torch.empty(shape)`` and so follows ``torch.device("meta")``.
        The other path (``use_cpu_initialization=False``) passes
        ``device=torch.cuda.current_device()`` explicitly, which the CPU emulation maps to the
        real CPU: it would allocate ~3 TB. ``perform_initialization=False`` skips the init kernels
        (no-ops on meta anyway). Only the routers' small buffers (expert_bias,
        local_tokens_per_expert, built with an explicit device) are real CPU tensors.
        """
        cfg, tcfg, model = _meta_model("glm5_744b")
        yield cfg, tcfg, model
        del model

    def test_every_weight_is_on_meta(self, built):
        _, _, model = built
        devices = {p.device.type for p in model.parameters()}
        assert devices == {"meta"}, devices

    def test_parameter_count_matches_the_hf_dump(self, built):
        """Our parameters + router expert biases = the HF stored count.

        HF stores 753,864,139,008 parameters. ``e_score_correction_bias`` [256] of each MoE
        router (75 decoder MoE layers + the MTP layer = 76 x 256 = 19,456) is not a megatron
        parameter here: megatron keeps it as the router's ``expert_bias`` buffer (updated by the
        aux-loss-free balancing rule, not by the optimizer). The DSA lightning indexer (wq_b
        [4096, 2048], wk [128, 6144], k_norm weight + bias [128] + [128], weights_proj [32, 6144]
        = 9,371,904 per layer, 78 layers + the MTP layer = 740,380,416) is built in every layer.
        Measured difference: exactly 0 (753,864,119,552 built + 19,456).
        The MTP layer has no embedding or output head of its own: it shares the main model's,
        as the HF dump does (the count would be off by 2 x 951,582,720 otherwise).
        """
        cfg, _, model = built
        ours = sum(p.numel() for p in model.parameters())
        built_indexer = sum(p.numel() for n, p in model.named_parameters() if "indexer" in n)
        expert_bias = sum(b.numel() for n, b in model.named_buffers() if n.endswith("expert_bias"))
        assert expert_bias == (cfg.num_moe_layers + 1) * cfg.num_experts == 76 * 256

        assert _indexer_params_per_layer(cfg) == 9_371_904
        assert built_indexer == (cfg.num_layers + 1) * _indexer_params_per_layer(cfg) == 740_380_416

        total = ours + expert_bias
        diff = total - HF_STORED_PARAMS
        print(
            f"\nglm5_744b: built {ours:,} (indexer {built_indexer:,}) + expert_bias {expert_bias:,} = "
            f"{total:,}; HF {HF_STORED_PARAMS:,}; difference {diff:+,}"
            + (" (exactly equal)" if diff == 0 else "")
        )
        assert abs(diff) <= 1e-4 * HF_STORED_PARAMS, f"difference {diff:+,} exceeds 0.01%"
        assert diff == 0, f"difference {diff:+,} parameters"

    def test_layer_structure_and_hf_shapes(self, built):
        from megatron.core.transformer.mlp import MLP
        from megatron.core.transformer.moe.moe_layer import MoELayer

        cfg, _, model = built
        layers = model.decoder.layers
        assert len(layers) == 78
        assert [isinstance(l.mlp, MoELayer) for l in layers] == [False] * 3 + [True] * 75
        assert all(type(l.mlp) is MLP for l in layers[:3])

        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        expected = {
            "embedding.word_embeddings.weight": HF["embed_tokens"],
            "output_layer.weight": HF["lm_head"],
            "decoder.final_layernorm.weight": (6144,),
        }
        for i in range(78):
            make = _dense_layer_shapes if i < 3 else _moe_layer_shapes
            expected.update(make(f"decoder.layers.{i}."))
        mtp = "mtp.layers.0."
        expected.update({
            mtp + "enorm.weight": (6144,),
            mtp + "hnorm.weight": (6144,),
            mtp + "eh_proj.weight": HF["mtp.eh_proj"],
            mtp + "final_layernorm.weight": (6144,),  # HF shared_head.norm
        })
        expected.update(_moe_layer_shapes(mtp + "mtp_model_layer."))

        missing = sorted(set(expected) - set(shapes))
        extra = sorted(set(shapes) - set(expected))
        assert not missing, f"{len(missing)} expected parameters missing, e.g. {missing[:5]}"
        assert not extra, f"{len(extra)} unexpected parameters, e.g. {extra[:5]}"
        wrong = {n: (shapes[n], expected[n]) for n in expected if shapes[n] != expected[n]}
        assert not wrong, f"shape mismatches (got, HF): {dict(list(wrong.items())[:5])}"

    def test_one_shared_mtp_layer(self, built):
        from megatron.core.transformer.moe.moe_layer import MoELayer

        from model_providers.glm5.model.mtp import SharedMultiTokenPredictionBlock

        cfg, tcfg, model = built
        assert cfg.mtp_num_steps == 3 and tcfg.mtp_num_layers == 1  # megatron sees the one layer
        assert model.config.mtp_num_layers == model.mtp.num_steps == 3  # GPTModel's loss: the depths
        assert isinstance(model.mtp, SharedMultiTokenPredictionBlock)
        assert len(model.mtp.layers) == 1
        assert isinstance(model.mtp.layers[0].mtp_model_layer.mlp, MoELayer)

    def test_moe_config_and_untied_output(self, built):
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

        _, tcfg, model = built
        assert tcfg.num_moe_experts == 256 and tcfg.moe_router_topk == 8
        assert tcfg.moe_ffn_hidden_size == 2048
        assert tcfg.moe_shared_expert_intermediate_size == 2048
        assert tcfg.moe_layer_freq == [0] * 3 + [1] * 75
        assert tcfg.moe_router_score_function == "sigmoid"
        assert tcfg.moe_router_enable_expert_bias is True
        assert tcfg.moe_router_topk_scaling_factor == 2.5
        assert tcfg.moe_router_num_groups is None  # n_group = topk_group = 1: no group routing
        assert tcfg.moe_token_dispatcher_type == "alltoall"
        assert isinstance(model.decoder.layers[3].mlp.token_dispatcher, MoEAlltoAllTokenDispatcher)
        assert model.share_embeddings_and_output_weights is False
        assert model.output_layer.weight is not model.embedding.word_embeddings.weight


# --- deepseek_v3_671b: counted, and built on the meta device ----------------------------------

#: DeepSeek-V3's published sizes (HF model card and README_WEIGHTS.md of deepseek-ai/DeepSeek-V3;
#: technical report arXiv:2412.19437): 671B main model, 685B on Hugging Face (+ "14B" of MTP),
#: 36.6B activated by the main model per token including the 0.9B output head (the report's 37B).
DSV3_MAIN, DSV3_HF_TOTAL, DSV3_MTP, DSV3_ACTIVE = 671e9, 685e9, 14e9, 36.6e9


def _dsv3_published_counts(cfg: GLM5Config, total: int, mtp: int, active: int) -> dict:
    """Our counts in the published figures' terms, each against the figure at the precision it
    is published with (half its last digit): 671B and 685B are whole billions (+-0.5B); 14B is
    685B - 671B, two rounded figures (+-1B); 36.6B is to 0.1B (+-0.05B). The HF dump stores the
    MTP layer's own copies of the embedding and output head (megatron's MTP shares the main
    model's: 2 x 129280 x 7168 = 1.85B more there), the routers' ``e_score_correction_bias``
    (megatron's ``expert_bias`` buffer, 59 x 256) and, being an FP8 dump, one fp32
    ``weight_scale_inv`` per 128 x 128 block of each FP8 weight (41.5M; without them the dump
    would be 684.49B, "684B"). ``active`` excludes embedding and head."""
    vocab_h = cfg.padded_vocab_size(1) * cfg.hidden_size
    bias = (cfg.num_moe_layers + 1) * cfg.num_experts
    return {"main": (total - mtp, DSV3_MAIN, 0.5e9),
            "hf_total": (total + 2 * vocab_h + bias + _dsv3_fp8_scales(cfg), DSV3_HF_TOTAL, 0.5e9),
            "mtp": (mtp + 2 * vocab_h, DSV3_MTP, 1e9),
            "active": (active + vocab_h, DSV3_ACTIVE, 0.05e9)}


def _dsv3_fp8_scales(cfg: GLM5Config) -> int:
    """fp32 block scales of the HF dump's FP8 weights (``quantization_config``: 128 x 128
    blocks): every linear layer of the decoder layers and the MTP layer but the routers (bf16),
    and ``eh_proj``; not the embedding, the head or the norms."""
    def blocks(out: int, inp: int) -> int:
        return -(-out // 128) * -(-inp // 128)

    h, n = cfg.hidden_size, cfg.num_attention_heads
    qk, rope = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.qk_rope_head_dim
    attention = (blocks(cfg.q_lora_rank, h) + blocks(n * qk, cfg.q_lora_rank)
                 + blocks(cfg.kv_lora_rank + rope, h)
                 + blocks(n * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
                 + blocks(h, n * cfg.v_head_dim))
    dense = attention + 2 * blocks(cfg.ffn_hidden_size, h) + blocks(h, cfg.ffn_hidden_size)
    expert = 2 * blocks(cfg.moe_ffn_hidden_size, h) + blocks(h, cfg.moe_ffn_hidden_size)
    moe = attention + (cfg.num_experts + cfg.num_shared_experts) * expert
    return cfg.first_k_dense * dense + (cfg.num_moe_layers + 1) * moe + blocks(h, 2 * h)


def test_deepseek_v3_counts_match_the_published_sizes():
    """The project's counter on conf/model/deepseek_v3_671b.yaml (no model built): main model
    671,026,404,352 (671B), with the HF dump's MTP copies, expert biases and FP8 block scales
    684,531,392,272 (685B), MTP 13.46B (685B - 671B = "14B"), 36.63B active with the head (36.6B; 37B)."""
    from model_providers.glm5.counting.size import model_size

    cfg = _load_model_yaml("deepseek_v3_671b")
    s = model_size(cfg)
    assert (s.total, s.mtp, s.active) == (682_636_472_320, 11_610_067_968, 35_698_924_544)
    assert _dsv3_fp8_scales(cfg) == 41_546_768
    for name, (ours, published, tol) in _dsv3_published_counts(cfg, s.total, s.mtp, s.active).items():
        assert abs(ours - published) <= tol, (name, ours, published)
    assert round((s.active + cfg.padded_vocab_size(1) * cfg.hidden_size) / 1e9) == 37  # the report's figure


@pytest.mark.heavy  # builds the 683B model on meta (~10 s)
def test_deepseek_v3_built_on_meta_is_the_counted_model_without_an_indexer():
    """megatron builds exactly what the counter counts, with no DSA indexer anywhere, DeepSeek-V3's
    group-limited routing (8 groups, top 4), YaRN and one MTP layer applied once."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from model_providers.glm5.counting.size import model_size

    cfg, tcfg, model = _meta_model("deepseek_v3_671b")
    names = [n for n, _ in model.named_parameters()]
    assert not [n for n in names if "indexer" in n]
    assert all(l.self_attention.core_attention.indexer is None for l in model.decoder.layers)
    ours = sum(p.numel() for p in model.parameters())
    mtp = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    assert (ours, mtp) == (model_size(cfg).total, model_size(cfg).mtp)
    layers = model.decoder.layers
    assert [isinstance(l.mlp, MoELayer) for l in layers] == [False] * 3 + [True] * 58
    assert len(model.mtp.layers) == 1 and tcfg.mtp_num_layers == 1
    assert (tcfg.moe_router_num_groups, tcfg.moe_router_group_topk, tcfg.moe_router_topk) == (8, 4, 8)
    assert (tcfg.rope_type, tcfg.rotary_scaling_factor, tcfg.mscale_all_dim) == ("yarn", 40.0, 1.0)
    a = layers[0].self_attention
    assert tuple(a.linear_q_up_proj.weight.shape) == (128 * 192, 1536)
    assert tuple(a.linear_kv_up_proj.weight.shape) == (128 * 256, 512)
    del model


# --- the tiny model, built for real ------------------------------------------------------------


def _build_tiny(cfg: GLM5Config, seed: int = 7):
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    tcfg = to_transformer_config(cfg, ParallelConfig(), PrecisionConfig())
    (model,) = build_model_chunks(cfg, tcfg, "local")
    return tcfg, model


@pytest.fixture(scope="module")
def tiny():
    cfg = GLM5Config()
    tcfg, model = _build_tiny(cfg)
    return cfg, tcfg, model


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(0)
    b, s = 2, 16
    tokens = torch.randint(0, 257, (b, s), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    position_ids = torch.arange(s).expand(b, s)
    return tokens, position_ids, labels


def _train_forward_backward(model, batch):
    """Training-mode forward with labels and backward of the summed LM loss (the MTP losses
    enter the backward through megatron's MTPLossAutoScaler). Returns the per-token LM loss and
    the per-depth MTP losses megatron logged."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tokens, position_ids, labels = batch
    model.train()
    model.zero_grad(set_to_none=True)
    MTPLossLoggingHelper.tracker.clear()
    loss = model(tokens, position_ids, None, labels=labels)
    mtp = MTPLossLoggingHelper.tracker["loss_values"].clone()
    MTPLossLoggingHelper.tracker.clear()
    loss.sum().backward()
    return loss.detach(), mtp


def test_the_tiny_model_is_the_schema_defaults_with_one_source():
    assert OmegaConf.load(os.path.join(CONF, "model", "glm5_tiny.yaml")) == {}  # nothing restated
    assert _load_model_yaml("glm5_tiny") == GLM5Config()
    assert _load_model_yaml("glm5_744b") != GLM5Config()


def test_tiny_forward_gives_per_token_losses_of_its_logits(tiny, batch):
    """The [b, s] loss is the per-token CE of the main head's logits. megatron's GPTModel with MTP
    needs labels even for logits, so the logits are read from the output layer's last call (the
    MTP heads call it first, one per depth) and cloned: megatron's cross entropy works on the
    fp32 logits in place."""
    _, _, model = tiny
    tokens, position_ids, labels = batch
    calls = []
    hook = model.output_layer.register_forward_hook(lambda mod, inp, out: calls.append(out[0].clone()))
    try:
        model.eval()
        with torch.no_grad():
            loss = model(tokens, position_ids, None, labels=labels)
    finally:
        hook.remove()
    assert loss.shape == labels.shape == (2, 16)
    assert len(calls) == 1 + 3
    logits_sbv = calls[-1]
    assert logits_sbv.shape == (16, 2, 512)  # [s, b, padded vocab]
    reference = F.cross_entropy(
        logits_sbv.transpose(0, 1).reshape(-1, 512).float(), labels.reshape(-1), reduction="none"
    )
    torch.testing.assert_close(loss, reference.view(2, 16), rtol=1e-5, atol=1e-5)
    # freshly initialised: close to uniform over the 512 (padded) vocabulary
    assert abs(loss.mean().item() - math.log(512)) < 0.5


def test_one_mtp_module_three_losses(tiny, batch):
    cfg, tcfg, model = tiny
    assert (cfg.mtp_num_steps, tcfg.mtp_num_layers, model.config.mtp_num_layers) == (3, 1, 3)
    assert len(model.mtp.layers) == 1
    loss, mtp = _train_forward_backward(model, batch)
    assert loss.shape == (2, 16)
    assert mtp.shape == (3,)
    assert bool((mtp > 0).all()), mtp
    # each depth is a next-next-token CE of a fresh model: near log(vocab), and the depths differ
    assert bool(((mtp - math.log(512)).abs() < 0.5).all()), mtp
    assert len(set(mtp.tolist())) == 3, mtp


def test_shared_mtp_equals_megatron_block_with_tied_copies(tiny, batch):
    """Reference: megatron's stock MultiTokenPredictionBlock with 3 separate layers
    (``mtp_num_layers=3``, how this model was built before megatron was told of one layer), each a
    copy of our one shared layer. Per-depth losses must match, and the gradient of every shared
    MTP parameter must equal the sum of the three copies' gradients (all 3 depths reach it)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
    )

    from model_providers.glm5.model.specs import decoder_block_spec, mtp_block_spec
    from parallel.megatron_compat import MicroBatch, reset_loss_trackers

    cfg, tcfg, model = tiny
    one = mtp_block_spec(tcfg, "local", cfg.dsa)
    assert len(one.layer_specs) == 1
    assert tcfg.mtp_num_layers == 1
    ref = GPTModel(
        config=dataclasses.replace(tcfg, mtp_num_layers=3),
        transformer_layer_spec=decoder_block_spec(tcfg, "local", cfg.dsa),
        vocab_size=cfg.padded_vocab_size(1),
        max_sequence_length=cfg.max_position_embeddings,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=int(cfg.rope_theta),
        mtp_block_spec=MultiTokenPredictionBlockSubmodules(layer_specs=one.layer_specs * 3),
    )
    assert type(ref.mtp) is MultiTokenPredictionBlock and len(ref.mtp.layers) == 3
    state = {}
    for k, v in model.state_dict().items():
        if k.startswith("mtp.layers.0."):
            for d in range(3):
                state[k.replace("mtp.layers.0.", f"mtp.layers.{d}.")] = v
        else:
            state[k] = v
    ref.load_state_dict(state, strict=True)
    assert sum(p.numel() for p in ref.parameters()) > sum(p.numel() for p in model.parameters())

    loss, mtp = _train_forward_backward(model, batch)
    reset_loss_trackers()  # per-layer trackers are sized by the model that made them (4 + 1 here)
    with MicroBatch().active():  # megatron's GPTModel does not make the micro-batch GLM5Model does
        ref_loss, ref_mtp = _train_forward_backward(ref, batch)
    reset_loss_trackers()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mtp, ref_mtp, rtol=1e-6, atol=1e-6)

    ref_params = dict(ref.named_parameters())
    mtp_params = [(n, p) for n, p in model.named_parameters() if n.startswith("mtp.")]
    assert mtp_params
    for name, p in mtp_params:
        copies = [ref_params[name.replace("mtp.layers.0.", f"mtp.layers.{d}.")].grad for d in range(3)]
        if p.grad is None:  # an expert no token was routed to, in both models
            assert all(g is None or not g.any() for g in copies), name
            continue
        # the same terms added in another order (3 fp32 additions, either side: 4 u sum|copies|)
        # from copies whose own backward rounds differently (other GEMM shapes): both are relative
        # to the copies' magnitude, not to their sum, which may cancel; 1e-4 of it for the latter
        magnitude = sum(g.abs() for g in copies)
        err = (p.grad - sum(copies)).abs()
        assert bool((err <= (1e-4 + 4 * 2.0 ** -24) * magnitude).all()), name
    eh = [ref_params[f"mtp.layers.{d}.eh_proj.weight"].grad.norm().item() for d in range(3)]
    assert min(eh) > 0.1 * max(eh), f"every depth contributes to eh_proj's gradient: {eh}"


def test_mtp_depths_two_and_three_reach_the_shared_parameters(tiny, batch):
    """Same weights, one MTP step instead of three, same loss weight per depth: depth 1 is
    identical, and the shared eh_proj gradient differs by what depths 2 and 3 contributed."""
    cfg, _, model = tiny
    cfg1 = dataclasses.replace(cfg, mtp_num_steps=1, mtp_loss_scale=cfg.mtp_loss_scale / cfg.mtp_num_steps)
    _, model1 = _build_tiny(cfg1, seed=11)
    assert sum(p.numel() for p in model1.parameters()) == sum(p.numel() for p in model.parameters())
    model1.load_state_dict(model.state_dict(), strict=True)

    loss3, mtp3 = _train_forward_backward(model, batch)
    g3 = model.mtp.layers[0].eh_proj.weight.grad.clone()
    loss1, mtp1 = _train_forward_backward(model1, batch)
    g1 = model1.mtp.layers[0].eh_proj.weight.grad.clone()

    assert mtp1.shape == (1,)
    torch.testing.assert_close(mtp1[0], mtp3[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss1, loss3, rtol=1e-6, atol=1e-6)
    rel = ((g3 - g1).norm() / g1.norm()).item()
    assert rel > 0.1, f"depths 2-3 changed eh_proj's gradient by only {rel:.2e} (relative)"


def test_dsa_mode_none_builds_no_indexer_and_trains_as_dense(tiny, batch):
    """``dsa.mode=none`` (DeepSeek-V3): no indexer module or parameter; given the dense model's
    weights (less its indexers) the losses and every gradient are the dense model's, bit for bit
    (the same attention path). The DeepSeek-V3 tiny preset trains (MTP x1, grouped routing)."""
    cfg, _, dense = tiny
    none_cfg = dataclasses.replace(cfg, dsa=dataclasses.replace(cfg.dsa, mode="none"))
    _, model = _build_tiny(none_cfg)
    assert not [n for n, _ in model.named_parameters() if "indexer" in n]
    assert all(l.self_attention.core_attention.indexer is None for l in model.decoder.layers)
    assert model.mtp.layers[0].mtp_model_layer.self_attention.core_attention.indexer is None
    weights = {k: v for k, v in dense.state_dict().items() if ".indexer." not in k}
    model.load_state_dict(weights, strict=True)
    want, want_mtp = _train_forward_backward(dense, batch)
    have, have_mtp = _train_forward_backward(model, batch)
    assert torch.equal(have, want) and torch.equal(have_mtp, want_mtp)
    grads = dict(dense.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, grads[name].grad), name

    dsv3 = _load_model_yaml("deepseek_v3_tiny")
    tcfg, tiny_v3 = _build_tiny(dsv3)
    assert (tcfg.moe_router_num_groups, tcfg.moe_router_group_topk, tcfg.mtp_num_layers) == (4, 2, 1)
    assert not [n for n, _ in tiny_v3.named_parameters() if "indexer" in n]
    loss, mtp = _train_forward_backward(tiny_v3, batch)
    assert mtp.shape == (1,) and bool(torch.isfinite(loss).all())


def test_router_sigmoid_bias_normalised_topk_scaled(tiny):
    """Router numerics against a hand computation: sigmoid scores, top-k chosen on
    scores + expert_bias, probabilities from the scores alone, normalised, times 2.5."""
    cfg, tcfg, model = tiny
    assert tcfg.moe_router_score_function == "sigmoid"
    assert tcfg.moe_router_enable_expert_bias is True
    assert tcfg.moe_router_topk_scaling_factor == cfg.moe_routed_scaling_factor == 2.5
    assert tcfg.moe_shared_expert_intermediate_size == cfg.num_shared_experts * cfg.moe_ffn_hidden_size == 64
    assert tcfg.moe_token_dispatcher_type == "alltoall"
    assert tuple(model.decoder.layers[1].mlp.shared_experts.linear_fc2.weight.shape) == (128, 64)
    assert model.share_embeddings_and_output_weights is False
    emb, out = model.embedding.word_embeddings.weight, model.output_layer.weight
    assert emb is not out and emb.data_ptr() != out.data_ptr()

    router = model.decoder.layers[1].mlp.router
    saved_bias = router.expert_bias.clone()
    try:
        router.eval()
        favoured = 5
        with torch.no_grad():
            router.expert_bias.zero_()
            router.expert_bias[favoured] = 10.0  # larger than any sigmoid gap: always chosen
            x = torch.randn(6, 2, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
            probs, routing_map = router(x)
        scores = torch.sigmoid(x.reshape(-1, cfg.hidden_size).float() @ router.weight.float().t())
        top = torch.topk(scores + router.expert_bias, k=2, dim=-1).indices
        picked = torch.gather(scores, 1, top)
        expected = torch.zeros_like(scores).scatter(1, top, 2.5 * picked / picked.sum(-1, keepdim=True))
        assert routing_map.shape == (12, 8) and bool((routing_map.sum(-1) == 2).all())
        assert bool(routing_map[:, favoured].all())
        torch.testing.assert_close(probs, expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(probs.sum(-1), torch.full((12,), 2.5), rtol=1e-5, atol=1e-6)
        # without the bias the favoured expert is not always the choice: the bias decides routing
        assert not bool(torch.topk(scores, k=2, dim=-1).indices.eq(favoured).any(-1).all())
    finally:
        with torch.no_grad():
            router.expert_bias.copy_(saved_bias)
