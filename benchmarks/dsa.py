"""One attention layer, forward + backward (indexer KL included), fp32, batch 1: our DSA in
sparse and warm-up mode against dense causal SDPA (our layer in dense mode; the warm-up as the
model runs it: the frozen layer without autograd, backward only of the indexer's KL), with a per-component
breakdown of where DSA's time goes, and optionally megatron-core 0.19.2's DSAttention. 16 heads,
qk 192 + 64, v 256, q/kv LoRA 512, indexer 8 x 128, hidden 512, top-k 2048. Each (variant, L)
runs in its own process so peak RSS is its own.

Each process times ``--repeats`` clean steps (ours_s: their median; peak RSS), then one more under
torch.profiler whose events are attributed to components: forward scopes the benchmark wraps around
the DSA functions, backward by autograd node, the rest (MLA projections, absorption, glue)
together. The parts must sum to within 10% of the clean step (printed). The sparse process also
times a plain GEMM of the sparse core's shape (one chunk of queries' scores), the machine's ceiling
for it, and the fused core alone on random selections against one contiguous block of keys that
every query selects (what the gathers cost it). The dense process's profile gives SDPA's own rate;
a DSA row's floor is its attention work (sparse core, indexer scoring and KL, dense prefix) at that
rate plus its other parts as measured: what DSA would take if every attention FLOP ran as fast as
the dense flash kernel does on a contiguous causal problem.

    .venv/bin/python benchmarks/dsa.py [--lengths 8192 16384 32768] [--modes sparse warmup]
                                       [--warmup-max 16384] [--megatron] [--repeats 3] [--json PATH]
                                       [--kernels auto torch]
"""

from __future__ import annotations

from parallel.megatron_compat import bootstrap

bootstrap()  # before megatron-core's first import

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.dsa_core_rates import core_on_rows, gemm_ceiling  # noqa: E402

HIDDEN, HEADS, NOPE, ROPE, V, LORA, TOPK = 512, 16, 192, 64, 256, 512, 2048
INDEX_HEADS, INDEX_DIM, CHUNK = 8, 128, 128
KERNELS = "auto"  #: model.dsa.kernels of the layer under test (--kernels; set in its process)
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

    from model_providers.glm5.model.config import DSAConfig
    from model_providers.glm5.model.dsa.hadamard import hadamard_rotate
    from model_providers.glm5.model.specs import local_layer_spec

    class DuplicatedLinear(Linear):
        def __init__(self, *args, parallel_mode=None, **kwargs):
            super().__init__(*args, **kwargs)

    class Backend(LocalSpecProvider):
        def linear(self):
            return DuplicatedLinear

    dsa.rotate_activation = hadamard_rotate
    spec = local_layer_spec(None, DSAConfig()).submodules.self_attention
    spec.module = MLASelfAttention
    spec.submodules.core_attention = get_dsa_module_spec_for_backend(
        cfg, Backend()).submodules.core_attention
    return build_module(spec, config=cfg, layer_number=1)


def _our_layer(cfg, mode: str):
    from megatron.core.transformer.spec_utils import build_module

    from model_providers.glm5.model.config import DSAConfig
    from model_providers.glm5.model.specs import local_layer_spec

    dsa = DSAConfig(mode=mode, index_heads=INDEX_HEADS, index_head_dim=INDEX_DIM, topk=TOPK,
                    query_chunk=CHUNK, kernels=KERNELS)
    spec = local_layer_spec(None, dsa).submodules.self_attention
    return build_module(spec, config=cfg, layer_number=1)


PARTS = ("indexer projection", "indexer scoring", "top-k", "sparse forward", "sparse backward",
         "indexer KL (value + gradients)", "KL backward", "dense attention forward",
         "dense attention backward", "other (MLA projections, absorption, glue)")
_OTHER = PARTS[-1]
_BACKWARD_NODES = {"SparseLatentAttentionBackward": "sparse backward",
                   "SparseLatentAttentionCPUBackward": "sparse backward",
                   "_KLWithEagerGradientsBackward": "KL backward",
                   "ScaledDotProductFlashAttentionForCpuBackward0": "dense attention backward"}


def _scoped(fn, name):
    import torch

    def wrapped(*args, **kwargs):
        with torch.profiler.record_function("dsa::" + name):
            return fn(*args, **kwargs)
    return wrapped


def _install_scopes():
    """record_function scopes around the DSA functions (the product code has none)."""
    import model_providers.glm5.model.dsa.attention as attention
    import model_providers.glm5.model.dsa.indexer as indexer
    import model_providers.glm5.model.dsa.kernels.dsa_cpu as fused
    import model_providers.glm5.model.dsa.sparse_attention as sparse

    attention.DSACoreAttention._indexer_inputs = _scoped(attention.DSACoreAttention._indexer_inputs,
                                                         "indexer projection")
    attention.select_topk = _scoped(attention.select_topk, "indexer scoring")
    indexer.topk_indices = _scoped(indexer.topk_indices, "top-k")
    sparse.SparseLatentAttention.forward = staticmethod(
        _scoped(sparse.SparseLatentAttention.forward, "sparse forward"))
    fused.SparseLatentAttentionCPU.forward = staticmethod(
        _scoped(fused.SparseLatentAttentionCPU.forward, "sparse forward"))
    attention.dense_kl = _scoped(attention.dense_kl, "indexer KL (value + gradients)")
    attention.sparse_kl = _scoped(attention.sparse_kl, "indexer KL (value + gradients)")
    attention.DSACoreAttention._dense = _scoped(attention.DSACoreAttention._dense,
                                                "dense attention forward")


def _attribute(events) -> dict:
    """Seconds per part from a profiler event tree: a dsa:: scope's own time (minus the scopes
    inside it), backward autograd nodes by name, everything else top-level to 'other'."""
    seconds = dict.fromkeys(PARTS, 0.0)

    def walk(event, part):
        name = event.name
        if name.startswith("dsa::"):
            inner = name[5:]
            seconds[inner] += event.time_range.elapsed_us() / 1e6
            if part is not None:
                seconds[part] -= event.time_range.elapsed_us() / 1e6
            part = inner
        for child in event.cpu_children:
            walk(child, part)

    for event in events:
        if event.cpu_parent is not None:
            continue
        prefix = "autograd::engine::evaluate_function: "
        if event.name.startswith("dsa::"):
            walk(event, None)
            continue
        part = _BACKWARD_NODES.get(event.name[len(prefix):], _OTHER) if event.name.startswith(prefix) else _OTHER
        seconds[part] += event.time_range.elapsed_us() / 1e6
        for child in event.cpu_children:
            walk(child, part)
    return seconds


def _scored_elements(first: int, rows: int) -> int:
    """Scores the causal-aware indexer computes for query rows first..first+rows-1."""
    total = 0
    for lo in range(0, rows, CHUNK):
        hi = min(lo + CHUNK, rows)
        total += (hi - lo) * max(TOPK, first + hi)
    return total


def part_work(length: int, mode: str) -> dict:
    """Analytic FLOPs (or bytes for top-k) of each part at sequence length ``length``."""
    n, qk, v, d_lat, dv = HEADS, NOPE + ROPE, V, LORA + ROPE, LORA
    sdpa_fwd = lambda rows: n * rows * rows / 2 * 2 * (qk + v)  # noqa: E731  causal
    kl_dense = lambda rows: rows * rows / 2 * (n * qk * 2 + INDEX_HEADS * INDEX_DIM * 2 * 3)  # noqa: E731
    if mode == "dense":
        return {"dense attention forward": sdpa_fwd(length), "dense attention backward": 2.5 * sdpa_fwd(length)}
    if mode == "warmup":  # the frozen layer: no backward of the dense attention
        return {"dense attention forward": sdpa_fwd(length), "indexer KL (value + gradients)": kl_dense(length)}
    prefix = min(length, TOPK)
    sparse = max(0, length - TOPK)
    per_key = n * TOPK * sparse * 2
    scored = _scored_elements(prefix, sparse)
    return {"indexer scoring": scored * INDEX_HEADS * (INDEX_DIM + 1) * 2,
            "top-k": ("bytes", scored * 4),
            "sparse forward": per_key * (d_lat + dv),
            "sparse backward": per_key * (3 * d_lat + 2 * dv),
            "indexer KL (value + gradients)": kl_dense(prefix) + sparse * TOPK * INDEX_HEADS * INDEX_DIM * 2 * 3,
            "dense attention forward": sdpa_fwd(prefix), "dense attention backward": 2.5 * sdpa_fwd(prefix)}


def run_one(variant: str, length: int, repeats: int) -> dict:
    import torch

    from parallel.config import ParallelConfig
    from parallel.initialize import initialize
    from model_providers.glm5.model.dsa.modes import indexer_only_forward
    from parallel.megatron_compat import MicroBatch

    torch.manual_seed(0)
    initialize(ParallelConfig(), seed=1234)
    cfg = _config(variant == "megatron")
    mode = {"ours": "sparse", "sdpa": "dense"}.get(variant, variant)
    layer = _megatron_dsa_layer(cfg) if variant == "megatron" else _our_layer(cfg, mode)

    def step(n):
        x = torch.randn(n, 1, HIDDEN, requires_grad=True)
        mask = torch.ones(1, 1, n, n, dtype=torch.bool).triu(1) if variant == "megatron" else None
        if mode == "warmup":  # as GLM5Model runs it: the frozen layer without autograd, the KL's backward
            out = indexer_only_forward(MicroBatch(), lambda: layer(x.detach(), attention_mask=mask)[0])
        else:
            with MicroBatch().active():  # the layer called on its own is one micro-batch
                out, _ = layer(x, attention_mask=mask)
        out.float().pow(2).mean().backward()

    step(256)  # warm-up
    core_shape = dict(heads=HEADS, dim=LORA + ROPE, dv=LORA, k=TOPK)
    ceiling = gemm_ceiling(chunk=CHUNK, **core_shape) if mode == "sparse" else None
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step(length)
        times.append(time.perf_counter() - t0)
    row = {"seconds": statistics.median(times), "steps_s": [round(t, 2) for t in times],
           "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if variant != "megatron":
        _install_scopes()
        with torch.profiler.profile() as prof:
            step(length)
        row["parts"] = _attribute(prof.events())
    if mode == "sparse":  # the better of before and after the steps (the machine is shared)
        row["gemm_ceiling_gflops"] = max(ceiling, gemm_ceiling(chunk=CHUNK, **core_shape))
        row["core_on_rows"] = core_on_rows(length, **core_shape) if KERNELS == "auto" else None
    return row


def _spawn(variant: str, length: int, repeats: int, kernels: str = "auto") -> dict | None:
    if variant == "megatron" and HEADS * length * length * 4 * 3 / 2**30 > MEM_GIB:
        return None
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, __file__, "--one", variant, str(length),
                           "--repeats", str(repeats), "--kernels", kernels], cwd=REPO,
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"{variant} L={length} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def result_row(length: int, mode: str, ours: dict, dense: dict) -> dict:
    """The JSON row: times, memory and the parts with their work and achieved rate."""
    work = part_work(length, mode)
    parts = {}
    for name, secs in ours["parts"].items():
        entry = {"s": round(secs, 3)}
        amount = work.get(name)
        if isinstance(amount, tuple):
            entry["gib"] = round(amount[1] / 2**30, 3)
            entry["gib_per_s"] = round(amount[1] / 2**30 / secs, 2) if secs > 0 else None
        elif amount:
            entry["gflop"] = round(amount / 1e9, 1)
            entry["gflop_per_s"] = round(amount / 1e9 / secs, 1) if secs > 0 else None
        parts[name] = entry
    row = {"L": length, "mode": mode, "ours_s": round(ours["seconds"], 2),
           "dense_s": round(dense["seconds"], 2) if dense else None,
           "ours_gib": round(ours["peak_rss_gib"], 2),
           "dense_gib": round(dense["peak_rss_gib"], 2) if dense else None,
           "parts_sum_s": round(sum(ours["parts"].values()), 2), "parts": parts}
    if "gemm_ceiling_gflops" in ours:
        core_s = ours["parts"]["sparse forward"] + ours["parts"]["sparse backward"]
        core = (work["sparse forward"] + work["sparse backward"]) / 1e9 / core_s if core_s else 0.0
        row["gemm_ceiling_gflop_per_s"] = round(ours["gemm_ceiling_gflops"], 1)
        row["sparse_core_gflop_per_s"] = round(core, 1)
        if ours.get("core_on_rows"):
            row["core_gflop_per_s_on_rows"] = {k: round(v, 1) for k, v in ours["core_on_rows"].items()}
    if dense and "parts" in dense:
        # the floor: every attention FLOP at dense SDPA's rate (its flash kernel on the whole
        # causal problem, this run), the other parts (projections, glue, top-k) as measured
        sdpa = ("dense attention forward", "dense attention backward")
        sdpa_s = sum(dense["parts"][p] for p in sdpa)
        rate = sum(part_work(length, "dense")[p] for p in sdpa) / 1e9 / sdpa_s
        flops = sum(v for v in work.values() if not isinstance(v, tuple)) / 1e9
        rest = sum(secs for name, secs in ours["parts"].items()
                   if name not in work or isinstance(work[name], tuple))
        row["sdpa_gflop_per_s"] = round(rate, 1)
        row["attention_gflop"] = round(flops, 1)
        row["floor_s"] = round(flops / rate + rest, 2)
        row["floor_vs_dense"] = round(row["floor_s"] / dense["seconds"], 2)
    return row


def _print_row(row: dict) -> None:
    ratio = f"{row['ours_s'] / row['dense_s']:.2f}x dense" if row["dense_s"] else "no dense"
    print(f"\nL={row['L']} {row['mode']} (kernels={row.get('kernels', 'auto')}): {row['ours_s']:.1f} s ({ratio} {row['dense_s']} s), "
          f"{row['ours_gib']:.2f} GiB (dense {row['dense_gib']} GiB); parts sum {row['parts_sum_s']:.1f} s "
          f"= {row['parts_sum_s'] / row['ours_s']:.0%} of the step")
    if "gemm_ceiling_gflop_per_s" in row:
        c, g = row["sparse_core_gflop_per_s"], row["gemm_ceiling_gflop_per_s"]
        print(f"  sparse core {c:.1f} GFLOP/s = {c / g:.0%} of the GEMM ceiling ({g:.1f} GFLOP/s, same shape)")
    if "core_gflop_per_s_on_rows" in row:
        r = row["core_gflop_per_s_on_rows"]
        print(f"  the core alone: {r['random']:.1f} GFLOP/s on random selections, {r['contiguous']:.1f} on one "
              f"contiguous block of keys for every query: the gathers cost {1 - r['random'] / r['contiguous']:.0%}")
    if "floor_s" in row:
        print(f"  floor: its {row['attention_gflop']:.0f} attention GFLOP at dense SDPA's "
              f"{row['sdpa_gflop_per_s']:.1f} GFLOP/s, the rest as measured: {row['floor_s']:.1f} s "
              f"= {row['floor_vs_dense']:.2f}x dense")
    print(f"  {'part':<44} {'s':>8} {'share':>6} {'work':>12} {'rate':>14}")
    for name, p in row["parts"].items():
        if not p["s"] and "gflop" not in p:
            continue
        work = f"{p['gflop']:.1f} GFLOP" if "gflop" in p else (f"{p['gib']:.2f} GiB" if "gib" in p else "")
        rate = (f"{p['gflop_per_s']} GFLOP/s" if p.get("gflop_per_s") else
                f"{p['gib_per_s']} GiB/s" if p.get("gib_per_s") else "")
        print(f"  {name:<44} {p['s']:8.2f} {p['s'] / row['ours_s']:6.1%} {work:>12} {rate:>14}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--modes", nargs="+", default=["sparse", "warmup"], choices=["sparse", "warmup"])
    ap.add_argument("--warmup-max", type=int, default=16384, help="warm-up mode only up to this L")
    ap.add_argument("--megatron", action="store_true", help="also megatron-core's DSAttention")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--repeats", type=int, default=3,
                    help="clean steps per cell (after a short warm-up step): s/step is their median")
    ap.add_argument("--kernels", nargs="+", default=["auto"], choices=["auto", "torch"],
                    help="model.dsa.kernels: auto (the fused C++ sparse MLA on CPU), torch (op by op); "
                         "several: one row each, measured in the same run")
    ap.add_argument("--one", nargs=2)
    args = ap.parse_args()
    global KERNELS
    KERNELS = args.kernels[0]
    if args.one:
        print(json.dumps(run_one(args.one[0], int(args.one[1]), args.repeats)))
        return
    rows, table = [], []
    for length in args.lengths:
        dense = _spawn("sdpa", length, args.repeats)
        print(f"  measured dense L={length}: {dense}", file=sys.stderr)
        for mode in args.modes:
            if mode == "warmup" and length > args.warmup_max:
                continue
            for kernels in args.kernels:
                ours = _spawn("ours" if mode == "sparse" else mode, length, args.repeats, kernels)
                if ours:
                    rows.append(dict(result_row(length, mode, ours, dense), kernels=kernels))
                    _print_row(rows[-1])
        mcore = _spawn("megatron", length, args.repeats) if args.megatron else None
        table.append((length, dense, mcore))
    print("\nDSA layer, fwd+bwd incl. indexer KL, fp32, batch 1, 16 heads, top-k 2048 (CPU, 2 cores)")
    print(f"{'L':>6} {'mode':>7} {'kernels':>7} | {'ours s':>8} {'GiB':>6} | {'SDPA s':>8} {'GiB':>6} | {'ours/SDPA':>9}")
    for row in rows:
        ratio = f"{row['ours_s'] / row['dense_s']:8.2f}x" if row["dense_s"] else f"{'-':>9}"
        print(f"{row['L']:>6} {row['mode']:>7} {row['kernels']:>7} | {row['ours_s']:8.1f} {row['ours_gib']:6.2f} | "
              f"{row['dense_s'] or 0:8.1f} {row['dense_gib'] or 0:6.2f} | {ratio}")
    for length, _, mcore in table:
        if mcore:
            print(f"megatron-core DSAttention L={length}: {mcore['seconds']:.1f} s, {mcore['peak_rss_gib']:.2f} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"rows written to {args.json}")


if __name__ == "__main__":
    main()
