"""Key gradients summed without atomics, in a fixed order: the scheme the sparse MLA backward and
the indexer KL share.

A kernel that gives each selected (query, key) pair its own contribution row -- the kv or key
gradient that pair adds, fp32 [dim] -- writes it to a partial buffer at the row
:func:`pair_order` places it: pairs numbered (batch, query, head group, slot) are stably sorted by
key, so each key's rows stand together in query order. :func:`add_rows_in_order` then adds each
key's run, in that order, to its fp32 accumulator row, one program per run. Chunks of queries
run one after another into the same accumulator, so every key's sum is taken in the same order
whatever the chunk size: the result is bitwise the same from run to run and for any chunking.
"""

from __future__ import annotations

import torch

from .indexer_fp8_triton import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

REDUCE_BLOCK_P = 16  #: sorted pair rows per reduction program (runs starting there are its own)
REDUCE_BLOCK_D = 128
#: ptxas resource use at GLM-5 shapes compiled for sm_90a without a GPU (triton 3.9; ``python -m
#: benchmarks.kernel_resources`` prints them, tests/unit/model/test_kernel_resources.py holds these
#: numbers to the compiled kernels): registers per thread, spill stores and loads (bytes per
#: thread), shared memory (KiB; an H100/H200 block may use 227), for
#: the sparse MLA backward's partial rows (576 fp32; Triton's default warps and stages).
RESOURCES = {
    "ordered-rows reduction": dict(registers=28, spill_stores=0, spill_loads=0, shared_kib=0),
}


if HAVE_TRITON:

    @triton.jit
    def _ordered_rows_kernel(keys_ptr, part_ptr, acc_ptr, N, NKEYS, D,
                             BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
        """keys [N] sorted (sentinel NKEYS for invalid pairs), part [N, D] in the same order:
        acc[key] += its run of rows, in order. A run belongs to the program holding its first
        row, which walks it to the end (past its own block if need be)."""
        p0 = tl.program_id(0) * BLOCK_P
        offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        for p in range(p0, tl.minimum(p0 + BLOCK_P, N)):
            key = tl.load(keys_ptr + p)
            prev = tl.load(keys_ptr + p - 1, mask=p > 0, other=-1)
            if (key != prev) & (key < NKEYS):
                acc_row = acc_ptr + key * D + offs_d
                a = tl.load(acc_row, mask=d_ok, other=0.0)
                r = p
                cur = key
                while cur == key:
                    a += tl.load(part_ptr + r.to(tl.int64) * D + offs_d, mask=d_ok, other=0.0)
                    r += 1
                    cur = tl.load(keys_ptr + r, mask=r < N, other=-1)
                tl.store(acc_row, a, mask=d_ok)


def pair_order(idx_chunk: torch.Tensor, valid_chunk, key_len: int, groups: int = 1):
    """(sorted keys [P], dest [P]) for the pairs of ``idx_chunk`` [b, c, k] (key positions in
    [0, key_len); ``valid_chunk`` [b, c, k] bool or None), each repeated for ``groups`` head
    groups: pair (b, t, g, slot) writes its row at ``dest[pair]``, and the sorted keys (batch
    offset in, invalid pairs as the sentinel b * key_len, sorted last) say whose row each is."""
    b, c, k = idx_chunk.shape
    keys = idx_chunk + (torch.arange(b, device=idx_chunk.device) * key_len)[:, None, None]
    if valid_chunk is not None:
        keys = torch.where(valid_chunk, keys, b * key_len)
    keys = keys[:, :, None].expand(b, c, groups, k).reshape(-1)
    keys_sorted, order = torch.sort(keys, stable=True)
    dest = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return keys_sorted, dest


def add_rows_in_order(keys_sorted: torch.Tensor, part: torch.Tensor, acc: torch.Tensor) -> None:
    """acc [b, key_len, dim] fp32 += each key's rows of ``part`` ([>= P, dim] fp32, placed by
    :func:`pair_order`), in their order."""
    rows, dim = keys_sorted.numel(), acc.shape[-1]
    grid = (triton.cdiv(rows, REDUCE_BLOCK_P), triton.cdiv(dim, REDUCE_BLOCK_D))
    _ordered_rows_kernel[grid](keys_sorted, part, acc, rows, acc.numel() // dim, dim,
                               BLOCK_P=REDUCE_BLOCK_P, BLOCK_D=REDUCE_BLOCK_D)
