"""``sbatch slurm/pretrain.sh`` on a real (one-node) Slurm cluster, 4 CPU tasks with gloo:

- the run's per-step losses equal a direct ``torchrun`` run of the same config, and its offline
  W&B run (read back with wandb's own reader) holds every metrics.jsonl key with equal values;
- USR1 sent to the batch shell mid-run (as Slurm does before the time limit) -> checkpoint, exit
  75, ``scontrol requeue``, the requeued job resumes from ``latest`` and finishes: per-step
  losses equal the uninterrupted run, and both job attempts logged to one W&B run id;
- ``slurm/curriculum.sh`` submits one slurm/pretrain.sh job per stage, each afterok on the
  previous one and restricted to its stage with ``curriculum.only`` (checked with the jobs held, so
  nothing trains, then cancelled), with the recipe's ``cluster.nodes`` as the jobs' node count
  unless ``--nodes`` is given.

The tests share the session's cluster (tests/e2e/conftest.py), started by the first one, a
one-process test: the tests that train hold the rank slot and come last.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from tests.support import wandb_offline
from tests.support.launch import REPO, read_metrics, run_train

STEPS = 6
COMMON = [f"trainer.steps={STEPS}", "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
          "trainer.seq_length=64", "scheduler.warmup_steps=1", "logger.progress_bar=false",
          "logger.log_every=1", "curriculum=none"]
EXACT = ("loss", "lm_loss", "mtp_loss", "lr", "grad_norm", "consumed_tokens")


def _sbatch(slurm, tmp_path, name, overrides):
    log_dir = tmp_path / "logs"
    log_dir.mkdir(exist_ok=True)
    env = {"PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    args = ["--ntasks-per-node=4", "--cpus-per-task=1", "--gpus-per-node=0", "--time=00:20:00",
            f"--job-name={name}", f"--output={log_dir}/%x-%j.out",
            os.path.join(REPO, "slurm", "pretrain.sh"), *overrides]
    job = slurm.sbatch(args, env=env, cwd=REPO)
    return job, log_dir / f"{name}-{job}.out"


def _summary(log_path) -> dict:
    lines = [ln for ln in log_path.read_text().splitlines() if ln.startswith("{\"run_dir\"")]
    assert lines, log_path.read_text()[-4000:]
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same config under torchrun (4 gloo ranks, no Slurm)."""
    run_dir = tmp_path_factory.mktemp("torchrun") / "run"
    run_train([*COMMON, f"trainer.run_dir={run_dir}"], nproc=4)
    return read_metrics(str(run_dir))


def _assert_same_steps(want, have):
    assert [r["step"] for r in have] == list(range(1, STEPS + 1))
    for a, b in zip(want, have):
        for key in EXACT:
            assert a[key] == b[key], (a["step"], key, a[key], b[key])


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


@pytest.mark.heavy
@pytest.mark.all_cores  # a 4-task job
def test_sbatch_four_tasks_matches_torchrun(slurm, reference, tmp_path):
    run_dir = tmp_path / "run"
    job, log = _sbatch(slurm, tmp_path, "glm5-sbatch", [*COMMON, f"trainer.run_dir={run_dir}"])
    info = slurm.wait(job, timeout=600)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, log.read_text()[-4000:])
    assert info["NumTasks"] == "4"
    summary = _summary(log)
    assert summary["world_size"] == 4 and summary["steps"] == STEPS and not summary["preempted"]
    metrics = read_metrics(str(run_dir))
    _assert_same_steps(reference, metrics)

    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    recs = wandb_offline.records(str(offline))
    assert wandb_offline.run_id(recs) == (run_dir / "wandb" / "run_id").read_text()
    (run,) = [r["run"] for r in recs if r["type"] == "run"]
    assert run["config"]["update"]["trainer"]["steps"] == STEPS  # the resolved config
    logged = wandb_offline.history(recs)
    assert sorted(logged) == list(range(1, STEPS + 1))
    for rec in metrics:
        expected = {k: v for k, v in rec.items() if v is not None}
        assert expected.keys() <= logged[rec["step"]].keys(), expected.keys() - logged[rec["step"]].keys()
        for key in ("loss", "lm_loss", "mtp_loss", "grad_norm", "lr", "stage", "moe_load_imbalance",
                    "tokens_code", "consumed_tokens"):
            assert logged[rec["step"]][key] == expected[key], (rec["step"], key)


@pytest.mark.heavy
@pytest.mark.all_cores  # a 4-task job, twice
def test_usr1_preemption_requeues_and_resumes(slurm, reference, tmp_path):
    run_dir = tmp_path / "run"
    job, log = _sbatch(slurm, tmp_path, "glm5-preempt", [*COMMON, f"trainer.run_dir={run_dir}"])
    deadline = time.time() + 400
    while not (run_dir / "metrics.jsonl").exists() or len(read_metrics(str(run_dir))) < 2:
        info = slurm.job(job)
        assert info["JobState"] in ("PENDING", "RUNNING", "CONFIGURING"), (info, log.read_text()[-4000:])
        assert time.time() < deadline, "no second step within 400 s"
        time.sleep(0.5)
    slurm.signal_batch(job, "USR1")
    info = slurm.wait(job, timeout=600)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, text[-4000:])
    assert info["Restarts"] == "1", info
    assert "got SIGUSR1" in text and "requeueing job" in text, text[-4000:]

    summaries = [json.loads(ln) for ln in text.splitlines() if ln.startswith("{\"run_dir\"")]
    assert len(summaries) == 2, text[-4000:]
    first, final = summaries
    assert first["preempted"] and 2 <= first["steps"] < STEPS, first
    assert not final["preempted"] and final["steps"] == STEPS
    assert (run_dir / "checkpoints" / f"iter_{first['steps']:07d}" / "manifest.json").exists()
    _assert_same_steps(reference, read_metrics(str(run_dir)))

    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2, runs  # one per job attempt
    ids = {wandb_offline.run_id(wandb_offline.records(str(r))) for r in runs}
    assert ids == {(run_dir / "wandb" / "run_id").read_text()}
    resumed = wandb_offline.history(wandb_offline.records(str(runs[1])))
    assert sorted(resumed) == list(range(first["steps"] + 1, STEPS + 1))


def test_a_recipes_nodes_reach_sbatch(slurm, tmp_path):
    """Without --nodes, each stage's job asks for the recipe's cluster.nodes; --nodes wins."""
    args = ["--hold", f"--output={tmp_path}/%x-%j.out", "--ntasks-per-node=1", "--gpus-per-node=0",
            "--cpus-per-task=1"]
    recipe = ["--", "trainer.name=chain3", "recipe=glm5_tiny_cpu", "cluster.name=h100_80gb", "cluster.nodes=2"]
    script = os.path.join(REPO, "slurm", "curriculum.sh")
    for given, nodes in (([], "2"), (["--nodes=1"], "1")):
        proc = subprocess.run(["bash", script, "--stages=main", *given, *args, *recipe], cwd=REPO, env=slurm.env,
                              capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr
        job = proc.stdout.split()[1]
        try:
            assert slurm.job(job)["NumNodes"].split("-")[0] == nodes, slurm.job(job)
        finally:
            subprocess.run(["scancel", job], env=slurm.env, timeout=30)
