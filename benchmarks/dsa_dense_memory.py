"""Memory and time of DSA's dense core attention (dense mode, warm-up, the sparse mode's prefix)
where SDPA's ``is_causal`` does not apply, forward + backward, fp32, batch 1, qk 256, v 256:
the explicit-mask path it replaced (one SDPA call with a [1, 1, s, L] visibility mask, kept here
as the reference) vs :func:`model_providers.glm5.model.dsa.dense_attention.dense_attention`.

Cases: L=8192 packed documents (4 of 2048 tokens, no CP) and L=32768 under CP2 emulated in one
process (CP rank 0's 16384 zigzag queries against the 32768 gathered keys). Each (case, path)
runs in its own process with large allocations mmapped (freed memory leaves RSS at once):
``peak`` is the peak RSS above the inputs (q, k, v, grad_out), ``held`` the RSS after the
forward above the inputs (the output and what autograd keeps for backward).

    .venv/bin/python benchmarks/dsa_dense_memory.py [--cases packed_8k cp2_32k] [--heads-32k 16]
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

QK, V, HEADS = 256, 256, 16
GIB = 2 ** 30


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _layout(case: str):
    import torch

    from data_pipeline.packing import document_ids_from_lengths
    from model_providers.glm5.model.dsa.visibility import TokenLayout
    from parallel.context_parallel import zigzag_positions

    if case == "packed_8k":
        L = 8192
        docs = torch.from_numpy(document_ids_from_lengths([L // 4] * 4, L))[None]
        return TokenLayout.build(L, L, docs)
    if case == "cp2_32k":
        L = 32768
        return TokenLayout.build(L // 2, L, None, zigzag_positions(L // 2, 2, 0))
    raise ValueError(case)


def _explicit_mask_attention(query, key, value, layout, scale):
    """The replaced path: [b or 1, 1, s, L] bool visibility, one SDPA call."""
    import torch
    import torch.nn.functional as F

    keys = torch.arange(layout.key_len)
    visible = (keys[None, :] <= layout.q_pos[:, None])[None]
    if layout.doc_q is not None:
        visible = visible & (layout.doc_q[:, :, None] == layout.doc_k[:, None, :])
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], scale=scale)
    return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


def child(case: str, path: str, heads: int) -> dict:
    import torch

    from model_providers.glm5.model.dsa.dense_attention import dense_attention

    torch.manual_seed(0)
    layout = _layout(case)
    s, L = len(layout.q_pos), layout.key_len
    query = torch.randn(s, 1, heads, QK, requires_grad=True)
    key = torch.randn(L, 1, heads, QK, requires_grad=True)
    value = torch.randn(L, 1, heads, V, requires_grad=True)
    grad_out = torch.randn(s, 1, heads * V)
    fn = _explicit_mask_attention if path == "explicit" else dense_attention
    base = _rss_bytes()
    base_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    out = fn(query, key, value, layout, QK ** -0.5)
    t1 = time.perf_counter()
    held = _rss_bytes() - base
    out.backward(grad_out)
    t2 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"case": case, "path": path, "heads": heads, "s": s, "L": L,
            "peak_gib": (max(peak, base_peak) - base) / GIB, "held_gib": held / GIB,
            "kv_gib": (key.numel() + value.numel()) * 4 / GIB,
            "fwd_s": t1 - t0, "bwd_s": t2 - t1}


def _table(rows: list, cases: list) -> str:
    lines = [f"DSA dense core attention, fwd+bwd, fp32, b=1, qk {QK}, v {V}; GiB above the inputs "
             "(q, k, v, grad_out); floor: the q/k/v gradients and the output, which any path makes",
             f"{'case':<10} {'heads':>5} {'s x L':>13} {'K+V':>5} {'floor':>5} | {'peak':^13} | "
             f"{'held for bwd':^13} | {'fwd+bwd s':^13}",
             f"{'':<10} {'':>5} {'':>13} {'':>5} {'':>5} |" + " before  after |" * 3]
    for case in cases:
        old, new = (next(r for r in rows if r["case"] == case and r["path"] == p)
                    for p in ("explicit", "blocked"))
        floor = old["kv_gib"] + (old["s"] * old["heads"] * (QK + V) * 4) / GIB
        lines.append(
            f"{case:<10} {old['heads']:>5} {old['s']:>6}x{old['L']:<6} {old['kv_gib']:>5.2f} "
            f"{floor:>5.2f} | {old['peak_gib']:>6.2f} {new['peak_gib']:>6.2f} | "
            f"{old['held_gib']:>6.2f} {new['held_gib']:>6.2f} | "
            f"{old['fwd_s'] + old['bwd_s']:>6.1f} {new['fwd_s'] + new['bwd_s']:>6.1f}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["packed_8k", "cp2_32k"])
    ap.add_argument("--heads-32k", type=int, default=HEADS, help="heads for cp2_32k")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        case, path, heads = args.child
        print(json.dumps(child(case, path, int(heads))))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    rows = []
    for case in args.cases:
        heads = args.heads_32k if case == "cp2_32k" else HEADS
        for path in ("explicit", "blocked"):
            proc = subprocess.run([sys.executable, __file__, "--child", case, path, str(heads)],
                                  capture_output=True, text=True, env=env)
            if proc.returncode:
                raise SystemExit(f"{case} {path} failed:\n{proc.stderr[-3000:]}")
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"  {case} {path}: {rows[-1]}", file=sys.stderr, flush=True)
    print(_table(rows, args.cases))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
