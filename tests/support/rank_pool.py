"""Training runs for tests, many per process: ``python -m tests.support.rank_pool SPOOL CLIENT_PID
EMULATION`` (under torchrun for more ranks) runs jobs one after another in the same ranks.

A fresh run process spends ~10 s of CPU importing torch and megatron-core before its first step,
for test runs of a few seconds, and a 2-rank run pays it on both of 2 cores. A pool starts its
ranks once per world size, CPU emulation and pytest process, and runs each job as
``python -m pretrain.train OVERRIDES`` does: the same composition and checks
(:func:`pretrain.config.command_line.resolve`), the same :func:`pretrain.train.run`, which leaves a process
group it did not start (the pool's) and destroys everything else it built (megatron's groups,
the model, the run-dir lock, its logging).

Between jobs a rank keeps the process group and the CPU emulation, plain or strict as the pool
was started (``parallel.cpu_emulation``: megatron keeps tensors across runs in class attributes,
such as the MoE aux-loss scale, so the two never share a process). The resume tests hold the pool
to this: a run killed in a fresh process and finished in a pool must log the straight run's
numbers bit for bit. A job that fails ends its pool (a rank may be stuck in a collective or hold
half-built state); the next job starts a fresh one.

Protocol (files in SPOOL, each written whole with a rename): the client writes ``job-<k>.json``
({"overrides": [...], "digest_dir": ...}); every rank runs it and writes ``done-<k>.rank<r>.json``
({"summary": ...} or {"error": traceback}). A rank exits when the client process is gone.
"""

from __future__ import annotations

from parallel.megatron_compat import bootstrap

bootstrap()  # before megatron-core's first import

import atexit
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

POLL_S = 0.02


def _write(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def _read(path: str):
    with open(path) as f:
        return json.load(f)


# --- a rank ------------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _next_job(path: str, client_pid: int):
    while not os.path.exists(path):
        if not _alive(client_pid):
            return None
        time.sleep(POLL_S)
    return _read(path)


def run_job(job: dict, emulation: str) -> dict:
    """One ``python -m pretrain.train`` run in this process; its summary (raises on failure,
    and when the run ended early: a preempted or diverged run exits non-zero)."""
    from pretrain.config.schema import compose
    from pretrain.config.command_line import resolve
    from pretrain.train import run
    from tests.support import topk_digest

    overrides = list(job["overrides"])
    rc, config_yaml, changes = resolve(compose(overrides), overrides)
    if rc.parallel.cpu_emulation != emulation:
        raise RuntimeError(f"a {rc.parallel.cpu_emulation} job sent to a {emulation} pool")
    with topk_digest.recording(job.get("digest_dir")):
        summary = run(rc, config_yaml, changes)
    if summary["preempted"] or summary["diverged"]:
        raise RuntimeError(f"the run ended early: {summary}")
    return summary


def serve(spool: str, client_pid: int, emulation: str) -> None:
    import traceback

    import torch.distributed

    from parallel.initialize import dist_env, start_process_group

    env = dist_env()
    for attempt in range(5):
        try:
            start_process_group(env, cpu_emulation_mode=emulation)
            break
        except torch.distributed.DistNetworkError:  # one rank: the free port it picked was taken since
            if env.world_size > 1 or attempt == 4:
                raise
            env = dist_env()
    k = 0
    while (job := _next_job(os.path.join(spool, f"job-{k}.json"), client_pid)) is not None:
        try:
            done = {"summary": run_job(job, emulation)}
        except BaseException:  # noqa: BLE001 -- a SystemExit of the run too: reported, then this pool ends
            done = {"error": traceback.format_exc()}
        _write(os.path.join(spool, f"done-{k}.rank{env.rank}.json"), done)
        if "error" in done:
            return
        k += 1


# --- the client (the pytest process) -----------------------------------------------------------


class RankPool:
    """``nproc`` ranks under the ``emulation`` CPU emulation serving jobs from this process,
    started on construction."""

    def __init__(self, nproc: int, emulation: str):
        from tests.support.launch import REPO, train_command, train_env

        self.nproc = nproc
        self.spool = tempfile.mkdtemp(prefix=f"rank-pool-{nproc}-")
        self.log = os.path.join(self.spool, "ranks.log")
        self.jobs = 0
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                train_command([self.spool, str(os.getpid()), emulation], nproc, ("-m", __name__)), cwd=REPO,
                env=train_env(nproc), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, overrides: list[str], timeout: float, digest_dir=None) -> dict:
        k, self.jobs = self.jobs, self.jobs + 1
        _write(os.path.join(self.spool, f"job-{k}.json"),
               {"overrides": list(overrides), "digest_dir": None if digest_dir is None else str(digest_dir)})
        done = [os.path.join(self.spool, f"done-{k}.rank{r}.json") for r in range(self.nproc)]
        deadline = time.time() + timeout
        while True:
            have = [_read(p) for p in done if os.path.exists(p)]
            errors = [d["error"] for d in have if "error" in d]
            if errors or not self.alive() or time.time() > deadline:
                why = (errors[0] if errors else "the pool's ranks exited" if time.time() <= deadline
                       else f"no result in {timeout} s")
                output = self.tail()
                self.close()
                raise AssertionError(f"training failed ({why}):\n{output}")
            if len(have) == self.nproc:
                return have[0]["summary"]  # rank 0's: the others have no metrics to summarise
            time.sleep(POLL_S)

    def tail(self, chars: int = 6000) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()[-chars:]

    def close(self) -> None:
        from tests.support.launch import kill_tree

        if self.alive():
            kill_tree(self.proc)
        shutil.rmtree(self.spool, ignore_errors=True)


#: live pools by (ranks, emulation), least recently used first; each rank holds ~0.5 GB
_POOLS: dict[tuple, RankPool] = {}
MAX_POOLS = 3


def emulation_of(overrides: list[str]) -> str:
    """The run's ``parallel.cpu_emulation`` (the last override of it wins, as in Hydra)."""
    values = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == "parallel.cpu_emulation"]
    return values[-1] if values else "plain"


def run(overrides: list[str], nproc: int, timeout: float, digest_dir=None) -> dict:
    """A run's JSON summary, from this session's pool of ``nproc`` ranks under the run's CPU
    emulation (started when there is none, or when the last one ended with a failed job; the
    least recently used one is closed beyond :data:`MAX_POOLS`). A multi-rank run holds the rank
    slot meanwhile (:func:`.core_gate.whole_machine`). Raises AssertionError on failure."""
    from tests.support import core_gate

    with core_gate.whole_machine() if nproc > 1 else contextlib.nullcontext():
        return _run(overrides, nproc, timeout, digest_dir)


def _run(overrides: list[str], nproc: int, timeout: float, digest_dir) -> dict:
    key = (nproc, emulation_of(overrides))
    pool = _POOLS.pop(key, None)
    if pool is None or not pool.alive():
        pool = RankPool(*key)
    _POOLS[key] = pool
    while len(_POOLS) > MAX_POOLS:
        _POOLS.pop(next(iter(_POOLS))).close()
    return pool.run(overrides, timeout, digest_dir)


@atexit.register
def _close_all() -> None:
    for pool in _POOLS.values():
        pool.close()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), sys.argv[3])
