"""All-gather context parallelism on CPU ranks: one GLM-5-proportioned MLA + DSA layer (as in
benchmarks/dsa.py: 16 heads, qk 192 + 64, v 256, q/kv LoRA 512, indexer 8 x 128, hidden 512,
top-k 2048), forward + backward, fp32, batch 1, at L tokens split over CP ranks (gloo).

Per cell: step time, per-rank peak RSS and its growth during the step (~activation memory), the
ratio of that growth to CP=1's, and the bytes all-gathered per token per layer against the
analytic count (kv latent + rope key, + indexer key when the indexer runs) x 4 bytes.

    .venv/bin/python benchmarks/long_context.py [--lengths 8192 16384 32768] [--cps 1 2 4]
                                                [--mode sparse|dense]
"""

from __future__ import annotations

from parallel.megatron_compat import bootstrap

bootstrap()  # before megatron-core's first import

import argparse
import json
import os
import resource
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.dsa import CHUNK, HIDDEN, INDEX_DIM, INDEX_HEADS, LORA, ROPE, TOPK, _config  # noqa: E402


def analytic_bytes_per_token(mode: str, itemsize: int = 4) -> int:
    """What each token contributes to the CP all-gather of one layer."""
    return (LORA + ROPE + (INDEX_DIM if mode != "dense" else 0)) * itemsize


def run_rank(length: int, cp: int, mode: str) -> None:
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer.spec_utils import build_module

    import model_providers.glm5.model.dsa.attention as attention
    from model_providers.glm5.model.config import DSAConfig
    from model_providers.glm5.model.specs import local_layer_spec
    from parallel.config import ParallelConfig
    from parallel.initialize import initialize
    from parallel.megatron_compat import MicroBatch

    initialize(ParallelConfig(cp=cp), seed=1234)
    gathered = [0]
    plain_gather = attention.gather_sequence

    def counting_gather(t):
        out = plain_gather(t)
        gathered[0] += out.numel() * out.element_size()
        return out

    attention.gather_sequence = counting_gather
    cfg = _config(False)
    cfg.context_parallel_size = cp
    dsa = DSAConfig(mode=mode, index_heads=INDEX_HEADS, index_head_dim=INDEX_DIM, topk=TOPK,
                    query_chunk=CHUNK)
    layer = build_module(local_layer_spec(None, dsa).submodules.self_attention, config=cfg,
                         layer_number=1)
    torch.manual_seed(parallel_state.get_context_parallel_rank())

    def step(n):
        x = torch.randn(n // cp, 1, HIDDEN, requires_grad=True)
        with MicroBatch().active():  # the layer called on its own is one micro-batch
            out, _ = layer(x, attention_mask=None)
        out.float().pow(2).mean().backward()

    step(256 * cp)  # warm-up
    gathered[0] = 0
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    torch.distributed.barrier()
    t0 = time.perf_counter()
    step(length)
    torch.distributed.barrier()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    rec = {"rank": torch.distributed.get_rank(), "seconds": seconds, "peak_rss_gib": peak,
           "step_growth_gib": peak - before, "gathered_bytes_per_token": gathered[0] / length}
    out = [None] * cp
    torch.distributed.all_gather_object(out, rec)
    if rec["rank"] == 0:
        print("RESULT " + json.dumps(out))


def spawn(length: int, cp: int, mode: str) -> list[dict]:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS=str(max(1, os.cpu_count() // cp)))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    from parallel.initialize import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cp}",
           f"--master-port={free_port()}", __file__, "--rank", str(length), str(cp), mode]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"L={length} cp={cp} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--mode", default="sparse", choices=["dense", "warmup", "sparse"])
    ap.add_argument("--rank", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank:
        run_rank(int(args.rank[0]), int(args.rank[1]), args.rank[2])
        return
    want = analytic_bytes_per_token(args.mode)
    print(f"mode={args.mode}; analytic gathered bytes/token/layer (fp32) = {want}")
    print("| L | CP | s/step | peak RSS/rank GiB (max) | step growth/rank GiB | vs CP=1 | gathered B/token | vs analytic |")
    print("|---|---|---|---|---|---|---|---|")
    for length in args.lengths:
        base = None
        for cp in args.cps:
            ranks = spawn(length, cp, args.mode)
            sec = max(r["seconds"] for r in ranks)
            peak = max(r["peak_rss_gib"] for r in ranks)
            growth = max(r["step_growth_gib"] for r in ranks)
            base = growth if cp == 1 else base
            got = ranks[0]["gathered_bytes_per_token"]
            ratio = f"{growth / base:.2f}x" if base else "-"
            match = f"{got / want:.3f}" if cp > 1 else "- (no gather)"
            print(f"| {length} | {cp} | {sec:.1f} | {peak:.2f} | {growth:.2f} | {ratio} | {got:.0f} | {match} |",
                  flush=True)


if __name__ == "__main__":
    main()
