"""A stream's first samples against the length its index is built for (``num_samples``): the
blend's corpus order and the ``best_fit`` layout are prefix-stable, megatron's concat indices are
not once a corpus's epoch count changes -- why a resumed stage must keep its stream's length
(:func:`pretrain.config.resume_changes.stream_change`)."""

from __future__ import annotations

import numpy as np
import pytest

from data_pipeline.build import build_mixture
from tests.support.data import SHARD_DOCS, data_cfg, write_corpus

N = 166  # corpus a (concat, weight 0.6) is built for ceil(ceil(0.6 N) x 1.02) = 102 samples: one epoch


@pytest.fixture(scope="module")
def streams(tmp_path_factory):
    """Samples [0, N) of the blend a (concat) + b (best_fit) at sequence length 64, built for
    N (a: one epoch of its 102), N + 1 (a: two, the second shuffled apart), 200 (the same two)
    and 2 N (a: two, shuffled together)."""
    tmp = tmp_path_factory.mktemp("stream")
    outputs = {n: write_corpus(tmp / "corpora", n, d, seed=i) for i, (n, d) in enumerate(SHARD_DOCS.items())}
    cfg = data_cfg(limit=1000, packing_b="best_fit")
    out = {}
    for length in (N, N + 1, 200, 2 * N):
        train, _ = build_mixture(cfg, outputs, 64, 1234, str(tmp / f"run{length}"), 512, num_samples=length,
                                 valid_samples=8)
        out[length] = (train.dataset_ids(0, N), np.stack([train[i]["tokens"].numpy() for i in range(N)]))
    return out


def test_the_blend_order_and_packed_samples_keep_their_prefix(streams):
    ids, tokens = streams[N]
    assert np.bincount(ids).tolist() == [100, 66]  # a, b
    for length in (N + 1, 200, 2 * N):
        assert np.array_equal(streams[length][0], ids)
        assert np.array_equal(streams[length][1][ids == 1], tokens[ids == 1])  # b: best_fit


def test_concat_samples_are_reordered_when_the_epoch_count_changes(streams):
    ids, tokens = streams[N]
    a = ids == 0

    def differ(length):
        return int((streams[length][1][a] != tokens[a]).any(axis=1).sum())

    print({length: differ(length) for length in (N + 1, 200, 2 * N)})
    assert differ(N + 1) >= 95 and differ(2 * N) >= 95  # of a's 100
    assert np.array_equal(streams[200][1], streams[N + 1][1])  # the same epochs: the same order
