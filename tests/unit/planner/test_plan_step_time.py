"""Cluster presets (planner/cluster.py) and the step-time model (planner/step_time.py):
strict presets with clear errors, and a time model whose parts move as their formulas say when
one parallel size changes (GLM-5 744B and DeepSeek-V3 shapes; nothing is built)."""

from __future__ import annotations

import dataclasses
import os

import pytest
from omegaconf import OmegaConf

from model_providers.glm5.model.config import GLM5Config, PrecisionConfig
from model_providers.glm5.counting.flops import flops_per_token, megatron_flops_per_token
from parallel.config import ParallelConfig, check_layout
from pretrain.config.schema import CONF_DIR, RunConfig
from pretrain.config.errors import ConfigError
from planner.cluster import load_cluster, preset_names
from planner.step_time import step_time

GLM5 = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(GLM5Config),
                                           OmegaConf.load(os.path.join(CONF_DIR, "model", "glm5_744b.yaml"))))
DSV3 = GLM5Config(num_layers=61, first_k_dense=3, hidden_size=7168, ffn_hidden_size=18432,
                  num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                  qk_rope_head_dim=64, v_head_dim=128, num_experts=256, moe_topk=8,
                  num_shared_experts=1, moe_ffn_hidden_size=2048, vocab_size=129280,
                  moe_router_groups=8, moe_router_group_topk=4, mtp_num_steps=1, recompute=None)
#: the 512-GPU layout GLM-5 shipped with first (before the planner's presets)
GLM5_512 = dict(tp=2, pp=8, vpp=2, ep=32, sequence_parallel=True, first_stage_layers=8,
                last_stage_layers=10, distributed_optimizer=True)


def _plan(model: GLM5Config, par: dict, nodes: int, seq: int = 4096, gbs: int = 4096,
          cluster: str = "h100_80gb", fp8=None, recompute="keep", **cluster_fields):
    """(step time, layout, run config) of one stage-like run config on ``nodes`` nodes."""
    rc = RunConfig()
    rc.model = dataclasses.replace(model, **({} if recompute == "keep" else {"recompute": recompute}))
    rc.parallel = ParallelConfig(**par)
    rc.precision = PrecisionConfig(dtype="bf16", fp8=fp8)
    rc.trainer.seq_length, rc.trainer.micro_batch_size, rc.trainer.global_batch_size = seq, 1, gbs
    c = load_cluster(cluster, {"nodes": nodes, **cluster_fields})
    m = rc.model
    layout, problems = check_layout(rc.parallel, world_size=c.world_size, num_layers=m.num_layers,
                                    num_attention_heads=m.num_attention_heads,
                                    num_experts=m.num_experts, seq_length=seq, micro_batch_size=1,
                                    global_batch_size=gbs)
    assert layout is not None and not problems, problems
    return step_time(rc, layout, c), layout, rc


# --- cluster presets ----------------------------------------------------------------------------


def test_presets_hold_the_published_numbers():
    assert {"h100_80gb", "h200_141gb", "b200_180gb"} <= set(preset_names())
    h100, h200 = load_cluster("h100_80gb"), load_cluster("h200_141gb", {"nodes": "64"})
    for c in (h100, h200):
        assert (c.gpus_per_node, c.bf16_tflops, c.fp8_tflops, c.fp32_tflops) == (8, 989, 1979, 66.9)
        assert (c.nvlink_gbps, c.internode_gbps) == (450, 50)  # GB/s; IB 400 Gb/s = 50 GB/s
    assert 79 < h100.gpu_memory_gib <= 80 and 140 < h200.gpu_memory_gib <= 141
    assert (h100.hbm_gbps, h200.hbm_gbps) == (3350, 4800)
    assert (h200.name, h200.nodes, h200.world_size) == ("h200_141gb", 64, 512)
    b200 = load_cluster("b200_180gb")  # DGX B200: 8 x 180 GB, NVLink 5, 400 Gb/s NICs
    assert (b200.bf16_tflops, b200.fp8_tflops, b200.tf32_tflops, b200.fp32_tflops) == (2250, 4500, 1100, 80)
    assert (b200.nvlink_gbps, b200.internode_gbps, b200.hbm_gbps) == (900, 50, 8000)
    assert 178 < b200.gpu_memory_gib <= 180


def test_bad_cluster_input_names_what_is_wrong():
    with pytest.raises(ConfigError, match=r"cluster='h300'.*presets: b200_180gb, h100_80gb, h200_141gb"):
        load_cluster("h300")
    with pytest.raises(ConfigError, match=r"cluster\.nodez is not a cluster field"):
        load_cluster("h100_80gb", {"nodez": "4"})
    with pytest.raises(ConfigError, match=r"cluster\.nodes=four"):
        load_cluster("h100_80gb", {"nodes": "four"})
    with pytest.raises(ConfigError, match=r"cluster\.matmul_efficiency=1\.5 must be a finite number in \(0, 1\]"):
        load_cluster("h100_80gb", {"matmul_efficiency": "1.5"})
    with pytest.raises(ConfigError, match=r"cluster\.nodes=0 must be >= 1"):
        load_cluster("h100_80gb", {"nodes": "0"})


# --- the time model -----------------------------------------------------------------------------


def test_doubling_data_parallelism_halves_compute_per_step():
    """Same global batch on twice the GPUs (dp 32 -> 64): each GPU computes half the
    micro-batches; the bubble fraction (pp - 1) / (vpp m) halves with m as well."""
    a, la, _ = _plan(GLM5, GLM5_512, nodes=64)
    b, lb, _ = _plan(GLM5, GLM5_512, nodes=128)
    assert (la.dp, lb.dp) == (32, 64) and (a.micro_batches, b.micro_batches) == (128, 64)
    assert b.compute_s == pytest.approx(a.compute_s / 2, rel=1e-9)
    assert b.ep_s == pytest.approx(a.ep_s / 2, rel=1e-9)
    assert b.pp_bubble_s / b.compute_s == pytest.approx(2 * a.pp_bubble_s / a.compute_s, rel=1e-9)
    print(f"GLM-5 4K on 512 / 1024 H100: {a.tokens_per_s_per_gpu:.0f} / {b.tokens_per_s_per_gpu:.0f} "
          f"tokens/s/GPU, MFU {a.mfu:.1%} / {b.mfu:.1%}")


def test_bubble_is_the_formula_and_parts_add_up():
    s, layout, rc = _plan(GLM5, GLM5_512, nodes=64)
    busy = s.compute_s + s.elementwise_s + s.launch_s + s.tp_s + s.ep_s + s.cp_s + s.pp_p2p_s
    pp, vpp, m = rc.parallel.pp, rc.parallel.vpp, s.micro_batches
    assert s.pp_bubble_s == pytest.approx((pp - 1) / (vpp * m) * busy, rel=1e-12)
    assert s.total_s == pytest.approx(busy + s.pp_bubble_s + s.dp_s + s.optimizer_s, rel=1e-12)
    tokens = rc.trainer.global_batch_size * rc.trainer.seq_length
    assert s.tokens_per_s_per_gpu == pytest.approx(tokens / s.total_s / layout.world_size)
    assert s.mfu == pytest.approx(megatron_flops_per_token(rc.model, 4096, 2) * s.tokens_per_s_per_gpu
                                  / 989e12)
    assert s.mfu_exact == pytest.approx(flops_per_token(rc.model, 4096, 2).total * s.tokens_per_s_per_gpu
                                        / 989e12)
    no_vpp, _, _ = _plan(GLM5, {**GLM5_512, "vpp": None}, nodes=64)
    assert no_vpp.pp_bubble_s / (no_vpp.total_s - no_vpp.pp_bubble_s - no_vpp.dp_s - no_vpp.optimizer_s) == \
        pytest.approx(7 / s.micro_batches)
    assert {"linear layers", "overlap", "pipeline bubble", "not modelled"} <= set(s.assumptions)


def test_compute_follows_precision_and_recomputation():
    """fp8 speeds up only the linear layers; full recomputation adds one forward of every layer
    (the exact count's ``recompute``) and repeats the forward collectives."""
    base, _, rc = _plan(GLM5, GLM5_512, nodes=64, recompute=None)
    fp8, _, _ = _plan(GLM5, GLM5_512, nodes=64, recompute=None, fp8="blockwise")
    full, _, frc = _plan(GLM5, GLM5_512, nodes=64, recompute="full")
    assert fp8.compute_s < base.compute_s and fp8.ep_s == base.ep_s
    f = flops_per_token(frc.model, 4096)
    assert 1.2 < full.compute_s / base.compute_s < f.hardware / f.total + 0.05
    assert full.ep_s == pytest.approx(1.5 * base.ep_s) and full.tp_s > base.tp_s


def test_communication_follows_link_placement():
    """EP all-to-all inside a node (ep x etp <= 8) runs on NVLink, across nodes mostly on the
    network, and so does a CP group spread over nodes; TP, CP and DP cost appear with their sizes."""
    par = dict(tp=1, pp=4, ep=8, sequence_parallel=False, distributed_optimizer=True)
    small = GLM5Config(num_layers=8, first_k_dense=1, hidden_size=2048, ffn_hidden_size=4096,
                       num_attention_heads=16, q_lora_rank=512, kv_lora_rank=256,
                       qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, num_experts=64,
                       moe_topk=8, moe_ffn_hidden_size=512, vocab_size=32000, mtp_num_steps=1)
    intra, _, _ = _plan(small, par, nodes=16, gbs=512)
    inter, _, _ = _plan(small, {**par, "ep": 32}, nodes=16, gbs=512)
    assert inter.ep_s > 4 * intra.ep_s  # 50 vs 450 GB/s, 31/32 of the peers remote vs 7/8 local
    tp8 = {**par, "tp": 8, "sequence_parallel": True, "etp": 1}
    with_tp, _, _ = _plan(small, tp8, nodes=16, gbs=512)
    assert intra.tp_s == 0 < with_tp.tp_s
    cp1, _, _ = _plan(small, par, nodes=16, seq=32768, gbs=64)
    cp4, _, _ = _plan(small, {**par, "cp": 4}, nodes=16, seq=32768, gbs=64)
    assert cp1.cp_s == 0 < cp4.cp_s
    # same work per GPU, plus what CP adds: every rank re-expands the gathered kv latent, and
    # the blocked dense attention recomputes its forward in backward
    f1, f4 = (flops_per_token(small, 32768, 1, cp).hardware for cp in (1, 4))
    assert cp4.compute_s / cp1.compute_s == pytest.approx(f4 / f1, rel=0.05) and f4 > f1
    # CP ranks are tp apart: with tp 8 a CP pair sits on two nodes and gathers over the network
    near, _, _ = _plan(small, {**par, "cp": 2}, nodes=16, seq=32768, gbs=64)
    far, _, _ = _plan(small, {**tp8, "cp": 2}, nodes=16, seq=32768, gbs=64)
    assert far.cp_s / far.micro_batches > 8 * near.cp_s / near.micro_batches
    allreduce, _, _ = _plan(small, {**par, "distributed_optimizer": False}, nodes=16, gbs=512)
    assert intra.dp_s > 0 and allreduce.dp_s > intra.dp_s  # 8 bytes of fp32 all-reduce vs 4 + 2
    warmup = dataclasses.replace(small, dsa=dataclasses.replace(small.dsa, mode="warmup"))
    indexer_only, _, _ = _plan(warmup, par, nodes=16, gbs=512)  # DSA warm-up trains the indexer only
    assert 0 < indexer_only.dp_s < 0.1 * intra.dp_s


def test_deepseek_v3_without_megatrons_speed_features_falls_well_short_of_its_throughput():
    """Megatron-LM reports ~1,297 tokens/s/GPU for DeepSeek-V3 on 1,024 H100 with fp8, DeepEP,
    its fusions and overlaps (the anchor with them: test_plan_factors.py). Laid out the same way
    (no virtual stages) with every speed feature off -- the alltoall dispatcher's one copy per
    routed expert over the network, nothing overlapped, unfused element-wise work -- the estimate
    is around half of it, the all-to-all its largest part."""
    par = dict(tp=2, pp=8, ep=64, etp=1, sequence_parallel=True, distributed_optimizer=True,
               first_stage_layers=7, last_stage_layers=6)
    plain, layout, _ = _plan(DSV3, par, nodes=128, gbs=8192, fp8="blockwise")
    flex, _, _ = _plan(DSV3, {**par, "moe_token_dispatcher_type": "flex", "moe_permute_fusion": True,
                              "moe_router_fusion": True, "cross_entropy_loss_fusion": True,
                              "gradient_accumulation_fusion": True}, nodes=128, gbs=8192, fp8="blockwise")
    print(f"DeepSeek-V3 4K, 1024 H100, tp2 pp8 ep64 fp8, features off: {plain.tokens_per_s_per_gpu:.0f} "
          f"tokens/s/GPU (EP {plain.ep_s:.1f} s of {plain.total_s:.1f} s); flex + fusions: "
          f"{flex.tokens_per_s_per_gpu:.0f}; Megatron-LM: 1297")
    assert layout.world_size == 1024
    assert 0.3 * 1297 < plain.tokens_per_s_per_gpu < 0.6 * 1297
    assert plain.ep_s > 0.4 * plain.total_s
    assert flex.ep_s < 0.4 * plain.ep_s and flex.tokens_per_s_per_gpu > 1.5 * plain.tokens_per_s_per_gpu
