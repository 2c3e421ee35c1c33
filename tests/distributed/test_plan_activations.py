"""The planner's activation estimate (``planner.activations``) against the peak activation
memory measured by tracking tensor allocations (``tests.support.activation_probe``) during one
training step of the tiny model: sequence 512 and 2048, dense and sparse DSA, recompute none /
selective / full, on 1 rank and on TP2 (+SP) / PP2 (1F1B, 2 micro-batches) / CP2 -- every rank
of every case within 15%.

Two launches, side by side: one rank, and two ranks running the three 2-rank layouts one after
the other (megatron's groups are rebuilt between layouts); each case builds its model.
Two layers (one dense-FFN, one MoE: every kind of layer, and the MTP module run 3 times; PP2: two
MoE layers) keep the 48 cases in the 2-core CI budget."""

import json
import subprocess
import sys

import pytest

from tests.support.launch import REPO, train_env

pytestmark = pytest.mark.all_cores  # a one-rank and a two-rank launch at once

TOLERANCE = 0.15
BASE = ["curriculum=none", "logger.wandb.mode=disabled", "trainer.micro_batch_size=1"]
TWO_LAYERS = "model.num_layers=2 trainer.global_batch_size=1"  # one dense-FFN, one MoE layer
LAYOUTS = {  # name: (ranks, fields)
    "one_rank": (1, TWO_LAYERS),
    "tp2": (2, f"parallel.tp=2 parallel.sequence_parallel=true {TWO_LAYERS}"),
    # one MoE layer per stage (megatron's aux-loss reduction hangs when a stage holds none)
    "pp2": (2, "parallel.pp=2 model.num_layers=2 model.first_k_dense=0 trainer.global_batch_size=2"),
    "cp2": (2, f"parallel.cp=2 {TWO_LAYERS}"),
}
CASES = [f"trainer.seq_length={seq} model.dsa.mode={mode} model.recompute={recompute}"
         for seq in (512, 2048) for mode in ("dense", "sparse")
         for recompute in ("null", "selective", "full")]


def _start(nproc: int, cases: list[str], out, log) -> subprocess.Popen:
    from parallel.initialize import free_port

    probe = ["-m", "tests.support.activation_probe", str(out), " ".join(BASE), *cases]
    cmd = [sys.executable, *probe] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}", *probe]
    env = train_env(nproc)
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    """{layout: [(case fields, [{"rank", "pp_rank", "cp_rank", "peak"}])]}. The one-rank and the
    two-rank launch run at once (the two-rank one waits in pipeline bubbles and collectives)."""
    root = tmp_path_factory.mktemp("activations")
    names = {n: [m for m, (ranks, _) in LAYOUTS.items() if ranks == n] for n in (1, 2)}
    logs = {n: open(root / f"ranks{n}.log", "w") for n in (1, 2)}
    procs = {n: _start(n, [f"{LAYOUTS[m][1]} {c}" for m in names[n] for c in CASES],
                       root / f"ranks{n}.json", logs[n]) for n in (1, 2)}
    out = {}
    for n, proc in procs.items():
        proc.wait(timeout=900)
        logs[n].close()
        if proc.returncode:
            log = (root / f"ranks{n}.log").read_text()
            raise AssertionError(f"{n}-rank probe failed ({proc.returncode}):\n{log[-6000:]}")
        with open(root / f"ranks{n}.json") as f:
            results = json.load(f)
        for i, name in enumerate(names[n]):
            out[name] = [(r["case"], r["ranks"]) for r in results[i * len(CASES):(i + 1) * len(CASES)]]
    return out


def _estimate(case: str, world: int, pp_rank: int, cp_rank: int):
    from model_providers.glm5.model.specs import resolve_backend
    from planner.activations import activation_bytes
    from pretrain.config.validation import check_run
    from tests.support.activation_probe import case_configs

    rc = case_configs(BASE, [case])[0]
    layout, problems = check_run(rc, world, check_paths=False)
    assert not problems, problems
    return activation_bytes(rc, layout, pp_rank, backend=resolve_backend(rc.model.layer_backend),
                            cp_rank=cp_rank)


@pytest.mark.heavy
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_activation_estimate_matches_measured_peak(measured, layout):
    world = LAYOUTS[layout][0]
    rows, bad = [], []
    for case, ranks in measured[layout]:
        assert len(ranks) == world
        for rank in ranks:
            est = _estimate(case, world, rank["pp_rank"], rank["cp_rank"]).peak
            ratio = est / rank["peak"]
            label = f"{layout} rank {rank['rank']} {case[len(LAYOUTS[layout][1]) + 1:]}"
            rows.append(f"{label:80s} {est / 2**20:8.2f} {rank['peak'] / 2**20:8.2f} MiB {ratio:6.3f}")
            if abs(ratio - 1) > TOLERANCE:
                bad.append(rows[-1])
    print("\n" + "\n".join(rows))
    assert not bad, "estimate off by more than 15%:\n" + "\n".join(bad)
