"""One attention layer, forward + backward (indexer KL included), fp32, batch 1: our DSA
(sparse mode) vs dense causal SDPA (our layer in dense mode) vs megatron-core 0.16.1's
DSAttention. 16 heads, qk 192 + 64, v 256, q/kv LoRA 512, indexer 8 x 128, hidden 512, top-k
2048. Each (variant, L) runs in its own process so peak RSS is its own.

    .venv/bin/python benchmarks/dsa.py [--lengths 4096 8192 16384]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

HIDDEN, HEADS, NOPE, ROPE, V, LORA, TOPK = 512, 16, 192, 64, 256, 512, 2048
INDEX_HEADS, INDEX_DIM, CHUNK = 8, 128, 128
MEM_GIB = 23.0  # this machine; megatron's DSAttention is skipped where its L x L scores cannot fit


def _config(megatron_dsa: bool):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    extra = {}
    if megatron_dsa:
        extra = dict(experimental_attention_variant="dsa", dsa_indexer_n_heads=INDEX_HEADS,
                     dsa_indexer_head_dim=INDEX_DIM, dsa_indexer_topk=TOPK,
                     dsa_indexer_loss_coeff=1.0, dsa_indexer_use_sparse_loss=True)
    return MLATransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, q_lora_rank=LORA,
        kv_lora_rank=LORA, qk_head_dim=NOPE, qk_pos_emb_head_dim=ROPE, v_head_dim=V,
        rope_type="rope", rotary_scaling_factor=1.0, normalization="RMSNorm", qk_layernorm=True,
        add_bias_linear=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, use_cpu_initialization=True,
        **extra)


def _megatron_dsa_layer(cfg):
    """megatron's MLASelfAttention (same local projections as ours) with megatron's DSAttention
    core from its own DSA spec. On CPU its indexer needs a plain linear that accepts TE's
    ``parallel_mode`` (LocalSpecProvider has none) and a pure-torch Hadamard rotation."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_dsa_module_spec_for_backend,
    )
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.transformer.experimental_attention_variant import dsa
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.spec_utils import build_module

    from model_providers.glm5.config import DSAConfig
    from model_providers.glm5.dsa.hadamard import hadamard_rotate
    from model_providers.glm5.specs import _local_layer_spec

    class DuplicatedLinear(Linear):
        def __init__(self, *args, parallel_mode=None, **kwargs):
            super().__init__(*args, **kwargs)

    class Backend(LocalSpecProvider):
        def linear(self):
            return DuplicatedLinear

    dsa.rotate_activation = hadamard_rotate
    spec = _local_layer_spec(None, DSAConfig()).submodules.self_attention
    spec.module = MLASelfAttention
    spec.submodules.core_attention = get_dsa_module_spec_for_backend(
        cfg, Backend()).submodules.core_attention
    return build_module(spec, config=cfg, layer_number=1)


def _our_layer(cfg, mode: str):
    from megatron.core.transformer.spec_utils import build_module

    from model_providers.glm5.config import DSAConfig
    from model_providers.glm5.specs import _local_layer_spec

    dsa = DSAConfig(mode=mode, index_heads=INDEX_HEADS, index_head_dim=INDEX_DIM, topk=TOPK,
                    query_chunk=CHUNK)
    spec = _local_layer_spec(None, dsa).submodules.self_attention
    return build_module(spec, config=cfg, layer_number=1)


def run_one(variant: str, length: int) -> dict:
    import torch

    from parallel.config import ParallelConfig
    from parallel.initialize import initialize

    torch.manual_seed(0)
    initialize(ParallelConfig(), seed=1234)
    cfg = _config(variant == "megatron")
    layer = _megatron_dsa_layer(cfg) if variant == "megatron" else _our_layer(
        cfg, "sparse" if variant == "ours" else "dense")

    def step(n):
        x = torch.randn(n, 1, HIDDEN, requires_grad=True)
        mask = torch.ones(1, 1, n, n, dtype=torch.bool).triu(1) if variant == "megatron" else None
        out, _ = layer(x, attention_mask=mask)
        out.float().pow(2).mean().backward()

    step(256)  # warm-up
    t0 = time.perf_counter()
    step(length)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def _spawn(variant: str, length: int) -> dict | None:
    if variant == "megatron" and HEADS * length * length * 4 * 3 / 2**30 > MEM_GIB:
        return None
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, __file__, "--one", variant, str(length)], cwd=REPO,
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"{variant} L={length} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--one", nargs=2)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one[0], int(args.one[1]))))
        return
    rows = {}
    for length in args.lengths:
        for variant in ("ours", "sdpa", "megatron"):
            rows[variant, length] = _spawn(variant, length)
            print(f"  measured {variant:>8} L={length}: {rows[variant, length]}", file=sys.stderr)
    fmt = lambda r, k: f"{r[k]:8.1f}" if r else "    skip"
    print("\nDSA layer, fwd+bwd incl. indexer KL, fp32, batch 1, 16 heads, top-k 2048 (CPU, 2 cores)")
    print(f"{'L':>6} | {'ours s':>8} {'GiB':>6} | {'SDPA s':>8} {'GiB':>6} | {'mcore s':>8} {'GiB':>6}"
          f" | {'mcore/ours time':>15} {'ours/mcore mem':>14} | {'SDPA/ours time':>14}")
    for length in args.lengths:
        o, d, m = rows["ours", length], rows["sdpa", length], rows["megatron", length]
        t_ratio = f"{m['seconds'] / o['seconds']:14.1f}x" if m and o else f"{'-':>15}"
        m_ratio = f"{o['peak_rss_gib'] / m['peak_rss_gib']:13.2f}x" if m and o else f"{'-':>14}"
        d_ratio = f"{d['seconds'] / o['seconds']:13.2f}x" if d and o else f"{'-':>14}"
        print(f"{length:>6} | {fmt(o, 'seconds')} {o['peak_rss_gib'] if o else 0:6.2f} | "
              f"{fmt(d, 'seconds')} {d['peak_rss_gib'] if d else 0:6.2f} | {fmt(m, 'seconds')} "
              f"{m['peak_rss_gib'] if m else 0:6.2f} | {t_ratio} {m_ratio} | {d_ratio}")
    if ("ours", 8192) in rows and ("ours", 16384) in rows and rows["ours", 8192] and rows["ours", 16384]:
        growth = rows["ours", 16384]["seconds"] / rows["ours", 8192]["seconds"]
        print(f"\nours: time growth 8192 -> 16384 = {growth:.2f}x (O(L*k) target <= 2.5x; O(L^2) would be 4x)")


if __name__ == "__main__":
    main()
