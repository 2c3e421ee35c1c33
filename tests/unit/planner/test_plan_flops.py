"""FLOPs per token (model_providers/glm5/counting/flops.py): the exact count equals what torch's
FlopCounterMode sees in a forward + backward of the real tiny model (dense, DSA sparse, DSA
warm-up; with recomputation), and Megatron's accounting of DeepSeek-V3 is its published number.

Two gaps in FlopCounterMode are filled here, as torch itself counts those ops elsewhere:
- the CPU flash-attention kernel (``_scaled_dot_product_flash_attention_for_cpu`` and its
  backward) has no formula (it would count 0). We register torch's own SDPA formulas (forward
  QK^T and PV; backward 5 products: S recomputed, dP, dV, dQ, dK), scaled by the causal share
  (s + 1) / (2 s) for ``is_causal``, since torch's formulas count every (query, key) pair;
- in-place ``baddbmm_`` (the KL's key gradient) has none either; it gets ``baddbmm``'s.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, bmm_flop, sdpa_backward_flop_count, sdpa_flop_count

from model_providers.glm5.model.config import DSAConfig, GLM5Config, PrecisionConfig, to_transformer_config
from model_providers.glm5.counting.flops import (
    flops_per_token,
    layer_work,
    megatron_flops_per_token,
    post_work,
)
from parallel.config import ParallelConfig

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="counts the CPU kernels")

aten = torch.ops.aten
SEQ, BATCH = 64, 1


def _causal_share(q_shape, k_shape, is_causal) -> float:
    s_q, s_k = q_shape[2], k_shape[2]
    return (s_q * (s_q + 1) / 2) / (s_q * s_k) if is_causal else 1.0


def _sdpa_cpu(q, k, v, dropout_p=0.0, is_causal=False, *args, out_shape=None, **kwargs) -> int:
    return round(sdpa_flop_count(q, k, v) * _causal_share(q, k, is_causal))


def _sdpa_cpu_backward(grad_out, q, k, v, out, lse, dropout_p=0.0, is_causal=False, *args,
                       out_shape=None, **kwargs) -> int:
    return round(sdpa_backward_flop_count(grad_out, q, k, v) * _causal_share(q, k, is_causal))


def _baddbmm_inplace(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    return bmm_flop(a_shape, b_shape)


MAPPING = {
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward,
    aten.baddbmm_: _baddbmm_inplace,
}


def _torch_sparse_backward_extra(cfg: GLM5Config, seq: int) -> float:
    """The torch reference sparse kernel (dsa/sparse_attention.py) stacks dO [n, kv_lora] and q
    [n, kv_lora + rope] into one operand of kv_lora + rope columns (dO zero-padded over the rope
    dims), so dP and the value part of dC are each formed over kv_lora + rope columns instead of
    kv_lora: 2 x 2 n rope topk extra FLOPs per query past the dense prefix, per attention layer
    (decoder layers and MTP steps). The formula counts the products the algorithm needs."""
    rows = seq - min(cfg.dsa.topk, seq)
    layers = cfg.num_layers + cfg.mtp_num_steps
    return 2 * 2 * cfg.num_attention_heads * cfg.qk_rope_head_dim * cfg.dsa.topk * rows * layers / seq


def _measured_per_token(cfg: GLM5Config) -> float:
    """FLOPs FlopCounterMode counts in one training forward + backward of the tiny model built by
    the provider, per token."""
    from megatron.core import tensor_parallel

    from model_providers.glm5.model.provider import build_model_chunks

    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    tcfg = to_transformer_config(cfg, ParallelConfig(), PrecisionConfig())
    (model,) = build_model_chunks(cfg, tcfg, "local")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    model.train()
    counter = FlopCounterMode(display=False, custom_mapping=MAPPING)
    with counter:
        loss = model(tokens, positions, None, labels=torch.roll(tokens, -1, dims=1))
        loss.sum().backward()
    return counter.get_total_flops() / (BATCH * SEQ)


CASES = [
    ("dense", None),
    ("sparse", None),
    ("warmup", None),
    ("warmup", "full"),  # the frozen forward runs without autograd: nothing is recomputed
    ("dense", "full"),
    ("sparse", "selective"),
]


@pytest.mark.heavy
@pytest.mark.parametrize("mode,recompute", CASES)
def test_exact_count_equals_flop_counter_on_the_tiny_model(one_rank, mode, recompute):
    """query_chunk=1: the torch indexer / KL score a chunk of c query rows against the keys its
    last row sees, c (c - 1) / 2 pairs more than the visible ones per chunk; one row per chunk
    scores exactly the visible keys (GLM-5's 256-row chunks at 202752 tokens add ~0.1%). seq 64
    with topk 32: a dense prefix of 32 queries and 32 sparse ones. Selective recomputation runs
    core_attn, mla_up_proj and moe again. kernels=torch: FlopCounterMode sees aten ops only,
    not the GEMMs inside the fused CPU kernel."""
    cfg = GLM5Config(dsa=DSAConfig(mode=mode, query_chunk=1, kernels="torch"), recompute=recompute,
                     recompute_modules=["core_attn", "mla_up_proj", "moe"])
    f = flops_per_token(cfg, SEQ)
    expected = f.hardware + (_torch_sparse_backward_extra(cfg, SEQ) if mode == "sparse" else 0.0)
    measured = _measured_per_token(cfg)
    print(f"{mode} recompute={recompute}: measured {measured:.0f}, exact {f.total:.0f} "
          f"+ recompute {f.recompute:.0f}, ratio {measured / expected:.5f}")
    assert measured == pytest.approx(expected, rel=0.02)
    assert (f.recompute > 0) == (recompute is not None and mode != "warmup")


@pytest.mark.parametrize("seq,cp,limit", [(128, 2, 128), (202752, 16, 202752), (202752, 16, 2048),
                                           (8192, 4, 8192)])
def test_context_parallel_attention_pairs_are_the_block_plans(seq, cp, limit):
    """Under CP the dense path runs blocks (dsa/dense_attention.py ``block_plan``): the pairs the
    formula counts are those of every rank's real block plan (causal square or full masked
    rectangle), for all queries and for the sparse mode's dense prefix (positions < topk). A
    2-rank gloo run of the tiny model under FlopCounterMode matched the cp=2 totals exactly."""
    from model_providers.glm5.model.dsa.dense_attention import block_plan
    from model_providers.glm5.model.dsa.visibility import TokenLayout
    from model_providers.glm5.counting.flops import _blocked_pairs
    from parallel.context_parallel import zigzag_positions

    pairs = 0
    for rank in range(cp):
        layout = TokenLayout.build(seq // cp, seq, q_pos=zigzag_positions(seq // cp, cp, rank))
        rows = layout.rows_before(limit)
        if rows:
            head = layout.rows(0, rows, min(limit, seq))
            for blk in block_plan(head, 1):
                n = blk.rows.stop - blk.rows.start
                keys = blk.keys.stop - blk.keys.start
                pairs += n * (n + 1) // 2 if blk.causal else n * keys
    assert _blocked_pairs(seq, cp, limit) == pairs


def test_parts_add_up_and_modes_differ_as_computed():
    """The per-layer / last-rank split the step-time model uses adds up to the totals; at GLM-5's
    202752 tokens sparse attention is a small fraction of dense, while the warm-up adds the
    indexer's dense KL to dense attention and has no weight gradients outside the indexer."""
    m = GLM5Config(num_layers=6, first_k_dense=2)
    for mode in ("dense", "warmup", "sparse"):
        m.dsa.mode = mode
        for tp, cp in ((1, 1), (2, 4)):
            f = flops_per_token(m, 512, tp, cp)
            parts = [layer_work(m, 512, i, tp, cp) for i in range(m.num_layers)]
            parts.append(post_work(m, 512, tp, cp))
            assert sum(p.model for p in parts) == pytest.approx(f.total, rel=1e-12)
            assert f.total == pytest.approx(f.dense + f.attention + f.indexer + f.mtp + f.output_heads)
        # every TP rank repeats the indexer but its KL target
        assert (flops_per_token(m, 512, 2).indexer > 1.5 * flops_per_token(m, 512).indexer) == (mode != "dense")
    m.dsa = DSAConfig(mode="dense", topk=2048)
    long = 202752
    dense = flops_per_token(m, long)
    m.dsa.mode = "sparse"
    sparse = flops_per_token(m, long)
    m.dsa.mode = "warmup"
    warm = flops_per_token(m, long)
    assert sparse.attention < 0.05 * dense.attention
    assert dense.indexer == 0 and sparse.indexer > 0 and warm.indexer > sparse.indexer
    assert warm.output_heads == pytest.approx(dense.output_heads / 3)  # the frozen forward: no backward


def test_megatron_accounting_of_deepseek_v3_is_its_published_number():
    """DeepSeek-V3 (61 layers, first 3 dense, 256 experts top-8 + 1 shared, MTP depth 1) at 4096
    tokens: Megatron-LM reports 338 TFLOP/s/GPU at 1,297 tokens/s/GPU = 260.6 GFLOP/token."""
    ds = GLM5Config(num_layers=61, first_k_dense=3, hidden_size=7168, ffn_hidden_size=18432,
                    num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_experts=256,
                    moe_topk=8, num_shared_experts=1, moe_ffn_hidden_size=2048, vocab_size=129280,
                    mtp_num_steps=1)
    megatron = megatron_flops_per_token(ds, 4096)
    exact = flops_per_token(ds, 4096)
    print(f"DeepSeek-V3 at 4096: Megatron {megatron / 1e9:.1f} GFLOP/token, exact {exact.total / 1e9:.1f}")
    assert megatron == pytest.approx(338e12 / 1297, rel=0.03)
    # the exact count adds the router and the flash backward's recomputed scores
    assert megatron < exact.total < 1.05 * megatron
