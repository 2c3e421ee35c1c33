"""The DSA core attention inside megatron's MLA, sparse mode: its output and gradients equal those
of per-head softmax attention restricted to the indexer's top-k keys (a plain masked reference
built from the same layer's q/k/v), with top-k well below the sequence length. The MLA
intermediates it reads reach it through megatron's selective recomputation of the core attention,
one micro-batch's each."""

import pytest
import torch

from parallel.megatron_compat import micro_batch
from parallel.megatron_compat.micro_batch import MicroBatch
from tests.support.dsa_layer import sparse_layer
from tests.support.dsa_probe import TopkProbe


def _pending(core):
    """The MLA intermediates handed over to ``core`` in the active micro-batch (left for it)."""
    mla = micro_batch.take(core)
    if mla is not None:
        micro_batch.current().hand_over(core, mla)
    return mla


def test_sparse_layer_equals_masked_per_head_reference(one_rank):
    torch.manual_seed(0)
    layer = sparse_layer("sparse", topk=10)
    captured = {}
    core = layer.core_attention
    core.register_forward_pre_hook(
        lambda m, args: captured.update(q=args[0], k=args[1], v=args[2], latent=_pending(m).kv_latent))
    # in fp64 (the torch path computes in the input's precision): this compares two formulas, so
    # their rounding (~1e-16) is far below any tolerance; the fused fp32 kernel's own error is
    # bounded against the torch path in test_dsa_cpu_kernel
    layer.double()
    x = torch.randn(40, 1, 64, dtype=torch.float64, requires_grad=True)
    with TopkProbe(layer) as probe, MicroBatch().active():
        out, _ = layer(x, attention_mask=None)

    q, k, v = captured["q"], captured["k"], captured["v"]  # [s, b, n, d]
    s = q.shape[0]
    # megatron's MLA up-projected per-head keys and values only for the dense prefix (the
    # absorbed form reads the latent): the reference up-projects every token itself
    assert not bool(k[10:, :, :, :16].any()) and not bool(v[10:].any()) and bool(v[:10].all())
    kv = torch.nn.functional.linear(captured["latent"], layer.linear_kv_up_proj.weight).view(s, 1, 4, 28)
    k = torch.cat([kv[..., :16], k[..., 16:]], dim=-1)
    v = kv[..., 16:]
    idx, valid = probe.latest[core]  # for queries 10..39 (earlier ones see every causal key)
    allowed = torch.ones(s, s, dtype=torch.bool).tril()
    sparse_rows = torch.zeros(s - 10, s, dtype=torch.bool).scatter_(1, idx[0], valid[0])
    allowed[10:] = sparse_rows
    assert int(allowed[10:].sum(1).max()) == 10 and not bool((allowed & ~torch.ones(s, s, dtype=torch.bool).tril()).any())
    scores = torch.einsum("snd,tnd->nst", q[:, 0], k[:, 0]) * core.softmax_scale
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    ref = torch.einsum("nst,tnv->snv", probs, v[:, 0]).reshape(s, 1, -1)
    ref_out, _ = layer.linear_proj(ref)
    assert out.dtype == torch.float64 and torch.allclose(out, ref_out, rtol=1e-12, atol=1e-12)

    # gradients too: the input's and every MLA weight's (the kv up-projection's reach it through
    # the dense prefix's per-head keys and values and the absorbed form's W_UK / W_UV; the indexer
    # is trained by the KL alone, its inputs detached)
    params = {n: p for n, p in layer.named_parameters() if not n.startswith("core_attention.indexer.")}
    names, wrt = ["input", *params], [x, *params.values()]
    g = torch.randn_like(out)
    ours = torch.autograd.grad((out * g).sum(), wrt, retain_graph=True, allow_unused=True)
    reference = torch.autograd.grad((ref_out * g).sum(), wrt, allow_unused=True)
    assert "linear_kv_up_proj.weight" in names
    for name, a, b in zip(names, ours, reference):
        assert (a is None) == (b is None), name
        if a is not None:
            # fp64 rounding of two association orders: ~1e-16 of the largest entry
            assert float((a - b).abs().max()) <= 1e-12 * float(b.abs().max()), name


def test_sparse_layer_with_topk_at_least_length_equals_dense(one_rank):
    torch.manual_seed(1)
    dense, sparse = sparse_layer("dense", 64), sparse_layer("sparse", 64)
    sparse.load_state_dict(dense.state_dict())
    x = torch.randn(33, 2, 64)
    with MicroBatch().active():
        out_dense, _ = dense(x, attention_mask=None)
    with MicroBatch().active():
        out_sparse, _ = sparse(x, attention_mask=None)
    assert torch.allclose(out_sparse, out_dense, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["warmup", "sparse"])
def test_core_attention_recompute_uses_each_micro_batch_intermediates(one_rank, mode):
    """Two micro-batches forward, then both backward (as a pipeline schedule interleaves them):
    with the core attention recomputed in backward, every gradient (the main model's through the
    kv latent and up-projection, the indexer's through the KL) equals the plain layer's."""
    torch.manual_seed(2)
    plain = sparse_layer(mode, topk=10)
    recomputed = sparse_layer(mode, topk=10, recompute_granularity="selective", recompute_modules=["core_attn"])
    recomputed.load_state_dict(plain.state_dict())
    assert recomputed.checkpoint_core_attention and not plain.checkpoint_core_attention
    xs = [torch.randn(40, 1, 64), torch.randn(40, 1, 64)]
    grads = []
    for layer in (plain, recomputed):
        inputs = [x.clone().requires_grad_() for x in xs]
        outs = []
        for x in inputs:  # one micro-batch each, both backward after both forwards
            with MicroBatch().active():
                outs.append(layer(x, attention_mask=None)[0])
        for out in outs:
            out.square().sum().backward()
        grads.append([x.grad for x in inputs] + [p.grad for p in layer.parameters()])
    assert all(g is not None for g in grads[0])
    assert any(n.startswith("core_attention.indexer.") for n, _ in plain.named_parameters())
    for want, have in zip(*grads):
        torch.testing.assert_close(have, want, rtol=1e-6, atol=1e-7)


def test_core_attention_takes_the_intermediates_once(one_rank):
    """The MLA layer's intermediates serve one core-attention forward; a core attention that runs
    without them (outside GLM5MLASelfAttention, or twice) names what is missing."""
    from model_providers.glm5.model.dsa.attention import MLAIntermediates

    torch.manual_seed(3)
    layer = sparse_layer("sparse", topk=10)
    core = layer.core_attention
    seen = []
    core.register_forward_pre_hook(lambda m, args: seen.append((_pending(m), args)))
    with MicroBatch().active() as active:
        layer(torch.randn(40, 1, 64), attention_mask=None)
        assert active.take(core) is None  # the core attention took them
        (mla, (q, k, v, _)), = seen
        with pytest.raises(RuntimeError, match=r"layer 1, model.dsa.mode=sparse\) got no MLAIntermediates"):
            core(q, k, v)  # twice
    assert isinstance(mla, MLAIntermediates) and mla.kv_latent.shape == (40, 1, 24)
    assert mla.kv_up_weight is layer.linear_kv_up_proj.weight and mla.kv_full is None
    with pytest.raises(RuntimeError, match=r"layer 1, model.dsa.mode=sparse\) got no MLAIntermediates"):
        core(q, k, v)  # outside any micro-batch
    with pytest.raises(RuntimeError, match=r"GLM5MLASelfAttention \(layer 1\) runs inside a micro-batch"):
        layer(torch.randn(40, 1, 64), attention_mask=None)


def test_sparse_under_context_parallelism_makes_no_full_length_per_head_key(one_rank, monkeypatch):
    """Under CP the MLA rebuilds keys from the all-gathered latent; sparse mode reads per-head
    keys and values only for its dense prefix (the later queries read the latent), so none of
    [L, b, n, d] is made, forward or backward (it used to be: zero-filled past the prefix, and a
    zero-filled key gradient). CP2 is emulated on one rank: the gathers append a second rank's
    fixed half. The output and gradients equal those of the same layer given the full key."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import model_providers.glm5.model.dsa.attention as attention

    other = {}

    def gather(t):  # this rank's half, then the other rank's (fixed, no gradient)
        half = other.setdefault(tuple(t.shape), torch.randn(t.shape, generator=torch.Generator().manual_seed(len(other))))
        return torch.cat([t, half.to(t.dtype)], dim=0)

    monkeypatch.setattr(attention, "cp_size", lambda: 2)
    monkeypatch.setattr(attention, "gather_sequence", gather)
    torch.manual_seed(5)
    layer = sparse_layer("sparse", topk=8)
    s, heads = 30, 4

    class Shapes(TorchDispatchMode):
        full: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[0] == 2 * s and t.shape[2] == heads:
                    self.full.append((func.__name__, tuple(t.shape)))
            return out

    x = torch.randn(s, 1, 64, requires_grad=True)
    with Shapes(), MicroBatch().active():
        out, _ = layer(x, attention_mask=None)
        out.square().sum().backward()
    assert Shapes.full == [], Shapes.full[:5]
    got = [out.detach(), x.grad] + [p.grad.clone() for p in layer.parameters()]

    # the same layer given the whole per-head key and value (the former path, read by _KeyReads)
    def full_key_value(self, key_local, kv_latent):
        key, value, c_full, k_rope = original(self, key_local, kv_latent)
        kv = torch.nn.functional.linear(c_full, self.linear_kv_up_proj.weight).view(*c_full.shape[:2], heads, -1)
        k_nope, value = kv.split([self.config.qk_head_dim, self.config.v_head_dim], dim=-1)
        key = torch.cat([k_nope, k_rope[:, :, None].expand(-1, -1, heads, -1)], dim=-1)
        return key, value, c_full, None

    original = attention.GLM5MLASelfAttention._gathered_key_value
    monkeypatch.setattr(attention.GLM5MLASelfAttention, "_gathered_key_value", full_key_value)
    layer.zero_grad(set_to_none=True)
    x2 = x.detach().clone().requires_grad_()
    with MicroBatch().active():
        out2, _ = layer(x2, attention_mask=None)
        out2.square().sum().backward()
    want = [out2.detach(), x2.grad] + [p.grad for p in layer.parameters()]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
