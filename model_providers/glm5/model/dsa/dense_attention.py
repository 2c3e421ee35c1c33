"""Dense softmax attention for the layouts SDPA's ``is_causal`` does not cover -- packed
documents (document ids) and context parallelism (two zigzag query chunks against the full
gathered sequence) -- without an s x L mask.

The query rows are cut into blocks of at most ``block_rows`` rows, each inside one run of
consecutive positions of one document. A block sees one key range: its document's first key up to
its last row's position, so every visible key of a row is in its block's single SDPA call (no
log-sum-exp merge) and keys of other documents are never scored. A block that starts its document
is SDPA's ``is_causal`` square; the others get a block-local [rows, keys] mask (causal, aligned at
the bottom right). The blocks run under one autograd function that saves only its inputs and
recomputes each block in backward, so neither masks nor per-block copies outlive the forward.

On GPUs the same rule runs as one fused flash-attention kernel instead (``triton=True``:
:mod:`.kernels.document_attention_triton`, no Python loop, no mask, no host sync); the blocks
are the CPU's path and the kernel's reference.

Where documents split differently per sample, each sample gets its own blocks. Key ranges need
the document boundaries on the host: the micro-batch being computed holds them
(``megatron_compat.micro_batch.MicroBatch.host_document_ids``: the data loader's host copy in
the training step, no sync; otherwise one device -> host copy per micro-batch, kept for the
layers that follow). Without documents the plan comes from the host query positions alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from model_providers.glm5.model.dsa.kernels.document_attention_triton import document_attention_triton
from model_providers.glm5.model.dsa.visibility import TokenLayout
from parallel.megatron_compat import micro_batch

BLOCK_ROWS = 1024  #: query rows per SDPA call; its transient mask is block_rows x key range
#: backward recomputes a block for as many heads at a time as keep its key/value gradients (and
#: SDPA's buffers of their size) near this many elements
BACKWARD_ELEMENTS = 1 << 26


@dataclass(frozen=True)
class Block:
    """Query rows ``rows`` of batch rows ``batch`` against keys ``keys``."""

    batch: slice
    rows: slice
    keys: slice
    causal: bool  #: rows and keys are the same positions: SDPA ``is_causal``, no mask
    mixed: bool  #: the key range holds other documents' keys: the mask compares document ids


def dense_attention(query_sbnd, key_sbnd, value_sbnd, layout: TokenLayout, scale: float,
                    block_rows: int = BLOCK_ROWS, triton: bool = False) -> torch.Tensor:
    """query [s, b, n, qk] at ``layout.q_pos``, key [L, b, n, qk], value [L, b, n, v] ->
    [s, b, n * v]: each query attends to the keys at or before its position in its document.
    ``triton``: packed documents and CP through the fused kernel (GPUs)."""
    s, b, n, _ = query_sbnd.shape
    if layout.plain_causal:
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query_sbnd, key_sbnd, value_sbnd))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)
    if triton:
        return document_attention_triton(query_sbnd, key_sbnd, value_sbnd, layout, scale)
    blocks = block_plan(layout, b, block_rows)
    out = _BlockedAttention.apply(query_sbnd, key_sbnd, value_sbnd, layout, blocks, scale)
    return out.view(s, b, -1)


def block_plan(layout: TokenLayout, batch: int, block_rows: int = BLOCK_ROWS) -> list[Block]:
    """Blocks covering every (sample, query row) once, in row order per sample."""
    pos = layout.q_pos.cpu() if layout.q_pos_host is None else layout.q_pos_host
    if layout.doc_q is None:
        return _sample_blocks(pos, None, slice(0, batch), block_rows)
    docs_k = micro_batch.host_document_ids(layout.doc_k)
    if docs_k.shape[0] == 1 or bool((docs_k == docs_k[:1]).all()):
        return _sample_blocks(pos, docs_k[0], slice(0, batch), block_rows)
    return [blk for i in range(batch) for blk in _sample_blocks(pos, docs_k[i], slice(i, i + 1),
                                                                 block_rows)]


def _sample_blocks(pos: torch.Tensor, doc_k: Optional[torch.Tensor], batch: slice,
                   block_rows: int) -> list[Block]:
    """Blocks of one sample (or of samples with the same documents): runs of rows with
    consecutive positions and one document, cut every ``block_rows`` rows; each sees keys from
    its document's first key (0 without documents) to its last position."""
    s = len(pos)
    new_run = torch.ones(s, dtype=torch.bool)
    new_run[1:] = pos[1:] != pos[:-1] + 1
    if doc_k is None:
        first_key = torch.zeros(s, dtype=torch.int64)
    else:
        doc_q = doc_k[pos]
        new_run[1:] |= doc_q[1:] != doc_q[:-1]
        ids, which = torch.unique(doc_k, return_inverse=True)
        first = torch.full((len(ids),), len(doc_k), dtype=torch.int64).scatter_reduce(
            0, which, torch.arange(len(doc_k)), reduce="amin")
        first_key = first[torch.searchsorted(ids, doc_q)]
    starts = torch.nonzero(new_run).flatten().tolist() + [s]
    blocks = []
    for r0, r1 in zip(starts[:-1], starts[1:]):
        lo = int(first_key[r0])
        for b0 in range(r0, r1, block_rows):
            b1 = min(b0 + block_rows, r1)
            p0, hi = int(pos[b0]), int(pos[b1 - 1]) + 1
            mixed = doc_k is not None and not bool((doc_k[lo:hi] == doc_k[p0]).all())
            blocks.append(Block(batch, slice(b0, b1), slice(lo, hi), p0 == lo and not mixed, mixed))
    return blocks


def _attend(q, k, v, layout: TokenLayout, blk: Block, scale: float) -> torch.Tensor:
    """SDPA of one block: q [b', n, rows, qk], k/v [b', n, keys, .] (bnsd views)."""
    if blk.causal:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    keys = torch.arange(blk.keys.start, blk.keys.stop, device=q.device)
    visible = keys[None, :] <= layout.q_pos[blk.rows, None]  # [rows, keys]
    if blk.mixed:
        doc_q = layout.doc_q[blk.batch, blk.rows]
        visible = visible & (doc_q[:, :, None] == layout.doc_k[blk.batch, None, blk.keys])
        visible = visible[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)


def _views(blk: Block, q, k, v, heads: slice = slice(None)):
    return (q[blk.batch, heads, blk.rows], k[blk.batch, heads, blk.keys],
            v[blk.batch, heads, blk.keys])


class _BlockedAttention(torch.autograd.Function):
    """The blocks' SDPA calls as one node: saves q, k, v (the inputs, not copies) and recomputes
    each block in backward (a few heads at a time, see :data:`BACKWARD_ELEMENTS`), accumulating
    key/value gradients over the blocks (fp32 for reduced precision inputs)."""

    @staticmethod
    def forward(ctx, query_sbnd, key_sbnd, value_sbnd, layout, blocks, scale):
        s, b, n, _ = query_sbnd.shape
        out = query_sbnd.new_empty(s, b, n, value_sbnd.shape[-1])
        q, k, v, o = (t.permute(1, 2, 0, 3) for t in (query_sbnd, key_sbnd, value_sbnd, out))
        for blk in blocks:
            o[blk.batch, :, blk.rows] = _attend(*_views(blk, q, k, v), layout, blk, scale)
        ctx.save_for_backward(query_sbnd, key_sbnd, value_sbnd)
        ctx.layout, ctx.blocks, ctx.scale = layout, blocks, scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        query_sbnd, key_sbnd, value_sbnd = ctx.saved_tensors
        acc = torch.float32 if key_sbnd.element_size() < 4 else key_sbnd.dtype
        grad_q = torch.empty_like(query_sbnd)
        grad_k = torch.zeros_like(key_sbnd, dtype=acc)
        grad_v = torch.zeros_like(value_sbnd, dtype=acc)
        bnsd = [t.permute(1, 2, 0, 3) for t in (query_sbnd, key_sbnd, value_sbnd, grad_out,
                                                 grad_q, grad_k, grad_v)]
        q, k, v, g_out, g_q, g_k, g_v = bnsd
        n = q.shape[1]
        for blk in ctx.blocks:
            per_head = (k[blk.batch, 0, blk.keys].numel() + v[blk.batch, 0, blk.keys].numel())
            step = max(1, BACKWARD_ELEMENTS // per_head)
            for h in range(0, n, step):
                heads = slice(h, min(h + step, n))
                inputs = [t.detach().requires_grad_() for t in _views(blk, q, k, v, heads)]
                with torch.enable_grad():
                    out = _attend(*inputs, ctx.layout, blk, ctx.scale)
                dq, dk, dv = torch.autograd.grad(out, inputs, g_out[blk.batch, heads, blk.rows])
                g_q[blk.batch, heads, blk.rows] = dq
                g_k[blk.batch, heads, blk.keys] += dk
                g_v[blk.batch, heads, blk.keys] += dv
        return grad_q, grad_k.to(key_sbnd.dtype), grad_v.to(value_sbnd.dtype), None, None, None
