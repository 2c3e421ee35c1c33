"""The indexer KL: values equal a naive computation, and gradients reach only the indexer
(its inputs are detached and the target carries no gradient), in dense and sparse form."""

import math

import torch

from model_providers.glm5.model.dsa.indexer import index_logits, select_topk
from model_providers.glm5.model.dsa.kl import dense_kl, sparse_kl
from model_providers.glm5.model.dsa.sparse_attention import sparse_latent_attention


def _naive_kl(target_rows, logit_rows):
    total = 0.0
    for p_row, l_row in zip(target_rows, logit_rows):
        finite = [(p, l) for p, l in zip(p_row, l_row) if math.isfinite(l)]
        z = math.log(sum(math.exp(l) for _, l in finite))
        total += sum(p * (math.log(p) - (l - z)) for p, l in finite if p > 0)
    return total / len(target_rows)


def _setup(seed=0, s=20, n=3, D=12, h=2, d=8):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(s, 1, n, D, generator=gen, requires_grad=True)
    key = torch.randn(s, 1, n, D, generator=gen, requires_grad=True)
    iq = torch.randn(1, s, h, d, generator=gen, requires_grad=True)
    ik = torch.randn(1, s, d, generator=gen, requires_grad=True)
    iw = torch.randn(1, s, h, generator=gen, requires_grad=True)
    return query, key, iq, ik, iw


def test_dense_kl_value_and_gradient_flow():
    query, key, iq, ik, iw = _setup()
    s, scale = query.shape[0], 0.3
    kl = dense_kl(iq, ik, iw, query, key, scale, chunk=6)

    scores = torch.einsum("snd,lnd->nsl", query[:, 0], key[:, 0]) * scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    target = scores.softmax(-1).sum(0)
    target = (target / target.sum(-1, keepdim=True)).tolist()
    logits = index_logits(iq, ik, iw, 0)[0].tolist()
    want = _naive_kl(target, logits)
    assert abs(float(kl) - want) <= 1e-5 * max(1.0, abs(want))

    kl.backward()
    assert query.grad is None and key.grad is None  # the KL never reaches the main model
    for t in (iq, ik, iw):
        assert t.grad is not None and t.grad.abs().sum() > 0


def test_sparse_kl_value_and_gradient_flow():
    query, key, iq, ik, iw = _setup(seed=1, s=24)
    s, n, D = query.shape[0], query.shape[2], query.shape[3]
    q_abs = torch.randn(1, s, n, D, requires_grad=True)
    kv = torch.randn(1, s, D, requires_grad=True)
    idx, valid = select_topk(iq.detach(), ik.detach(), iw.detach(), topk=5, chunk=7)
    out, head_probs = sparse_latent_attention(q_abs, kv, idx, valid, 0.25, D - 4, 7)
    kl = sparse_kl(iq, ik, iw, idx, valid, head_probs, chunk=5)

    logits = index_logits(iq, ik, iw, 0)[0]
    sel_logits = logits.gather(-1, idx[0]).masked_fill(~valid[0], float("-inf")).tolist()
    target = head_probs[0].masked_fill(~valid[0], 0.0)
    target = (target / target.sum(-1, keepdim=True)).tolist()
    want = _naive_kl(target, sel_logits)
    assert abs(float(kl) - want) <= 1e-5 * max(1.0, abs(want))

    kl.backward()
    assert q_abs.grad is None and kv.grad is None
    for t in (iq, ik, iw):
        assert t.grad is not None and t.grad.abs().sum() > 0


def test_kl_is_zero_when_indexer_matches_target():
    """Sanity of the direction: KL(target || q) = 0 when softmax(I) equals the target over the
    visible keys (logits shifted by 5: softmax does not see it; the hidden key's logit is
    finite and must not count), and > 0 otherwise; d logits = softmax - target."""
    from model_providers.glm5.model.dsa.kl import _kl_and_grads

    target = torch.tensor([[0.2, 0.3, 0.5, 0.0]])
    hidden = torch.tensor([[False, False, False, True]])
    matching = torch.tensor([[[math.log(0.2) + 5, math.log(0.3) + 5, math.log(0.5) + 5, 9.0]]])
    value, d_ph, d_w = _kl_and_grads(matching, torch.ones(1, 1), target, hidden, True)
    assert abs(float(value)) < 1e-6 and float(d_ph.abs().max()) < 1e-6
    value, d_ph, _ = _kl_and_grads(torch.zeros(1, 1, 4), torch.ones(1, 1), target, hidden, True)
    uniform = torch.tensor([1 / 3] * 3)
    assert abs(float(value) - float((target[0, :3] * (target[0, :3] / uniform).log()).sum())) < 1e-6
    assert float(d_ph.abs().max()) == 0.0  # ReLU's gradient at 0 scores


def _reference_kl(iq, ik, iw, target, keys_of_row=None):
    """Autograd through the plain formula: mean over rows of KL(target || softmax(logits)) with
    logits over all L keys (target 0 and logit -inf where hidden), or at ``keys_of_row``."""
    per_head = torch.einsum("bshd,bld->bshl", iq, ik).relu()
    logits = torch.einsum("bsh,bshl->bsl", iw, per_head)
    if keys_of_row is not None:
        logits = logits.gather(-1, keys_of_row)
    logits = logits.masked_fill(target == 0, float("-inf"))
    logq = torch.log_softmax(logits, -1)
    terms = torch.where(target > 0, target * (target.clamp_min(1e-30).log() - logq), 0.0)
    return terms.sum() / (iq.shape[0] * iq.shape[1])


def _grads(value, tensors):
    return torch.autograd.grad(value, tensors)


def test_dense_kl_gradients_equal_autograd_of_the_formula_with_documents():
    """The eagerly computed gradients (b = 2, packed documents with different boundaries, odd
    chunks, CP-style non-contiguous query positions) equal autograd of the formula."""
    from model_providers.glm5.model.dsa.visibility import TokenLayout

    gen = torch.Generator().manual_seed(3)
    b, L, n, D, h, d = 2, 23, 3, 10, 2, 8
    docs = torch.tensor([[0] * 9 + [1] * 6 + [2] * 8, [0] * 4 + [1] * 19])
    for q_pos in (None, torch.tensor([0, 1, 2, 3, 4, 5, 17, 18, 19, 20, 21, 22])):
        s = L if q_pos is None else len(q_pos)
        layout = TokenLayout.build(s, L, docs, q_pos)
        query = torch.randn(s, b, n, D, generator=gen)
        key = torch.randn(L, b, n, D, generator=gen)
        iq = torch.randn(b, s, h, d, generator=gen, requires_grad=True)
        ik = torch.randn(b, L, d, generator=gen, requires_grad=True)
        iw = torch.randn(b, s, h, generator=gen, requires_grad=True)
        kl = dense_kl(iq, ik, iw, query, key, 0.3, chunk=5, layout=layout)
        scores = torch.einsum("sbnd,lbnd->bnsl", query, key) * 0.3
        probs = scores.masked_fill(layout.hidden(0, s)[:, None], float("-inf")).softmax(-1).sum(1)
        want = _reference_kl(iq, ik, iw, probs / probs.sum(-1, keepdim=True))
        torch.testing.assert_close(kl, want, rtol=1e-5, atol=1e-6)
        for got, ref in zip(_grads(kl, (iq, ik, iw)), _grads(want, (iq, ik, iw))):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_sparse_kl_gradients_equal_autograd_of_the_formula():
    gen = torch.Generator().manual_seed(4)
    b, s, h, d, kk = 2, 30, 3, 8, 7
    iq = torch.randn(b, s, h, d, generator=gen, requires_grad=True)
    ik = torch.randn(b, s, d, generator=gen, requires_grad=True)
    iw = torch.randn(b, s, h, generator=gen, requires_grad=True)
    idx, valid = select_topk(iq.detach(), ik.detach(), iw.detach(), topk=kk, chunk=4)
    head_probs = torch.rand(b, s, kk, generator=gen)
    kl = sparse_kl(iq, ik, iw, idx, valid, head_probs, chunk=3)
    target = head_probs.masked_fill(~valid, 0.0)
    want = _reference_kl(iq, ik, iw, target / target.sum(-1, keepdim=True), idx)
    torch.testing.assert_close(kl, want, rtol=1e-5, atol=1e-6)
    for got, ref in zip(_grads(kl, (iq, ik, iw)), _grads(want, (iq, ik, iw))):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
