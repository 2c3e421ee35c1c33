"""DSA modes on the tiny GLM-5 through the real training entry point: warm-up trains only the
indexer (everything else bit-identical, the KL falls) and sparse training changes every weight.
(Sparse mode under TP2 and CP against one rank: tests/distributed/test_parity.py.)"""

import pytest
import torch

from tests.support.launch import checkpoint_tensors, read_metrics, run_train

INDEXER = ".indexer."


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """30 dense steps so attention is peaked and the indexer has something to learn."""
    root = tmp_path_factory.mktemp("dsa")
    run_train([f"trainer.run_dir={root / 'dense'}", "trainer.steps=30", "model.dsa.mode=dense"])
    return root, root / "dense" / "checkpoints" / "iter_0000030"


@pytest.fixture(scope="module")
def warmed_up(pretrained):
    root, ckpt = pretrained
    run_dir = root / "warmup"
    run_train([f"trainer.run_dir={run_dir}", "trainer.steps=8", "model.dsa.mode=warmup",
               f"checkpoint.init_from={ckpt}", "optimizer.lr=5e-3", "optimizer.min_lr=2e-4"])
    return run_dir, run_dir / "checkpoints" / "iter_0000008"


@pytest.mark.heavy
def test_warmup_trains_only_the_indexer_and_kl_falls(pretrained, warmed_up, tmp_path):
    _, start = pretrained
    run_dir, end = warmed_up
    before = checkpoint_tensors(start, tmp_path)
    after = checkpoint_tensors(end, tmp_path)
    weights = [k for k in before if not k.startswith(("optimizer", "rng"))]
    indexer = [k for k in weights if INDEXER in k]
    others = [k for k in weights if INDEXER not in k]
    assert len(indexer) == 5 * 5 and len(others) > 50  # 4 layers + MTP, 5 tensors each
    for k in others:  # incl. the routers' expert_bias (aux-loss-free update is off in warm-up)
        assert torch.equal(before[k], after[k]), k
    for k in indexer:
        assert not torch.equal(before[k], after[k]), k
    kl = [r["indexer_kl"] for r in read_metrics(str(run_dir))]
    assert kl[0] > 1e-3, kl  # the pretrained attention differs from the untrained indexer
    assert sum(kl[-3:]) / 3 < 0.8 * sum(kl[:3]) / 3, kl  # each step's KL is on another batch: noisy


@pytest.mark.heavy
def test_sparse_training_changes_every_weight(warmed_up, tmp_path):
    _, start = warmed_up
    run_dir = start.parent.parent.parent / "sparse"
    run_train([f"trainer.run_dir={run_dir}", "trainer.steps=3", "model.dsa.mode=sparse",
               f"checkpoint.init_from={start}"])
    before = checkpoint_tensors(start, tmp_path)
    after = checkpoint_tensors(run_dir / "checkpoints" / "iter_0000003", tmp_path)
    weights = [k for k in before if not k.startswith(("optimizer", "rng"))]
    changed = [k for k in weights if not torch.equal(before[k], after[k])]
    assert set(changed) == set(weights)
    assert all(r["indexer_kl"] > 0 for r in read_metrics(str(run_dir)))
