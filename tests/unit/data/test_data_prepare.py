"""A run's data prepared before its ranks start (issue 38): ``python -m data_pipeline.prepare``
builds every stage's sample index of the default (tiny) curriculum, as training builds them -- a
training start afterwards builds none, its datasets only load -- and a launch over several nodes
whose data is missing stops with one error line naming the stage and the prepare command,
before any process group exists (nothing written, no rank contacted).

Each case is a process of its own (the entry points as a user runs them); the corpora are the
shared sample cache's."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.heavy  # entry-point subprocesses (a few seconds each) and a training start

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TINY = ["curriculum=tiny", "logger.wandb.mode=disabled"]  #: the default run's curriculum, said out loud
STAGES = ["pretrain_general", "pretrain_code_reasoning", "extend_256", "extend_512", "extend_1024",
          "dsa_warmup", "dsa_sparse"]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "HYDRA_FULL_ERROR")


def _env(**launch: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith(("SLURM_", "TORCHELASTIC"))}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["GLM5_DATA_CACHE"] = env.get("GLM5_DATA_CACHE", os.path.join(REPO, ".cache", "data"))
    env["WANDB_MODE"] = "disabled"
    env["PYTHONWARNINGS"] = "ignore"
    return {**env, **launch}


def _run(module: str, args: list[str], timeout: float = 300, **launch: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=_env(**launch),
                          capture_output=True, text=True, timeout=timeout)


def _index_files(run_dir) -> dict:
    """Every file and folder under ``data_index/`` with its modification time."""
    root = os.path.join(run_dir, "data_index")
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            out[os.path.relpath(os.path.join(d, n), root)] = os.stat(os.path.join(d, n)).st_mtime_ns
    return out


def _stage_index_dirs(run_dir, *overrides: str) -> dict:
    """Each stage's index folder as the run computes it (pretrain.data_prep.stage_request)."""
    from data_pipeline.readiness import index_dir
    from pretrain.config.schema import compose
    from pretrain.config.validation import plan_run
    from pretrain.data_prep import stage_request
    from pretrain.config.command_line import resolve

    args = [f"trainer.run_dir={run_dir}", *TINY, *overrides]
    rc, _, changes = resolve(compose(args), args)
    return {st.name: index_dir(stage_request(st), str(run_dir)) for st in plan_run(rc, 1, changes)}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A run dir prepared by ``python -m data_pipeline.prepare``, its output and its files."""
    run_dir = tmp_path_factory.mktemp("prepare") / "run"
    proc = _run("data_pipeline.prepare", [f"trainer.run_dir={run_dir}", *TINY])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run_dir, proc.stdout, _index_files(run_dir)


def test_prepare_builds_every_stage_s_index(prepared):
    run_dir, out, files = prepared
    lines = [ln for ln in out.splitlines() if ln.startswith("prepare: stage ")]
    assert [ln.split("'")[1] for ln in lines] == STAGES  # one line per stage, in order
    dirs = _stage_index_dirs(run_dir)
    assert set(dirs) == set(STAGES)
    for name, line in zip(STAGES, lines):
        assert line.endswith(f"({dirs[name]})")
        assert os.path.exists(os.path.join(dirs[name], ".complete"))
    # dsa_warmup and dsa_sparse read the same stream with the same held-out set: one index
    assert dirs["dsa_warmup"] == dirs["dsa_sparse"] and len(set(dirs.values())) == 6
    assert sorted(os.listdir(run_dir / "data_index")) == sorted({os.path.basename(d) for d in dirs.values()})
    built = [ln for ln in lines if ": built sample index [" in ln]
    assert len(built) == 6 and "the same data as stage 'dsa_warmup'" in lines[-1]

    again = _run("data_pipeline.prepare", [f"trainer.run_dir={run_dir}", *TINY])
    assert again.returncode == 0
    assert sum(": already prepared [" in ln for ln in again.stdout.splitlines()) == 6
    assert _index_files(run_dir) == files  # nothing rebuilt or touched


def test_a_training_start_after_prepare_builds_nothing(prepared, tmp_path):
    """The first stage's datasets load from the prepared indices (the run is stopped after its
    first step: the datasets are built before the model)."""
    src, _, files = prepared
    run_dir = tmp_path / "run"
    shutil.copytree(src, run_dir)  # the key has no run-dir path in it: the same indices
    files = _index_files(run_dir)
    log = tmp_path / "train.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "pretrain.train", f"trainer.run_dir={run_dir}", *TINY,
                                 "curriculum.only=pretrain_general", "logger.progress_bar=false"],
                                cwd=REPO, env=_env(), stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while proc.poll() is None and time.time() < deadline:
            if (run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text().strip():
                break  # one step trained: the stage's datasets exist
            time.sleep(0.5)
    finally:
        proc.kill()
        proc.wait()
    text = log.read_text()
    assert (run_dir / "metrics.jsonl").read_text().strip(), text[-3000:]
    assert "data: every stage's corpora and sample indices are prepared; nothing to build" in text.splitlines()
    assert "data: building" not in text
    assert _index_files(run_dir) == files  # no index folder or file written, none rebuilt


def _multi_node_start(run_dir, overrides: list[str], **launch: str):
    """A rank of a simulated 2-node launch, its master address a socket of ours that no process
    group may contact: ``(result, whether anything connected)``."""
    with socket.socket() as master:
        master.bind(("127.0.0.1", 0))
        master.listen(8)
        port = str(master.getsockname()[1])
        proc = _run("pretrain.train", [f"trainer.run_dir={run_dir}", *TINY, *overrides], timeout=120,
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **launch)
        master.setblocking(False)
        try:
            master.accept()[0].close()
            contacted = True
        except BlockingIOError:
            contacted = False
    return proc, contacted


def _command(run_dir, *overrides: str) -> str:
    args = " ".join([f"trainer.run_dir={run_dir}", *TINY, *overrides])
    return f"python -m data_pipeline.prepare {args} (or sbatch slurm/prepare.sh {args}) before training"


def test_a_multi_node_launch_without_a_stage_s_index_stops_naming_it(prepared, tmp_path):
    src, _, _ = prepared
    run_dir = tmp_path / "run"
    shutil.copytree(src / "data_index", run_dir / "data_index")
    gone = _stage_index_dirs(run_dir)["extend_512"]
    shutil.rmtree(gone)
    # rank 3 of 4 on 2 nodes under torchrun: it checks on its own, before any collective
    proc, contacted = _multi_node_start(run_dir, ["parallel=tp2_pp2"], RANK="3", WORLD_SIZE="4",
                                        LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: stage 'extend_512' has no prepared sample index ({gone}): run "
        f"{_command(run_dir, 'parallel=tp2_pp2')} (a run over several nodes does not build data while its "
        f"ranks wait)")
    assert "Traceback" not in proc.stderr and not contacted
    assert sorted(os.listdir(run_dir)) == ["data_index"]  # no checkpoints/, logs/, run.lock, config.yaml
    assert not os.path.exists(gone)  # and nothing built


def test_a_multi_node_launch_of_an_unprepared_run_writes_nothing(tmp_path):
    run_dir = tmp_path / "fresh"
    # rank 0 of a 2-node srun step (Slurm's variables, as slurm/pretrain.sh launches)
    proc, contacted = _multi_node_start(run_dir, ["parallel=tp2_pp2"], SLURM_PROCID="0", SLURM_NTASKS="4",
                                        SLURM_LOCALID="0", SLURM_STEP_NUM_NODES="2", SLURM_JOB_ID="1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: stage 'pretrain_general' has no prepared sample index (")
    assert ("stages 'pretrain_code_reasoning', 'extend_256', 'extend_512', 'extend_1024', 'dsa_warmup', "
            "'dsa_sparse' lack prepared data too") in line
    assert line.endswith(f"run {_command(run_dir, 'parallel=tp2_pp2')} (a run over several nodes does not "
                         "build data while its ranks wait)")
    assert not contacted and not run_dir.exists()
