"""megatron's fused vocab-parallel cross entropy (``parallel.cross_entropy_loss_fusion``) is
plain torch, so it runs on CPU ranks: in bf16 (the only precision it is allowed in -- it rounds
the logits' gradient to bf16, which an fp32 run would not) it trains bit for bit like megatron's
unfused cross entropy, on one rank and across the TP2 vocab split."""

import pytest

from tests.support.launch import read_metrics, run_train

COMMON = ["trainer.steps=2", "precision=bf16", "checkpoint.save_at_end=false"]
TP2 = ["parallel.tp=2", "parallel.sequence_parallel=true"]


@pytest.mark.heavy
@pytest.mark.parametrize("nproc, layout", [(1, []), (2, TP2)], ids=["one_rank", "tp2"])
def test_fused_cross_entropy_trains_like_the_unfused_one_in_bf16(tmp_path, nproc, layout):
    runs = {}
    for fused in (False, True):
        run_dir = tmp_path / f"fused_{fused}"
        run_train([*COMMON, *layout, f"parallel.cross_entropy_loss_fusion={str(fused).lower()}",
                   f"trainer.run_dir={run_dir}"], nproc=nproc)
        runs[fused] = read_metrics(str(run_dir))
    assert len(runs[True]) == len(runs[False]) == 2
    for a, b in zip(runs[False], runs[True]):
        for key in ("lm_loss", "mtp_loss", "loss", "grad_norm"):
            assert b[key] == a[key], (a["step"], key, a[key], b[key])
