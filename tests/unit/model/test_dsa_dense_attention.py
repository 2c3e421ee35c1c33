"""Blocked dense attention (packed documents, context parallelism) equals SDPA with the explicit
s x L visibility mask, outputs and gradients, and never allocates a tensor of s x L elements."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from data_pipeline.packing import document_ids_from_lengths
from model_providers.glm5.model.dsa import dense_attention as dense_attention_module
from model_providers.glm5.model.dsa.dense_attention import BLOCK_ROWS, block_plan, dense_attention
from model_providers.glm5.model.dsa.visibility import TokenLayout
from parallel.context_parallel import zigzag_positions
from parallel.megatron_compat.micro_batch import MicroBatch, host_document_ids

SCALE = 0.21


def _reference(query, key, value, q_pos, doc_ids):
    """The explicit-mask path: [b or 1, 1, s, L] visibility, one SDPA call."""
    s, b = query.shape[:2]
    L = key.shape[0]
    visible = (torch.arange(L)[None, :] <= q_pos[:, None])[None]
    if doc_ids is not None:
        visible = visible & (doc_ids[:, q_pos, None] == doc_ids[:, None, :])
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], scale=SCALE)
    return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def _documents(*lengths_per_sample):
    total = sum(lengths_per_sample[0])
    return torch.stack([torch.from_numpy(document_ids_from_lengths(lens, total))
                        for lens in lengths_per_sample])


def _inputs(s, L, b, n=3, qk=10, v=6, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(s, b, n, qk), (L, b, n, qk), (L, b, n, v)]
    return [torch.randn(*shape, generator=gen).to(dtype).requires_grad_() for shape in shapes]


def _check(layout, doc_ids, b, block_rows, n=3, dtype=torch.float32, tol=1e-5):
    s, L = len(layout.q_pos), layout.key_len
    query, key, value = _inputs(s, L, b, n=n, dtype=dtype)
    grad = torch.randn(s, b, n * value.shape[-1], generator=torch.Generator().manual_seed(1))
    out = dense_attention(query, key, value, layout, SCALE, block_rows=block_rows)
    grads = torch.autograd.grad(out, (query, key, value), grad.to(dtype))
    q32, k32, v32 = (t.detach().double().requires_grad_() for t in (query, key, value))
    ref = _reference(q32, k32, v32, layout.q_pos, doc_ids)
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), grad.double())
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    for g, r in zip(grads, ref_grads):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), r, rtol=tol, atol=tol)


@pytest.mark.parametrize("block_rows", [16, 1000])
def test_packed_documents_with_different_boundaries_per_sample(block_rows):
    docs = _documents([30, 41, 25], [9, 50, 20, 17])  # 16-row blocks straddle every boundary
    layout = TokenLayout.build(96, 96, docs)
    _check(layout, docs, b=2, block_rows=block_rows)


@pytest.mark.parametrize("cp,rank", [(2, 0), (2, 1), (4, 0), (4, 3)])
@pytest.mark.parametrize("packed", [False, True])
def test_context_parallel_zigzag_queries(cp, rank, packed):
    L = 128
    docs = _documents([50, 47, 31], [13, 100, 15]) if packed else None
    layout = TokenLayout.build(L // cp, L, docs, zigzag_positions(L // cp, cp, rank))
    _check(layout, docs, b=2, block_rows=12)


def test_sparse_prefix_rows_against_leading_keys():
    """The sparse mode's dense prefix: rows before position top-k against keys 0..k-1."""
    L, cp, topk = 128, 2, 100
    docs = _documents([40, 60, 28], [70, 58])
    full = TokenLayout.build(L // cp, L, docs, zigzag_positions(L // cp, cp, 0))
    prefix = full.rows_before(topk)
    assert 0 < prefix < L // cp
    _check(full.rows(0, prefix, topk), docs[:, :topk], b=2, block_rows=8)


def test_document_ids_repeated_later_in_the_sample():
    """Visibility is by document id: an id that comes back after another document sees its
    earlier tokens (key ranges then hold other documents' keys, masked by id)."""
    docs = torch.tensor([[0] * 10 + [1] * 7 + [0] * 9 + [2] * 6])
    layout = TokenLayout.build(32, 32, docs)
    assert any(blk.keys.start == 0 and blk.rows.start == 17 for blk in block_plan(layout, 1, 8))
    _check(layout, docs, b=1, block_rows=8)


def test_plain_causal_and_same_documents_in_every_sample():
    _check(TokenLayout.build(40, 40), None, b=2, block_rows=8)
    docs = _documents([12, 28], [12, 28])
    _check(TokenLayout.build(40, 40, docs), docs, b=2, block_rows=8)


def test_backward_a_few_heads_at_a_time(monkeypatch):
    # a few heads per recomputed SDPA call (one for long key ranges)
    monkeypatch.setattr(dense_attention_module, "BACKWARD_ELEMENTS", 2 * 16 * 40)
    docs = _documents([50, 47, 31], [13, 100, 15])
    layout = TokenLayout.build(64, 128, docs, zigzag_positions(64, 2, 1))
    _check(layout, docs, b=2, block_rows=12, n=5)


def test_reduced_precision_accumulates_key_gradients_in_fp32():
    docs = _documents([60, 68])
    layout = TokenLayout.build(64, 128, docs, zigzag_positions(64, 2, 1))
    _check(layout, docs, b=1, block_rows=8, dtype=torch.bfloat16, tol=2e-2)


def test_document_blocks_skip_other_documents_keys():
    docs = _documents([100, 28])
    blocks = block_plan(TokenLayout.build(128, 128, docs), 1, 64)
    assert [(b.rows.start, b.rows.stop, b.keys.start, b.keys.stop, b.causal) for b in blocks] == [
        (0, 64, 0, 64, True), (64, 100, 0, 100, False), (100, 128, 100, 128, True)]


def test_host_document_ids_are_copied_once_per_batch_and_never_stale():
    docs = _documents([100, 28])
    with MicroBatch(docs).active():
        first = host_document_ids(docs)
        assert host_document_ids(docs.detach()) is first  # later layers
        prefix = host_document_ids(docs[:, :64])  # the sparse mode's prefix
        assert prefix.shape == (1, 64) and prefix.data_ptr() == first.data_ptr()  # no second copy
        docs.copy_(_documents([20, 108]))  # same memory, new ids
        assert torch.equal(host_document_ids(docs), _documents([20, 108]))


def test_host_document_ids_of_another_micro_batch_are_refused():
    """The attention asks the active micro-batch for the host copy of the ids it received: ids
    of another micro-batch (other memory, or more keys) are an error, not another's plan."""
    docs = _documents([100, 28])
    with MicroBatch(docs).active():
        with pytest.raises(RuntimeError, match=r"not those of the active MicroBatch\(document_ids=\(1, 128\)\)"):
            host_document_ids(_documents([100, 28]))
        with pytest.raises(RuntimeError, match="not those of the active"):
            host_document_ids(torch.cat([docs, docs], dim=1)[:, :128])
    with MicroBatch(None).active(), pytest.raises(RuntimeError, match="not those of the active"):
        host_document_ids(docs)


def test_the_training_step_hands_over_the_host_copy(monkeypatch):
    """forward_step passes the data loader's host ids with the device ones: no copy at all."""
    from pretrain import step as one_step

    host = {"tokens": torch.zeros(1, 128, dtype=torch.long), "position_ids": torch.zeros(1, 128, dtype=torch.long),
            "labels": torch.zeros(1, 128, dtype=torch.long), "loss_mask": torch.ones(1, 128),
            "document_ids": _documents([50, 78])}
    monkeypatch.setattr(one_step, "to_device", lambda batch: {k: v.clone() for k, v in batch.items()})
    seen = []

    def model(tokens, position_ids, attention_mask, *, labels, loss_mask, micro_batch):
        with micro_batch.active():
            seen.append((attention_mask, micro_batch.document_ids, host_document_ids(attention_mask)))
        return torch.zeros(1, 128)

    one_step.forward_step(iter([host]), model)
    (device_ids, held, host_ids), = seen
    assert held is device_ids and device_ids is not host["document_ids"]
    assert host_ids is host["document_ids"]


class _LargestAllocation(TorchDispatchMode):
    """Records the element count of the largest tensor any op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.largest = max([self.largest, *sizes])
        return out


@pytest.mark.parametrize("packed", [False, True])
def test_no_s_by_L_tensor_is_allocated(packed):
    L = 10 * BLOCK_ROWS
    s = L // 2  # CP2: this rank's zigzag queries against the whole sequence
    docs = _documents([L // 4] * 4) if packed else None
    layout = TokenLayout.build(s, L, docs, zigzag_positions(s, 2, 0))
    query, key, value = _inputs(s, L, b=1, n=1, qk=2, v=2)
    with _LargestAllocation() as blocked:
        dense_attention(query, key, value, layout, SCALE).sum().backward()
    with _LargestAllocation() as explicit, torch.no_grad():
        _reference(query, key, value, layout.q_pos, docs)
    assert explicit.largest >= s * L
    assert blocked.largest < s * L / 4
