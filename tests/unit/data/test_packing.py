"""Long-context packing: best-fit equals a naive reference, trajectories are split only when longer
than the sequence, utilisation on the sample agent corpus at 8K, and per-sample document
structure: positions restart per document, no token attends across a document (checked on the
mask, on real attention outputs, and against megatron's own EOD-based masks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from data_pipeline.build import build_datasets
from data_pipeline.packing import (attention_mask, best_fit, cu_seqlens, pack, packed_seq_params,
                                   position_ids, split_long)
from tests.support.data import default_data_cfg


def _naive_best_fit(lengths, capacity):
    rooms = []
    for n in sorted(lengths, reverse=True):
        fits = [i for i, r in enumerate(rooms) if r >= n]
        if fits:
            i = min(fits, key=lambda i: rooms[i])
            rooms[i] -= n
        else:
            rooms.append(capacity - n)
    return sorted(capacity - r for r in rooms)


def test_best_fit_matches_naive_reference():
    rng = np.random.RandomState(0)
    assert list(best_fit(np.array([5, 4, 3, 3, 1]), 8)) == [0, 1, 0, 1, 1]
    for trial in range(30):
        cap = int(rng.randint(8, 300))
        lengths = rng.randint(1, cap + 1, size=int(rng.randint(1, 200)))
        bins = best_fit(lengths, cap)
        fills = np.bincount(bins, weights=lengths).astype(int)
        assert fills.max() <= cap
        assert sorted(fills.tolist()) == _naive_best_fit(lengths.tolist(), cap)
    with pytest.raises(ValueError, match=r"item lengths must be in \[1, 8\]"):
        best_fit(np.array([9]), 8)


def test_split_long_covers_each_document_exactly():
    doc, off, n = split_long(np.array([3, 10, 4, 9]), 4)
    assert doc.tolist() == [0, 1, 1, 1, 2, 3, 3, 3]
    assert off.tolist() == [0, 0, 4, 8, 0, 0, 4, 8] and n.tolist() == [3, 4, 4, 2, 4, 4, 4, 1]


def _agent_shards(seq_length, run_dir):
    cfg = default_data_cfg(mixtures={"default": {"agent": 1.0}})
    train, _ = build_datasets(cfg, seq_length, 1234, str(run_dir), 512, num_samples=1)
    return train.dataset.datasets  # one CorpusDataset per shard, one epoch of packed sequences


def test_agent_corpus_packs_at_8k_with_high_utilisation(tmp_path):
    capacity = 8192 + 1
    shards = _agent_shards(8192, tmp_path)
    pad = shards[0].config.tokenizer.fill
    real = total = 0
    for ds in shards:
        lengths = ds.dataset.sequence_lengths
        layout = ds.packed
        for d in np.asarray(ds.indices):  # whole unless longer than the sequence, then full chunks
            items = np.flatnonzero(layout["doc"] == d)
            pieces = sorted(zip(layout["offset"][items], layout["length"][items]))
            if lengths[d] <= capacity:
                assert pieces == [(0, lengths[d])]
            else:
                assert [o for o, _ in pieces] == list(range(0, lengths[d], capacity))
                assert sum(n for _, n in pieces) == lengths[d]
        assert len(ds) == len(layout["bin_offsets"]) - 1
        for i in range(len(ds)):
            s = ds[i]
            window = torch.cat([s["tokens"], s["labels"][-1:]])
            real += int((window != pad).sum())
            total += capacity
    utilisation = real / total
    print(f"agent packing utilisation at 8K: {utilisation:.4f} over {total // capacity} sequences")
    assert utilisation >= 0.95
    assert any((lengths > capacity).any() for lengths in [ds.dataset.sequence_lengths for ds in shards])


def test_packed_samples_never_attend_across_documents(tmp_path):
    ds = _agent_shards(2048, tmp_path)[0]
    eod = ds.config.tokenizer.eod
    checked = samples = 0
    for i in range(len(ds)):
        s = ds[i]
        doc, pos = s["document_ids"], s["position_ids"]
        if doc.max() < 2 and samples:
            continue
        samples += 1
        if samples > 12:
            break
        assert doc[0] == 0 and (torch.diff(doc) >= 0).all()
        for d in doc.unique():
            where = torch.nonzero(doc == d).flatten()
            assert (where == torch.arange(where[0], where[-1] + 1)).all()  # contiguous
            assert (pos[where] == torch.arange(len(where))).all()  # positions restart
        allowed = ~attention_mask(doc[None])[0, 0]
        same = doc[:, None] == doc[None, :]
        causal = torch.ones(2048, 2048, dtype=torch.bool).tril()
        assert torch.equal(allowed, same & causal)
        assert torch.equal(allowed.sum(1), pos + 1)  # each token sees exactly its document's prefix
        # targets in the next document or in padding are never trained on
        boundary = torch.nonzero(torch.diff(doc)).flatten()
        assert (s["loss_mask"][boundary] == 0).all()
        assert (s["loss_mask"][s["labels"] == ds.config.tokenizer.fill] == 0).all()
        assert (s["tokens"][boundary] == eod).all()  # every packed item ends its document with EOD
        checked += len(boundary)
    assert checked > 20 and ds.loss_masks is not None


def test_attention_output_of_a_document_ignores_the_others(tmp_path):
    ds = _agent_shards(2048, tmp_path)[0]
    s = next(ds[i] for i in range(len(ds)) if ds[i]["document_ids"].max() >= 3)
    doc = s["document_ids"]
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, 2048, 16, dtype=torch.float64) for _ in range(3))
    allowed = ~attention_mask(doc[None])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    first = doc == 0
    k2, v2 = k.clone(), v.clone()
    k2[..., first, :] += 5.0
    v2[..., first, :] -= 3.0
    out2 = F.scaled_dot_product_attention(q, k2, v2, attn_mask=allowed)
    assert torch.equal(out[..., ~first, :], out2[..., ~first, :])
    assert not torch.allclose(out[..., first, :], out2[..., first, :])
    for d in doc.unique().tolist():
        idx = torch.nonzero(doc == d).flatten()
        alone = F.scaled_dot_product_attention(q[..., idx, :], k[..., idx, :], v[..., idx, :], is_causal=True)
        torch.testing.assert_close(out[..., idx, :], alone)


def test_concat_samples_match_megatron_eod_masks(tmp_path):
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    cfg = default_data_cfg(mixtures={"default": {"math": 1.0}})
    train, _ = build_datasets(cfg, 256, 1234, str(tmp_path), 512, num_samples=64)
    eod = train.dataset.datasets[0].config.tokenizer.eod
    resets = 0
    for i in range(20):
        s = train[i]
        mask, loss, pos = _get_ltor_masks_and_position_ids(s["tokens"], eod, True, True, True, True)
        assert torch.equal(pos, s["position_ids"])
        assert torch.equal(mask, attention_mask(s["document_ids"][None])[0])
        assert torch.equal(loss, s["loss_mask"])  # eod_mask_loss: no target across a boundary
        resets += int((s["position_ids"] == 0).sum())
    assert resets > 40  # math documents are short: several per 256-token window


def test_cu_seqlens_and_packed_seq_params(tmp_path):
    ds = _agent_shards(512, tmp_path)[0]
    batch = torch.stack([ds[0]["document_ids"], ds[1]["document_ids"]])
    cu = cu_seqlens(batch)
    lengths = [int((row == d).sum()) for row in batch for d in row.unique()]
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == 1024
    assert torch.diff(cu).tolist() == lengths
    params = packed_seq_params(batch)
    assert params.qkv_format == "thd" and params.max_seqlen_q == max(lengths)
    assert torch.equal(params.cu_seqlens_q, cu) and torch.equal(params.cu_seqlens_kv, cu)
    assert position_ids(np.array([[0, 0, 1, 1, 1, 2]])).tolist() == [[0, 1, 0, 1, 2, 0]]


def test_pack_is_deterministic_and_seeded():
    lengths = np.random.RandomState(1).randint(1, 5000, size=400)
    a, b, c = pack(lengths, 8193, 7), pack(lengths, 8193, 7), pack(lengths, 8193, 8)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["doc"], c["doc"])
    assert np.array_equal(np.bincount(a["doc"], weights=a["length"]), lengths)
