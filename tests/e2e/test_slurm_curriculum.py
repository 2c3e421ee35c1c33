"""``slurm/curriculum.sh`` submits one slurm/pretrain.sh job per stage, each stage afterok on the
previous one and restricted to its stage with ``curriculum.only``. Checked on the real cluster
with the jobs held (so nothing trains), then cancelled."""

import os
import subprocess

from tests.support.launch import REPO


def test_stages_are_chained_with_afterok(slurm, tmp_path):
    proc = subprocess.run(
        ["bash", os.path.join(REPO, "slurm", "curriculum.sh"), "--stages=warmup,main,long",
         "--hold", f"--output={tmp_path}/%x-%j.out", "--ntasks-per-node=1", "--gpus-per-node=0",
         "--cpus-per-task=1", "--", "trainer.name=chain"],
        cwd=REPO, env=slurm.env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    submitted = [line.split() for line in proc.stdout.splitlines()]
    try:
        assert [stage for stage, _ in submitted] == ["warmup", "main", "long"]
        previous = None
        for stage, job in submitted:
            info = slurm.job(job)
            assert info["JobName"] == f"glm5-{stage}"
            assert info["Command"] == os.path.join(REPO, "slurm", "pretrain.sh")
            expected = "(null)" if previous is None else f"afterok:{previous}(unfulfilled)"
            assert info["Dependency"] == expected, (stage, info["Dependency"])
            command = subprocess.run(["squeue", "-h", "-o", "%o", "-j", job], env=slurm.env,
                                     capture_output=True, text=True, timeout=30).stdout.split()
            assert command == [os.path.join(REPO, "slurm", "pretrain.sh"), "trainer.name=chain",
                               f"curriculum.only={stage}"]
            previous = job
    finally:
        subprocess.run(["scancel", *[job for _, job in submitted]], env=slurm.env, timeout=30)


def test_stage_names_come_from_the_composed_config(slurm, tmp_path):
    proc = subprocess.run(
        ["bash", os.path.join(REPO, "slurm", "curriculum.sh"), "--hold", f"--output={tmp_path}/%x-%j.out",
         "--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1", "--", "trainer.name=chain2",
         "curriculum=tiny"],
        cwd=REPO, env=slurm.env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    submitted = [line.split() for line in proc.stdout.splitlines()]
    try:
        assert [stage for stage, _ in submitted] == [
            "pretrain_general", "pretrain_code_reasoning", "extend_256", "extend_512", "extend_1024",
            "dsa_warmup", "dsa_sparse"]
    finally:
        subprocess.run(["scancel", *[job for _, job in submitted]], env=slurm.env, timeout=30)
