"""Packed documents end to end through the tiny GLM-5: with the micro-batch's document ids in the
attention-mask slot, the per-token LM loss of a packed sample equals the losses of its documents
run one by one (RoPE at sample positions vs document positions: exact because RoPE is relative
and attention across documents is masked), in dense, warm-up and sparse DSA modes; so does the
indexer KL of every layer, the shared MTP layer included (packed mean = token-weighted mean of the
documents'), and each MTP depth's loss: MTP's shifts stay inside documents."""

import numpy as np
import pytest
import torch

from data_pipeline.packing import document_ids_from_lengths, position_ids
from model_providers.glm5.model.config import DSAConfig, GLM5Config, PrecisionConfig
from tests.support.dsa_probe import TopkProbe

LENGTHS = [23, 37, 12]  # the last document is shorter than top-k, the middle one much longer


def _model(mode: str):
    from megatron.core import tensor_parallel

    from model_providers.glm5.model.config import to_transformer_config
    from model_providers.glm5.model.provider import build_model_chunks
    from parallel.config import ParallelConfig

    cfg = GLM5Config(dsa=DSAConfig(mode=mode, topk=8, query_chunk=7))
    torch.manual_seed(3)
    tensor_parallel.model_parallel_cuda_manual_seed(3)
    tcfg = to_transformer_config(cfg, ParallelConfig(), PrecisionConfig())
    (model,) = build_model_chunks(cfg, tcfg, "local")
    return model.eval()


def _kl_per_layer():
    from megatron.core.transformer.moe import moe_utils

    from model_providers.glm5.model.dsa.attention import KL_TRACKER

    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    values = tracker[KL_TRACKER]["values"].clone() if KL_TRACKER in tracker else None
    moe_utils.clear_aux_losses_tracker()
    return values


def _run(model, tokens, labels, positions, document_ids):
    from parallel.megatron_compat import reset_loss_trackers

    reset_loss_trackers()  # no entry left by an earlier test in this process (a dense run makes none)
    with torch.no_grad():
        loss = model(tokens[None], positions[None], document_ids, labels=labels[None])
    return loss[0], _kl_per_layer()


def _kl_sum_rounding_bound(lengths, kl_sums):
    """How far two fp32 evaluations of a layer's KL summed over rows can differ when their inputs
    (attention scores, indexer logits) come from GEMMs of other shapes, as packed and lone
    documents' do (other blockings; other ones again on another CPU or thread count).

    A row's KL is sum_j t_j (log t_j - log q_j) over the n keys it sees (n <= its position in the
    document + 1): a difference of two sums of size H(t) <= ln n and CE = H(t) + KL, while the
    KL itself is ~1e-4 a row here, so its absolute error is set by the terms, not by its value.
    With u = 2^-24 and each term's roundings: log q_j = (z_j - max) - lse is off by
    u (|log q_j| + 2 ln n), so u (CE + 2 ln n) over the row; the products t_j log q_j another
    u CE and t_j log t_j 2u H; t_j itself (a softmax through a polynomial exp) is off by 3u
    relative, which moves the row by at most 3u sum_j t_j |log t_j - log q_j + 1| <=
    3u (H + CE + 1). In all, u (12 ln n + 3 + 5 KL) a row (the sums over keys and rows run in
    double or add terms of one sign). The inputs' own GEMM rounding enters to first order only
    through t - q and log t - log q, which are small where the KL is (Pinsker), and is covered by
    the same terms. The two runs may err in opposite directions: twice the sum over rows."""
    u = 2.0 ** -24
    keys_seen = torch.cat([torch.arange(1, n + 1, dtype=torch.float64) for n in lengths])
    return 2 * u * ((12 * keys_seen.log() + 3).sum() + 5 * kl_sums)


@pytest.mark.parametrize("mode", ["dense", "warmup", "sparse"])
def test_packed_sample_equals_documents_run_one_by_one(one_rank, mode):
    model = _model(mode)
    total = sum(LENGTHS)
    g = torch.Generator().manual_seed(11)
    stream = torch.randint(0, 500, (total + 1,), generator=g)
    tokens, labels = stream[:-1], stream[1:]
    docs = torch.from_numpy(document_ids_from_lengths(LENGTHS, total))
    packed_loss, packed_kl = _run(model, tokens, labels, torch.from_numpy(position_ids(docs.numpy())),
                                  docs[None])

    start, kl_sum = 0, 0.0
    for n in LENGTHS:
        sl = slice(start, start + n)
        loss, kl = _run(model, tokens[sl], labels[sl], torch.arange(n), None)
        torch.testing.assert_close(packed_loss[sl], loss, rtol=1e-5, atol=1e-5)
        if kl is not None:
            kl_sum = kl_sum + kl * n
        start += n
    if mode == "dense":
        assert packed_kl is None
    else:
        # 4 decoder layers and the shared MTP layer (its input at position t embeds token
        # t + depth: the same as the lone document's only if the shift stops at the document end)
        assert packed_kl is not None and bool((packed_kl[:5] > 0).all())
        got, want = packed_kl[:5].double() * total, kl_sum[:5].double()
        bound = _kl_sum_rounding_bound(LENGTHS, want)
        assert bool(((got - want).abs() <= bound).all()), ((got - want).abs().tolist(), bound.tolist())
    # without the document ids the packed sample is one causal sequence: the losses differ
    cross = _run(model, tokens, labels, torch.arange(total), None)[0]
    assert not torch.allclose(cross[LENGTHS[0]:], packed_loss[LENGTHS[0]:], rtol=1e-3, atol=1e-4)


def test_sparse_topk_never_picks_another_documents_key(one_rank):
    model = _model("sparse")
    total = sum(LENGTHS)
    tokens = torch.randint(0, 500, (total,), generator=torch.Generator().manual_seed(2))
    docs = torch.from_numpy(document_ids_from_lengths(LENGTHS, total))
    with TopkProbe(model) as probe:
        _run(model, tokens, tokens, torch.arange(total), docs[None])
    core = model.decoder.layers[-1].self_attention.core_attention
    idx, valid = probe.latest[core]  # query rows 8.. (the first 8 see at most 8 keys: dense)
    query_doc = docs[8:][None, :, None].expand_as(idx)
    assert bool(valid.any())
    assert bool((docs[idx][valid] == query_doc[valid]).all())
    assert bool((idx[valid] <= torch.arange(8, total)[None, :, None].expand_as(idx)[valid]).all())
    # every query sees min(topk, its position in the document + 1) keys
    in_doc = torch.from_numpy(np.concatenate([np.arange(n) for n in LENGTHS]))[8:]
    assert valid[0].sum(-1).tolist() == torch.clamp(in_doc + 1, max=8).tolist()


def _mtp_losses(model, tokens, labels, positions, document_ids):
    """Each MTP depth's loss (loss-token mean) of one training-mode forward."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()
    model.train()
    model(tokens[None], positions[None], document_ids, labels=labels[None],
          loss_mask=torch.ones(1, len(tokens)))
    _kl_per_layer()
    return MTPLossLoggingHelper.tracker["loss_values"].clone()


def test_mtp_targets_stay_inside_documents(one_rank):
    """Depth d at position t predicts token t + d + 1: in a packed sample the last d positions of
    each document have no target in it and carry no loss, exactly as the lone document's last d
    positions (megatron's roll would otherwise train them on the next document's tokens)."""
    model = _model("dense")
    total = sum(LENGTHS)
    stream = torch.randint(0, 500, (total + 1,), generator=torch.Generator().manual_seed(5))
    tokens, labels = stream[:-1], stream[1:]
    docs = torch.from_numpy(document_ids_from_lengths(LENGTHS, total))
    packed = _mtp_losses(model, tokens, labels, torch.from_numpy(position_ids(docs.numpy())), docs[None])
    depths = torch.arange(1, packed.numel() + 1, dtype=torch.float64)
    want_sum, start = torch.zeros_like(depths), 0
    for n in LENGTHS:
        sl = slice(start, start + n)
        want_sum += _mtp_losses(model, tokens[sl], labels[sl], torch.arange(n), None).double() * (n - depths)
        start += n
    per_depth_tokens = sum(n - depths for n in LENGTHS)
    torch.testing.assert_close(packed.double() * per_depth_tokens, want_sum, rtol=1e-5, atol=1e-6)
    # megatron's own shift over the packed sample differs: it crosses the document boundaries
    # (a micro-batch without document ids)
    crossing = _mtp_losses(model, tokens, labels, torch.from_numpy(position_ids(docs.numpy())), None)
    assert not torch.allclose(crossing, packed, rtol=1e-3)
