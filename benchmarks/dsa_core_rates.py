"""Rates of the sparse MLA core's shape on this machine, for ``benchmarks/dsa.py``: a plain
batched GEMM of that shape (the BLAS ceiling the micro-kernels are held against) and the fused CPU
core alone on random selections against one contiguous block of keys (what the gathers cost it).
Shapes: ``heads`` query heads, ``dim`` latent + rope width, ``dv`` latent (value) width, ``k``
selected keys per query."""

from __future__ import annotations

import statistics
import time


def gemm_ceiling(heads: int, dim: int, dv: int, k: int, chunk: int) -> float:
    """GFLOP/s of one batched GEMM of the sparse core's shape: a chunk of queries' [heads, dim]
    against their own gathered [k, dim] rows, the faster of the two layouts (the rows
    transposed as the core reads them, or laid out [dim, k]); median of 15 each."""
    import torch

    from model_providers.glm5.model.dsa.sparse_attention import rows_per_chunk

    c = rows_per_chunk(k, dim, 4, chunk)
    a = torch.randn(c, heads, dim)
    rows = torch.randn(c, k, dim)
    best = 0.0
    for b in (rows.transpose(1, 2), rows.transpose(1, 2).contiguous()):
        times = []
        for _ in range(17):
            t0 = time.perf_counter()
            torch.bmm(a, b)
            times.append(time.perf_counter() - t0)
        best = max(best, 2 * c * heads * dim * k / sorted(times[2:])[7] / 1e9)
    return best


def core_on_rows(length: int, heads: int, dim: int, dv: int, k: int, queries: int = 256) -> dict | None:
    """GFLOP/s of the fused CPU sparse core alone (forward + backward, ``queries`` queries; median
    of 5) on each query's own random selection of k keys out of ``length``, and on one contiguous
    block of k keys that every query selects (the same rows, read in order and reused from cache):
    {"random": ..., "contiguous": ...}. None without the fused kernel."""
    import torch

    from model_providers.glm5.model.dsa.kernels.dsa_cpu import KEY_BLOCK, cpu_kernel

    kernel = cpu_kernel()
    if kernel is None:
        return None
    q = torch.randn(1, queries, heads, dim) * 0.1
    q_lat, q_pe = q[..., :dv], q[..., dv:]
    kv = torch.randn(1, length, dim)
    grad = torch.randn(1, queries, heads, dv) * 0.01
    flop = 2 * queries * k * heads * ((dim + dv) + (3 * dim + 2 * dv))
    selections = {"random": torch.stack([torch.randperm(length)[:k] for _ in range(queries)]),
                  "contiguous": torch.arange(k).expand(queries, k).contiguous()}
    rates = {}
    for name, idx in selections.items():
        idx = idx.view(1, queries, k)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            out, lse, _ = kernel.forward(q_lat, q_pe, kv, idx, None, dim ** -0.5, KEY_BLOCK)
            kernel.backward(q_lat, q_pe, kv, idx, None, dim ** -0.5, KEY_BLOCK, grad, out, lse)
            times.append(time.perf_counter() - t0)
        rates[name] = flop / statistics.median(times) / 1e9
    return rates
