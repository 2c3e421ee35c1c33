"""Validation loss per data category (issue 16): a held-out set split evenly over the mixture's
categories, each sample's loss sum and tokens reported by the loss function, attributed to its
category in micro-batch order; ``valid_lm_loss/<category>`` in metrics.jsonl, W&B, the console
and the curriculum plot, and ``valid_lm_loss`` the mixture's shares of them."""

from __future__ import annotations

import glob

import numpy as np
import pytest
import torch

from data_pipeline.batches import micro_batch_samples, micro_batches
from data_pipeline.build import build_datasets
from data_pipeline.config import DataConfigError
from pretrain.step import lm_loss_func, validation_metrics, with_sample_sums
from pretrain.reporting.metrics import category_losses
from tests.support.launch import read_metrics, run_train
from tests.support.data import default_data_cfg

SHARES = {"general": 0.2, "code": 0.3, "math": 0.3, "agent": 0.2}  # conf/data/samples.yaml's default


def test_stratified_set_has_each_category_in_equal_parts(tmp_path):
    _, valid = build_datasets(default_data_cfg(), 64, 1234, str(tmp_path), 512, num_samples=16, valid_samples=10)
    assert valid.categories == ["agent", "code", "general", "math"]
    assert valid.category_shares == pytest.approx({c: SHARES[c] for c in valid.categories})
    indices, labels = valid.stratified(10)
    assert labels == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3] and len(set(indices)) == 10
    of_sample = np.asarray(valid._category_of_dataset)[valid.dataset_ids(0, len(valid))]
    assert [int(of_sample[i]) for i in indices] == labels
    for c, want in enumerate((3, 3, 2, 2)):  # samples with loss tokens first, as many as there are
        has_loss = [float(valid[i]["loss_mask"].sum()) > 0 for i in np.flatnonzero(of_sample == c)]
        chosen = [float(valid[i]["loss_mask"].sum()) > 0 for i, lab in zip(indices, labels) if lab == c]
        assert sum(chosen) == min(want, sum(has_loss)) > 0
    assert valid.stratified(10) == (indices, labels)
    with pytest.raises(DataConfigError, match=r"3 validation samples cannot hold one of each of the 4 categories"):
        valid.stratified(3)


def test_sample_sums_add_up_to_the_loss_and_follow_micro_batches():
    torch.manual_seed(0)
    out, mask = torch.rand(3, 8), (torch.rand(3, 8) > 0.3).float()
    loss, tokens, reports = with_sample_sums(lambda o: lm_loss_func(mask, o), mask, out)
    per = reports["lm_samples"]
    assert per.shape == (2, 3) and torch.allclose(per.sum(1), reports["lm"])
    assert torch.allclose(per[0], (out * mask).sum(1)) and int(tokens) == int(mask.sum())
    data = [{"x": torch.tensor([i])} for i in range(16)]
    for rank in (0, 1):
        numbers = micro_batch_samples(4, 8, 2, rank, 2)
        assert [b["x"].flatten().tolist() for b in micro_batches(data, 4, 8, 2, rank, 2)] == numbers
    assert micro_batch_samples(4, 8, 2, 1, 2) == [[6, 7], [10, 11]]


def test_validation_metrics_weigh_categories_by_the_mixture():
    m = validation_metrics([[20.0, 10.0], [9.0, 3.0], [0.0, 0.0]], ["code", "general", "math"],
                           {"code": 0.5, "general": 0.3, "math": 0.2})
    assert m == pytest.approx({"valid_lm_loss/code": 2.0, "valid_lm_loss/general": 3.0,
                               "valid_lm_loss": (0.5 * 2.0 + 0.3 * 3.0) / 0.8})


def test_plot_gets_a_panel_per_category(tmp_path):
    from PIL import Image

    from pretrain.reporting.plots import plot_curriculum

    rows = [{"step": s, "stage": "a" if s < 3 else "b", "consumed_tokens": 100 * s, "loss": 5.0 - s / 10,
             "lm_loss": 4.9 - s / 10, "lr": 1e-3, "seq_length": 64} for s in range(1, 6)]
    plot_curriculum(rows, str(tmp_path / "plain.png"))
    for r in rows[1::2]:
        r.update({"valid_lm_loss": 4.0, "valid_lm_loss/code": 4.2, "valid_lm_loss/math": 3.8})
    plot_curriculum(rows, str(tmp_path / "valid.png"))
    heights = [Image.open(tmp_path / f).size[1] for f in ("plain.png", "valid.png")]
    assert heights[1] == pytest.approx(heights[0] * 6 / 5, rel=0.02)


@pytest.mark.heavy
def test_run_logs_validation_loss_per_category(tmp_path):
    from tests.support.wandb_offline import history, records

    run_dir = tmp_path / "run"
    run_train([f"trainer.run_dir={run_dir}", "logger.wandb.mode=offline", "trainer.steps=2", "trainer.eval_every=2",
               "trainer.eval_samples=8", "trainer.global_batch_size=8", "trainer.micro_batch_size=4",
               "trainer.seq_length=64", "checkpoint.save_at_end=false"])
    rec = read_metrics(str(run_dir))[-1]
    per = {c: rec[f"valid_lm_loss/{c}"] for c in SHARES}
    assert all(np.isfinite(v) and 3.0 < v < 8.0 for v in per.values()) and len(set(per.values())) == 4
    assert rec["valid_lm_loss"] == pytest.approx(sum(SHARES[c] * per[c] for c in SHARES), rel=1e-12)
    assert "valid_lm_loss" not in read_metrics(str(run_dir))[0]
    logged = history(records(glob.glob(str(run_dir / "wandb" / "offline-run-*"))[0]))[2]
    assert {k: logged[k] for k in rec if k.startswith("valid_lm_loss")} == \
        {k: v for k, v in rec.items() if k.startswith("valid_lm_loss")}
    assert category_losses(rec) == " | " + " ".join(f"{c} {per[c]:.4f}" for c in sorted(SHARES))
