"""Resume with Muon state is exact: 6 steps of muon_split straight equal 3 steps, a SIGKILL and
a restart from the step-3 checkpoint (same losses, LR and grad norms bit for bit; bit-identical
final weights and optimizer state), on one rank and with the distributed optimizer on 2 ranks
(momentum sharded over DP, each rank saving its own shard)."""

import pytest
import torch

from tests.support.launch import assert_resumed_equals_straight, kill_after_checkpoint, run_train

STEPS = 6
COMMON = [f"trainer.steps={STEPS}", "trainer.global_batch_size=8", "trainer.micro_batch_size=4",
          "optimizer=muon_split", "optimizer.lr=0.003", "optimizer.min_lr=0.0003",
          "optimizer.muon.lr=0.003", "optimizer.muon.min_lr=0.0003"]
LAYOUTS = {"single": (1, []), "dp2_distopt": (2, ["parallel=dp2_distopt", "trainer.micro_batch_size=2"])}

pytestmark = pytest.mark.heavy


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kill_and_resume_with_muon_state(tmp_path, layout):
    nproc, extra = LAYOUTS[layout]
    common = COMMON + extra
    straight = tmp_path / "straight"
    run_train([*common, f"trainer.run_dir={straight}"], nproc=nproc)

    resumed = tmp_path / "resumed"
    overrides = [*common, f"trainer.run_dir={resumed}", "checkpoint.save_every=3"]
    kill_after_checkpoint(overrides, resumed / "checkpoints" / "latest", "iter_0000003", nproc)
    assert not (resumed / "checkpoints" / "iter_0000006").exists()
    assert run_train(overrides, nproc=nproc)["steps"] == STEPS

    w_straight, w_resumed = assert_resumed_equals_straight(straight, resumed, STEPS, tmp_path)
    if layout == "single":  # the optimizer state per parameter
        momentum = "optimizer.state.exp_avg.decoder.layers.1.self_attention.linear_kv_up_proj.weight"
        unused = momentum.replace("exp_avg", "exp_avg_sq")
        assert w_straight[momentum].abs().sum() > 0  # Muon's momentum buffer is saved ...
        assert not w_straight[unused].any()  # ... and its unused second-moment slot stayed zero (Muon, not Adam)
        adam_second = "optimizer.state.exp_avg_sq.embedding.word_embeddings.weight"
        assert w_straight[adam_second].abs().sum() > 0
    else:  # the distributed optimizer's per-rank format: its flat buckets, momentum saved
        flat = [k for k in w_straight if k.startswith("optimizer.distributed.") and k.endswith(".exp_avg")]
        assert flat and all(w_straight[k].abs().sum() > 0 for k in flat), flat
    for k in w_straight:  # weights and optimizer state
        assert torch.equal(w_straight[k], w_resumed[k]), k
