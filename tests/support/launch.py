"""Launch real training runs (one process, or torchrun with gloo ranks) from tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from parallel.initialize import free_port
from tests.support import core_gate

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: overrides every test run uses: no W&B, no progress bar, one stage (trainer.steps) with a short
#: warmup; curriculum tests pass curriculum=... after these
QUIET = ["logger.wandb.mode=disabled", "logger.progress_bar=false", "scheduler.warmup_steps=1",
         "curriculum=none"]


def quiet(overrides: list[str]) -> list[str]:
    """QUIET for ``overrides``: a run that names a curriculum keeps its stages' own schedules
    (an override of a field every stage sets would be refused as reaching no stage)."""
    if any(o.startswith("curriculum=") and o != "curriculum=none" for o in overrides):
        return [o for o in QUIET if not o.startswith(("scheduler.warmup_steps=", "curriculum="))]
    return QUIET


def train_command(overrides: list[str], nproc: int = 1, module: tuple = ("-m", "pretrain.train")) -> list[str]:
    """The argv of a run in its own processes: ``python <module> overrides`` on one rank, under
    torchrun on more; ``module`` may name a launcher that wraps the entry point."""
    if nproc == 1:
        return [sys.executable, *module, *overrides]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}", *module, *overrides]


def train_env(nproc: int) -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1" if nproc > 1 else env.get("OMP_NUM_THREADS", "2")
    env["PYTHONWARNINGS"] = "ignore"
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def run_train(overrides: list[str], nproc: int = 1, timeout: int = 600, digest_dir=None) -> dict:
    """Run to completion on ``nproc`` ranks of this session's :mod:`.rank_pool`; return the JSON
    summary ``python -m pretrain.train`` prints. ``digest_dir``: record the DSA selections
    there (:mod:`.topk_digest`). Fails with the ranks' output."""
    from tests.support import rank_pool

    return rank_pool.run([*quiet(overrides), *overrides], nproc, timeout, digest_dir)


def run_in_new_processes(overrides: list[str], nproc: int = 1, timeout: int = 600) -> dict:
    """:func:`run_train` in processes of its own, for what a process does from its start (a
    rank's log holds the libraries' import-time records). Returns the JSON summary."""
    with core_gate.whole_machine() if nproc > 1 else contextlib.nullcontext():
        proc = subprocess.run(train_command([*quiet(overrides), *overrides], nproc), cwd=REPO,
                              env=train_env(nproc), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def initial_checkpoint(root, *overrides: str):
    """One rank writes step 0 (the seeded initial weights) under ``root/init``; parity tests start
    every layout from it. Returns the checkpoint folder."""
    run_train([f"trainer.run_dir={root / 'init'}", "trainer.steps=0", *overrides])
    ckpt = root / "init" / "checkpoints" / "iter_0000000"
    assert (ckpt / "metadata.json").exists()
    return ckpt


def read_metrics(run_dir: str) -> list[dict]:
    """metrics.jsonl, keeping the last record per step (a resumed run rewrites steps)."""
    by_step = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]


def checkpoint_tensors(ckpt_dir, scratch_dir) -> dict:
    """Every tensor of a dist checkpoint (weights and optimizer state), read in this process
    through a private 1-rank gloo group."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    dist.init_process_group("gloo", init_method=f"file://{scratch_dir}/pg-{free_port()}",
                            rank=0, world_size=1)
    try:
        tensors = dist_checkpointing.load_plain_tensors(str(ckpt_dir))
    finally:
        dist.destroy_process_group()
    return {k: v for k, v in tensors.items() if isinstance(v, torch.Tensor)}


def kill_tree(proc) -> None:
    """SIGKILL the launcher and every process under it (torchrun starts ranks in new sessions)."""
    import psutil

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


def kill_after_checkpoint(overrides: list[str], latest_file, wanted: str, nproc: int = 1,
                          timeout: int = 600) -> None:
    """Start a run and SIGKILL all of it once ``latest_file`` names checkpoint ``wanted``. Its ranks
    freeze right after that save (:mod:`.stop_at_checkpoint`), so the kill always lands between
    that checkpoint and the next, however busy the machine."""
    kill_when(overrides, nproc, ("-m", "tests.support.stop_at_checkpoint", f"--stop-after={wanted}"),
              lambda: latest_file.exists() and latest_file.read_text().strip() == wanted,
              f"checkpoint {wanted}", timeout)


def kill_when(overrides: list[str], nproc: int, launcher: tuple, ready, what: str, timeout: int = 600) -> None:
    """Start a run through ``launcher`` and SIGKILL all of it as soon as ``ready()`` holds; fails
    naming ``what`` when the run ends first or ``timeout`` passes."""
    with core_gate.whole_machine() if nproc > 1 else contextlib.nullcontext():
        log = tempfile.TemporaryFile("w+")  # not a pipe: a full pipe would block the run
        proc = subprocess.Popen(train_command([*quiet(overrides), *overrides], nproc, launcher), cwd=REPO,
                                env=train_env(nproc), stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.time() + timeout
        try:
            while time.time() < deadline:
                if ready():
                    return
                if proc.poll() is not None:
                    log.seek(0)
                    raise AssertionError(f"the run ended ({proc.returncode}) before {what}:\n"
                                         f"{log.read()[-6000:]}")
                time.sleep(0.05)
            raise AssertionError(f"{what} did not happen in {timeout} s")
        finally:
            kill_tree(proc)
            log.close()


def assert_resumed_equals_straight(straight, resumed, steps: int, scratch_dir) -> tuple[dict, dict]:
    """The resumed run logged every step of the straight one with the same losses, LR, grad norm
    and tokens bit for bit; returns both final checkpoints' tensors (same keys) for more checks."""
    want, have = read_metrics(str(straight)), read_metrics(str(resumed))
    assert [r["step"] for r in have] == list(range(1, steps + 1))
    for a, b in zip(want, have):
        for key in ("loss", "lm_loss", "mtp_loss", "lr", "grad_norm", "consumed_tokens"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    final = f"iter_{steps:07d}"
    w_straight = checkpoint_tensors(straight / "checkpoints" / final, scratch_dir)
    w_resumed = checkpoint_tensors(resumed / "checkpoints" / final, scratch_dir)
    assert w_straight.keys() == w_resumed.keys()
    return w_straight, w_resumed
