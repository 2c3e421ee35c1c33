"""The step-time model's factors (planner/step_time.py, planner/cluster.py; sources in
docs/planner.md "Factors"): each one moves the step time the way its source says, by the amount
its formula gives, and the same global factors land on the public anchors -- Megatron's
DeepSeek-V3 run on 1,024 H100 (FP8 blockwise, 1,297 tokens/s/GPU with per-tensor scaling, 330
vs 338 TFLOP/s blockwise: Megatron-Bridge 25.09) and Megatron-LM's 14-layer DeepSeek-V3 proxy
on 64 H100 (bf16, alltoall, no recompute: 225.1 TFLOP/s/GPU, Megatron-LM PR #6311). Nothing
is built: run configs are composed and the layouts validated as a launch would."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from parallel.config import check_layout
from planner.cluster import load_cluster
from planner.step_time import (ELEMENTWISE, FP8_RECIPE_RATE, GRAD_ACCUMULATION_BYTES, _dp_time,
                               _ns_flops, _rank_grads, bins_hit, step_time)

#: Megatron's DeepSeek-V3 H100 benchmark (Megatron-MoE-ModelZoo best_practice/DeepSeekV3/run.sh,
#: Megatron-Bridge 25.09): TP2 PP8 VPP4 EP64, Et|(tt|)*30mL, MBS 1, GBS 8192, seq 4096
DSV3_RUN = ["model=deepseek_v3_671b", "parallel=dsv3_h100_1024gpu", "precision=fp8_blockwise",
            "optimizer=adam", "curriculum=none", "trainer.seq_length=4096", "trainer.global_batch_size=8192"]
#: the 14-layer proxy of Megatron-LM PR #6311 / #6429: 64 H100, TP1 PP4 VPP2 EP16, Ett|(tt|)*6mL,
#: alltoall, seq 2048, MBS 1, GBS 256, bf16, no recompute
PROXY_RUN = ["model=deepseek_v3_671b", "model.num_layers=14", "model.recompute=null",
             "parallel=dsv3_h100_1024gpu", "parallel.tp=1", "parallel.pp=4", "parallel.vpp=2", "parallel.ep=16",
             "parallel.sequence_parallel=false", 'parallel.pipeline_layout="Ett|(tt|)*6mL"',
             "parallel.moe_token_dispatcher_type=alltoall", "parallel.overlap_moe_expert_parallel_comm=false",
             "parallel.delay_wgrad_compute=false", "parallel.stages={}", "precision=bf16", "optimizer=adam", "curriculum=none",
             "trainer.seq_length=2048", "trainer.global_batch_size=256", "trainer.micro_batch_size=1"]
#: GLM-5 at 4K on 64 x 8 H200 as the planner's first preset laid it out, every feature off
GLM5_4K = ["model=glm5_744b", "curriculum=none", "optimizer=muon_split", "precision=bf16",
           "trainer.seq_length=4096", "trainer.global_batch_size=4096", "trainer.micro_batch_size=1",
           "model.recompute=null", "parallel.tp=4", "parallel.pp=8", "parallel.ep=16", "parallel.etp=1",
           "parallel.sequence_parallel=true", "parallel.distributed_optimizer=true",
           "parallel.last_stage_layers=1"]
FUSIONS = ["parallel.moe_permute_fusion=true", "parallel.moe_router_fusion=true",
           "parallel.cross_entropy_loss_fusion=true", "parallel.gradient_accumulation_fusion=true"]


def _plan(overrides, cluster="h200_141gb", nodes=64, **fields):
    """(step time, run config, layout, cluster) of a one-stage run; the layout is checked as
    check_layout does (the speed features' own rules are parallel.features', tested there)."""
    from pretrain.config.schema import compose, to_run_config
    from pretrain.curriculum import plan

    c = load_cluster(cluster, {"nodes": nodes, **fields})
    (stage,), problems = plan(to_run_config(compose(list(overrides))))  # with the preset's entry for it
    assert problems == [], problems
    rc = stage.rc
    m, t = rc.model, rc.trainer
    layout, problems = check_layout(rc.parallel, world_size=c.world_size, num_layers=m.num_layers,
                                    num_attention_heads=m.num_attention_heads, num_experts=m.num_experts,
                                    seq_length=t.seq_length, micro_batch_size=t.micro_batch_size,
                                    global_batch_size=t.global_batch_size, mtp_num_steps=m.mtp_num_steps)
    assert layout is not None, problems
    return step_time(rc, layout, c), rc, layout, c


# --- the anchors ----------------------------------------------------------------------------------


def test_deepseek_v3_on_1024_h100_lands_on_megatrons_published_throughput():
    """1,297 tokens/s/GPU (338 TFLOP/s, per-tensor FP8; 330 TFLOP/s blockwise = 1,266): within
    15% with the recipe's features; its EP all-to-all overlap is worth ~15% (Megatron-Bridge #5094
    measured 15% of a Qwen3-235B step on H100), so without it the estimate drops by about that."""
    on, rc, layout, _ = _plan(DSV3_RUN, "h100_80gb", 128)
    assert (rc.trainer.micro_batch_size, rc.model.recompute_modules) == (1, ["mla_up_proj", "mlp", "moe_act"])
    off, *_ = _plan(DSV3_RUN + ["parallel.overlap_moe_expert_parallel_comm=false",
                                "parallel.delay_wgrad_compute=false"], "h100_80gb", 128)
    print(f"DeepSeek-V3 1024 H100 fp8 blockwise: {on.tokens_per_s_per_gpu:.0f} tokens/s/GPU "
          f"(MFU {on.mfu:.1%}), without the EP overlap {off.tokens_per_s_per_gpu:.0f}; Megatron: 1297")
    assert layout.world_size == 1024 and (layout.mtp_chunk, layout.loss_chunk) == (31, 31)
    assert abs(on.tokens_per_s_per_gpu / 1297 - 1) < 0.15
    assert abs(on.mfu * 989 / 338 - 1) < 0.15  # Megatron's FLOPs accounting: 260 GFLOP/token
    assert 1.08 < on.tokens_per_s_per_gpu / off.tokens_per_s_per_gpu < 1.3
    assert on.hidden_s > 0.3 * on.ep_s


def test_deepseek_v3_bf16_proxy_on_64_h100_lands_on_megatron_lms_measurement():
    """225.1 TFLOP/s/GPU = 3,310 tokens/s/GPU at 68.0 GFLOP/token (Megatron's accounting)."""
    s, rc, layout, _ = _plan(PROXY_RUN, "h100_80gb", 8)
    assert layout.layers_per_stage == (2, 2, 2, 2, 2, 2, 2, 0)
    print(f"DeepSeek-V3 14-layer proxy, 64 H100 bf16: {s.mfu * 989:.0f} TFLOP/s/GPU; Megatron-LM: 225.1")
    assert abs(s.mfu * 989 / 225.1 - 1) < 0.15


# --- each factor ----------------------------------------------------------------------------------


def test_flex_dispatcher_sends_a_token_over_the_network_once_per_node():
    """GLM-5's ep16 spans two nodes: the alltoall dispatcher sends 8 copies a token, half of
    them to the other node, at 60% of the NIC; DeepEP sends one per other node it needs (almost
    surely 1 of 1: 1 - C(128, 8) / C(256, 8)) at 85% of it (DeepEP README: 43-58 GB/s RDMA on
    50 GB/s NICs)."""
    a2a, *_ = _plan(GLM5_4K)
    flex, *_ = _plan(GLM5_4K + ["parallel.moe_token_dispatcher_type=flex"])
    remote = bins_hit(256, 8, 2) / 2
    assert remote == pytest.approx(1 - math.comb(128, 8) / math.comb(256, 8), rel=1e-12)
    assert flex.ep_s / a2a.ep_s == pytest.approx((remote / 0.85) / (8 * 0.5 / 0.6), rel=1e-9)
    assert flex.ep_s < 0.2 * a2a.ep_s and flex.total_s < a2a.total_s


def test_expected_destinations_follow_group_limited_routing():
    """bins_hit against a simulation of uniform routing: GLM-5 (no groups) over 8 nodes, and
    DeepSeek-V3's node-limited routing (top-4 of 8 groups) over 8 nodes and 64 ranks."""
    rng = random.Random(0)

    def simulate(experts, topk, bins, groups, gtopk, n=20000):
        hit = 0
        per_group, per_bin = experts // groups, experts // bins
        for _ in range(n):
            chosen = rng.sample(range(groups), gtopk)
            pool = [g * per_group + e for g in chosen for e in range(per_group)]
            hit += len({x // per_bin for x in rng.sample(pool, topk)})
        return hit / n

    for args in ((256, 8, 8, 1, 1), (256, 8, 8, 8, 4), (256, 8, 64, 8, 4), (256, 8, 2, 8, 4)):
        assert bins_hit(*args) == pytest.approx(simulate(*args), rel=0.02), args
    assert bins_hit(256, 8, 8, 8, 4) <= 4  # at most 4 nodes per token, as DeepSeek-V3 designed


def test_overlapping_grad_reduce_and_param_gather_hides_dp_behind_compute():
    """overlap_grad_reduce hides 90% of the gradient reduce-scatter, at most the last
    micro-batch's backward plus half the bubble; overlap_param_gather the parameter all-gather
    behind the first forward and the other half."""
    base = GLM5_4K + ["parallel.moe_token_dispatcher_type=flex"]
    off, rc, layout, c = _plan(base)
    grads = _plan(base + ["parallel.overlap_grad_reduce=true"])[0]
    both = _plan(base + ["parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true"])[0]
    reduce, gather, other = _dp_time(rc, layout, c, 2, _rank_grads(rc, layout))
    assert off.dp_s == pytest.approx(reduce + gather + other, rel=1e-12)
    per_mb = (off.compute_s + off.elementwise_s) / off.micro_batches
    assert grads.dp_s == pytest.approx(off.dp_s - min(0.9 * reduce, 0.6 * per_mb + off.pp_bubble_s / 2), rel=1e-9)
    assert both.dp_s == pytest.approx(grads.dp_s - min(0.9 * gather, 0.4 * per_mb + off.pp_bubble_s / 2), rel=1e-9)
    assert both.dp_s < grads.dp_s < off.dp_s and off.compute_s == both.compute_s


def test_ep_all_to_all_overlap_hides_half_of_the_steady_phase():
    """overlap_moe_expert_parallel_comm (with VPP when pp > 1): ep_overlap (50%) of the
    all-to-all of the micro-batches the 1F1B schedule pairs with another's backward."""
    base = GLM5_4K + ["parallel.moe_token_dispatcher_type=flex", "parallel.vpp=2", "parallel.last_stage_layers=null",
                      'parallel.pipeline_layout="Et*5|' + "t*5|" * 6 + "|" + "t*6|" * 7 + 'tmL"']
    off, rc, *_ = _plan(base)
    on, *_ = _plan(base + ["parallel.overlap_moe_expert_parallel_comm=true", "parallel.delay_wgrad_compute=true"])
    pp, vpp, m = 8, 2, off.micro_batches
    steady = 1 - (2 * (pp - 1 - off.slowest_rank) + (vpp - 1) * pp) / (m * vpp)
    assert on.ep_s == pytest.approx(off.ep_s * (1 - 0.5 * steady), rel=1e-6)
    assert on.total_s < off.total_s


def test_tp_comm_overlap_hides_its_share_of_the_tp_collectives():
    off, *_ = _plan(GLM5_4K)
    on, *_ = _plan(GLM5_4K + ["parallel.tp_comm_overlap=true"])
    assert off.tp_s > 0 and on.tp_s == pytest.approx(0.4 * off.tp_s, rel=1e-9)


def test_fp8_trades_faster_gemms_for_quantisation_traffic():
    """precision.fp8: the decoder's linear layers at 32% of the fp8 peak times the recipe's rate
    (blockwise 330/338, MXFP8 29388/29994 of per-tensor: Megatron-Bridge 25.09); the output heads
    stay bf16; each linear input and output gradient is quantised (4 B per value)."""
    run = DSV3_RUN + ["parallel.overlap_moe_expert_parallel_comm=false", "parallel.delay_wgrad_compute=false"]
    fp8, *_ = _plan(run, "h100_80gb", 128)
    bf16, *_ = _plan(run + ["precision=bf16"], "h100_80gb", 128)
    assert fp8.compute_s < bf16.compute_s and fp8.elementwise_s > bf16.elementwise_s
    assert FP8_RECIPE_RATE["blockwise"] == pytest.approx(330 / 338)
    assert fp8.assumptions["linear layers"].startswith("32% of 1979 fp8 TFLOP/s x 0.976 (blockwise) = 618; "
                                                      "output heads 593 bf16")
    b200, *_ = _plan(DSV3_RUN[:2] + ["precision=mxfp8"] + DSV3_RUN[3:], "b200_180gb", 128)
    assert b200.assumptions["linear layers"].startswith("32% of 4500 fp8 TFLOP/s x 0.980 (mxfp8) = 1411")


def test_fusions_cut_the_element_wise_traffic_by_their_passes():
    """Each fusion switch replaces its unfused passes by the fused kernel's; the permute fusion on
    GLM-5's MoE layers saves (14 - 8) passes of top-k x h bf16 values per token."""
    off, rc, layout, c = _plan(GLM5_4K)
    permute, *_ = _plan(GLM5_4K + ["parallel.moe_permute_fusion=true"])
    tokens, hbm = 4096 / 4, 4800e9 * 0.7  # a GPU's share of a micro-batch (tp 4); H200 HBM x 0.7
    saved = off.elementwise_s - permute.elementwise_s
    slow = off.slowest_rank
    moe_layers = sum(1 for i in _rank_layer_ids(layout, 8)[slow] if i >= rc.model.first_k_dense)
    moe_layers += 3 if slow == 7 else 0  # MTP x 3 on the last rank
    assert ELEMENTWISE["permute"][:2] == (14, 8)
    assert saved == pytest.approx(off.micro_batches * moe_layers * tokens * 2 * 8 * 6144 * (14 - 8) / hbm, rel=1e-9)
    fused, *_ = _plan(GLM5_4K + FUSIONS)
    assert fused.elementwise_s < 0.5 * off.elementwise_s and fused.total_s < permute.total_s < off.total_s


def test_unfused_gradient_accumulation_moves_10_bytes_per_parameter_per_micro_batch():
    off, rc, layout, c = _plan(GLM5_4K)
    on, *_ = _plan(GLM5_4K + ["parallel.gradient_accumulation_fusion=true"])
    g = _rank_grads(rc, layout)[off.slowest_rank]
    assert off.elementwise_s - on.elementwise_s == pytest.approx(
        off.micro_batches * (g.dense + g.expert) * GRAD_ACCUMULATION_BYTES / (4800e9 * 0.7), rel=1e-9)


def test_expert_imbalance_slows_the_routed_experts_and_their_all_to_all():
    """moe_imbalance 1.2 (the busiest expert rank gets 20% more tokens than the mean): the EP
    time grows 20%, compute by 20% of the routed experts' GEMMs."""
    run = GLM5_4K + ["parallel.moe_token_dispatcher_type=flex"]
    even, rc, *_ = _plan(run)
    skew, *_ = _plan(run, moe_imbalance=1.2)
    assert skew.ep_s == pytest.approx(1.2 * even.ep_s, rel=1e-9)
    m = rc.model
    moe_layers = 11 if even.slowest_rank < 7 else 1 + 3
    routed = 6 * 6144 * 2048 * 8 * 3 * 1024 * moe_layers * even.micro_batches / (989e12 * 0.6)
    assert skew.compute_s - even.compute_s == pytest.approx(0.2 * routed, rel=1e-6)
    assert m.moe_topk == 8


def test_launch_gaps_add_their_microseconds_per_layer_forward():
    none, *_ = _plan(GLM5_4K, launch_gap_us=0)
    gaps, *_ = _plan(GLM5_4K, launch_gap_us=100)
    layers = 11 if gaps.slowest_rank < 7 else 1 + 3
    assert none.launch_s == 0 and gaps.launch_s == pytest.approx(100e-6 * layers * gaps.micro_batches)


def test_muon_newton_schulz_costs_what_its_iterations_compute():
    """5 quintic iterations on every matrix a rank owns (4 a^2 b + 2 a^3 each, a <= b); at the
    fp32 CUDA-core peak (ns_dtype fp32: torch's default fp32 matmul) it is ~15x the bf16 cost."""
    assert _ns_flops(2048, 6144, 5) == 5 * (4 * 2048 ** 2 * 6144 + 2 * 2048 ** 3)
    adam, *_ = _plan(GLM5_4K[:2] + ["optimizer=adam"] + GLM5_4K[3:])
    fp32, *_ = _plan(GLM5_4K)
    bf16, *_ = _plan(GLM5_4K + ["optimizer.muon.ns_dtype=bf16"])
    assert adam.optimizer_s < bf16.optimizer_s < fp32.optimizer_s
    # routed experts dominate: 256 experts x 75 MoE layers (+ MTP) over 512 GPUs, each expert's fc1
    # [4096, 6144] and fc2 [6144, 2048]
    expert = _ns_flops(4096, 6144, 5) + _ns_flops(6144, 2048, 5)
    assert fp32.optimizer_s > 256 * 10 / 16 / 4 * expert / (66.9e12 * 0.6)
    assert (fp32.optimizer_s - adam.optimizer_s) / (bf16.optimizer_s - adam.optimizer_s) == pytest.approx(
        989 / 66.9, rel=0.1)


def test_the_pipeline_layout_places_mtp_and_the_loss():
    """GLM-5's MTP x 3 (3.4 decoder layers of work at 4K) and four output heads (6.6) set the
    pace on the rank that holds them with 8 layers; a layout with the loss in a chunk of its own
    on the last rank and the MTP module on the one before runs faster (their parameters, and so
    their gradients, go along)."""
    from planner.balance import piece_equivalents

    head = GLM5_4K + FUSIONS + ["parallel.moe_token_dispatcher_type=flex", "parallel.last_stage_layers=null"]
    together, rc, *_ = _plan(head + ['parallel.pipeline_layout="Et*10|' + "t*10|" * 6 + 't*8mL"'])
    split, rc, layout, _ = _plan(head + ['parallel.pipeline_layout="Et*11|t*11|' + "t*12|" * 4 + 't*8m|L"'])
    assert piece_equivalents(rc) == pytest.approx((3.41, 6.56), abs=0.01)
    assert (layout.mtp_chunk, layout.loss_chunk) == (6, 7)
    assert together.slowest_rank == 7 and split.slowest_rank != 7 and split.total_s < together.total_s
    g = _rank_grads(rc, layout)
    vocab_h = rc.model.padded_vocab_size(4) * 6144 / 4
    assert g[7].dense == pytest.approx(vocab_h)  # the output layer alone
    assert g[6].dense > 2 * vocab_h  # 8 layers, MTP's layer and eh_proj, its embedding copy


def _rank_layer_ids(layout, pp):
    from planner.step_time import _rank_layers

    return _rank_layers(layout, pp)


def test_bf16_moments_halve_adams_state():
    from planner.memory import moment_bytes
    from pretrain.config.schema import OptimizerConfig

    assert moment_bytes(OptimizerConfig()) == 8
    assert moment_bytes(OptimizerConfig(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")) == 4
    full, rc, layout, c = _plan(DSV3_RUN, "h100_80gb", 128)
    half, *_ = _plan(DSV3_RUN + ["optimizer.exp_avg_dtype=bf16", "optimizer.exp_avg_sq_dtype=bf16"], "h100_80gb", 128)
    assert half.optimizer_s < full.optimizer_s


def test_every_factor_is_printed():
    s, *_ = _plan(GLM5_4K)
    for key in ("linear layers", "attention core", "element-wise", "launch gaps", "expert imbalance",
                "EP dispatcher", "overlap", "optimizer step", "collectives"):
        assert key in s.assumptions
    assert list(itertools.islice(s.assumptions, 1)) == ["linear layers"]
    assert "swiglu 20" in s.assumptions["element-wise"] and "permute 14 (unfused)" in s.assumptions["element-wise"]
