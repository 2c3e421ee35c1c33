"""Resume with Muon state is exact: 6 steps of muon_split straight equal 3 steps, a SIGKILL and
a restart from the step-3 checkpoint (same losses, LR and grad norms bit for bit; bit-identical
final weights and optimizer state), on one rank and with the distributed optimizer on 2 ranks
(momentum sharded over DP, saved fully reshardable)."""

import os
import signal
import subprocess
import time

import psutil
import pytest
import torch

from tests.launch import QUIET, REPO, checkpoint_tensors, read_metrics, run_train, train_command, train_env

STEPS = 6
COMMON = [f"trainer.steps={STEPS}", "trainer.global_batch_size=8", "trainer.micro_batch_size=4",
          "optimizer=muon_split", "optimizer.lr=0.003", "optimizer.min_lr=0.0003",
          "optimizer.muon.lr=0.003", "optimizer.muon.min_lr=0.0003"]
LAYOUTS = {"single": (1, []), "dp2_distopt": (2, ["parallel=dp2_distopt", "trainer.micro_batch_size=2"])}

pytestmark = pytest.mark.heavy


def _kill_tree(proc):
    """SIGKILL the launcher and every process under it (torchrun starts ranks in new sessions)."""
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for p in [psutil.Process(proc.pid), *tree] if proc.poll() is None else tree:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _kill_after_checkpoint(overrides, nproc, latest_file, wanted, timeout=600):
    proc = subprocess.Popen(train_command([*QUIET, *overrides], nproc), cwd=REPO, env=train_env(nproc),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            if latest_file.exists() and latest_file.read_text().strip() == wanted:
                return
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.02)
        raise AssertionError("no checkpoint appeared in time")
    finally:
        _kill_tree(proc)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kill_and_resume_with_muon_state(tmp_path, layout):
    nproc, extra = LAYOUTS[layout]
    common = COMMON + extra
    straight = tmp_path / "straight"
    run_train([*common, f"trainer.run_dir={straight}"], nproc=nproc)

    resumed = tmp_path / "resumed"
    overrides = [*common, f"trainer.run_dir={resumed}", "checkpoint.save_every=3"]
    _kill_after_checkpoint(overrides, nproc, resumed / "checkpoints" / "latest", "iter_0000003")
    assert not (resumed / "checkpoints" / "iter_0000006").exists()
    assert run_train(overrides, nproc=nproc)["steps"] == STEPS

    want, have = read_metrics(str(straight)), read_metrics(str(resumed))
    assert [r["step"] for r in have] == list(range(1, STEPS + 1))
    for a, b in zip(want, have):
        for key in ("loss", "lm_loss", "mtp_loss", "lr", "grad_norm", "consumed_tokens"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])

    w_straight = checkpoint_tensors(straight / "checkpoints" / "iter_0000006", tmp_path)
    w_resumed = checkpoint_tensors(resumed / "checkpoints" / "iter_0000006", tmp_path)
    assert w_straight.keys() == w_resumed.keys()
    momentum = "optimizer.state.exp_avg.decoder.layers.1.self_attention.linear_kv_up_proj.weight"
    unused = momentum.replace("exp_avg", "exp_avg_sq")
    assert w_straight[momentum].abs().sum() > 0  # Muon's momentum buffer is saved ...
    assert not w_straight[unused].any()  # ... and its unused second-moment slot stayed zero (Muon, not Adam)
    adam_second = "optimizer.state.exp_avg_sq.embedding.word_embeddings.weight"
    assert w_straight[adam_second].abs().sum() > 0
    for k in w_straight:  # weights and optimizer state
        assert torch.equal(w_straight[k], w_resumed[k]), k
