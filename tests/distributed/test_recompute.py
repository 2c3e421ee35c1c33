"""Activation recomputation (megatron's selective -- MLA up-projections and MoE -- and full)
changes memory, not numbers: the tiny model in sparse DSA mode trains to the same losses and
gradient norms as without it."""

import pytest

from tests.support.launch import read_metrics, run_train

COMMON = ["trainer.steps=3", "trainer.seq_length=128", "trainer.global_batch_size=4",
          "trainer.micro_batch_size=2", "model.dsa.mode=sparse", "model.dsa.topk=16",
          "checkpoint.save_at_end=false"]


@pytest.fixture(scope="module")
def without_recompute(tmp_path_factory):
    """The run both recompute modes are compared with (one run for both)."""
    run_dir = tmp_path_factory.mktemp("recompute") / "plain"
    run_train([*COMMON, f"trainer.run_dir={run_dir}"])
    return read_metrics(str(run_dir))


@pytest.mark.heavy
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_gives_the_same_training(tmp_path, without_recompute, recompute):
    run_train([*COMMON, f"trainer.run_dir={tmp_path / recompute}", f"model.recompute={recompute}"])
    want, have = without_recompute, read_metrics(str(tmp_path / recompute))
    assert len(want) == len(have) == 3
    for a, b in zip(want, have):
        for key in ("lm_loss", "mtp_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-6), (a["step"], key)
        # the KL (~3e-4) is a difference of O(1) sums: recomputed up-projections move it ~1e-9
        assert b["indexer_kl"] == pytest.approx(a["indexer_kl"], rel=1e-5, abs=1e-8), a["step"]


@pytest.mark.heavy
def test_full_recompute_trains_the_indexer_in_warmup(tmp_path):
    """Warm-up freezes everything but the indexer, the embedding included: under full
    recomputation the first layer's checkpoint then had no input needing a gradient, and no
    indexer trained (grad_norm 0, no KL)."""
    warmup = [*COMMON, "model.dsa.mode=warmup"]
    run_train([*warmup, f"trainer.run_dir={tmp_path / 'plain'}"])
    run_train([*warmup, f"trainer.run_dir={tmp_path / 'full'}", "model.recompute=full"])
    want, have = read_metrics(str(tmp_path / "plain")), read_metrics(str(tmp_path / "full"))
    assert len(want) == len(have) == 3
    assert all(a["grad_norm"] > 0 for a in want)
    for a, b in zip(want, have):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6), a["step"]
        assert b["indexer_kl"] == pytest.approx(a["indexer_kl"], rel=1e-5, abs=1e-8), a["step"]
