"""Bad input to ``python -m pretrain.train`` gets one line (issue 36): every config error prints
one ``error:`` line naming the field and its value (a list under it when a config has several
problems), exits 1 with no traceback, and nothing is written -- no run dir, nothing in the
current directory, an existing file left as it was. A checkpoint of another model given as
``checkpoint.init_from`` is refused the same way, from the checkpoint's metadata, before the run
dir exists.

Every case is one ``python -m pretrain.train`` process (each stops at validation: it is the
imports' time, ~3 s), from an empty current directory that must stay empty; they run one after
another on the test's core, next to the one checkpoint run started first.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.heavy  # one training-entry subprocess per bad input

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TIMEOUT_S = 300

#: case -> (overrides, what the error must name). ``{tmp}``: the case's folder; each run's
#: ``trainer.run_dir`` is ``{tmp}/run`` unless the case sets it.
CASES = {
    "negative_steps": (["trainer.steps=-1"], ["trainer.steps=-1"]),
    "zero_tp": (["parallel.tp=0"], ["parallel.tp=0 must be >= 1"]),
    "zero_dsa_topk": (["model.dsa.topk=0"], ["model.dsa.topk=0"]),
    "sequence_too_long": (["curriculum=none", "trainer.seq_length=8192"],
                          ["trainer.seq_length=8192 exceeds model.max_position_embeddings=4096"]),
    "nan_lr": (["curriculum=none", "optimizer.lr=nan"], ["optimizer.lr=nan must be a finite number"]),
    "inf_lr": (["curriculum=none", "optimizer.lr=inf"], ["optimizer.lr=inf must be a finite number"]),
    "other_lrs_not_finite": (
        ["curriculum=none", "optimizer.min_lr=nan", "scheduler.init_lr=inf"],
        ["optimizer.min_lr=nan must be a finite number", "scheduler.init_lr=inf must be a finite number"]),
    "stage_lrs_not_finite": (
        ["curriculum.stages.0.lr.peak=nan", "curriculum.stages.3.lr.end=inf"],
        ["curriculum.stages[0] (pretrain_general).lr.peak=nan must be a finite number",
         "curriculum.stages[3] (extend_512).lr.end=inf must be a finite number"]),
    "empty_run_dir": (["trainer.run_dir="], ["trainer.run_dir='' is empty"]),
    "recipe_on_another_size": (["recipe=glm5_tiny_cpu", "cluster.name=h100_80gb", "cluster.nodes=1"],
                               ["cluster.nodes=1 x 8 GPUs per node (h100_80gb) is 8 ranks, this launch has 1"]),
    # Hydra's own refusals, as one line too
    "unknown_key": (["trainer.stepz=3"], ["Could not override 'trainer.stepz'", "Key 'stepz' not in 'TrainerConfig'"]),
    "unknown_option": (["parallel=nonexistent"], ["Could not find 'parallel/nonexistent'",
                                                  "Available options in 'parallel': cp2, cp2_tp2,"]),
    "wrong_type": (["trainer.steps=abc"], ["trainer.steps=abc", "'abc' of type 'str' could not be converted to Integer"]),
    "override_syntax": (["trainer.steps=[1"], ["no viable alternative at input '[1'"]),
    "run_dir_is_cwd": (["trainer.run_dir=."], ["trainer.run_dir='.' is the current directory {tmp}/cwd"]),
    "run_dir_is_a_file": (["trainer.run_dir={tmp}/notes.txt"],
                          ["trainer.run_dir='{tmp}/notes.txt': {tmp}/notes.txt exists and is not a folder"]),
    "init_from_other_shape": (
        ["checkpoint.init_from={ckpt}", "model.hidden_size=64"],
        ["checkpoint.init_from={ckpt}: embedding.word_embeddings.weight has shape (512, 128) in "
         "{ckpt}/checkpoints/iter_0000001 but (512, 64) in the configured model"]),
}
#: a 1-step run of the tiny model whose checkpoint ``init_from_other_shape`` starts from
CHECKPOINT_RUN = ["curriculum=none", "trainer.steps=1", "trainer.seq_length=32", "trainer.micro_batch_size=4",
                  "trainer.global_batch_size=4", "scheduler.warmup_steps=0", "logger.progress_bar=false"]
NOTES = "keep me\n"


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HYDRA_FULL_ERROR")
           and not k.startswith("SLURM_")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["GLM5_DATA_CACHE"] = env.get("GLM5_DATA_CACHE", os.path.join(REPO, ".cache", "data"))
    env["WANDB_MODE"] = "disabled"
    return env


def _start(args: list[str], cwd: str, log: str) -> subprocess.Popen:
    with open(log, "w") as out:  # a file, not a pipe: the checkpoint run's output is read at its end
        return subprocess.Popen([sys.executable, "-m", "pretrain.train", "logger.wandb.mode=disabled", *args],
                                cwd=cwd, env=_env(), stdout=out, stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen, log: str) -> tuple[int, str]:
    try:
        proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    with open(log) as f:
        return proc.returncode, f.read()


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """``result(case)`` runs a case's process (once) and returns ``(exit status, output, seconds,
    the case's folder, the checkpoint run's folder)``; the checkpoint run starts at once."""
    root = tmp_path_factory.mktemp("bad_input")
    ckpt = root / "ckpt_run"
    ckpt_log = str(root / "ckpt_run.log")
    ckpt_proc = _start([f"trainer.run_dir={ckpt}", *CHECKPOINT_RUN], REPO, ckpt_log)
    done = {}

    def run(case):
        tmp = root / case
        (tmp / "cwd").mkdir(parents=True)
        (tmp / "notes.txt").write_text(NOTES)
        overrides, _ = CASES[case]
        args = [a.format(tmp=tmp, ckpt=ckpt) for a in overrides]
        if not any(a.startswith("trainer.run_dir=") for a in args):
            args.append(f"trainer.run_dir={tmp / 'run'}")
        began = time.monotonic()
        status, out = _finish(_start(args, str(tmp / "cwd"), str(tmp / "log")), str(tmp / "log"))
        return status, out, time.monotonic() - began, tmp, ckpt

    def result(case):
        if case not in done:
            if case == "init_from_other_shape":
                status, out = _finish(ckpt_proc, ckpt_log)
                assert status == 0 and (ckpt / "checkpoints" / "iter_0000001").is_dir(), out[-3000:]
            done[case] = run(case)
        return done[case]

    yield result
    if ckpt_proc.poll() is None:
        ckpt_proc.kill()


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gets_one_error_line_and_writes_nothing(launched, case):
    status, out, seconds, tmp, ckpt = launched(case)
    print(f"{case}: {seconds:.1f} s\n{out}")
    assert status == 1, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    errors = [i for i, line in enumerate(out.splitlines()) if line.startswith("error:")]
    assert len(errors) == 1, out[-3000:]
    lines = out.splitlines()[errors[0]:]
    block = "\n".join([lines[0]] + [ln for ln in lines[1:] if ln.startswith("  - ")])  # several problems: a list
    for expected in CASES[case][1]:
        assert expected.format(tmp=tmp, ckpt=ckpt) in block, out[-3000:]
    # nothing written: no run dir, nothing in the current directory, the file as it was
    assert sorted(os.listdir(tmp)) == ["cwd", "log", "notes.txt"]
    assert os.listdir(tmp / "cwd") == []
    assert (tmp / "notes.txt").read_text() == NOTES


def test_nan_or_inf_lr_is_not_blamed_on_min_lr(launched):
    for case in ("nan_lr", "inf_lr"):
        _, out, _, _, _ = launched(case)
        assert "min_lr" not in out, out


def test_a_single_problem_is_one_line(launched):
    _, out, _, _, _ = launched("zero_tp")
    assert out.strip().splitlines()[-1] == "error: invalid curriculum: every stage: parallel.tp=0 must be >= 1"


def test_muon_lrs_not_finite_are_named():
    """Muon's own LRs (in-process: ``check_muon`` imports megatron-core for Muon runs)."""
    import dataclasses

    from pretrain.config.schema import OptimizerConfig, SchedulerConfig
    from pretrain.optim.schedule import check_schedule

    opt = OptimizerConfig(name="muon")
    bad = dataclasses.replace(opt, muon=dataclasses.replace(opt.muon, lr=float("nan"), min_lr=float("-inf")))
    assert check_schedule(SchedulerConfig(), bad, 100) == [
        "optimizer.muon.lr=nan must be a finite number", "optimizer.muon.min_lr=-inf must be a finite number"]
    # the Muon LRs default to the Adam ones: a NaN there is named once, as optimizer.lr
    assert check_schedule(SchedulerConfig(), dataclasses.replace(opt, lr=float("nan")), 100) == [
        "optimizer.lr=nan must be a finite number"]


def test_a_zero_or_nan_lr_under_a_muon_lr_ratio_is_named_not_divided_by():
    """Stages scale ``optimizer.muon.lr`` by its ratio to ``optimizer.lr`` (a ZeroDivisionError
    traceback once)."""
    from pretrain.config.schema import compose, to_run_config
    from pretrain.curriculum import plan

    for lr in ("0", "nan"):
        rc = to_run_config(compose(["optimizer.name=muon", "optimizer.muon.lr=0.01", f"optimizer.lr={lr}"]))
        _, problems = plan(rc)
        assert problems == [f"optimizer.lr={float(lr)} must be a finite number > 0: each stage's "
                            f"optimizer.muon.lr keeps its ratio to it (optimizer.muon.lr=0.01)"]
